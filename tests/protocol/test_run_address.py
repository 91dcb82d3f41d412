"""Run addresses (``RUN@0xTRAINER[,BOOTSTRAP...]``) and what an announcement sighting records (issue 13)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crypto.keys import Address, WalletKey
from prime_node.config import RunConfig
from prime_node.roles.announcement import announced_config
from protocol.envelope import Envelope
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.run_announcement import (
    MAX_BOOTSTRAP,
    RunAddress,
    RunAnnouncement,
    TrainerTrust,
    seal_announcement,
)

NOW = 1_700_000_000_000
TRAINER = Address.parse("0x79B1B33BA04F20879BFfB5b089c6f3a3DE75E420")
PEER = "/ip4/10.0.0.7/tcp/4001/p2p/16Uiu2HAmDfv66QNaobLxD21FcCf4oGVCDEnnB9Q5JyHR1eYnUHco"

run_ids = st.from_regex(r"\A[a-z0-9][a-z0-9._-]{0,63}\Z")
multiaddrs = st.builds(
    "/ip4/{}.{}.{}.{}/tcp/{}/p2p/16Uiu2HAm{}".format,
    *(st.integers(0, 255) for _ in range(4)),
    st.integers(1, 65535),
    st.text(alphabet="abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ123456789", min_size=1, max_size=46),
)


@given(run_ids, st.binary(min_size=20, max_size=20), st.lists(multiaddrs, max_size=MAX_BOOTSTRAP))
def test_a_run_address_reads_back_as_itself(run_id: str, raw: bytes, bootstrap: list[str]) -> None:
    address = RunAddress(run_id, Address(raw), tuple(bootstrap))
    assert RunAddress.parse(str(address)) == address
    assert RunAddress.parse(f"  {run_id}@{str(address.trainer).lower()}\n") == RunAddress(
        run_id, Address(raw)
    )


def test_the_trainer_may_be_written_in_lower_case_but_not_with_a_wrong_checksum() -> None:
    text = f"demo@{str(TRAINER).lower()},{PEER}"
    assert RunAddress.parse(text) == RunAddress("demo", TRAINER, (PEER,))
    with pytest.raises(InvariantError) as caught:
        RunAddress.parse("demo@0x79b1B33BA04F20879BFfB5b089c6f3a3DE75E420")  # one letter's case flipped
    assert caught.value.reason == "bad_run_address"


@pytest.mark.parametrize(
    "text",
    [
        "demo",  # a bare run id names no trainer
        f"@{TRAINER}",  # no run id
        f"Demo@{TRAINER}",  # run ids are lower case
        "demo@0x1234",  # not 20 bytes
        f"demo@{TRAINER}@{TRAINER}",
        f"demo@{TRAINER},",  # an empty bootstrap entry
        f"demo@{TRAINER},ip4/1.2.3.4/tcp/1",  # a multiaddr starts with /
        f"demo@{TRAINER},/ip4/1.2.3.4/tcp/1 /p2p/x",
        f"demo@{TRAINER}," + ",".join([PEER] * (MAX_BOOTSTRAP + 1)),
        f"demo@{TRAINER},/" + "a" * 600,
    ],
)
def test_malformed_run_addresses_are_refused_by_name(text: str) -> None:
    with pytest.raises(InvariantError) as caught:
        RunAddress.parse(text)
    assert caught.value.reason == "bad_run_address"


@given(st.text(max_size=200))
def test_any_text_parses_or_is_refused_with_bad_run_address(text: str) -> None:
    try:
        parsed = RunAddress.parse(text)
    except InvariantError as exc:
        assert exc.reason == "bad_run_address"
    else:
        assert RunAddress.parse(str(parsed)) == parsed


def _announce(key: WalletKey, run_id: str = "loop") -> Envelope:
    config = RunConfig(run_id=run_id)
    announcement = RunAnnouncement(run_id, key.address, announced_config(config, key.address), NOW)
    return seal_announcement(key, announcement, now_ms=NOW)


def test_sightings_are_bounded_and_the_pinned_trainer_is_never_forgotten() -> None:
    pinned = WalletKey.generate()
    trust = TrainerTrust("loop", pinned=pinned.address, max_sightings=4)
    trust.offer(_announce(pinned), now_ms=NOW)
    flood = [WalletKey.generate() for _ in range(10)]
    for index, key in enumerate(flood):
        with pytest.raises(RemoteProtocolError) as caught:
            trust.offer(_announce(key), now_ms=NOW + index)
        assert caught.value.reason == "untrusted_trainer"
    assert len(trust.sightings) == 4 and trust.forgotten == 7
    assert ("loop", pinned.address) in trust.sightings
    assert [s.trainer for s in trust.sightings.values()][1:] == [k.address for k in flood[-3:]]
    assert trust.current is not None and trust.current.trainer == pinned.address


def test_another_runs_announcement_is_listed_and_refused() -> None:
    key = WalletKey.generate()
    trust = TrainerTrust("loop", pinned=key.address)
    with pytest.raises(RemoteProtocolError) as caught:
        trust.offer(_announce(key, run_id="math7"), now_ms=NOW)
    assert caught.value.reason == "wrong_run" and trust.current is None
    assert trust.latest is not None and str(trust.latest.address) == f"math7@{key.address}"
