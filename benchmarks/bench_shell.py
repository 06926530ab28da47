"""The shell's overhead: `SessionStateManager` and its handles against the pure op and a locked swap of the
same pure op, at 64 sessions, side by side in one process.

Rows (each sample is 20,000 ops on 64 live sessions, each holding a 4-item `LatentBuffer`):

* ``commit``: ``handle.commit`` (handles made once) vs ``fs.commit`` vs ``with lock: state = fs.commit(...)``,
  on a session drawn uniformly at random per op (a commit needs a live session: no misses);
* ``get+commit``: ``manager.get_or_create_session(sid).commit`` vs ``fs.get_or_create`` + ``fs.commit`` vs
  the same two under one lock, on bench_manager's id stream: uniform hits and exactly one miss in 10 (a
  new session, evicting the least recently used; its buffer created by the same op).

The ids used to cycle over the sessions in order, every op a hit: the cheapest order there is for an LRU
table, and one no server sees. Ratios are shell / locked swap and shell / pure, medians over rounds of the
per-round ratio of CPU time, rotated and interleaved, GC on, torch at 1 thread; cells are every op timed on
its own (median, p99, p99.9). Run: ``python benchmarks/run.py shell`` (or ``python benchmarks/bench_shell.py``).
"""

from __future__ import annotations

import random
import statistics
import threading
from collections.abc import Callable

import numpy as np
import torch
from bench_manager import _IdStream

import functional_state as fs
from _timing import cell_of, fmt_cell, fmt_time, interleaved_rounds, round_ratio, timed_each

SESSIONS = 64
OPS = 20_000
ROUNDS, TAIL_ROUNDS = 7, 3
ITEM = np.zeros(16, np.float32)
IMPLS = ("pure", "locked", "shell")


def _table() -> fs.ManagerState:
    state = fs.ManagerState.create(max_sessions=SESSIONS)
    for i in range(SESSIONS):
        state, _ = fs.get_or_create(state, f"s{i}")
        state = fs.put(state, f"s{i}", "buf", fs.LatentBuffer.create(maxlen=4))
    return state


def _manager() -> fs.SessionStateManager:
    manager = fs.SessionStateManager(max_sessions=SESSIONS)
    for i in range(SESSIONS):
        manager.get_or_create_session(f"s{i}").put("buf", fs.LatentBuffer.create(maxlen=4))
    return manager


def _commit_ops() -> dict[str, Callable[[str], None]]:
    pure_state, locked_state, manager = _table(), _table(), _manager()
    lock = threading.Lock()
    handles = {f"s{i}": manager.get_or_create_session(f"s{i}") for i in range(SESSIONS)}
    commit = fs.commit

    def pure(sid: str) -> None:
        nonlocal pure_state
        pure_state = commit(pure_state, sid, "buf", ITEM)

    def locked(sid: str) -> None:
        nonlocal locked_state
        with lock:
            locked_state = commit(locked_state, sid, "buf", ITEM)

    def shell(sid: str) -> None:
        handles[sid].commit("buf", ITEM)

    return {"pure": pure, "locked": locked, "shell": shell}


def _get_commit_ops() -> dict[str, Callable[[str], None]]:
    pure_state, locked_state, manager = _table(), _table(), _manager()
    lock = threading.Lock()
    buf = fs.LatentBuffer.create(maxlen=4)
    get_or_create, commit, put = fs.get_or_create, fs.commit, fs.put
    get_session = manager.get_or_create_session

    def pure(sid: str) -> None:
        nonlocal pure_state
        s, session = get_or_create(pure_state, sid)
        if not session.objects:
            s = put(s, sid, "buf", buf)
        pure_state = commit(s, sid, "buf", ITEM)

    def locked(sid: str) -> None:
        nonlocal locked_state
        with lock:
            s, session = get_or_create(locked_state, sid)
            if not session.objects:
                s = put(s, sid, "buf", buf)
            locked_state = commit(s, sid, "buf", ITEM)

    def factory() -> fs.LatentBuffer:
        return buf

    def shell(sid: str) -> None:
        h = get_session(sid)
        h.get_or_create("buf", factory)
        h.commit("buf", ITEM)

    return {"pure": pure, "locked": locked, "shell": shell}


