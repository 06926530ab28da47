"""The shell's overhead (issue 24): `SessionStateManager` and its handles against the pure op and a plain
locked swap of the same pure op, at 64 sessions, side by side in one process.

Rows (each sample is 640 ops, round-robin over 64 live sessions holding a 4-item `LatentBuffer`):

* ``commit``: ``handle.commit`` (handles made once) vs ``fs.commit`` vs ``with lock: state = fs.commit(...)``;
* ``get+commit``: ``manager.get_or_create_session(sid).commit`` vs ``fs.get_or_create`` + ``fs.commit``
  vs the same two under one lock (a hit each time).

Ratios are shell / locked swap and shell / pure. Interleaved samples, gc on, torch at 1 thread, median of
``ROUNDS``. Run: ``PYTHONPATH=. python benchmarks/bench_shell.py`` (point PYTHONPATH at another tree, e.g. a
``git archive`` of the base commit, to measure it the same way).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

import functional_state as fs
from _timing import fmt_time, interleaved_medians

SESSIONS = 64
OPS = 640  # ops per sample: 10 rounds over the sessions
ROUNDS = 9
ITEM = np.zeros(16, np.float32)


def _table() -> fs.ManagerState:
    state = fs.ManagerState.create(max_sessions=SESSIONS)
    for i in range(SESSIONS):
        state, _ = fs.get_or_create(state, f"s{i}")
        state = fs.put(state, f"s{i}", "buf", fs.LatentBuffer.create(maxlen=4))
    return state


def measure() -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    ids = [f"s{i % SESSIONS}" for i in range(OPS)]
    box = {"pure": _table(), "locked": _table()}
    lock = threading.Lock()
    manager = fs.SessionStateManager(max_sessions=SESSIONS)
    for i in range(SESSIONS):
        manager.get_or_create_session(f"s{i}").put("buf", fs.LatentBuffer.create(maxlen=4))
    handles = {sid: manager.get_or_create_session(sid) for sid in set(ids)}

    def pure_commit() -> None:
        s = box["pure"]
        for sid in ids:
            s = fs.commit(s, sid, "buf", ITEM)
        box["pure"] = s

    def locked_commit() -> None:
        for sid in ids:
            with lock:
                box["locked"] = fs.commit(box["locked"], sid, "buf", ITEM)

    def shell_commit() -> None:
        for sid in ids:
            handles[sid].commit("buf", ITEM)

    def pure_get_commit() -> None:
        s = box["pure"]
        for sid in ids:
            s, _ = fs.get_or_create(s, sid)
            s = fs.commit(s, sid, "buf", ITEM)
        box["pure"] = s

    def locked_get_commit() -> None:
        for sid in ids:
            with lock:
                box["locked"], _ = fs.get_or_create(box["locked"], sid)
            with lock:
                box["locked"] = fs.commit(box["locked"], sid, "buf", ITEM)

    def shell_get_commit() -> None:
        for sid in ids:
            manager.get_or_create_session(sid).commit("buf", ITEM)

    fns = {
        "commit/pure": pure_commit,
        "commit/locked": locked_commit,
        "commit/shell": shell_commit,
        "get+commit/pure": pure_get_commit,
        "get+commit/locked": locked_get_commit,
        "get+commit/shell": shell_get_commit,
    }
    t = interleaved_medians(fns, repeats=ROUNDS)
    out = {}
    for row in ("commit", "get+commit"):
        pure, locked, shell = (t[f"{row}/{k}"] / OPS for k in ("pure", "locked", "shell"))
        out[row] = {
            "pure": pure,
            "locked": locked,
            "shell": shell,
            "vs_locked": shell / locked,
            "vs_pure": shell / pure,
        }
    return out


def run() -> dict:
    """The ``shell`` section of BENCHMARKS.md (`benchmarks/run.py shell`)."""
    r = measure()
    rows = [
        [
            op,
            fmt_time(v["pure"]),
            fmt_time(v["locked"]),
            fmt_time(v["shell"]),
            f"{v['vs_locked']:.2f}",
            f"{v['vs_pure']:.2f}",
        ]
        for op, v in r.items()
    ]
    return {
        "title": f"Shell overhead: SessionStateManager against the pure op at {SESSIONS} sessions",
        "header": ["op", "pure", "pure + lock", "shell", "shell / pure + lock", "shell / pure (goal <= 1.3)"],
        "rows": rows,
        "ratio": ("handle.commit: shell / pure (goal <= 1.3)", r["commit"]["vs_pure"]),
        "extra_ratios": [("get_or_create_session + commit: shell / pure (goal <= 1.3)", r["get+commit"]["vs_pure"])],
        "notes": (
            f"Each sample is {OPS} ops, round-robin over {SESSIONS} live sessions each holding a 4-item `LatentBuffer`; "
            f"medians of {ROUNDS} interleaved samples, GC on, torch at 1 thread. `commit`: `handle.commit` (handles "
            "made once) against `fs.commit` and against `with lock: state = fs.commit(...)`; `get+commit`: "
            "`manager.get_or_create_session(sid).commit` (a hit each time) against `fs.get_or_create` + `fs.commit`, "
            "alone and each under the lock. The shell's one-step writes (`shell/slot.py`: a commit, a session-local "
            "verb, a factory's object) and its hit take the lock through its bound `acquire`/`release`, not a `with` "
            "block: the statement looks `__enter__` and `__exit__` up on every entry, measured at about 80 of the "
            "160 ns of one locked swap on this machine, paid twice per hit-and-commit. A miss is admitted "
            "(`shell/admission.admit`) and installed under one acquisition: it adds no bytes, so no user code runs. "
            "Reproduce: `PYTHONPATH=$PWD python benchmarks/run.py shell`."
        ),
    }


def main() -> None:
    print(f"shell overhead at {SESSIONS} sessions (per op; median of {ROUNDS} interleaved samples of {OPS} ops)")
    print(f"{'op':<12}{'pure':>12}{'locked swap':>14}{'shell':>12}{'shell/locked':>14}{'shell/pure':>12}")
    for row, r in measure().items():
        print(
            f"{row:<12}{fmt_time(r['pure']):>12}{fmt_time(r['locked']):>14}{fmt_time(r['shell']):>12}"
            f"{r['vs_locked']:>13.2f}x{r['vs_pure']:>11.2f}x"
        )


if __name__ == "__main__":
    main()
