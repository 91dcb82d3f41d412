"""Verification over real libp2p hosts on 127.0.0.1 (TCP + Noise + yamux, gossipsub): an honest batch is
accepted and handed to the trainer, a cheater's batch is rejected and never is."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import trio

from crypto.keys import WalletKey
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.verification.service import publish_batch, publish_frame
from tests.verification.network_helpers import fresh, judged, make_scenario, start_swarm

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


async def test_honest_and_cheating_batches_over_real_libp2p(tmp_path: Path) -> None:
    validator = WalletKey.generate()
    scenario = make_scenario([validator])
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, OPEN, tmp_path, scenario, [validator], serve_api=True)
        assert swarm.admission is not None
        await trio.sleep(2)  # let the gossipsub mesh settle after the connections
        service = swarm.validators[0][1]
        forged = fresh(scenario).attack_frames("forged_proof", counter=7)[0]
        bad_id = await publish_frame(swarm.inferer, forged)
        assert "toploc_exponent_mismatch" in await judged(service, bad_id)
        batch = fresh(scenario).batch(8)
        good_id = await publish_batch(swarm.inferer, scenario.key, batch)
        with trio.fail_after(60):
            got = await swarm.admission.next_accepted()
        assert (got.batch_id, got.batch) == (good_id, batch)
        assert "toploc_exponent_mismatch" in swarm.admission.stats()["rejected"]
        status = swarm.validators[0][0].status_sections["validation"]()
        assert (status["validated"], status["accepted"], status["backlog"]) == (2, 1, 0)
        nursery.cancel_scope.cancel()
