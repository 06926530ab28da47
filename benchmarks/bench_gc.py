"""A full garbage collection with 100,000 sessions alive: the functional table (pure and in the shell)
against the one-lock OrderedDict manager of bench_manager.py, each alone in the heap in turn.

A server runs with the collector on. Every full collection (generation 2) traverses every tracked
container in the process, so a table that keeps more containers per session, or keeps them scattered over
the heap, stalls every op that happens to trigger one (the tail in bench_manager's p99.9). Each variant is
built, then ``gc.collect()`` is timed ``ROUNDS`` times, then the variant is dropped before the next is
built; once with the imports' heap as it is (a server as is) and once with it frozen (``gc.freeze()``, what
a server can do after its warm-up), where the collection is the manager's own and the goal is held.

Why the table costs what it does: the tracked objects each variant adds, by type, per session, and the
collection time per tracked object; the OrderedDict manager built among garbage shows what scattering the
same objects over the heap costs.

Reproduce: ``python benchmarks/run.py gc`` (``GC_SESSIONS=20000`` for a quick look).
"""

from __future__ import annotations

import collections
import gc
import os
import time
from collections.abc import Callable
from typing import Any

from bench_manager import ITEM, OrderedDictManager, _floor_table, floor_commit

import functional_state as fs
from _timing import Cell, cell_of, fmt_cell, fmt_time

SESSIONS = int(os.environ.get("GC_SESSIONS", "100000"))
ROUNDS = 7
FROZEN = (
    "imports frozen, then OrderedDict + 1 lock",
    "imports frozen, then pure table",
    "imports frozen, then shell",
    "imports frozen, then OrderedDict + 1 lock built among garbage",
    "imports frozen, then bench_manager's floor table (a layout prototype)",
    "imports frozen, then the floor table on RerootMap (the table's map)",
)
RING = 4  # items committed into each session's 4-item ring: the steady state after its first four ops


def _ordered_dict(n: int) -> OrderedDictManager:
    manager = OrderedDictManager(n)
    for i in range(n):
        for _ in range(RING):
            manager.op(f"s{i}", ITEM)
    return manager


def _ordered_dict_scattered(n: int) -> OrderedDictManager:
    """The same manager, each session's dict and deque allocated between short-lived containers (as a
    table's objects are: each write allocates its new session, objects dict and object among the garbage of the
    last): the same objects, spread over the heap."""
    junk = []
    manager = OrderedDictManager(n)
    for i in range(n):
        junk.append([{} for _ in range(8)])
        for _ in range(RING):
            manager.op(f"s{i}", ITEM)
    del junk
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


def _floor(n: int, reroot: bool = False) -> tuple:
    """bench_manager's floor table (a prototype of the layout, not a product): one persistent map of
    ``sid -> (session dict, tick)``, a session a dict of rings, a ring a tuple of the items. Once its
    leaves hold only untracked values (numpy arrays, ints), the collector untracks the ring tuples, then
    the session dicts, then the node tuples: what stays tracked is the map's own nodes."""
    state = _floor_table(n, reroot)
    for i in range(n):
        for _ in range(RING):
            state = floor_commit(state, f"s{i}", "buf", ITEM)
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
    return {
        "cell": cell,
        "per_session": sum(added.values()) / n,
        "by_type": top,
        "tracked": max(1, sum(added.values())),
    }


def run() -> dict:
    n = SESSIONS
    results = {
        "the imports alone": _measure(None, n),
        "OrderedDict + 1 lock": _measure(_ordered_dict, n),
        "pure table": _measure(_pure, n),
        "shell": _measure(_shell, n),
        FROZEN[0]: _measure(_ordered_dict, n, freeze_imports=True),
        FROZEN[1]: _measure(_pure, n, freeze_imports=True),
        FROZEN[2]: _measure(_shell, n, freeze_imports=True),
        FROZEN[3]: _measure(_ordered_dict_scattered, n, freeze_imports=True),
        FROZEN[4]: _measure(_floor, n, freeze_imports=True),
        FROZEN[5]: _measure(lambda n: _floor(n, reroot=True), n, freeze_imports=True),
    }
    raw = {k: r["cell"].median for k, r in results.items()}
    rows = []
    for name, r in results.items():
        frozen = name in FROZEN
        rows.append(
            (
                name,
                fmt_cell(r["cell"]),
                f"{raw[name] / raw[FROZEN[0] if frozen else 'OrderedDict + 1 lock']:.2f}x",
                "" if name == "the imports alone" else f"{r['per_session']:.2f}",
                fmt_time(raw[name] / r["tracked"]) if frozen else "",
                ", ".join(f"{k} {v:.2f}" for k, v in r["by_type"][:6]),
            )
        )
    return {
        "title": f"A full garbage collection with {n:,} sessions alive (each manager alone in the heap)",
        "header": (
            "heap holds",
            "gc.collect() (p99, p99.9)",
            "/ the OrderedDict manager's (frozen rows: frozen)",
            "tracked objects added per session",
            "collection time per tracked object",
            "added per session, by type",
        ),
        "rows": rows,
        "ratio": (
            f"pure table / OrderedDict manager, full collection at {n:,} sessions, imports frozen (goal <= 2)",
            raw[FROZEN[1]] / raw[FROZEN[0]],
        ),
        "extra_ratios": [
            (
                f"shell / OrderedDict manager, full collection at {n:,} sessions, imports frozen (goal <= 2)",
                raw[FROZEN[2]] / raw[FROZEN[0]],
            ),
            (
                f"pure table / OrderedDict manager, full collection at {n:,} sessions, nothing frozen",
                raw["pure table"] / raw["OrderedDict + 1 lock"],
            ),
            (
                f"floor table on RerootMap / OrderedDict manager, full collection at {n:,} sessions, imports frozen",
                raw[FROZEN[5]] / raw[FROZEN[0]],
            ),
            (
                f"OrderedDict manager built among garbage / built alone, imports frozen, at {n:,} sessions",
                raw[FROZEN[3]] / raw[FROZEN[0]],
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
            f"then it is dropped before the next is built. The first four rows are a server as is: every full "
            f"collection also traverses the imports' heap (JAX, torch, this package: the first row), which "
            f"dilutes any ratio toward 1. The frozen rows call `gc.freeze()` after the imports and before "
            f"building (what a server can do after its warm-up, one line: the imports and the model leave every "
            f"later collection), so their whole collection is the manager's own: the goal is held there. The "
            f"by-type column counts the tracked objects the variant added (`gc.get_objects()` before and after), "
            f"per session: every one is traversed by every full collection. The last row builds the OrderedDict "
            f"manager with short-lived containers allocated between its sessions (as each write of the table "
            f"allocates its new session, objects dict and object among the last write's garbage): the same objects "
            f"spread over the heap, to show what locality costs a collection. The floor row is a prototype of a "
            f"persistent layout the collector can mostly skip: bench_manager's floor table (a map of "
            f"`sid -> (session dict, tick)`, a ring a tuple of untracked items), whose ring tuples, session dicts "
            f"and node tuples the collector untracks once it finds they hold only untracked values; the row after it is "
            f"the same on the table's own map (`RerootMap`, which the pure and shell rows use too): one dict "
            f"instead of the HAMT's nodes. Freezing the sessions too helps "
            f"only until they are replaced, and a commit replaces its session, objects dict and object. The "
            f"machine is shared (2 cores, other jobs running): collection times vary with its cache pressure. "
            f"Reproduce: `GC_SESSIONS={n} python benchmarks/run.py gc`."
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
