"""Timing helpers for the benchmarks: medians of repeated runs, measured side by side, GC on by default.

Kept instead of pyperf or pytest-benchmark: every claim in BENCHMARKS.md is a ratio of two things timed in
one process, round by round (A, B, A, B, ...), so that load from the other jobs on a shared machine hits
both alike. pyperf times each benchmark in its own worker processes, one benchmark after the other, and
pytest-benchmark runs all rounds of one benchmark before the next: neither interleaves two functions. An A/A
check on this shared 2-core machine (load average 8-10; the same workload timed as A and as B, true ratio 1;
trials of medians of 7), three runs of 15, 40 and 60 trials: median error interleaved 9%, 6%, 9% vs in
consecutive blocks 1%, 15%, 10%, mixed; worst error interleaved 49%, 47%, 39% vs blocks 37%, 89%, 126%.
Interleaving bounds the worst case, which is what a ratio in a report must survive. Rerun the check with
``python benchmarks/_timing.py [trials]``. The Markdown tables are tabulate's (benchmarks/run.py).
"""

from __future__ import annotations

import gc
import statistics
import sys
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
    samples = interleaved_rounds(fns, repeats=repeats, number=number, gc_enabled=gc_enabled, rotate=False)
    return {k: statistics.median(v) for k, v in samples.items()}


def interleaved_rounds(
    fns: dict[str, Callable[[], object]],
    *,
    repeats: int = 7,
    number: int = 1,
    gc_enabled: bool = True,
    rotate: bool = True,
) -> dict[str, list[float]]:
    """Per function, its per-call time in each of ``repeats`` rounds (one sample of every function per round),
    after one warm-up call each. ``rotate``: round ``i`` starts at the ``i``-th function (mod their number),
    so every function runs in every position equally often and none always follows the same neighbour
    (one that evicts the caches, or leaves garbage for the collector). Pair the samples with `round_ratio`."""
    for fn in fns.values():
        fn()
    names = list(fns)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    was_enabled = gc.isenabled()
    try:
        for r in range(repeats):
            shift = r % len(names) if rotate else 0
            for name in names[shift:] + names[:shift]:
                fn = fns[name]
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
    return samples


def round_ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of ``a``'s time over ``b``'s in the same round (`interleaved_rounds`): load that
    drifts between rounds cancels in each round's ratio, where a ratio of two medians can pair a quiet
    round of one with a busy round of the other."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


def fmt_time(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _consecutive_medians(fns: dict[str, Callable[[], object]], *, repeats: int = 7) -> dict[str, float]:
    """As `interleaved_medians`, but all runs of one function before the next (pytest-benchmark's order)."""
    out = {}
    for name, fn in fns.items():
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def aa_check(trials: int = 40) -> dict[str, tuple[float, float]]:
    """Time one workload as "A" and as "B" (true ratio 1), interleaved and in consecutive blocks:
    ``{order: (median |A/B - 1|, worst |A/B - 1|)}`` over ``trials``."""
    import jax.numpy as jnp

    import functional_state as fs

    state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    state = fs.put(state, "a", "ring", fs.ArrayRing.create(8, (64,)))
    x = jnp.ones(64)

    def work() -> object:
        return [fs.commit(state, "a", "ring", x) for _ in range(20)]

    errors: dict[str, list[float]] = {"interleaved": [], "consecutive": []}
    for _ in range(trials):
        for order, timer in [("interleaved", interleaved_medians), ("consecutive", _consecutive_medians)]:
            r = timer({"A": work, "B": work})
            errors[order].append(abs(r["A"] / r["B"] - 1))
    return {k: (statistics.median(v), max(v)) for k, v in errors.items()}


if __name__ == "__main__":
    for order, (median, worst) in aa_check(int(sys.argv[1]) if len(sys.argv) > 1 else 40).items():
        print(f"{order:12} |A/B - 1|: median {median:.1%}, worst {worst:.1%}")
