"""Cancellation a handler's threads honour: a job the runtime gives up (its attempt timed out, its partition was
revoked past the grace period, the worker is stopping) must not keep running beside its retry or its new owner.

Cancelling an asyncio task does not stop a thread it awaits, so a handler runs blocking work through
``ctx.cancel.run(fn, ...)`` (or ``in_thread(fn, ...)``, which finds the running job's token): when the awaiting
task is cancelled, the token is set, the ``on_cancel`` callbacks run (kill the container, close the build's
connection, kill the subprocess) and the task waits until the thread has returned before the cancellation goes on —
only then does the retry start or the partition go to its next owner. Code deep inside that thread registers its
own cleanup through ``current()``; threads that poll can watch ``cancelled`` instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("kiln.cancel")
# Job threads: enough for every slot's blocking work, separate from asyncio's default executor.
_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="kiln-job")


class CancelToken:
    """One attempt's cancellation (``JobContext.cancel``)."""

    def __init__(self, stop_wait_s: float = 60.0) -> None:
        self.stop_wait_s = stop_wait_s
        self._callbacks: list[Callable[[], object]] = []
        self._lock = threading.Lock()
        # Made on first use: a threading.Event per job costs as much as the rest of a no-op job's bookkeeping.
        self._event: threading.Event | None = None
        self._given_up = False

    @property
    def cancelled(self) -> threading.Event:
        """Set when the job is given up (blocking code polls or waits on it)."""
        with self._lock:
            if self._event is None:
                self._event = threading.Event()
                if self._given_up:
                    self._event.set()
            return self._event

    def on_cancel(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` (from a thread) when the job is given up; at once if it already was."""
        with self._lock:
            if not self._given_up:
                self._callbacks.append(callback)
                return
        _call(callback)

    def cancel(self) -> None:
        with self._lock:
            self._given_up = True
            if self._event is not None:
                self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _call(callback)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` in a job thread; if the caller is cancelled, cancel the token and wait for ``fn`` to return."""
        context = contextvars.copy_context()
        context.run(_current.set, self)  # the thread's code finds this token through current()
        future = _THREADS.submit(context.run, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            await asyncio.to_thread(self.cancel)
            done, _ = await asyncio.to_thread(concurrent.futures.wait, [future], self.stop_wait_s)
            if not done:
                log.error("a cancelled job's thread (%s) still runs after %g s", getattr(fn, "__name__", fn),
                          self.stop_wait_s)
            raise


_current: contextvars.ContextVar[CancelToken | None] = contextvars.ContextVar("kiln_cancel", default=None)


def current() -> CancelToken | None:
    """The token of the job this code runs for (in its task, or in a thread started by ``run``), if any."""
    return _current.get()


def enter(token: CancelToken) -> contextvars.Token[CancelToken | None]:
    """Make ``token`` the running job's (the runtime does this around the handler)."""
    return _current.set(token)


def leave(mark: contextvars.Token[CancelToken | None]) -> None:
    _current.reset(mark)


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn`` in a job thread under the running job's token (outside a job: an unshared one)."""
    return await (current() or CancelToken()).run(fn, *args, **kwargs)


def on_cancel(callback: Callable[[], object]) -> None:
    """Register ``callback`` with the running job's token (no-op outside a job)."""
    token = current()
    if token is not None:
        token.on_cancel(callback)


def _call(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:  # a cleanup that fails must not stop the others
        log.exception("cancel callback failed")
