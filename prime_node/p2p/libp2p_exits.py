"""How a py-libp2p host's failures reach our callers: one clear ``NodeError`` line for a host that could
not start or stopped under its user, the operating system's words for a failed dial, and quiet for what
py-libp2p reports while shutting down (its services fail by cancelling the code inside them)."""

from __future__ import annotations

import errno
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from prime_node.errors import NodeError, first_node_error

log = logging.getLogger(__name__)


def raise_on_exit(
    exc: BaseException,
    listen: str,
    *,
    started: bool,
    body_error: BaseException | None,
    failures: list[BaseException],
) -> None:
    """What leaves ``open_libp2p_host`` when ``exc`` ends its host: the caller's own error; a clear
    NodeError for a host that could not start; a cancellation from outside. Returns (the context then ends
    quietly, or raises ``host_failed`` if the host failed under the caller) for what libp2p reports while
    shutting down."""
    if body_error is not None and not _only_cancelled(body_error):
        raise body_error from None  # the caller's own error
    if not started:
        own = first_node_error(exc)
        if own is not None:
            raise own from None
        bind = bind_error(exc)
        if bind is not None:
            raise NodeError(f"cannot listen on {listen}: {bind.strerror}", reason="port_in_use") from None
        if isinstance(exc, Exception):
            raise NodeError(
                f"cannot start the libp2p host on {listen}: {short(exc)}", reason="listen_failed"
            ) from exc
        raise exc
    # A py-libp2p service that fails cancels the code running inside its context (the caller's body):
    # that is the host failing, not the caller stopping, so the body's cancellation must not end the
    # context quietly (``open_libp2p_host`` raises it once out of its teardown scope). While shutting down
    # the services sometimes spawn tasks into closing nurseries: log that, and let a cancellation from
    # outside go on its way.
    if body_error is not None and failures:
        return
    if isinstance(exc, BaseExceptionGroup):
        cancelled, rest = exc.split(trio.Cancelled)
        if rest is not None:
            log.debug("libp2p reported errors while shutting down: %r", rest)
        if cancelled is not None:
            raise cancelled from None
    elif isinstance(exc, trio.Cancelled | KeyboardInterrupt):
        raise exc
    else:
        log.debug("libp2p reported an error while shutting down: %r", exc)


@asynccontextmanager
async def failures_into(failures: list[BaseException]) -> AsyncIterator[None]:
    """Note what leaves the block other than cancellation (a py-libp2p service that failed: its context
    cancels the code inside it, so the caller sees only ``Cancelled``), and let it go on its way."""
    try:
        yield
    except BaseException as exc:
        rest = exc.split(trio.Cancelled)[1] if isinstance(exc, BaseExceptionGroup) else exc
        if rest is not None and not isinstance(rest, trio.Cancelled):
            failures.append(rest)
        raise


def _only_cancelled(exc: BaseException) -> bool:
    return isinstance(exc, trio.Cancelled) or (
        isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None
    )


def first_leaf(exc: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: the one worth a line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def dial_cause(exc: BaseException, depth: int = 8) -> str:
    """What made a dial fail, in the operating system's words where there are some ("connection
    refused"), not py-libp2p's wrapper ("no addresses established a successful connection (with
    exceptions)"): the first OSError with an error number down its causes, else its own first line."""
    pending: list[tuple[BaseException, int]] = [(exc, 0)]
    seen: set[int] = set()
    while pending:
        current, level = pending.pop(0)
        if id(current) in seen or level > depth:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None and current.strerror:
            return current.strerror.lower()
        children = [*(getattr(current, "errors", None) or ()), *(getattr(current, "exceptions", None) or ())]
        children += [c for c in (current.__cause__, current.__context__) if c is not None]
        pending += [(child, level + 1) for child in children if isinstance(child, BaseException)]
    return short(exc)


def short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


def bind_error(exc: BaseException) -> OSError | None:
    """The OSError inside whatever py-libp2p wrapped it in, if any."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (
            errno.EADDRINUSE,
            errno.EADDRNOTAVAIL,
            errno.EACCES,
        ):
            return current
        if isinstance(current, BaseExceptionGroup):
            stack.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                stack.append(linked)
    return None
