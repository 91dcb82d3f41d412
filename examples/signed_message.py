"""Sign a message as a prime-node peer would, then check it as a receiver does.

Run: python examples/signed_message.py
"""

from __future__ import annotations

import time

from crypto.keys import WalletKey
from protocol.codec import encode
from protocol.envelope import Domain, EnvelopeVerifier, seal
from protocol.errors import RemoteProtocolError


def main() -> None:
    key = WalletKey.generate()
    domain = Domain(kind="heartbeat", run="example-run")
    now_ms = int(time.time() * 1000)
    frame = encode(seal(key, domain, b"hello swarm", now_ms=now_ms))
    print(f"signer {key.address} sent a {len(frame)}-byte frame")

    receiver = EnvelopeVerifier(domain)
    envelope = receiver.open(frame, now_ms=now_ms + 50)
    print(f"accepted {envelope.payload!r} from {envelope.signer}")
    try:
        receiver.open(frame, now_ms=now_ms + 100)
    except RemoteProtocolError as refused:
        print(f"the same frame again is refused: {refused.reason}")


if __name__ == "__main__":
    main()
