"""The replies of a bidirectional gRPC stream, in the servicers of executor and router.

A reader takes the caller's requests and puts replies (or starts tasks that put them later, as a
decoupled generation does); the servicer yields the replies as they come. The stream ends when
the reader and every task it started are done; the caller's error ends it too. A caller that
leaves cancels the reader and every task, so no work is left running for nobody: close
`replies()` with the servicer's generator (contextlib.aclosing).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class StreamReplies(Generic[T]):
    def __init__(self) -> None:
        self.out: asyncio.Queue[T | None] = asyncio.Queue()
        self.tasks: set[asyncio.Task[None]] = set()

    def put(self, reply: T) -> None:
        self.out.put_nowait(reply)

    def start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Work that puts its replies later; the stream waits for it before it ends."""
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def replies(self, read: Callable[[], Awaitable[None]]) -> AsyncGenerator[T, None]:
        """Runs `read` and yields every reply put meanwhile, until all is done."""

        async def run() -> None:
            try:
                await read()
                if self.tasks:
                    await asyncio.wait(set(self.tasks))
            finally:
                self.out.put_nowait(None)

        reader = asyncio.create_task(run())
        try:
            while (item := await self.out.get()) is not None:
                yield item
            await reader  # the caller's stream broke: its error ends ours
        finally:
            reader.cancel()
            for task in list(self.tasks):
                task.cancel()  # a caller that left: its work is dropped
