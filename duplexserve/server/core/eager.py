"""Run a coroutine at once, on the caller's stack, until it first has to wait.

On the fast path nearly every message is handled without waiting for anything (inline
codecs, sends that only write to the transport), so a task per message would be pure
overhead: a task object, a loop callback, a wake-up. :func:`run_eager` starts the
coroutine on the spot; only if it really suspends on a future does a task take over the
rest, resuming it exactly where it stopped. (Python 3.12's ``eager_start`` does the
same; 3.11 is supported.)
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from typing import Any


def run_eager(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[None] | None:
    """None if ``coro`` finished here (its exceptions raise here); else the task finishing it."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    task = asyncio.get_running_loop().create_task(_finish(coro, waiting))
    task.add_done_callback(functools.partial(_unwind, coro))
    return task


def _unwind(coro: Coroutine[Any, Any, Any], _: asyncio.Task[None]) -> None:
    """A task cancelled before its first step never ran ``_finish``: cancel ``coro`` here,
    so its ``finally`` blocks run now rather than whenever it is collected."""
    if coro.cr_frame is None:  # finished
        return
    try:
        coro.throw(asyncio.CancelledError())
    except BaseException:  # the CancelledError, or what its cleanup raised
        return
    coro.close()  # it tried to wait again while cleaning up: stop it there


async def _finish(coro: Coroutine[Any, Any, Any], waiting: Any) -> None:
    """Drive ``coro`` on, from a task, as the task itself would have."""
    while True:
        cancelled = False
        try:
            if waiting is None:  # a bare yield (asyncio.sleep(0)): give the loop a turn
                await asyncio.sleep(0)
            else:  # as a task would: take over the future the coroutine yielded
                waiting._asyncio_future_blocking = False
                await waiting
        except asyncio.CancelledError:
            # The future's own cancellation reaches coro through its result(); a cancel of
            # this task while the future was already done must be thrown in.
            cancelled = waiting is None or not waiting.cancelled()
        except BaseException:
            pass
        try:
            waiting = coro.throw(asyncio.CancelledError()) if cancelled else coro.send(None)
        except StopIteration:
            return
