"""Eight threads against one budgeted `SessionStateManager`: every op checked as it lands (issue 19).

Each thread owns some sessions (only it touches them, so a single-threaded replay of its own op sequence,
the model, predicts their contents exactly) and shares a few with the others (whose commits must all land,
each thread's in its own order). The budget may only park, which moves bytes but never changes what a
session holds, so the replay stays exact. After every op: each budgeted pool within its budget, the kept
accounting equal to a full walk (on one snapshot), and the session touched equal to its replay.
"""

from __future__ import annotations

import contextlib
import random
import threading

import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from functional_state import LatentBuffer, SessionStateLostError, SessionStateManager

THREADS = 8
OPS = 40  # per thread
SHARED = ("shared0", "shared1", "shared2")
BUDGET = {"cpu": 2048}
LOCK_FACTORY = threading.Lock  # a scratch run replaces it with a no-op to see this test fail
_REFUSED = (fs.BudgetExceededError, fs.SharedStorageError, fs.ObjectParkedError, fs.NotParkedError)


def _item(v: int):
    # 16 B, its own buffer; a JAX array, so a park moves it to the host pool ("cpu/pinned_host")
    return jnp.asarray(np.full(4, v, np.int32))


def _digest(handle, name: str = "buf") -> tuple[int, ...]:
    return tuple(int(x[0]) for x in handle.view(name))


def _check_snapshot(m: SessionStateManager) -> None:
    s = m.state  # one snapshot: the two figures describe the same table
    kept, walked = fs.stats(s), fs.stats(s, exact=True)
    assert kept == walked, {
        k: (kept.get(k), walked.get(k)) for k in kept.keys() | walked.keys() if kept.get(k) != walked.get(k)
    }
    for pool, limit in BUDGET.items():
        assert kept.get(f"nbytes:{pool}", 0) <= limit, (pool, kept.get(f"nbytes:{pool}"), limit)


def _worker(m: SessionStateManager, t: int, tmp_path, saved: dict, commits: dict) -> None:
    rng = random.Random(1000 + t)
    model: dict[str, list[int]] = {}  # the replay: own session -> its ring's values (maxlen 4)
    handles: dict = {}
    dead: dict = {}  # handles of dropped own sessions: they must refuse writes
    n_forks = 0
    own = [f"t{t}-own{k}" for k in range(2)]
    for step in range(OPS):
        live = sorted(model)
        op = rng.choice(["begin", "commit", "commit", "commit", "shared", "park", "restore", "fork", "drop", "dead"])
        if op == "begin" or not live:
            sid = rng.choice(own)
            if sid not in model:
                h = m.get_or_create_session(sid)
                assert "buf" not in h.state  # a new incarnation starts empty
                h.put("buf", LatentBuffer.create(maxlen=4))
                handles[sid], model[sid] = h, []
            else:
                assert m.get_or_create_session(sid).state is not None
        elif op == "commit":
            sid = rng.choice(live)
            v = t * 10_000 + step
            try:
                handles[sid].commit("buf", _item(v))
            except fs.BudgetExceededError:
                pass  # refused: nothing changed
            else:
                model[sid] = (model[sid] + [v])[-4:]
        elif op == "shared":
            sid = rng.choice(SHARED)
            v = t * 10_000 + step
            try:
                m.get_or_create_session(sid).commit("buf", _item(v))
            except fs.BudgetExceededError:
                pass
            else:
                commits[t].append((sid, v))
        elif op == "park":
            sid = rng.choice(live + list(SHARED))
            with contextlib.suppress(_REFUSED):
                m.park(sid, "buf")
        elif op == "restore":
            sid = rng.choice(live + list(SHARED))
            with contextlib.suppress(_REFUSED):
                m.restore(sid, "buf")
        elif op == "fork":
            src = rng.choice(live)
            n_forks += 1
            dst = f"t{t}-fork{n_forks}"
            handles[dst] = m.fork_session(src, dst)
            model[dst] = list(model[src])
        elif op == "drop":
            sid = rng.choice(live)
            assert m.drop_session(sid)
            dead[sid] = handles.pop(sid)
            model.pop(sid)
            sid = None
        elif op == "dead" and dead:
            sid = rng.choice(sorted(dead))
            with pytest.raises(SessionStateLostError, match="dropped"):
                dead[sid].commit("buf", _item(-1))
            sid = None
        else:
            sid = None
        if t < 2 and step == OPS // 2 and live:  # a few saves: a snapshot of one session, as it is now
            sid = live[0]
            m.save_session(sid, tmp_path / f"t{t}")
            saved[t] = (sid, tuple(model[sid]))
        _check_snapshot(m)
        if sid is not None and sid in model:
            assert _digest(handles[sid]) == tuple(model[sid]), (t, step, op, sid)
    for sid, values in model.items():  # and at the end, every own session against its replay
        assert _digest(m.get_session(sid)) == tuple(values), (t, sid)


def test_eight_threads_with_a_budget_lose_nothing_and_keep_the_budget(tmp_path):
    m = SessionStateManager(max_sessions=512, byte_budget=BUDGET, release_levers=["park"], lock_factory=LOCK_FACTORY)
    for sid in SHARED:
        m.get_or_create_session(sid).put("buf", LatentBuffer.create())  # unbounded: every commit stays
    saved: dict = {}
    commits: dict[int, list] = {t: [] for t in range(THREADS)}
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            _worker(m, t, tmp_path, saved, commits)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a thread is stuck: deadlock"
    if errors:
        raise errors[0]
    for sid in SHARED:  # every shared commit landed once, each thread's in its own order
        got = _digest(m.get_session(sid))
        for t in range(THREADS):
            mine = [v for s, v in commits[t] if s == sid]
            assert [v for v in got if v // 10_000 == t] == mine, (sid, t)
        assert len(got) == sum(s == sid for c in commits.values() for s, _ in c)
    for t, (sid, values) in saved.items():  # a save holds the session as it was when it was called
        loaded = SessionStateManager().load_session(sid, tmp_path / f"t{t}")
        assert _digest(loaded) == values
    _check_snapshot(m)
    assert m.stats()["parks"] > 0 and m.stats()["restores"] > 0  # the budget and the ops did move bytes
