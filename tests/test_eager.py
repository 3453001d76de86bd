"""run_eager: a coroutine runs on the spot, and a task finishes it only if it must wait."""

from __future__ import annotations

import asyncio

import pytest

from duplexserve.server.core.eager import run_eager


def test_a_coroutine_that_never_waits_finishes_on_the_spot() -> None:
    async def main() -> None:
        seen: list[int] = []

        async def inner() -> None:
            seen.append(1)

        async def work() -> None:
            await inner()  # awaits that complete at once do not suspend
            seen.append(2)

        assert run_eager(work()) is None
        assert seen == [1, 2]

    asyncio.run(main())


def test_its_exceptions_raise_at_the_caller() -> None:
    async def main() -> None:
        async def work() -> None:
            raise ValueError("bad")

        with pytest.raises(ValueError, match="bad"):
            run_eager(work())

    asyncio.run(main())


def test_a_coroutine_that_waits_is_finished_by_a_task_in_order() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        seen: list[object] = []

        async def work() -> None:
            seen.append("start")
            seen.append(await first)
            await asyncio.sleep(0)  # a bare yield
            seen.append(await second)

        task = run_eager(work())
        assert task is not None and seen == ["start"]
        first.set_result("a")
        await asyncio.sleep(0.01)
        assert seen == ["start", "a"] and not task.done()
        second.set_result("b")
        await task
        assert seen == ["start", "a", "b"]

    asyncio.run(main())


def test_a_failed_future_raises_inside_the_coroutine() -> None:
    async def main() -> None:
        fut = asyncio.get_running_loop().create_future()
        caught: list[str] = []

        async def work() -> str:
            try:
                await fut
            except KeyError as exc:
                caught.append(str(exc))
            raise RuntimeError("after")

        task = run_eager(work())
        assert task is not None
        fut.set_exception(KeyError("k"))
        with pytest.raises(RuntimeError, match="after"):
            await task
        assert caught == ["'k'"]

    asyncio.run(main())


@pytest.mark.parametrize("future_done_first", [False, True])
def test_cancelling_the_task_cancels_the_coroutine(future_done_first: bool) -> None:
    async def main() -> None:
        fut = asyncio.get_running_loop().create_future()
        cleaned: list[bool] = []

        async def work() -> None:
            try:
                await fut
                await asyncio.get_running_loop().create_future()  # never set
            finally:
                cleaned.append(True)

        task = run_eager(work())
        assert task is not None
        if future_done_first:  # the cancel arrives while the task is about to resume
            fut.set_result(None)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == [True]

    asyncio.run(main())
