"""Manager op cost at 64 / 1,000 / 100,000 sessions: the functional table vs mutable OrderedDict managers.

One op = get_or_create (a hit on a live session, or for exactly 10% of ops a fresh id never seen before,
which evicts the least recently used session) + a commit into a 4-item ring. Every implementation runs
the same id sequences, interleaved:

* ``pure``: the pure functions, no lock (the op itself);
* ``pure + lock``: the same under one `threading.Lock` per op (what a shell must pay at least);
* ``shell``: `SessionStateManager` with session handles (what a torch pipeline calls);
* ``OrderedDict + 1 lock``: one OrderedDict of deques mutated in place, one lock taken once per op, no
  counters (the fair anchor);
* ``OrderedDict, no lock``: the same without the lock;
* ``floor + lock``: the least a fully persistent pure-Python table can do for the same op, under the same
  lock (`floor_get_or_create`, `floor_put`, `floor_commit`: every old state valid and unchanged, exact LRU,
  no checks, counters or accounting); what separates ours from it is the cost of those, and what separates
  it from the OrderedDict is the cost of persistence itself.

The ids are drawn against a mirror of the LRU table, so a "hit" is always live and a miss always new: the
miss rate is exactly 10% in every sample (checked from the table's own counters). Also measured: the first
miss after 400k hits against a miss on a fresh table (the old tick scan stalled there), and a commit into a
session holding 10,000 objects against one holding 10.

``--against TREE`` instead times the pure op of this tree and of another (an exported commit:
``git archive ddfaf96 | tar -x -C /tmp/base``) in one process, interleaved, against the one-lock baseline:

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/bench_manager.py --against /tmp/base --rounds 5
"""

from __future__ import annotations

import argparse
import importlib
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import immutables
import numpy as np

import functional_state as fs
from _timing import fmt_time, interleaved_medians
from functional_state.table.recency_log import Log, append, entries

SIZES = (64, 1_000, 100_000)
OPS = {64: 20_000, 1_000: 20_000, 100_000: 20_000}  # ops per sample
MISS_EVERY = 10  # exactly one op in 10 is a miss
ITEM = np.zeros(16, np.float32)
ROUNDS_ON, ROUNDS_OFF = 5, 3
CALLS = (1 + ROUNDS_ON) + (1 + ROUNDS_OFF)  # each interleaved_medians call warms every function up once


class OrderedDictManager:
    """The baseline: a bespoke cache, one OrderedDict mutated in place; ``op`` is get_or_create + commit."""

    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, dict] = OrderedDict()

    def op(self, sid: str, item) -> None:
        sessions = self.sessions
        session = sessions.get(sid)
        if session is None:
            session = sessions[sid] = {"buf": deque(maxlen=4)}
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
        else:
            sessions.move_to_end(sid)
        session["buf"].append(item)


class OneLockManager(OrderedDictManager):
    """The same, the whole op under exactly one lock acquisition."""

    def __init__(self, max_sessions: int):
        super().__init__(max_sessions)
        self.lock = threading.Lock()

    def op(self, sid: str, item) -> None:
        with self.lock:
            OrderedDictManager.op(self, sid, item)


# --- the floor: the least a fully persistent pure-Python table can do for the same op --------------------
# A bound, not a product: no argument checks, no counters, no accounting, every ring of capacity FLOOR_RING.
# What it keeps of the table's semantics: every old state stays valid and unchanged (all of it is tuples,
# maps never written after they are built, and a log appended only past every window that reads it); exact
# LRU order and eviction; a commit costs O(log n) in the table's and the session's sizes. Its encoding is
# the cheapest found: the state is one tuple (nodes, clock, log, start, end, pending, pending tick, cap);
# nodes: immutables.Map sid -> (session, tick); recency: a tick per node and an append-only log of
# (sid, tick) in two parallel lists, branched by a table derived from an old one and compacted at
# 4x the table (the table's own `recency_log.Log` and `append`: the log is shared code); a hit writes no node (the session is left pending, its tick in the state) and
# its commit writes the node once; a session is a dict copied on write up to FLOOR_SMALL objects (cheaper
# than a persistent map there, and a dict of untracked values leaves the garbage collector's lists),
# an immutables.Map beyond (O(log n)); a ring is a tuple.
FLOOR_RING = 4
FLOOR_SMALL = 8
FLOOR_COMPACT_AT = 4
_FLOOR_EMPTY: dict = {}


