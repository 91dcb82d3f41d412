"""The weight swarm as an inferer sees it, holding one complete policy: a fake for tests of the inferer's
model work and publishing (the real swarm's policy handling is tested in tests/swarm)."""

from __future__ import annotations

from pathlib import Path

import trio


class OnePolicy:
    """``newest`` is the one policy held; ``wait_newer`` returns it if it is newer, else never returns."""

    def __init__(self, step: int, path: Path) -> None:
        self.held = (step, path)

    def newest(self) -> tuple[int, Path]:
        return self.held

    async def wait_newer(self, than: int | None) -> tuple[int, Path]:
        if than is None or than < self.held[0]:
            return self.held
        await trio.sleep_forever()
        raise AssertionError("unreachable")
