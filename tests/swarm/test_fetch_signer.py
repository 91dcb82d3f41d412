"""Which manifest a fetch gives up on at once (issue 36, friction 7).

A manifest id pins the manifest's bytes, and those name its signer: when they name another key than the
run's trainer, no peer can ever send a trainer-signed manifest for that id, so the fetch fails at once
with "manifest signed by 0x…, but the run's trainer is 0x…". A peer that signs the trainer's own
manifest with its key is a liar (banned), and must not make the fetch give up."""

from __future__ import annotations

from pathlib import Path

import pytest

from crypto.keys import WalletKey
from prime_node.swarm.checkpoint_pieces import build_checkpoint
from prime_node.swarm.versions import open_sent
from prime_node.testing.swarm_fixtures import write_model_dir
from protocol.codec import encode
from protocol.envelope import Domain, seal
from protocol.errors import RemoteProtocolError
from protocol.swarm.messages import ManifestEnvelope


def _shared(tmp_path: Path, key: WalletKey) -> tuple[bytes, ManifestEnvelope]:
    model = write_model_dir(tmp_path / "model", weight_bytes=1 << 16)
    shared = build_checkpoint(model, key, run="test", step=1, now_ms=1_000)
    mid = shared.manifest.id()
    return mid, ManifestEnvelope(mid, encode(shared.envelope))


def test_a_manifest_of_another_signer_is_refused_with_the_documented_line(tmp_path: Path) -> None:
    other, trainer = WalletKey.generate(), WalletKey.generate()
    _, message = _shared(tmp_path, other)
    with pytest.raises(RemoteProtocolError) as refused:
        open_sent(message, trainer.address)
    assert refused.value.reason == "wrong_signer"
    assert str(refused.value) == (
        f"manifest signed by {other.address}, but the run's trainer is {trainer.address}"
    )


def test_the_trainers_manifest_re_signed_by_a_peer_is_a_lie_not_a_wrong_signer(tmp_path: Path) -> None:
    trainer, forger = WalletKey.generate(), WalletKey.generate()
    mid, honest = _shared(tmp_path, trainer)
    envelope = open_sent(honest, trainer.address)[0]
    forged = seal(forger, Domain.parse(envelope.domain), envelope.payload, now_ms=2_000)
    with pytest.raises(RemoteProtocolError) as refused:
        open_sent(ManifestEnvelope(mid, encode(forged)), trainer.address)
    assert refused.value.reason != "wrong_signer"  # the fetch bans this peer and waits for an honest one
    assert refused.value.reason == "inconsistent_manifest"
    assert open_sent(honest, trainer.address)[1].id() == mid
