"""Timing helpers for the benchmarks: medians of repeated runs, measured side by side."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable


def interleaved_medians(fns: dict[str, Callable[[], object]], *, repeats: int = 7, number: int = 1) -> dict[str, float]:
    """Median per-call time of each function, alternating them run by run so that noise hits all alike."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                for _ in range(number):
                    fn()
                samples[name].append((time.perf_counter() - start) / number)
            finally:
                gc.enable()
    return {k: statistics.median(v) for k, v in samples.items()}


def fmt_time(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"
