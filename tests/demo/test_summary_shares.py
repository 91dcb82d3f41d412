"""The demo summary's issue-38 figures: the stale share of all inference and the trainer's busy share."""

from __future__ import annotations

from prime_node.demo.summary import summarize


def test_the_summary_says_what_share_of_inference_went_stale_and_how_busy_the_trainer_was() -> None:
    """Issue 38: (stale + stale_in_queue) / batches produced by every inferer, the adversary included."""
    snapshots = {
        "trainer": {
            "sections": {
                "training": {
                    "step": 10,
                    "batches_rejected": {"stale": 2, "stale_in_queue": 3, "uninformative": 4},
                    "busy_share": 0.81,
                }
            }
        },
        "inferer-1": {"sections": {"rollouts": {"produced": 60}}},
        "adversary": {"sections": {"rollouts": {"produced": 40}}},
    }
    roles = {"trainer": "trainer", "inferer-1": "inferer", "adversary": "adversary"}
    summary = summarize(snapshots, roles)
    assert summary["batches_produced"] == 100
    assert summary["stale_share"] == 0.05
    assert summary["busy_share"] == 0.81
