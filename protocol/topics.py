"""Every gossip topic of the swarm, named once: publishers and subscribers in any layer import these.

Topics are scoped to the run by the gossip layer, so the names here are the same for every run.
"""

from __future__ import annotations

HEARTBEATS_TOPIC = "heartbeats"
"""Signed peer records (node/service.py)."""
RUN_TOPIC = "run"
"""The trainer's signed run announcement (roles/announcement.py)."""
ROLLOUTS_TOPIC = "rollouts"
"""Inferers' signed rollout batches (verification/batch_publish.py)."""
VERDICTS_TOPIC = "verdicts"
"""Validators' signed verdicts on rollout batches."""
CHECKPOINTS_TOPIC = "checkpoints"
"""The trainer's checkpoint announcements (swarm/service.py)."""
DEMAND_TOPIC = "demand"
"""The trainer's signed demand: policy steps it accepts, batches it wants (roles/demand.py)."""

ALL_TOPICS = (HEARTBEATS_TOPIC, RUN_TOPIC, ROLLOUTS_TOPIC, VERDICTS_TOPIC, CHECKPOINTS_TOPIC, DEMAND_TOPIC)
