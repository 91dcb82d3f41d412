"""Secret randomness, from one place: nonces, keys and salts are drawn here and nowhere else.

``secrets`` reads the operating system's CSPRNG; a caller that needs determinism (tests, replays) passes
its bytes in instead of calling this.
"""

from __future__ import annotations

import secrets


def random_bytes(size: int) -> bytes:
    """``size`` bytes from the OS's cryptographically secure generator."""
    return secrets.token_bytes(size)
