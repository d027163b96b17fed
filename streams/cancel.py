"""Cancellation a handler's threads honour: a job the runtime gives up (its attempt timed out, its partition was
revoked past the grace period, the worker is stopping) must not keep running beside its retry or its new owner.

Cancelling an asyncio task does not stop a thread it awaits, so a handler runs blocking work through
``ctx.cancel.run(fn, ...)``: when the awaiting task is cancelled, the token is set, the handler's ``on_cancel``
callbacks run (kill the container, the subprocess) and the task waits until the thread has returned before the
cancellation goes on — only then does the retry start or the partition go to its next owner. Threads that poll
can watch ``cancelled`` instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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
        self.cancelled = threading.Event()
        self.stop_wait_s = stop_wait_s
        self._callbacks: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    def on_cancel(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` (from a thread) when the job is given up; at once if it already was."""
        with self._lock:
            if not self.cancelled.is_set():
                self._callbacks.append(callback)
                return
        _call(callback)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _call(callback)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` in a job thread; if the caller is cancelled, cancel the token and wait for ``fn`` to return."""
        future = _THREADS.submit(functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            await asyncio.to_thread(self.cancel)
            done, _ = await asyncio.to_thread(concurrent.futures.wait, [future], self.stop_wait_s)
            if not done:
                log.error("a cancelled job's thread (%s) still runs after %g s", getattr(fn, "__name__", fn),
                          self.stop_wait_s)
            raise


def _call(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:  # a cleanup that fails must not stop the others
        log.exception("cancel callback failed")
