"""The spill lever of `enforce_budget` / `apply_plan`: a session the plan would drop is offered to a callback
first; one it took leaves the table without being lost (no eviction counted); one whose spill failed stays
while the budget can be met otherwise, and is dropped (as an eviction) only as a last resort. The shell's
lever (tests/test_shell_spill.py) follows this same policy: `enforce_budget` owns it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import functional_state as fs
from functional_state import ManagerState
from functional_state.transfer import export_session, import_session


def _full() -> ManagerState:
    s = ManagerState.create(byte_budget="3 KiB")
    for sid in ("a", "b", "c"):
        s, _ = fs.get_or_create(s, sid)
        s = fs.put(s, sid, "x", fs.DenseValue.create([np.full(256, ord(sid), np.float32)]))  # 1 KiB each
    return s


def _grown(s: ManagerState) -> ManagerState:
    s, _ = fs.get_or_create(s, "d")
    return fs.put(s, "d", "x", fs.DenseValue.create([np.zeros(512, np.float32)]))  # 2 KiB: 5 KiB in all


def test_a_session_the_spill_took_lives_on_elsewhere_and_is_not_an_eviction():
    peer = ManagerState.create()
    offered = []

    def to_peer(state: ManagerState, sid: str) -> bool:
        nonlocal peer
        offered.append(sid)
        peer = import_session(peer, export_session(state, sid))
        return True

    before = _grown(_full())
    after = fs.enforce_budget(before, protect="d", levers=("drop",), spill=to_peer)
    assert offered == ["a", "b"] and set(after.session_ids) == {"c", "d"}
    assert after.evictions == before.evictions  # nothing lost
    for sid in offered:
        assert fs.view(peer, sid, "x")[0].tolist() == fs.view(before, sid, "x")[0].tolist()


def _failing(how: str, refuse: str, offered: list[str]):
    def spill(state: ManagerState, sid: str) -> bool:
        offered.append(sid)
        if sid not in refuse:
            return True
        if how == "raises":
            raise ConnectionError("peer gone")
        return False

    return spill


@pytest.mark.parametrize("how", ["raises", "declines"])
def test_a_session_whose_spill_failed_is_kept_while_others_can_go(how, caplog):
    # Issue 36: the pure verb used to drop a session whose spill failed, while the shell kept it.
    caplog.set_level(logging.INFO, "functional_state")
    offered: list[str] = []
    before = _grown(_full())
    after = fs.enforce_budget(before, protect="d", levers=("drop",), spill=_failing(how, "a", offered))
    assert "a" in after.session_ids and set(after.session_ids) == {"a", "d"}  # b and c went in its place
    assert offered == ["a", "b", "c"] and after.evictions == before.evictions  # nothing lost
    word = "raised" if how == "raises" else "was declined"
    assert f"spilling session 'a' {word}; it stays in the table" in caplog.text


@pytest.mark.parametrize("how", ["raises", "declines"])
def test_a_failed_spill_is_dropped_as_an_eviction_only_as_a_last_resort(how, caplog):
    caplog.set_level(logging.INFO, "functional_state")
    offered: list[str] = []
    before = _grown(_full())
    after = fs.enforce_budget(before, protect="d", levers=("drop",), spill=_failing(how, "abc", offered))
    plain = fs.enforce_budget(before, protect="d", levers=("drop",))
    assert after.session_ids == plain.session_ids and after.evictions == before.evictions + 2
    assert sorted(offered) == ["a", "b"]  # not offered again once the budget could not be met without them
    assert "cannot be met without dropping session(s) ['a', 'b'], whose spill failed" in caplog.text


def test_apply_plan_keeps_a_session_whose_spill_failed():
    before = _grown(_full())
    plan = fs.plan_release(before, "cpu", 2048, ["d"], levers=("drop",))
    assert plan is not None
    after = fs.apply_plan(before, plan, spill=lambda state, sid: sid != "a")
    assert "a" in after.session_ids and "b" not in after.session_ids and after.evictions == before.evictions


def test_nothing_is_offered_within_budget():
    offered: list[str] = []
    s = _full()
    assert fs.enforce_budget(s, levers=("drop",), spill=lambda s, sid: offered.append(sid)) is s
    assert offered == []