def compacted(nodes: Any, log: Log, start: int, end: int, pending: str | None, tick: int) -> Log:
    """`lru.compacted` over the floor's nodes ``(session, tick)``: a window's current entries in one segment."""
    sids, ticks = [], []
    for sid, t in entries(log, start, end):
        node = nodes.get(sid)
        if node is not None and (tick if sid == pending else node[1]) == t:
            sids.append(sid)
            ticks.append(t)
    return Log(sids, ticks)


def floor_create(max_sessions: int) -> tuple:
    """An empty floor table."""
    return (immutables.Map(), 0, Log([], []), 0, 0, None, 0, max_sessions)


def floor_get_or_create(state: tuple, sid: str) -> tuple[tuple, Any]:
    """The floor's get_or_create: ``(state, session)``; a hit makes ``sid`` most recent, a miss inserts an
    empty session and, when full, evicts the least recent."""
    nodes, clock, log, start, end, pending, pending_tick, cap = state
    node = nodes.get(sid)
    if node is not None:
        if pending is not None and pending != sid:  # settle the previous hit unless its commit did
            nodes = nodes.set(pending, (nodes[pending][0], pending_tick))
        sids = log.sids
        if log.base + len(sids) == end:
            sids.append(sid)
            if sids[end - log.base] is sid:
                log.ticks.append(clock)
            else:  # another table appended first: branch
                log = Log([sid], [clock], end, log)
        else:
            log = Log([sid], [clock], end, log)
        end += 1
        if end - start >= FLOOR_COMPACT_AT * len(nodes):
            log = compacted(nodes, log, start, end, sid, clock)
            start, end = 0, len(log.sids)
        return (nodes, clock + 1, log, start, end, sid, clock, cap), node[0]
    if len(nodes) >= cap:  # evict: the oldest entry still current
        while True:
            seg, i = log, start
            while i < seg.base:
                seg = seg.parent
            victim, t = seg.sids[i - seg.base], seg.ticks[i - seg.base]
            start += 1
            v = nodes.get(victim)
            if v is not None and (pending_tick if victim == pending else v[1]) == t:
                break
        nodes = nodes.delete(victim)
        if victim == pending:
            pending = None
    nodes = nodes.set(sid, (_FLOOR_EMPTY, clock))
    log = append(log, end, sid, clock)
    end += 1
    if end - start >= FLOOR_COMPACT_AT * len(nodes):
        log = compacted(nodes, log, start, end, pending, pending_tick)
        start, end = 0, len(log.sids)
    return (nodes, clock + 1, log, start, end, pending, pending_tick, cap), _FLOOR_EMPTY


def floor_put(state: tuple, sid: str, name: str, ring: tuple) -> tuple:
    """The floor's put: ``ring`` stored under ``name`` in session ``sid``."""
    nodes, clock, log, start, end, pending, pending_tick, cap = state
    node = nodes[sid]
    session = node[0]
    if type(session) is dict and len(session) < FLOOR_SMALL:
        session = session.copy()
        session[name] = ring
    else:
        session = (session if type(session) is immutables.Map else immutables.Map(session)).set(name, ring)
    if sid == pending:
        return (nodes.set(sid, (session, pending_tick)), clock, log, start, end, None, 0, cap)
    return (nodes.set(sid, (session, node[1])), *state[1:])


def floor_commit(state: tuple, sid: str, name: str, item: Any) -> tuple:
    """The floor's commit: ``item`` appended to ring ``name`` of session ``sid`` (the oldest dropped when full)."""
    nodes, clock, log, start, end, pending, pending_tick, cap = state
    node = nodes[sid]
    session = node[0]
    r = session[name]
    r = (r[1], r[2], r[3], item) if len(r) == FLOOR_RING else (*r, item)  # (unrolled: FLOOR_RING is 4)
    if type(session) is dict:
        session = session.copy()
        session[name] = r
    else:
        session = session.set(name, r)
    if sid == pending:  # the hit's tick lands with this write; nothing is pending after it
        return (nodes.set(sid, (session, pending_tick)), clock, log, start, end, None, 0, cap)
    return (nodes.set(sid, (session, node[1])), clock, log, start, end, pending, pending_tick, cap)


