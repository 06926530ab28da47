"""The shell's one write path (`functional_state.shell.writes`): the restore-and-retry helper every write shares,
the write options record, and a miss decided by `admit` (not by a hand-made copy of it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import functional_state as fs
from functional_state import ManagerState, SessionStateManager
from functional_state.shell import writes
from functional_state.shell.admission import Decision


def _parked() -> ManagerState:
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.commit(fs.put(s, "a", "x", fs.LatentBuffer.create(maxlen=2)), "a", "x", np.zeros(4, np.float32))
    s, _ = fs.park(s, "a", "x")
    return s


def _commit(table: ManagerState) -> tuple[ManagerState, str]:
    return fs.commit(table, "a", "x", np.ones(4, np.float32)), "done"


def test_restoring_restores_what_the_plan_meets_and_runs_it_again() -> None:
    parked = _parked()
    with pytest.raises(fs.ObjectParkedError):
        _commit(parked)
    work, after, out = writes.restoring(_commit, parked, "a", None)
    assert out == "done" and not fs.lookup(work, "a").get("x").parked
    assert [v.tolist() for v in fs.view(after, "a", "x")] == [[0.0] * 4, [1.0] * 4]
    assert fs.lookup(parked, "a").get("x").parked  # (the input is unchanged)


@pytest.mark.parametrize("where, names", [(None, None), ("a", ["y"])])
def test_restoring_raises_what_it_may_not_restore(where: Any, names: Any) -> None:
    # No session to restore in (a verb by id), or only other objects: the plan's error stands.
    with pytest.raises(fs.ObjectParkedError):
        writes.restoring(_commit, _parked(), where, names)


def test_restoring_hands_back_the_restores_of_a_plan_that_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    handed: list[tuple[ManagerState, ManagerState]] = []
    monkeypatch.setattr(writes, "hand_back", lambda base, grabbed: handed.append((base, grabbed)))
    parked, calls = _parked(), []

    def plan(table: ManagerState) -> tuple[ManagerState, None]:
        calls.append(table)
        if len(calls) == 1:
            _commit(table)  # meets the parked object
        raise RuntimeError("user code failed after the restore")

    with pytest.raises(RuntimeError, match="after the restore"):
        writes.restoring(plan, parked, "a", None)
    assert handed == [(parked, calls[1])] and calls[1] is not parked


def test_a_write_record_defaults_to_a_plain_table_write() -> None:
    w = writes.Write()
    assert (w.writer, w.cell, w.names, w.then, w.dropped) == (None, None, None, None, None)
    assert (w.acquires, w.local, w.attrs_unchanged, w.budget) == (False, False, False, True)
    assert writes.INSERT.budget is False and writes.STEP.attrs_unchanged is True


def test_a_miss_is_decided_by_admit(monkeypatch: pytest.MonkeyPatch) -> None:
    # The miss path installs what `admit` decides (the evicted session's handle detached by it), under one lock.
    seen: list[Decision] = []
    real = writes.admit

    def spy(*args: Any, **kw: Any) -> Decision:
        seen.append(real(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(writes, "admit", spy)
    m = SessionStateManager(max_sessions=1)
    old = m.get_or_create_session("a")
    m.get_or_create_session("a")  # a hit: nothing to decide
    assert len(seen) == 1
    m.get_or_create_session("b")  # evicts a
    assert len(seen) == 2 and [d.sid for d in seen[1].left] == ["a"]
    assert not old.in_table and m.stats()["evictions"] == 1
