"""Tests of `table/renumber.py`.

A loaded table continues the installed table's incarnation numbers (issue 24).

A table read from a checkpoint was built from an empty one, so it numbered its sessions from 0 again: after
a `load` the shell's installed table could hold, under an id a handle had, the very incarnation number that
handle's (dropped) incarnation had. That was the cause of the lock-free read-order race fixed last stop
(`tests/test_shell_fastpath.py`) and of keying detached cells by identity. The shell now installs
`continued(loaded, installed.issued)`: the same table, numbered on from the installed table's counter.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager
from functional_state import table as ms
from functional_state.table.renumber import continued
from functional_state.table.usage import stats
from helpers import assert_unchanged, race, snapshot


def _table(budget: Any = None) -> fs.ManagerState:
    """A table with history: evictions at its cap, hits reordering recency, a fork, a drop, counters set."""
    t = fs.ManagerState.create(max_sessions=4, byte_budget=budget)
    for i in range(6):  # two evictions
        t, _ = fs.get_or_create(t, f"s{i}")
        t = fs.put(t, f"s{i}", "x", LatentBuffer.create(maxlen=3))
        t = fs.commit(t, f"s{i}", "x", float(i))
    t, _ = fs.get_session(t, "s3")
    t = fs.fork_session(t, "s2", "f")
    t = fs.drop_session(t, "s4")[0]
    t, _ = fs.get_or_create(t, "s5")
    return t


def _views(t: fs.ManagerState) -> dict[str, dict[str, Any]]:
    return {sid: {k: o.view() for k, o in s.objects.items()} for sid, s in fs.sessions(t).items()}


def _ids(t: fs.ManagerState) -> list[int | None]:
    return [fs.incarnation(t, sid) for sid in t.session_ids]


@pytest.mark.parametrize("budget", [None, "1GiB"])
def test_continued_numbers_on_from_first_and_keeps_everything_else(budget: Any) -> None:
    t = _table(budget)
    before = snapshot(t)
    moved = continued(t, 100)
    assert_unchanged(t, before)  # pure
    assert moved.session_ids == t.session_ids
    assert _ids(moved) == list(range(100, 100 + len(t)))  # least recently used first
    assert moved.issued == 100 + len(t)
    # The same sessions: each map shared (a stored session carries its table's tick and incarnation, so the
    # renumbered table stores a copy of the small session record, never of what it holds).
    for sid in t.session_ids:
        new, old = ms.lookup(moved, sid), ms.lookup(t, sid)
        assert new._objects is old._objects and new._attrs is old._attrs and new._policies is old._policies
    assert moved.counters == t.counters
    config = (moved.max_sessions, moved.byte_budget, moved.evict_when_full)
    assert config == (t.max_sessions, t.byte_budget, t.evict_when_full)
    assert stats(moved, exact=True) == stats(t, exact=True)


def test_continued_table_behaves_as_the_table_it_renumbers() -> None:
    t = _table()
    moved = continued(t, 50)
    offset = moved.issued - t.issued
    verbs = [
        lambda s: fs.get_or_create(s, "new")[0],  # evicts the least recent
        lambda s: fs.get_session(s, "s2")[0],
        lambda s: fs.commit(s, "s2", "x", 9.0),
        lambda s: fs.get_or_create(s, "newer")[0],
        lambda s: fs.drop_session(s, "s5")[0],
        lambda s: fs.fork_session(s, "s2", "g"),
        lambda s: fs.get_or_create(s, "newest")[0],
    ]
    for verb in verbs:
        t, moved = verb(t), verb(moved)
        assert moved.session_ids == t.session_ids and moved.counters == t.counters
        assert _views(moved) == _views(t)
        assert moved.issued - t.issued == offset  # one number per insertion, as in ``t``
        assert min(i for i in _ids(moved) if i is not None) >= 50


@pytest.mark.parametrize("first", [-1, True, 1.5, "3"])
def test_continued_refuses_a_first_that_is_not_a_count(first: Any) -> None:
    t = _table()
    before = snapshot(t)
    with pytest.raises(fs.InvalidArgumentError, match="first must be a non-negative int"):
        continued(t, first)
    assert_unchanged(t, before)


def test_a_load_never_issues_a_number_a_handle_from_before_holds(tmp_path: Path) -> None:
    # Failed before: the loaded "a" and "b" had incarnations 0 and 1 again, those of the handles made first.
    m = SessionStateManager(max_sessions=8)
    handles = [m.get_or_create_session(sid).put("x", LatentBuffer.create(maxlen=2)) for sid in "abc"]
    m.save(tmp_path / "ckpt")
    m.drop_session("c")
    handles.append(m.get_or_create_session("d"))
    for _ in range(2):  # a second load numbers on from the first one's
        m.load(tmp_path / "ckpt")
        held = {ms.incarnation_of(m.state, sid) for sid in m.state.session_ids}
        assert held.isdisjoint(h._cell.uid for h in handles), (held, [h._cell.uid for h in handles])
        assert all(not h.in_table for h in handles)
        handles += [m.get_or_create_session(sid) for sid in m.state.session_ids]
    assert m.state.session_ids == ("a", "b", "c")  # the loaded table, as saved
    assert len({h._cell.uid for h in handles}) == len(handles)


class _NoLock:
    """A lock that excludes nothing: the shell without its lock (to see the race test catch it)."""

    def acquire(self) -> bool:
        return True

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: Any) -> None:
        pass


_MAXLEN = 16
_WORKERS = 6
_OPS = 250
_LOADS = 30


def _load_race(tmp_path: Path, lock_factory: Any = threading.Lock) -> None:
    """Loads of a saved table racing handle reads and writes from ``_WORKERS`` threads, one session each.

    Only worker ``i`` writes to ``s{i}``, so each incarnation's history is sequential: it starts as the
    checkpoint holds it (the first incarnation was saved, every later one loaded) and gains exactly the
    commits that succeeded through its handle. Every read must show that history, and at the end every
    incarnation's state must equal its single-threaded replay."""
    m = SessionStateManager(max_sessions=2 * _WORKERS, lock_factory=lock_factory)
    saved = {}
    for i in range(_WORKERS):
        h = m.get_or_create_session(f"s{i}").put("x", LatentBuffer.create(maxlen=_MAXLEN))
        for v in range(i + 1):
            h.commit("x", float(v))
        saved[i] = h.get("x").view()
    m.save(tmp_path / "ckpt")
    histories: list[dict[Any, tuple[Any, list[float]]]] = [{} for _ in range(_WORKERS)]
    errors: list[str] = []
    done = threading.Event()

    def work(i: int) -> None:
        if i == _WORKERS:  # the loader
            for _ in range(_LOADS):
                m.load(tmp_path / "ckpt")
            done.set()
            return
        mine, sid = histories[i], f"s{i}"
        for k in range(_OPS):
            if k > _OPS // 2 and not done.is_set():
                done.wait(5)  # (the second half runs once the loads are over: the last incarnation settles)
            h = m.get_or_create_session(sid)
            _, history = mine.setdefault(id(h._cell), (h._cell, []))
            expected = (saved[i] + tuple(history))[-_MAXLEN:]
            if h.state.get("x").view() != expected or h.get_or_create("x", list).view() != expected:
                errors.append(f"{sid} read {h.state.get('x').view()} after {len(history)} commits, not {expected}")
                return
            try:
                h.commit("x", float(1000 * i + k))
                history.append(float(1000 * i + k))
            except fs.SessionStateLostError:
                if h.in_table:
                    errors.append(f"{sid}: a commit was refused through a handle still in the table")
                    return

    race(work, _WORKERS + 1)
    assert not errors, errors[:3]
    for i, mine in enumerate(histories):
        for cell, history in mine.values():
            replay = fs.ManagerState.create()
            replay, _ = fs.get_or_create(replay, "r")
            replay = fs.put(replay, "r", "x", LatentBuffer.create(maxlen=_MAXLEN))
            for v in (*saved[i], *history):
                replay = fs.commit(replay, "r", "x", v)
            got = (ms.lookup(m.state, cell.session_id) if cell.left is None else cell.session).get("x").view()
            assert got == ms.lookup(replay, "r").get("x").view(), (cell.session_id, cell.uid, got)
    assert sum(len(mine) for mine in histories) > _WORKERS  # the loads did replace sessions mid-run


def test_loads_racing_handle_reads_and_writes_keep_every_session_its_own(tmp_path: Path) -> None:
    _load_race(tmp_path)
