"""APIFuture: the result of a submitted request of tally's Tinker clients,
as Tinker's (result() blocks, `await` waits in asyncio).

    future = APIFuture(concurrent_future, lambda response: response.step)
    step = future.result(timeout=60)     # or: step = await future
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, Generator, Generic, Optional, TypeVar

T = TypeVar("T")


class APIFuture(Generic[T]):
    """The result of a submitted request, like Tinker's APIFuture:
    result() blocks, `await future` (or result_async()) waits in asyncio.
    A submitted request cannot be cancelled."""

    def __init__(self, source: concurrent.futures.Future,
                 convert: Callable[[Any], T]) -> None:
        """The result of concurrent.futures.Future `source`, passed through
        `convert`."""
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._future.set_running_or_notify_cancel()

        def done(finished: concurrent.futures.Future) -> None:
            try:
                value = convert(finished.result())
            # The request's error, or converting's: either completes it.
            except Exception as error:  # pylint: disable=broad-except
                self._future.set_exception(error)
            else:
                self._future.set_result(value)

        source.add_done_callback(done)

    def result(self, timeout: Optional[float] = None) -> T:
        """The result; raises TimeoutError after `timeout` seconds (None:
        waits as long as it takes) and the request's error if it failed."""
        return self._future.result(timeout)

    async def result_async(self, timeout: Optional[float] = None) -> T:
        """result() for asyncio."""
        return await asyncio.wait_for(asyncio.wrap_future(self._future),
                                      timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    def future(self) -> concurrent.futures.Future[T]:
        """The underlying concurrent.futures.Future."""
        return self._future
