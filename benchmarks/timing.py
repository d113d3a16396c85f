"""Timing shared by the benchmarks: a call run ``warmup`` times untimed, then ``repeat`` times,
each timed alone; the times reduced by ``stat`` (``min``: the best run, the least disturbed by
other load; ``statistics.median``: a typical run)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def timed(
    fn: Callable[[], object],
    repeat: int,
    stat: Callable[[Sequence[float]], float] = min,
    warmup: int = 1,
) -> float:
    """Seconds per call of ``fn``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return stat(times)
