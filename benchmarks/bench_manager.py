"""Manager throughput: get_or_create + commit (no stats) at 64, 1,000 and 100,000 sessions, the functional
manager vs a mutable OrderedDict manager written here as the baseline."""

from __future__ import annotations

import random
from collections import OrderedDict, deque

import numpy as np

import functional_state as fs
from _timing import fmt_time, interleaved_medians

SIZES = (64, 1_000, 100_000)
OPS = 2_000


class MutableManager:
    """The baseline: what a bespoke cache does, mutating one OrderedDict in place."""

    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, dict] = OrderedDict()
        self.hits = self.misses = 0

    def get_or_create(self, sid: str) -> dict:
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
        self.sessions[sid]["buf"].append(item)


def run() -> dict:
    item = np.zeros(16, np.float32)
    rng = random.Random(0)
    fns, per_size = {}, {}
    for n in SIZES:
        state = fs.ManagerState.create(max_sessions=n)
        base = MutableManager(n)
        buf = fs.LatentBuffer.create(maxlen=4)
        for i in range(n):
            sid = f"s{i}"
            state, _ = fs.get_or_create(state, sid)
            state = fs.put(state, sid, "buf", buf)
            base.get_or_create(sid)
        ids = [f"s{rng.randrange(n)}" for _ in range(OPS)]
        holder = {"state": state}

        def functional(ids=ids, holder=holder):
            s = holder["state"]
            for sid in ids:
                s, _ = fs.get_or_create(s, sid)
                s = fs.commit(s, sid, "buf", item)
            holder["state"] = s

        def mutable(ids=ids, base=base):
            for sid in ids:
                base.get_or_create(sid)
                base.commit(sid, item)

        fns[f"functional@{n}"] = functional
        fns[f"mutable@{n}"] = mutable
        per_size[n] = holder
    t = interleaved_medians(fns, repeats=7)
    per_op = {k: v / OPS for k, v in t.items()}
    rows = [
        (f"{n:,}", fmt_time(per_op[f"functional@{n}"]), fmt_time(per_op[f"mutable@{n}"]),
         f"{per_op[f'functional@{n}'] / per_op[f'mutable@{n}']:.1f}x")
        for n in SIZES
    ]
    return {
        "title": "Manager throughput: functional vs mutable OrderedDict",
        "header": ("sessions", "functional per op", "mutable per op", "functional / mutable"),
        "rows": rows,
        "ratio": ("functional(100,000) / functional(64) per op", per_op["functional@100000"] / per_op["functional@64"]),
        "extra_ratios": [("mutable(100,000) / mutable(64) per op", per_op["mutable@100000"] / per_op["mutable@64"])],
        "notes": (
            f"One op = get_or_create (a hit, moving the session to most recent) + commit of a small array into a "
            f"4-item ring, {OPS:,} ops on random sessions per run. The functional manager returns a new immutable "
            f"state each op (persistent hash map + tick index, O(log n)); the baseline mutates in place (O(1)). "
            f"The constant factor is the price of immutability (every old state stays valid, forks are free); "
            f"the growth column shows it does not scale with the session count beyond the log factor."
        ),
        "figures": per_op,
    }
