"""Timing helpers for the benchmarks: interleaved, rotated rounds with the garbage collector on, and every
cell reported as its median with the p99 and p99.9 beside it.

Kept instead of pyperf or pytest-benchmark: every claim in BENCHMARKS.md is a ratio of two things timed in
one process, round by round (A, B, A, B, ...), so that load from the other jobs on a shared machine hits
both alike. pyperf times each benchmark in its own worker processes, one benchmark after the other, and
pytest-benchmark runs all rounds of one benchmark before the next: neither interleaves two functions. An A/A
check on this shared 2-core machine (load average 8-10; the same workload timed as A and as B, true ratio 1;
trials of medians of 7), three runs of 15, 40 and 60 trials: median error interleaved 9%, 6%, 9% vs in
consecutive blocks 1%, 15%, 10%, mixed; worst error interleaved 49%, 47%, 39% vs blocks 37%, 89%, 126%.
Interleaving bounds the worst case, which is what a ratio in a report must survive. Rerun the check with
``python benchmarks/_timing.py [trials]``. The Markdown tables are tabulate's (benchmarks/run.py).

Three rules every section follows:

* **Rotated interleaving** (`interleaved_rounds`, ``rotate=True``): round ``i`` starts at the ``i``-th
  function, so each runs in every position equally often and none always follows the same neighbour (one
  that evicts the caches or leaves garbage for the collector to find in the next one's time).
* **GC on**: a function that allocates many long-lived containers pays for the collections it causes, as
  it does in a server.
* **Tails beside medians** (`Cell`): the median alone hides a collection that stalls one call in a
  thousand. `interleaved_cells` times every call on its own; `timed_each` does it inside a loop of ops.
  ``clock="cpu"`` (process CPU time, all threads) is for ratios on a machine where other jobs take the
  cores away: wall time then counts their time too.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, NamedTuple

import numpy as np

Clock = Literal["wall", "cpu"]
_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


class Cell(NamedTuple):
    """One cell of a table: the median time per call and its tail, in seconds, over ``calls`` timed calls."""

    median: float
    p99: float
    p999: float
    calls: int

    def __str__(self) -> str:
        return fmt_cell(self)


def cell_of(times: Iterable[float]) -> Cell:
    """The `Cell` of per-call times (seconds). Percentiles are numpy's ``higher`` method: a time that was
    measured, never one interpolated between two calls.

    Example: ``cell_of([1e-6] * 999 + [1e-3]).p999`` is 1e-3 (one call in a thousand stalled).
    """
    a = np.sort(np.asarray(list(times), dtype=np.float64))
    if a.size == 0:
        raise ValueError("cell_of needs at least one time")
    p = np.percentile(a, [50, 99, 99.9], method="higher")
    return Cell(float(p[0]), float(p[1]), float(p[2]), int(a.size))


def fmt_cell(c: Cell) -> str:
    """``median (p99 x, p99.9 y)``: what a table shows for every timed cell."""
    return f"{fmt_time(c.median)} (p99 {fmt_time(c.p99)}, p99.9 {fmt_time(c.p999)})"


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    *,
    repeats: int = 7,
    number: int = 1,
    gc_enabled: bool = True,
    rotate: bool = True,
    clock: Clock = "wall",
) -> dict[str, float]:
    """Median per-call time of each function over ``repeats`` rotated, interleaved rounds (`interleaved_rounds`).

    The garbage collector runs as it does in a server (``gc_enabled=True``): a function that allocates
    many long-lived containers pays for the collections it causes. ``gc_enabled=False`` measures the same
    work with collection off, to show how much of a cost is the collector's.
    """
    samples = interleaved_rounds(fns, repeats=repeats, number=number, gc_enabled=gc_enabled, rotate=rotate, clock=clock)
    return {k: statistics.median(v) for k, v in samples.items()}


def interleaved_rounds(
    fns: dict[str, Callable[[], object]],
    *,
    repeats: int = 7,
    number: int = 1,
    gc_enabled: bool = True,
    rotate: bool = True,
    clock: Clock = "wall",
    untimed: dict[str, Callable[[], object]] | None = None,
) -> dict[str, list[float]]:
    """Per function, its per-call time in each of ``repeats`` rounds (one sample of every function per round),
    after one warm-up call each. ``rotate``: round ``i`` starts at the ``i``-th function (mod their number),
    so every function runs in every position equally often and none always follows the same neighbour
    (one that evicts the caches, or leaves garbage for the collector). ``clock``: ``"wall"`` or ``"cpu"``
    (`time.process_time`: this process's CPU time, every thread's). ``untimed``: per function, a call made
    after each of its runs, off the clock (a reset of what the run used up, e.g. a cache's positions, that
    is no part of what is compared). Pair the samples with `round_ratio`."""
    now = _CLOCKS[clock]
    for name, fn in fns.items():
        fn()
        if untimed and name in untimed:
            untimed[name]()
    names = list(fns)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    was_enabled = gc.isenabled()
    try:
        for r in range(repeats):
            for name in rotation(names, r) if rotate else names:
                fn = fns[name]
                if not gc_enabled:
                    gc.disable()
                start = now()
                for _ in range(number):
                    fn()
                samples[name].append((now() - start) / number)
                if was_enabled:
                    gc.enable()
                if untimed and name in untimed:
                    untimed[name]()
    finally:
        if was_enabled:
            gc.enable()
    return samples


def interleaved_cells(
    fns: dict[str, Callable[[], object]],
    *,
    repeats: int = 7,
    number: int = 1,
    gc_enabled: bool = True,
    clock: Clock = "wall",
) -> dict[str, Cell]:
    """As `interleaved_rounds` (rotated), but every one of the ``number`` calls of a round timed on its own:
    per function, the `Cell` of all ``repeats * number`` call times. The clock is read twice per call, so a
    call far shorter than a microsecond is better timed in a loop (`timed_each` inside the loop, or
    `interleaved_rounds` for the median)."""
    now = _CLOCKS[clock]
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in fns}
    was_enabled = gc.isenabled()
    try:
        for r in range(repeats):
            for name in rotation(names, r):
                fn, out = fns[name], times[name]
                if not gc_enabled:
                    gc.disable()
                for _ in range(number):
                    start = now()
                    fn()
                    out.append(now() - start)
                if was_enabled:
                    gc.enable()
    finally:
        if was_enabled:
            gc.enable()
    return {k: cell_of(v) for k, v in times.items()}


def timed_each(op: Callable[[str], object], keys: Iterable[str], out: list[int]) -> None:
    """Call ``op(key)`` for each key, appending each call's wall time in nanoseconds to ``out`` (for the tail
    of an op too short to time through `interleaved_cells`: the loop is the same for every variant, so
    each pays the same two clock reads, whose cost `timer_overhead` reports)."""
    clock = time.perf_counter_ns
    append = out.append
    for key in keys:
        start = clock()
        op(key)
        append(clock() - start)


def timer_overhead(n: int = 100_000) -> float:
    """Median seconds `timed_each` adds to each call: its time per call of an op that does nothing."""
    out: list[int] = []
    timed_each(_nothing, ["k"] * n, out)
    return statistics.median(out) * 1e-9


def _nothing(_: str) -> None:
    return None


def rotation(names: Sequence[str], r: int) -> list[str]:
    """``names`` as round ``r`` runs them: starting at the ``r``-th (mod their number)."""
    shift = r % len(names)
    return list(names[shift:]) + list(names[:shift])


def round_ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of ``a``'s time over ``b``'s in the same round (`interleaved_rounds`): load that
    drifts between rounds cancels in each round's ratio, where a ratio of two medians can pair a quiet
    round of one with a busy round of the other."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))


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
