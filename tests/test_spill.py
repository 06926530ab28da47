"""The spill lever of `enforce_budget` / `apply_plan`: a session the plan would drop is offered to a callback
first; one it took leaves the table without being lost (no eviction counted), one it failed is dropped."""

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


@pytest.mark.parametrize("how", ["raises", "declines"])
def test_a_session_whose_spill_failed_is_dropped_as_before(how, caplog):
    caplog.set_level(logging.INFO, "functional_state")

    def failing(state: ManagerState, sid: str) -> bool:
        if how == "raises":
            raise ConnectionError("peer gone")
        return False

    before = _grown(_full())
    after = fs.enforce_budget(before, protect="d", levers=("drop",), spill=failing)
    plain = fs.enforce_budget(before, protect="d", levers=("drop",))
    assert after.session_ids == plain.session_ids and after.evictions == before.evictions + 2
    assert "spilling session 'a'" in caplog.text


def test_nothing_is_offered_within_budget():
    offered: list[str] = []
    s = _full()
    assert fs.enforce_budget(s, levers=("drop",), spill=lambda s, sid: offered.append(sid)) is s
    assert offered == []