def floor_lru(state: tuple) -> list[str]:
    """The floor's session ids, least recently used first."""
    nodes, _, log, start, end, pending, pending_tick, _ = state
    return compacted(nodes, log, start, end, pending, pending_tick).sids  # (the current entries, in order)


class _IdStream:
    """Id sequences with exactly one miss in MISS_EVERY ops; hits are uniform over the sessions live in an
    LRU table of ``n`` (a mirror of what every implementation holds after the same ids)."""

    def __init__(self, n: int, rng: random.Random):
        self.n, self.rng, self.ops = n, rng, OPS.get(n, 20_000)
        self.lru: OrderedDict[str, None] = OrderedDict((f"s{i}", None) for i in range(n))
        self.live = list(self.lru)  # random access for uniform hits
        self.where = {sid: i for i, sid in enumerate(self.live)}
        self.next_id = n

    def sequence(self) -> list[str]:
        out = []
        for k in range(self.ops):
            if k % MISS_EVERY == MISS_EVERY - 1:
                sid = f"s{self.next_id}"
                self.next_id += 1
                self.lru[sid] = None
                old, _ = self.lru.popitem(last=False)
                i = self.where.pop(old)
                self.live[i] = sid
                self.where[sid] = i
            else:
                sid = self.live[self.rng.randrange(self.n)]
                self.lru.move_to_end(sid)
            out.append(sid)
        return out


def _tables(n: int):
    """One table per implementation, n sessions each. Each its own: tables that shared structure would keep
    each other's superseded entries alive and shift garbage-collection cost from one workload to another."""
    buf = fs.LatentBuffer.create(maxlen=4)
    pure = fs.ManagerState.create(max_sessions=n)
    locked = fs.ManagerState.create(max_sessions=n)
    shell = fs.SessionStateManager(max_sessions=n)
    one_lock, no_lock = OneLockManager(n), OrderedDictManager(n)
    for i in range(n):
        sid = f"s{i}"
        for name in ("pure", "locked"):
            s = pure if name == "pure" else locked
            s, _ = fs.get_or_create(s, sid)
            s = fs.put(s, sid, "buf", buf)
            if name == "pure":
                pure = s
            else:
                locked = s
        shell.get_or_create_session(sid).put("buf", buf)
        one_lock.op(sid, ITEM)
        no_lock.op(sid, ITEM)
    return pure, locked, shell, one_lock, no_lock, _floor_table(n)


def _workloads(n: int, rng: random.Random) -> tuple[dict, dict]:
    pure_state, locked_state, shell, one_lock, no_lock, floor_state = _tables(n)
    stream = _IdStream(n, rng)
    runs = [stream.sequence() for _ in range(CALLS)]
    buf = fs.LatentBuffer.create(maxlen=4)
    holders = {"pure": {"state": pure_state}, "locked": {"state": locked_state}, "floor": {"state": floor_state}}
    turn = dict.fromkeys(("pure", "locked", "shell", "one_lock", "no_lock", "floor"), 0)
    lock = threading.Lock()
    get_or_create, commit, put = fs.get_or_create, fs.commit, fs.put

    def ids(name: str) -> list[str]:
        seq = runs[turn[name]]  # an IndexError here means a sequence would be replayed
        turn[name] += 1
        return seq

    def pure():
        holder = holders["pure"]
        s = holder.pop("state")  # the only reference: superseded versions die as in a server
        for sid in ids("pure"):
            s, session = get_or_create(s, sid)
            if not session.objects:
                s = put(s, sid, "buf", buf)
            s = commit(s, sid, "buf", ITEM)
        holder["state"] = s

    def pure_locked():
        holder = holders["locked"]
        s = holder.pop("state")
        for sid in ids("locked"):
            with lock:
                s, session = get_or_create(s, sid)
                if not session.objects:
                    s = put(s, sid, "buf", buf)
                s = commit(s, sid, "buf", ITEM)
        holder["state"] = s

    def factory():  # (defined once, as a pipeline's factory is: the pure side builds no closure per op either)
        return buf

    def shell_ops():
        for sid in ids("shell"):
            h = shell.get_or_create_session(sid)
            h.get_or_create("buf", factory)
            h.commit("buf", ITEM)

    floor_ops = _floor_ops(holders["floor"], lock)

    def floor_locked():
        floor_ops(ids("floor"))

    def one_lock_ops():
        op = one_lock.op
        for sid in ids("one_lock"):
            op(sid, ITEM)

    def no_lock_ops():
        op = no_lock.op
        for sid in ids("no_lock"):
            op(sid, ITEM)

    fns = {
        f"pure@{n}": pure,
        f"locked@{n}": pure_locked,
        f"shell@{n}": shell_ops,
        f"one_lock@{n}": one_lock_ops,
        f"no_lock@{n}": no_lock_ops,
        f"floor@{n}": floor_locked,
    }
    return fns, {"holders": holders, "shell": shell, "one_lock": one_lock, "base_misses": pure_state.misses}


