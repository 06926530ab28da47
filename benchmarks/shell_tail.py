"""What the shell's slowest ops are: the manager bench's op timed one by one, each slow op classified.

The op is bench_manager's shell op (``get_or_create_session`` + ``get_or_create`` + ``commit``, uniform ids,
exactly one miss in 10) on a full table of ``n`` sessions. Per op it records the wall and thread CPU time of
each of the three calls, the garbage collections that ran inside it (by generation, from ``gc.callbacks``),
and whether the recency log was compacted. It prints the median, p99 and p99.9 and, for the slowest 0.1% by
wall time and by CPU time, what they had in common: a slow op whose CPU time is under half its wall time was
descheduled (the machine preempted it); one with a collection in it paid for the collection.

    PYTHONPATH=$PWD python benchmarks/shell_tail.py 100000
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any, NamedTuple

import numpy as np
from bench_manager import _IdStream

import functional_state as fs

ITEM = np.zeros(16, np.float32)


class Op(NamedTuple):
    wall: int  # ns, the whole op
    cpu: int  # ns of this thread's CPU time
    collections: tuple[int, ...]  # the generations collected inside the op
    miss: bool
    phases: tuple[int, int, int]  # wall ns of get_or_create_session, get_or_create, commit
    compacted: bool  # the recency log was compacted inside the op


def measure(n: int, samples: int = 3, ops: int = 20_000) -> tuple[list[Op], list[tuple[int, int]]]:
    """Every op of ``samples`` id sequences on a table of ``n``; and each collection's (generation, wall ns)."""
    buf = fs.LatentBuffer.create(maxlen=4)
    manager = fs.SessionStateManager(max_sessions=n)
    for i in range(n):
        manager.get_or_create_session(f"s{i}").put("buf", buf)

    def factory() -> Any:
        return buf

    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    collected: list[tuple[int, int]] = []
    started = [0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = clock()
        else:
            collected.append((info["generation"], clock() - started[0]))

    stream = _IdStream(n, random.Random(0))
    stream.ops = ops
    out: list[Op] = []
    get_session = manager.get_or_create_session
    gc.callbacks.append(on_gc)
    try:
        for _ in range(samples):
            for k, sid in enumerate(stream.sequence()):
                end, seen = manager._slot.table._recency.end, len(collected)
                c0, t0 = cpu(), clock()
                h = get_session(sid)
                t1 = clock()
                h.get_or_create("buf", factory)
                t2 = clock()
                h.commit("buf", ITEM)
                t3, c3 = clock(), cpu()
                gens = tuple(g for g, _ in collected[seen:])
                compacted = manager._slot.table._recency.end < end  # (a compaction renumbers the log from 0)
                out.append(Op(t3 - t0, c3 - c0, gens, k % 10 == 9, (t1 - t0, t2 - t1, t3 - t2), compacted))
    finally:
        gc.callbacks.remove(on_gc)
    return out, collected


def _quantiles(values: list[int]) -> str:
    v = sorted(values)
    return f"median {statistics.median(v) / 1e3:.1f} µs, p99 {v[int(0.99 * len(v))] / 1e3:.1f} µs, p99.9 {v[int(0.999 * len(v))] / 1e3:.1f} µs, max {v[-1] / 1e6:.1f} ms"


def report(n: int) -> None:
    ops, collected = measure(n)
    print(f"{len(ops)} ops on {n:,} sessions")
    print("wall:", _quantiles([o.wall for o in ops]))
    print("CPU: ", _quantiles([o.cpu for o in ops]))
    for gen in (0, 1, 2):
        took = [t for g, t in collected if g == gen]
        if took:
            print(
                f"gen{gen} collections: {len(took)}, median {statistics.median(took) / 1e6:.2f} ms, max {max(took) / 1e6:.1f} ms"
            )
    print("recency-log compactions inside an op:", sum(o.compacted for o in ops))
    tail = max(1, len(ops) // 1000)
    for key in ("wall", "cpu"):
        slow = sorted(ops, key=lambda o: -getattr(o, key))[:tail]
        print(
            f"slowest 0.1% by {key} ({tail} ops): descheduled (CPU < half the wall) {sum(o.cpu < o.wall / 2 for o in slow)}, "
            f"with a collection {sum(bool(o.collections) for o in slow)} "
            f"(by the highest generation collected: {dict(Counter(max(o.collections) for o in slow if o.collections))}), "
            f"misses {sum(o.miss for o in slow)}, with a compaction {sum(o.compacted for o in slow)}"
        )


if __name__ == "__main__":
    report(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
