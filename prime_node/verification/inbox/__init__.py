"""The rollout inbox: the one intake of the ``rollouts`` topic, for the validator and the trainer's admission.

A gossiped frame or an announced batch goes through the same steps on both roles: the worker banned? →
an announcement (``RolloutAnnouncement``)? → screen → fetch → screen the frame → hand it to the owner
(``Intake.arrived``). What differs is a setting (``InboxSettings``):

- ``fetch_on_arrival``: the validator fetches every offer it accepts at once; the trainer keeps offers
  (bounded like the judge queue: ``per_worker_offers`` each, ``max_offers`` in all, the worker holding
  most losing its oldest) and fetches one only when its owner ``want``s it (an accepting quorum is in),
  while the owner has room (``Intake.room``); a wanted batch that does not fit the fetch bounds waits.
- ``steps``: whether (and against what) a claimed policy step too far ahead is refused on arrival.
- ``reannounce``: whether a fetched batch is re-announced (the validator's peers may fetch it there).

Defences, the same on both roles (docs/security.md, *Rollout announcements and their bytes*): an offer
that is not its worker's, of another run, over ``max_rollout_batch_bytes`` or (given ``steps``) too far
ahead is refused before any byte moves; each worker gets at most ``per_worker_fetches`` fetches pending
and ``per_worker_fetch_bytes`` reserved (refused on arrival: ``refused_worker_fetches`` /
``refused_worker_bytes``); past the bounds of all workers together (``max_fetches``, ``max_held_bytes``)
a worker with fewer pending evicts the newest fetch of the worker with the most. The ``BatchTransfer``
(built here when none is given) grants download slots round-robin across workers, newest step first
(``fair_slots.py``), enforces a reply deadline and a byte-rate floor, checks the first chunk against the
offer (``check_frame_start``) and backs off failed holders.

**Charging (one rule).** A refusal on arrival is charged to the peer that sent it as
``protocol/rollout_screen.offence_for`` says (``future_policy`` is ``bad_data`` only when ``steps`` is
authoritative, else ``stale``): screening checks that the signer is the gossip sender before anything
else, so the charge always lands on the author. A peer that sends data-plane bytes that are not the batch
is banned (``ban_peer``: counted in ``charged`` and ``banned_senders``), a worker that does not deliver its
own offer is charged ``unsolicited`` (``undelivered``). This is the validator's rule, now the trainer's
too: the trainer used to count a lying holder only as ``bad_bytes`` on its peer scores' side and charge
nothing for a malformed frame or offer, so a peer could flood its offer store at no cost; ``ban_peer`` is
what both did for bytes, and charging the proven author of a refused frame is what keeps a flood from
being free. Lag is never charged: a batch below the trainer's floor (``BELOW_FLOOR``) is dropped
uncharged, and so are a validator's missing or stale policies (reputation.py's ``NOT_CHARGED``).

**Hooks.** ``IntakeHooks.floor`` (the lowest policy step the trainer still accepts): a batch below it is
dropped before it is fetched or judged. ``IntakeHooks.archive``: ``keep`` runs in a worker thread once per
batch id that passed screening, before it is queued for judging (so whatever its verdict), beside the
intake (at most ``archive_pending`` at once; beyond, skipped and counted): a slow disk never stalls gossip,
and an exception is logged, never stops intake.
"""

from prime_node.verification.inbox.intake import RolloutInbox
from prime_node.verification.inbox.terms import (
    INTAKE_COUNTS,
    Archive,
    Arrival,
    InboxSettings,
    Intake,
    IntakeHooks,
    StepBound,
    new_batch_id,
)

__all__ = [
    "INTAKE_COUNTS",
    "Archive",
    "Arrival",
    "InboxSettings",
    "Intake",
    "IntakeHooks",
    "RolloutInbox",
    "StepBound",
    "new_batch_id",
]
