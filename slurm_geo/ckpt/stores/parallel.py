"""Running transfers a few at once: the parts of one multipart upload, the packs of a copy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_all(work: Callable[[T], R], items: Sequence[T], workers: int,
            on_done: Callable[[T, R], None] = lambda _item, _result: None) -> list[R]:
    """`work(item)` for every item, at most `workers` at once; the results in the items'
    order. `on_done(item, result)` runs in the calling thread as each one finishes.

    With one worker (or one item) everything runs in the calling thread, in order. Else
    the items run on a pool of threads, and the first failure cancels the items not yet
    started, waits for the ones running (a thread cannot be stopped mid-request), and is
    raised; the others' failures are dropped.
    """
    if workers <= 1 or len(items) <= 1:
        results = []
        for item in items:
            results.append(work(item))
            on_done(item, results[-1])
        return results
    with ThreadPoolExecutor(min(workers, len(items)), "slurm-geo-transfer") as pool:
        futures: dict[Future[R], int] = {pool.submit(work, item): i
                                         for i, item in enumerate(items)}
        try:
            for future in as_completed(futures):
                on_done(items[futures[future]], future.result())
        finally:
            for future in futures:
                future.cancel()  # those running finish before the pool's shutdown returns
    return [future.result() for future in futures]
