"""Timing helpers for the benchmarks: medians of repeated runs, measured side by side, GC on by default.

Kept instead of pyperf or pytest-benchmark: every claim in BENCHMARKS.md is a ratio of two things timed in
one process, round by round (A, B, A, B, ...), so that load from the other jobs on a shared machine hits
both alike. pyperf times each benchmark in its own worker processes, one benchmark after the other, and
pytest-benchmark runs all rounds of one benchmark before the next: neither interleaves two functions. On
this 2-core machine under load (load average 8), an A/A check (the same workload timed as A and as B, true
ratio 1, 40 trials of medians of 7) was off by a median 6% interleaved and 15% in consecutive blocks
(worst 47% vs 89%). The Markdown tables are tabulate's (benchmarks/run.py).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable


def interleaved_medians(
    fns: dict[str, Callable[[], object]], *, repeats: int = 7, number: int = 1, gc_enabled: bool = True
) -> dict[str, float]:
    """Median per-call time of each function, alternating them run by run so that noise hits all alike.

    The garbage collector runs as it does in a server (``gc_enabled=True``): a function that allocates
    many long-lived containers pays for the collections it causes. ``gc_enabled=False`` measures the same
    work with collection off, to show how much of a cost is the collector's.
    """
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    was_enabled = gc.isenabled()
    try:
        for _ in range(repeats):
            for name, fn in fns.items():
                if not gc_enabled:
                    gc.disable()
                start = time.perf_counter()
                for _ in range(number):
                    fn()
                samples[name].append((time.perf_counter() - start) / number)
                if was_enabled:
                    gc.enable()
    finally:
        if was_enabled:
            gc.enable()
    return {k: statistics.median(v) for k, v in samples.items()}


def fmt_time(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"