def _miss_after_hits(hits: int = 400_000) -> dict[str, float]:
    """Time one miss on a table worn by ``hits`` hits against the same miss on a fresh table."""
    fresh = fs.ManagerState.create(max_sessions=2)
    fresh, _ = fs.get_or_create(fresh, "a")
    fresh, _ = fs.get_or_create(fresh, "b")
    worn = fresh
    for i in range(hits):
        worn, _ = fs.get_or_create(worn, "ab"[i % 2])
    return interleaved_medians(
        {"fresh": lambda: fs.get_or_create(fresh, "c"), "worn": lambda: fs.get_or_create(worn, "c")},
        repeats=9,
        number=200,
    )


def _commit_by_object_count() -> dict[str, float]:
    fns = {}
    for n_objects in (10, 10_000):
        state, _ = fs.get_or_create(fs.ManagerState.create(), "s")
        session = fs.lookup(state, "s")
        for i in range(n_objects):
            session = session.put(f"o{i}", fs.LatentBuffer.create(maxlen=4))
        state = fs.update_session(state, "s", lambda _, s=session: s)
        fns[n_objects] = lambda state=state: fs.commit(state, "s", "o5", ITEM)
    return interleaved_medians(fns, repeats=9, number=2000)


def _miss_rate(n: int, ctx: dict) -> dict[str, float]:
    """Misses per op over every sample, from each implementation's own table (the check of exactly 10%)."""
    ops = CALLS * OPS[n]
    pure = ctx["holders"]["pure"]["state"]
    locked = ctx["holders"]["locked"]["state"]
    shell = ctx["shell"].stats()
    return {
        "pure": (pure.misses - ctx["base_misses"]) / ops,
        "locked": (locked.misses - ctx["base_misses"]) / ops,
        "shell": (shell["misses"] - n) / ops,
    }


