"""``fetch --seed-until swarm`` on real nodes (libp2p on 127.0.0.1, real data-plane channels): a fetcher
that has its copy keeps serving while a connected peer still fetches, and stops once that peer holds
every piece (issue 15: fetchers that left as soon as their copy was written stopped uploading). And the
keystore unlocked in a worker thread while fetch imports its modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from crypto.errors import WrongPasswordError
from crypto.keys import WalletKey
from prime_node.cli.network_options import NodeFlags
from prime_node.cli.seeding import SeedPolicy, seed_version
from prime_node.cli.swarm import _KeyInBackground
from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from prime_node.wallet_store import LIGHT_SCRYPT, create_keystore
from tests.p2p.helpers import wait_until
from tests.swarm.network_helpers import start_peer


async def test_a_fetcher_keeps_serving_until_its_fetching_neighbour_holds_every_piece(tmp_path: Path) -> None:
    trainer_key = WalletKey.generate()
    model = write_model_dir(tmp_path / "model", weight_bytes=8 << 20)
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer_key.address, key=trainer_key)
        options = {"bootstrap": (origin.node.advertised_multiaddrs()[0],), "follow": False}
        first = await start_peer(nursery, tmp_path, 1, trainer=trainer_key.address, **options)  # type: ignore[arg-type]
        manifest = await origin.swarm.share(model, step=1, piece_size=64 << 10)
        mid = manifest.id()
        await first.swarm.fetch(mid)
        second = await start_peer(nursery, tmp_path, 2, trainer=trainer_key.address, **options)  # type: ignore[arg-type]
        await wait_until(lambda: second.node.key.address in first.swarm.dataplane.links, timeout=60)
        fetched: list[Path] = []

        async def fetch_second() -> None:
            fetched.append(await second.swarm.fetch(mid))

        nursery.start_soon(fetch_second)
        first_node = first.swarm.versions[mid].transfer.node
        await wait_until(lambda: second.node.key.address in first_node.peers, timeout=60, step=0.01)
        ended = await seed_version(first.swarm, mid, trainer_key.address, SeedPolicy("swarm", 120.0))
        # It stopped because the neighbour announced every piece, not by the "stopped asking" rule.
        assert ended == "peers_hold_it"
        assert second.swarm.progress(mid) == (manifest.piece_count, manifest.piece_count)
        assert first_node.peers_wanting() == []
        with trio.fail_after(30):
            while not fetched:
                await trio.sleep(0.05)
        assert read_tree(fetched[0]) == read_tree(model)
        # "done" returns at once; a duration waits that long (at least: a loaded machine may add to it).
        assert await seed_version(first.swarm, mid, trainer_key.address, SeedPolicy("done")) == "done"
        started = trio.current_time()
        ended = await seed_version(first.swarm, mid, trainer_key.address, SeedPolicy("duration", 0.5))
        assert ended == "duration" and trio.current_time() - started >= 0.5
        nursery.cancel_scope.cancel()


def test_fetch_unlocks_its_keystore_beside_the_imports_and_a_wrong_password_stays_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = WalletKey.generate()
    keystore = tmp_path / "keystore.json"
    create_keystore(keystore, key, "right", scrypt=LIGHT_SCRYPT)
    flags = NodeFlags(keystore=keystore, password_env="FETCH_TEST_PASSWORD", data_dir=tmp_path)
    monkeypatch.setenv("FETCH_TEST_PASSWORD", "right")
    with _KeyInBackground(flags, ephemeral=False) as unlocking:
        assert unlocking.future is not None  # the password comes from the environment: no prompt
        assert unlocking.key().address == key.address
    monkeypatch.setenv("FETCH_TEST_PASSWORD", "wrong")
    with pytest.raises(WrongPasswordError) as caught, _KeyInBackground(flags, ephemeral=False) as unlocking:
        unlocking.key()
    assert "\n" not in str(caught.value)
    with _KeyInBackground(flags, ephemeral=True) as unlocking:  # nothing unlocked: a fresh identity
        assert unlocking.future is None and unlocking.key().address != key.address
