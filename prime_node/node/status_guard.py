"""Who the status API answers, and how often: pure checks on a request's headers and a token bucket.

The API is bound to 127.0.0.1, but a web page the user has open can still send it requests. Two checks
refuse those before any work. A page that points its own DNS name at 127.0.0.1 (DNS rebinding) still
names that host in ``Host`` (refused with 421 by ``is_loopback_host``). A page on any other origin makes
the browser say so: ``Origin`` on CORS requests, ``Sec-Fetch-Site`` on every request of current browsers
(loopback counts as a trustworthy origin, so they send it there too). The API serves no pages of its own,
so anything but ``none`` (typed in the address bar) or ``same-origin`` is someone else's page; this
includes ``same-site``, which a page on another port of 127.0.0.1 gets (sites ignore ports).

No clock and no I/O here: times are passed in (the server reads trio's clock).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

LOOPBACK_HOSTS = frozenset({b"127.0.0.1", b"localhost", b"[::1]"})
OWN_FETCH_SITES = frozenset({b"none", b"same-origin"})


def is_loopback_host(host: bytes) -> bool:
    """Whether a ``Host`` header names this machine's loopback (with or without a port)."""
    name = host.strip().lower()
    bracketed = name.startswith(b"[")  # an IPv6 literal carries colons of its own
    return (name[: name.find(b"]") + 1] if bracketed else name.split(b":", 1)[0]) in LOOPBACK_HOSTS


def own_origins(port: int) -> frozenset[bytes]:
    """The serialized origins of the API itself on ``port``: a browser omits the scheme's default port
    (80), and a client that names it anyway means the same origin."""
    suffixes = (b":%d" % port, b"") if port == 80 else (b":%d" % port,)
    return frozenset(b"http://" + host + suffix for host in LOOPBACK_HOSTS for suffix in suffixes)


def cross_site_refusal(headers: Iterable[tuple[bytes, bytes]], port: int) -> str | None:
    """Why a request comes from another site's page (``None`` if nothing says so). ``headers`` as h11 gives
    them: names lower-case. An ``Origin`` of ``null`` (sandboxed frames, files) is someone else's too."""
    own = own_origins(port)
    for name, value in headers:
        if name == b"origin" and value.strip().lower() not in own:
            return f"Origin {value[:100]!r}"
        if name == b"sec-fetch-site" and value.strip().lower() not in OWN_FETCH_SITES:
            return f"Sec-Fetch-Site {value[:40]!r}"
    return None


@dataclass
class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` held. ``take`` always takes one and says how long the
    caller must wait before acting on it: a caller that waits is held to ``rate`` without being refused."""

    rate: float
    burst: int
    tokens: float
    updated: float

    @classmethod
    def full(cls, rate: float, burst: int, now: float) -> TokenBucket:
        return cls(rate, burst, float(burst), now)

    def take(self, now: float) -> float:
        if now > self.updated:
            self.tokens = min(float(self.burst), self.tokens + (now - self.updated) * self.rate)
            self.updated = now
        self.tokens -= 1.0
        return 0.0 if self.tokens >= 0.0 else -self.tokens / self.rate
