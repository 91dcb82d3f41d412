"""The cheap first look a validator takes at a gossiped rollout frame, before it may cost anything more.

A frame is screened on arrival, before it is queued and before any wait: the envelope decodes, was
signed by the peer that gossiped it, is for this run's rollout domain, is fresh, and its signature
recovers its signer; the payload's header names this run, that same signer as its worker, and a policy
step no further than ``future_steps`` past the newest step the trainer has published. Only the header is
read (``protocol.rollouts.peek_header``, the payload's first kilobyte): the samples are left to the full,
strict decode of the check pipeline, so screening costs one signature recovery whatever the frame holds.
The replay check is the pipeline's too, so that a frame and its replay are judged in the order they came.

A refusal is a RemoteProtocolError whose ``reason`` is one of the validator's reason codes;
``offence_for`` says what it costs the sender. Pure: the caller passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass

from crypto.keys import Address
from protocol.codec import decode
from protocol.envelope import Domain, Envelope, FreshnessWindow, Reject, check_signature
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.rollouts import BatchHeader, peek_header
from protocol.scoring import Offence

MALFORMED_ENVELOPE = "malformed_envelope"
MALFORMED_BATCH = "malformed_batch"
SIGNER_NOT_WORKER = "signer_not_worker"
WRONG_RUN = "wrong_run"
FUTURE_POLICY = "future_policy"

# What a refusal costs its sender (protocol/scoring.py). A replay and a frame the replay cache cannot vouch
# for are cheap to spot and may be an overloaded cache's doing: no charge beyond STALE, or none.
_OFFENCES: dict[str, Offence | None] = {
    MALFORMED_ENVELOPE: Offence.MALFORMED,
    Reject.WRONG_DOMAIN.value: Offence.MALFORMED,
    Reject.EXPIRED.value: Offence.STALE,
    Reject.FROM_THE_FUTURE.value: Offence.STALE,
    Reject.BAD_SIGNATURE.value: Offence.INVALID_SIGNATURE,
    Reject.SIGNER_MISMATCH.value: Offence.SIGNER_MISMATCH,
    Reject.REPLAY.value: Offence.STALE,
    Reject.BEHIND_REPLAY_WINDOW.value: None,
    MALFORMED_BATCH: Offence.MALFORMED,
    SIGNER_NOT_WORKER: Offence.SIGNER_MISMATCH,
    WRONG_RUN: Offence.MALFORMED,
}


@dataclass(frozen=True)
class Screened:
    envelope: Envelope
    header: BatchHeader


def offence_for(reason: str, *, certain: bool) -> Offence | None:
    """The charge for a frame refused with ``reason``. A step the trainer never published is BAD_DATA when
    ``certain`` (its announcements are heard), else only STALE: the validator may merely be behind."""
    if reason == FUTURE_POLICY:
        return Offence.BAD_DATA if certain else Offence.STALE
    return _OFFENCES.get(reason, Offence.MALFORMED)


def screen_rollout(
    frame: bytes,
    *,
    domain: Domain,
    window: FreshnessWindow,
    sender: Address,
    run_id: str,
    newest_step: int,
    future_steps: int,
    now_ms: int,
) -> Screened:
    """The envelope and header of a plausible frame from ``sender``; RemoteProtocolError (module doc)."""
    try:
        envelope = decode(frame, Envelope)
    except ProtocolError as exc:
        raise RemoteProtocolError(f"undecodable envelope: {exc}", reason=MALFORMED_ENVELOPE) from exc
    if envelope.signer != sender:
        # Checked before the signature: relaying someone else's frame is refused whatever it holds.
        raise RemoteProtocolError(
            f"frame signed by {envelope.signer}, gossiped by {sender}", reason=Reject.SIGNER_MISMATCH
        )
    if envelope.domain != str(domain):
        raise RemoteProtocolError(
            f"envelope for {envelope.domain[:80]!r}, expected {domain}", reason=Reject.WRONG_DOMAIN
        )
    if envelope.timestamp_ms < now_ms - window.max_age_ms:
        raise RemoteProtocolError("envelope is too old", reason=Reject.EXPIRED)
    if envelope.timestamp_ms > now_ms + window.max_skew_ms:
        raise RemoteProtocolError("envelope is dated in the future", reason=Reject.FROM_THE_FUTURE)
    check_signature(envelope)
    try:
        header = peek_header(envelope.payload)
    except ProtocolError as exc:
        raise RemoteProtocolError(str(exc), reason=MALFORMED_BATCH) from exc
    if header.worker != envelope.signer:
        raise RemoteProtocolError(
            f"signed by {envelope.signer}, names {header.worker}", reason=SIGNER_NOT_WORKER
        )
    if header.run_id != run_id:
        raise RemoteProtocolError(f"batch of run {header.run_id[:64]!r}", reason=WRONG_RUN)
    if header.policy_step > newest_step + future_steps:
        raise RemoteProtocolError(
            f"policy {header.policy_step} is more than {future_steps} past the newest published "
            f"step {newest_step}",
            reason=FUTURE_POLICY,
        )
    return Screened(envelope, header)