def run() -> dict:
    rng = random.Random(0)
    fns: dict = {}
    contexts: dict = {}
    for n in SIZES:
        f, contexts[n] = _workloads(n, rng)
        fns.update(f)
    per_op = {k: OPS[int(k.rsplit("@", 1)[1])] for k in fns}
    on = {k: v / per_op[k] for k, v in interleaved_medians(fns, repeats=ROUNDS_ON).items()}
    off = {k: v / per_op[k] for k, v in interleaved_medians(fns, repeats=ROUNDS_OFF, gc_enabled=False).items()}
    misses = {n: _miss_rate(n, contexts[n]) for n in SIZES}
    rows = []
    for n in SIZES:
        p, lk, sh, one, none, fl = (on[f"{k}@{n}"] for k in ("pure", "locked", "shell", "one_lock", "no_lock", "floor"))
        rows.append(
            (
                f"{n:,}",
                fmt_time(p),
                fmt_time(lk),
                fmt_time(sh),
                fmt_time(one),
                fmt_time(none),
                fmt_time(fl),
                f"{lk / one:.2f}x",
                f"{fl / one:.2f}x",
                f"{lk / fl:.2f}x",
                f"{p / none:.2f}x",
                f"{sh / one:.2f}x",
                f"{sh / lk:.2f}x",
                f"{off[f'locked@{n}'] / off[f'one_lock@{n}']:.2f}x",
                f"{off[f'floor@{n}'] / off[f'one_lock@{n}']:.2f}x",
                " / ".join(f"{misses[n][k]:.2%}" for k in ("pure", "locked", "shell")),
            )
        )
    miss = _miss_after_hits()
    objects = _commit_by_object_count()
    return {
        "title": "Manager op: functional table vs mutable OrderedDict managers, exactly 10% misses (GC on)",
        "header": (
            "sessions",
            "pure",
            "pure + lock",
            "shell",
            "OrderedDict + 1 lock",
            "OrderedDict, no lock",
            "floor + lock",
            "pure + lock / 1 lock (goal <= 3)",
            "floor + lock / 1 lock",
            "pure + lock / floor + lock",
            "pure / no lock",
            "shell / 1 lock",
            "shell / pure + lock (goal <= 1.3)",
            "GC off: pure + lock / 1 lock",
            "GC off: floor + lock / 1 lock",
            "miss rate (pure / pure + lock / shell)",
        ),
        "rows": rows,
        "ratio": ("pure + lock / OrderedDict + 1 lock at 64 sessions (goal <= 3)", on["locked@64"] / on["one_lock@64"]),
        "extra_ratios": [
            *(
                (
                    f"pure + lock / OrderedDict + 1 lock at {n:,} sessions (goal <= 3)",
                    on[f"locked@{n}"] / on[f"one_lock@{n}"],
                )
                for n in SIZES[1:]
            ),
            *(
                (f"shell / pure + lock at {n:,} sessions (goal <= 1.3)", on[f"shell@{n}"] / on[f"locked@{n}"])
                for n in SIZES
            ),
            *(
                (f"floor + lock / OrderedDict + 1 lock at {n:,} sessions", on[f"floor@{n}"] / on[f"one_lock@{n}"])
                for n in SIZES
            ),
            (
                f"miss after 400k hits / miss on a fresh table (goal <= 2; {fmt_time(miss['worn'])} vs "
                f"{fmt_time(miss['fresh'])})",
                miss["worn"] / miss["fresh"],
            ),
            (
                f"commit into a session of 10,000 objects / of 10 (goal <= 2; {fmt_time(objects[10_000])} vs "
                f"{fmt_time(objects[10])})",
                objects[10_000] / objects[10],
            ),
        ],
        "notes": (
            f"One op = get_or_create (a hit on a session live in the table, or, for exactly one op in "
            f"{MISS_EVERY}, an id never used before, which evicts the LRU session) + a commit into a 4-item ring; "
            f"{OPS[64]:,} ops per sample, a fresh id sequence for every sample and the same sequences for every "
            f"implementation; medians of {ROUNDS_ON} interleaved samples with the garbage collector on "
            f"({ROUNDS_OFF} with it off for the GC-off column). The baselines take no counters; the one-lock "
            f"baseline acquires its lock once per op. The miss-rate column is read back from each table's own "
            f"miss counter over all samples. The shell's op is `get_or_create_session`, `get_or_create('buf', "
            f"factory)` with a factory defined once, and `commit` (its lock taken per call; the read is "
            f"lock-free). The table is one C-backed persistent map (immutables.Map) holding "
            f"a recency tick per node and an append-only eviction log. The floor row is the least a fully "
            f"persistent pure-Python table does for the same op (`floor_*` in bench_manager.py, checked against "
            f"ours and the OrderedDict in tests/test_table_floor.py): the same map, tick and log, a session as "
            f"a dict copied on write (a Map beyond {FLOOR_SMALL} objects), a ring as a tuple, one tuple per "
            f"state, no checks, counters or accounting. Reproduce: `PYTHONPATH=$PWD python benchmarks/run.py manager`."
        ),
        "figures": {"gc_on": on, "gc_off": off, "miss_rate": misses, "miss": miss, "objects": objects},
    }


def _load_tree(tree: str):
    """``TREE/functional_state`` imported as a second package (every import inside it is relative)."""
    where = Path(tempfile.mkdtemp(prefix="bench_manager_"))
    shutil.copytree(Path(tree) / "functional_state", where / "functional_state_against")
    sys.path.insert(0, str(where))
    return importlib.import_module("functional_state_against")


