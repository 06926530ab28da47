"""A full garbage collection with 100,000 sessions alive: the functional table (pure and in the shell)
against the one-lock OrderedDict manager of bench_manager.py, each alone in the heap in turn.

A server runs with the collector on. Every full collection (generation 2) traverses every tracked
container in the process, so a table that keeps more containers per session stalls every op that happens
to trigger one (the tail in bench_manager's p99.9). Each variant is built, then ``gc.collect()`` is timed
``ROUNDS`` times, then the variant is dropped before the next is built. The interpreter's own heap (JAX,
torch and this package imported, nothing built) is timed the same way: the goal compares what each
manager adds to it, because that heap is the same for both and would dilute the ratio toward 1.

Why the table costs what it does: the tracked objects each variant adds, by type, per session. And a
prototype of the guidance: ``gc.freeze()`` after a server's warm-up moves everything alive into the
permanent generation, which no collection traverses (the imports' heap included), until those objects
are replaced; a session touched after the freeze is replaced by new, tracked objects.

Reproduce: ``python benchmarks/run.py gc`` (``GC_SESSIONS=20000`` for a quick look).
"""

from __future__ import annotations

import collections
import gc
import os
import time
from collections.abc import Callable
from typing import Any

from bench_manager import ITEM, OrderedDictManager

import functional_state as fs
from _timing import Cell, cell_of, fmt_cell, fmt_time

SESSIONS = int(os.environ.get("GC_SESSIONS", "100000"))
ROUNDS = 7
FROZEN = ("imports frozen, then OrderedDict + 1 lock", "imports frozen, then pure table")
RING = 4  # items committed into each session's 4-item ring: the steady state after its first four ops


def _ordered_dict(n: int) -> OrderedDictManager:
    manager = OrderedDictManager(n)
    for i in range(n):
        for _ in range(RING):
            manager.op(f"s{i}", ITEM)
    return manager


def _pure(n: int) -> fs.ManagerState:
    buf = fs.LatentBuffer.create(maxlen=RING)
    state = fs.ManagerState.create(max_sessions=n)
    for i in range(n):
        sid = f"s{i}"
        state, _ = fs.get_or_create(state, sid)
        state = fs.put(state, sid, "buf", buf)
        for _ in range(RING):
            state = fs.commit(state, sid, "buf", ITEM)
    return state


def _shell(n: int) -> fs.SessionStateManager:
    buf = fs.LatentBuffer.create(maxlen=RING)
    manager = fs.SessionStateManager(max_sessions=n)
    for i in range(n):
        h = manager.get_or_create_session(f"s{i}")
        h.get_or_create("buf", lambda: buf)
        for _ in range(RING):
            h.commit("buf", ITEM)
    return manager


def _tracked() -> collections.Counter[str]:
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def _collections(rounds: int = ROUNDS) -> Cell:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - start)
    return cell_of(times)


def _measure(build: Callable[[int], Any] | None, n: int, *, freeze_imports: bool = False) -> dict[str, Any]:
    """Build one variant (None: nothing), time full collections with it alive, count what it added;
    ``freeze_imports``: `gc.freeze()` the heap before building (a server's warm-up), unfrozen after."""
    gc.collect()
    before = _tracked()
    if freeze_imports:
        gc.freeze()
    try:
        held = build(n) if build is not None else None
        gc.collect()
        cell = _collections()
    finally:
        if freeze_imports:
            gc.unfreeze()
    added = _tracked() - before
    del held
    gc.collect()
    top = sorted(((k, v / n) for k, v in added.items() if v / n >= 0.01), key=lambda kv: -kv[1])
    return {"cell": cell, "per_session": sum(added.values()) / n, "by_type": top}


def run() -> dict:
    n = SESSIONS
    results = {
        "empty": _measure(None, n),
        "OrderedDict + 1 lock": _measure(_ordered_dict, n),
        "pure table": _measure(_pure, n),
        "shell": _measure(_shell, n),
        "imports frozen, then OrderedDict + 1 lock": _measure(_ordered_dict, n, freeze_imports=True),
        "imports frozen, then pure table": _measure(_pure, n, freeze_imports=True),
    }
    empty = results["empty"]["cell"].median
    od = results["OrderedDict + 1 lock"]["cell"].median - empty
    rows = []
    for name, r in results.items():
        own = r["cell"].median - empty
        subtracted = name not in ("empty", *FROZEN)
        rows.append(
            (
                name,
                fmt_cell(r["cell"]),
                fmt_time(max(own, 0.0)) if subtracted else "",
                f"{own / od:.2f}x" if subtracted else "",
                "" if name == "empty" else f"{r['per_session']:.2f}",
                ", ".join(f"{k} {v:.2f}" for k, v in r["by_type"][:6]),
            )
        )
    added = {k: results[k]["cell"].median - empty for k in results}
    raw = {k: results[k]["cell"].median for k in results}
    return {
        "title": f"A full garbage collection with {n:,} sessions alive (GC on, each variant alone in the heap)",
        "header": (
            "heap holds",
            "gc.collect()",
            "added to the empty heap's",
            "added / OrderedDict's",
            "tracked objects per session",
            "per session, by type",
        ),
        "rows": rows,
        "ratio": (
            f"pure table / OrderedDict manager, collection time added at {n:,} sessions (goal <= 2)",
            added["pure table"] / od,
        ),
        "extra_ratios": [
            (f"shell / OrderedDict manager, collection time added at {n:,} sessions (goal <= 2)", added["shell"] / od),
            (
                f"pure table / OrderedDict manager, whole gc.collect() at {n:,} sessions",
                raw["pure table"] / raw["OrderedDict + 1 lock"],
            ),
            (
                f"imports frozen: pure table / OrderedDict manager, whole gc.collect() at {n:,} sessions",
                raw[FROZEN[1]] / raw[FROZEN[0]],
            ),
            (
                f"imports frozen / not, pure table, whole gc.collect() at {n:,} sessions",
                raw[FROZEN[1]] / raw["pure table"],
            ),
        ],
        "notes": (
            f"Each variant holds {n:,} sessions, each a {RING}-item ring with {RING} items committed (the same "
            f"16-float numpy item, which the collector does not track); it is built, collected once, then "
            f"`gc.collect()` is timed {ROUNDS} times (wall time: a collection stalls the thread that runs it), "
            f"then it is dropped before the next is built. The empty row is the heap of the imports alone (JAX, "
            f"torch, this package); the goal compares what each manager adds to it. The by-type column counts "
            f"the tracked objects the variant added (`gc.get_objects()` before and after), per session: every "
            f"one is traversed by every full collection. The frozen rows call `gc.freeze()` after the imports and "
            f"before building (what a server can do after its warm-up: the imports and the model leave every "
            f"later collection), so their whole collection is the manager's own; freezing the sessions too "
            f"helps only until they are replaced, and a commit replaces its session's node, session and object. Reproduce: "
            f"`GC_SESSIONS={n} python benchmarks/run.py gc`."
        ),
        "figures": {
            k: {"cell": list(v["cell"]), "per_session": v["per_session"], "by_type": v["by_type"]}
            for k, v in results.items()
        },
    }


if __name__ == "__main__":
    result = run()
    for row in result["rows"]:
        print(" | ".join(str(c) for c in row))
    for label, value in [result["ratio"], *result["extra_ratios"]]:
        print(f"{label}: {value:.3g}")