def _drive(op: Callable[[str], None], ids: list[str]) -> None:
    for sid in ids:
        op(sid)


def measure() -> dict[str, dict]:
    """Per row, the CPU rounds (per op) and the per-op cells of each implementation."""
    torch.set_num_threads(1)
    rng = random.Random(0)
    calls = (1 + ROUNDS) + (1 + TAIL_ROUNDS)
    stream = _IdStream(SESSIONS, rng)
    stream.ops = OPS
    sequences = {
        "commit": [[f"s{rng.randrange(SESSIONS)}" for _ in range(OPS)] for _ in range(calls)],
        "get+commit": [stream.sequence() for _ in range(calls)],
    }
    fns: dict[str, Callable[[], None]] = {}
    tails: dict[str, Callable[[], None]] = {}
    lat: dict[str, list[int]] = {}
    for row, ops in (("commit", _commit_ops()), ("get+commit", _get_commit_ops())):
        for impl, op in ops.items():
            key = f"{row}/{impl}"
            turn = iter(sequences[row])
            lat[key] = []
            fns[key] = lambda op=op, turn=turn: _drive(op, next(turn))
            tails[key] = lambda op=op, turn=turn, out=lat[key]: timed_each(op, next(turn), out)
    cpu = interleaved_rounds(fns, repeats=ROUNDS, clock="cpu")
    interleaved_rounds(tails, repeats=TAIL_ROUNDS)
    out: dict[str, dict] = {}
    for row in sequences:
        rounds = {impl: [t / OPS for t in cpu[f"{row}/{impl}"]] for impl in IMPLS}
        out[row] = {
            "cpu": {impl: statistics.median(v) for impl, v in rounds.items()},
            "cells": {impl: cell_of([t * 1e-9 for t in lat[f"{row}/{impl}"][OPS:]]) for impl in IMPLS},
            "vs_locked": round_ratio(rounds, "shell", "locked"),
            "vs_pure": round_ratio(rounds, "shell", "pure"),
        }
    return out


def run() -> dict:
    m = measure()
    rows = [
        (
            row,
            *(fmt_cell(r["cells"][impl]) for impl in IMPLS),
            " / ".join(fmt_time(r["cpu"][impl]) for impl in IMPLS),
            f"{r['vs_locked']:.2f}x",
            f"{r['vs_pure']:.2f}x",
        )
        for row, r in m.items()
    ]
    return {
        "title": f"Shell overhead at {SESSIONS} sessions: handles against the pure op and a locked swap (uniform ids)",
        "header": (
            "op",
            "pure (per op; p99, p99.9)",
            "locked swap (per op; p99, p99.9)",
            "shell (per op; p99, p99.9)",
            "CPU per op (pure / locked / shell)",
            "CPU: shell / locked swap (goal <= 1.3)",
            "CPU: shell / pure",
        ),
        "rows": rows,
        "ratio": ("commit: shell / locked swap, CPU (goal <= 1.3)", m["commit"]["vs_locked"]),
        "extra_ratios": [("get+commit: shell / locked swap, CPU (goal <= 1.3)", m["get+commit"]["vs_locked"])],
        "notes": (
            f"{OPS:,} ops per sample on {SESSIONS} sessions, each drawn uniformly at random (commit: hits only; "
            f"get+commit: bench_manager's stream, exactly one miss in 10, which creates the session and its "
            f"buffer and evicts the least recently used). The ratios are medians over {ROUNDS} rounds of the "
            f"per-round ratio of CPU time (`time.process_time`), rotated and interleaved, GC on; the cells are "
            f"every op of {TAIL_ROUNDS} more rounds timed on its own (wall time, the two clock reads included). "
            f"The locked swap takes its lock once per op. The machine is shared: the figures are noisy. "
            f"Reproduce: `python benchmarks/run.py shell`."
        ),
    }


if __name__ == "__main__":
    result = run()
    print(*result["header"], sep=" | ")
    for row in result["rows"]:
        print(*row, sep=" | ")