def _pure_locked(module, n: int):
    """One op of ``module``'s pure functions under one lock, on a table of its own (see `_workloads`)."""
    buf = module.LatentBuffer.create(maxlen=4)
    state = module.ManagerState.create(max_sessions=n)
    for i in range(n):
        state, _ = module.get_or_create(state, f"s{i}")
        state = module.put(state, f"s{i}", "buf", buf)
    holder = {"state": state}
    lock = threading.Lock()
    get_or_create, commit, put = module.get_or_create, module.commit, module.put

    def ops(ids: list[str]) -> None:
        s = holder.pop("state")
        for sid in ids:
            with lock:
                s, session = get_or_create(s, sid)
                if not session.objects:
                    s = put(s, sid, "buf", buf)
                s = commit(s, sid, "buf", ITEM)
        holder["state"] = s

    return ops


def _floor_table(n: int) -> tuple:
    """A floor table of ``n`` sessions, each with an empty ring ``buf``."""
    state = floor_create(n)
    for i in range(n):
        state, _ = floor_get_or_create(state, f"s{i}")
        state = floor_put(state, f"s{i}", "buf", ())
    return state


def _floor_ops(holder: dict, lock: Any):
    """The floor's op under ``lock`` for each id of a list, on the table in ``holder["state"]`` (taken out
    while it runs: the only reference, so superseded versions die as in a server)."""

    def ops(ids: list[str]) -> None:
        s = holder.pop("state")
        f_get_or_create, f_put, f_commit = floor_get_or_create, floor_put, floor_commit
        for sid in ids:
            with lock:
                s, session = f_get_or_create(s, sid)
                if not session:
                    s = f_put(s, sid, "buf", ())
                s = f_commit(s, sid, "buf", ITEM)
        holder["state"] = s

    return ops


def compare(against: str, sizes: tuple[int, ...], rounds: int, ops: int) -> list[str]:
    """Per-op times of this tree and ``against`` (pure + lock) and of the one-lock baseline, interleaved:
    medians of ``rounds`` samples of ``ops`` ops, wall and CPU time (the CPU time is steadier on a shared
    machine), garbage collector on. Returns the report lines."""
    other = _load_tree(against)
    lines = [f"this tree: {fs.__file__}; against: {other.__file__}"]
    for n in sizes:
        stream = _IdStream(n, random.Random(0))
        stream.ops = ops
        runs = [stream.sequence() for _ in range(rounds + 1)]  # the first warms up
        one = OneLockManager(n)
        for i in range(n):
            one.op(f"s{i}", ITEM)

        def one_lock(ids: list[str], op=one.op) -> None:
            for sid in ids:
                op(sid, ITEM)

        fns = {
            "this": _pure_locked(fs, n),
            "against": _pure_locked(other, n),
            "floor": _floor_ops({"state": _floor_table(n)}, threading.Lock()),
            "one_lock": one_lock,
        }
        wall: dict[str, list[float]] = {k: [] for k in fns}
        cpu: dict[str, list[float]] = {k: [] for k in fns}
        for r, ids in enumerate(runs):
            for name, fn in fns.items():
                w, c = time.perf_counter(), time.process_time()
                fn(ids)
                if r:
                    wall[name].append((time.perf_counter() - w) / ops)
                    cpu[name].append((time.process_time() - c) / ops)
        for label, t in (("wall", wall), ("cpu", cpu)):
            m = {k: statistics.median(v) for k, v in t.items()}
            lines.append(
                f"{n:>7,} {label:4s}: this {fmt_time(m['this'])}, against {fmt_time(m['against'])}, one lock "
                f"{fmt_time(m['one_lock'])}; this/1 lock {m['this'] / m['one_lock']:.2f}x, against/1 lock "
                f"{m['against'] / m['one_lock']:.2f}x, against/this {m['against'] / m['this']:.2f}x; floor "
                f"{fmt_time(m['floor'])}, floor/1 lock {m['floor'] / m['one_lock']:.2f}x, this/floor "
                f"{m['this'] / m['floor']:.2f}x"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", help="a tree (its functional_state/) to time side by side with this one")
    parser.add_argument("--sizes", default="64,1000,100000", help="table sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="samples per implementation (median)")
    parser.add_argument("--ops", type=int, default=20_000, help="ops per sample")
    args = parser.parse_args(argv)
    if args.against is None:
        report = run()
        print(report["title"], *report["rows"], *report["extra_ratios"], sep="\n")
        return
    sizes = tuple(int(x) for x in args.sizes.split(","))
    print(*compare(args.against, sizes, args.rounds, args.ops), sep="\n")


if __name__ == "__main__":
    main()
