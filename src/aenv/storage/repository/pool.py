"""The repository's bounded thread pool: where blocking store calls and file I/O run.

Store calls block (boto3, POSIX I/O), so they run in threads; the pool's size bounds both the
requests in flight and the memory they hold (about two chunks per worker), however many chunks
an operation has.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

T = TypeVar("T")
DEFAULT_WORKERS = 8


class Pool:
    def __init__(self, workers: int = DEFAULT_WORKERS) -> None:
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="aenv-repository")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args))

    async def map(self, calls: Iterable[Callable[[], T]]) -> list[T]:
        """Results in order; on the first failure the calls not yet started are dropped."""
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._executor, call) for call in calls]
        try:
            return await asyncio.gather(*futures)
        except BaseException:
            for future in futures:
                future.cancel()
            raise

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
