"""Manager op cost at 64 / 1,000 / 100,000 sessions: the functional table vs a locked mutable OrderedDict.

One op = get_or_create (a hit, or for 10% of ops a new session, which evicts the least recently used one)
+ a commit into a 4-item ring. Three implementations run the same id sequence, interleaved:

* ``pure + lock``: the pure functions, each op under a `threading.Lock` (what a shell must pay at least);
* ``shell``: `SessionStateManager` with session handles (what a torch pipeline calls);
* ``mutable + lock``: an OrderedDict of dicts of deques mutated in place under a lock (the fair anchor).

Also measured: the first miss after 400k hits against a miss on a fresh table (the old tick scan stalled
there), and a commit into a session holding 10,000 objects against one holding 10.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict, deque

import numpy as np

import functional_state as fs
from _timing import fmt_time, interleaved_medians

SIZES = (64, 1_000, 100_000)
OPS = 20_000
MISS_RATE = 0.1
ITEM = np.zeros(16, np.float32)


class LockedMutableManager:
    """The baseline: a bespoke cache, one OrderedDict mutated in place, every call under a lock."""

    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, dict] = OrderedDict()
        self.lock = threading.Lock()
        self.hits = self.misses = 0

    def get_or_create(self, sid: str) -> dict:
        with self.lock:
            session = self.sessions.get(sid)
            if session is not None:
                self.sessions.move_to_end(sid)
                self.hits += 1
                return session
            self.misses += 1
            session = {"buf": deque(maxlen=4)}
            self.sessions[sid] = session
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
            return session

    def commit(self, sid: str, item) -> None:
        with self.lock:
            self.sessions[sid]["buf"].append(item)


def _id_sequence(n: int, rng: random.Random) -> list[str]:
    """OPS ids: hits on random live sessions, and MISS_RATE new ids (each evicts the LRU session)."""
    ids, newest = [], n - 1
    for _ in range(OPS):
        if rng.random() < MISS_RATE:
            newest += 1
            ids.append(f"s{newest}")
        else:
            ids.append(f"s{newest - rng.randrange(n)}")
    return ids


def _tables(n: int):
    """Three tables of n sessions. Each its own: tables that shared structure would keep each other's
    superseded entries alive and shift garbage-collection cost from one workload to the other."""
    buf = fs.LatentBuffer.create(maxlen=4)
    state = fs.ManagerState.create(max_sessions=n)
    shell = fs.SessionStateManager(max_sessions=n)
    mutable = LockedMutableManager(n)
    for i in range(n):
        sid = f"s{i}"
        state, _ = fs.get_or_create(state, sid)
        state = fs.put(state, sid, "buf", buf)
        shell.get_or_create_session(sid).put("buf", buf)
        mutable.get_or_create(sid)
    return state, shell, mutable


def _workloads(n: int, rng: random.Random) -> dict:
    state, shell, mutable = _tables(n)
    buf = fs.LatentBuffer.create(maxlen=4)
    runs = [_id_sequence(n, rng) for _ in range(2)]  # alternate two sequences so misses stay misses
    holder, turn = {"state": state}, {"pure": 0, "shell": 0, "mutable": 0}
    lock = threading.Lock()
    get_or_create, commit, put = fs.get_or_create, fs.commit, fs.put

    def pure():
        ids = runs[turn["pure"] % 2]
        turn["pure"] += 1
        s = holder.pop("state")  # the only reference: superseded versions die as in a server
        for sid in ids:
            with lock:
                s, session = get_or_create(s, sid)
                if not session.objects:
                    s = put(s, sid, "buf", buf)
                s = commit(s, sid, "buf", ITEM)
        holder["state"] = s

    def shell_ops():
        ids = runs[turn["shell"] % 2]
        turn["shell"] += 1
        for sid in ids:
            h = shell.get_or_create_session(sid)
            h.get_or_create("buf", lambda: buf)
            h.commit("buf", ITEM)

    def mutable_ops():
        ids = runs[turn["mutable"] % 2]
        turn["mutable"] += 1
        for sid in ids:
            mutable.get_or_create(sid)
            mutable.commit(sid, ITEM)

    return {f"pure@{n}": pure, f"shell@{n}": shell_ops, f"mutable@{n}": mutable_ops}


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


def run() -> dict:
    rng = random.Random(0)
    fns: dict = {}
    for n in SIZES:
        fns.update(_workloads(n, rng))
    on = {k: v / OPS for k, v in interleaved_medians(fns, repeats=5).items()}
    off = {k: v / OPS for k, v in interleaved_medians(fns, repeats=3, gc_enabled=False).items()}
    rows = []
    for n in SIZES:
        p, sh, m = on[f"pure@{n}"], on[f"shell@{n}"], on[f"mutable@{n}"]
        rows.append(
            (
                f"{n:,}",
                fmt_time(p),
                fmt_time(sh),
                fmt_time(m),
                f"{p / m:.2f}x",
                f"{sh / m:.2f}x",
                f"{fmt_time(off[f'pure@{n}'])} / {fmt_time(off[f'mutable@{n}'])} ({off[f'pure@{n}'] / off[f'mutable@{n}']:.2f}x)",
            )
        )
    miss = _miss_after_hits()
    objects = _commit_by_object_count()
    return {
        "title": "Manager op: functional table vs locked mutable OrderedDict (GC on)",
        "header": (
            "sessions",
            "pure + lock",
            "shell",
            "mutable + lock",
            "pure / mutable",
            "shell / mutable",
            "GC off: pure / mutable",
        ),
        "rows": rows,
        "ratio": ("pure + lock / mutable + lock at 64 sessions (goal <= 3)", on["pure@64"] / on["mutable@64"]),
        "extra_ratios": [
            ("pure + lock / mutable + lock at 1,000 sessions (goal <= 3)", on["pure@1000"] / on["mutable@1000"]),
            ("pure + lock / mutable + lock at 100,000 sessions (goal <= 3)", on["pure@100000"] / on["mutable@100000"]),
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
            f"One op = get_or_create (a hit on a random live session, or a new session for {MISS_RATE:.0%} of ops, "
            f"which evicts the LRU one) + a commit into a 4-item ring; {OPS:,} ops per sample, medians of 5 "
            f"interleaved samples with the garbage collector on (the last column: 3 samples with it off). The "
            f"table is one C-backed persistent map (immutables.Map) holding a doubly linked recency list, so a "
            f"hit rewrites at most 4 entries and a miss at most 4, O(log n) whatever the history. Reproduce: "
            f"`make bench BENCH=manager`."
        ),
        "figures": {"gc_on": on, "gc_off": off, "miss": miss, "objects": objects},
    }
