"""Tests of `shell/cells.py`: which handles the shell keeps for reuse, and what its weak maps hold.

Issue 39: at 100,000 sessions with uniform hits, every hit built a handle that the ring of recent handles kept
alive for the next 1,024 builds. Those handles, their cells and weak references outlived the collector's two
young generations (each build a handful of objects for every later full collection to traverse until the ring
let go), and the weak references of the handles the ring let go stayed in the shell's maps until a sweep
walked every entry inside one caller's op. Now a handle is kept only when it is built again within the
window, and the entries of one that died leave at once.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from functional_state import LatentBuffer, SessionStateManager
from functional_state.shell import cells

_ITEM = np.zeros(4, np.float32)


def _manager(n: int) -> SessionStateManager:
    manager, buf = SessionStateManager(max_sessions=n), LatentBuffer.create(maxlen=2)
    for i in range(n):
        manager.get_or_create_session(f"s{i}").put("buf", buf)
    return manager


def test_a_handle_built_once_dies_with_its_callers_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cells, "_RECENT", 8)
    manager = _manager(64)
    for i in range(16):  # (the builds above leave the window)
        manager.get_or_create_session(f"s{i}")
    # s40 was last built long ago: a session met once in a while. Its handle is not kept for reuse.
    ref = weakref.ref(manager.get_or_create_session("s40"))
    assert ref() is None
    # Built again within the window: a session in use, whose handle a per-request caller gets back.
    again = weakref.ref(manager.get_or_create_session("s40"))
    assert again() is not None and manager.get_or_create_session("s40") is again()


def test_the_weak_maps_hold_no_pile_of_dead_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each handle is built, used and dropped (uniform hits over a table larger than the window): the entries
    # of a dead handle leave at the next build, not in a sweep of every entry inside some later caller's op.
    monkeypatch.setattr(cells, "_RECENT", 8)
    manager = _manager(400)
    kept = manager._cells
    for i in range(400):
        h = manager.get_or_create_session(f"s{i}")
        h.commit("buf", _ITEM)
        del h
        # (the ring's 8 handles, the two last built and not yet looked at again, and this one)
        assert len(kept.handles) <= 8 + 3 and len(kept.live) <= 8 + 3, i
        assert sum(ref() is None for ref in kept.handles.values()) <= 2, i


def test_kept_handles_leave_the_ring_with_their_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    # A handle the ring lets go (nothing else holds it) takes its weak-map entries along at once.
    monkeypatch.setattr(cells, "_RECENT", 4)
    manager = _manager(64)
    for i in range(32):
        manager.get_or_create_session(f"s{i}")
        manager.get_or_create_session(f"s{i}")  # the second build: kept
    gc.collect()
    kept = manager._cells
    assert len(kept._recent) == 4
    assert set(kept.handles) == set(kept._recent) and set(kept.live) == set(kept._recent)


def test_a_handle_held_by_its_caller_keeps_its_cell_shared() -> None:
    # The entries of a handle built once stay while its caller holds it: every handle of the incarnation
    # shares its cell, and a departure detaches it with the session's last state.
    manager = SessionStateManager(max_sessions=2)
    a = manager.get_or_create_session("a")
    a.put("buf", LatentBuffer.create(maxlen=2)).commit("buf", 1.0)
    for sid in ("b", "c", "d"):
        manager.get_or_create_session(sid)  # builds of other sessions; "a" leaves at "c"
    assert not a.in_table and a.view("buf") == (1.0,)


def test_the_handle_of_a_session_just_created_is_kept_for_its_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # A session a miss created is about to be used: its handle is kept at once, so the request's next call
    # gets it back instead of building a second cell and handle.
    monkeypatch.setattr(cells, "_RECENT", 8)
    manager = _manager(64)
    first = weakref.ref(manager.get_or_create_session("new"))
    assert first() is not None and manager.get_or_create_session("new") is first()


def test_a_session_whose_handle_only_the_ring_kept_leaves_with_nothing_to_detach(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Its handle (kept for reuse, held by no caller) leaves the ring first and dies, its cell with it: no copy
    # is handed over and no "live handles" line is logged (the LRU logged the eviction). A handle a caller
    # holds is still detached with the session's last state.
    manager = SessionStateManager(max_sessions=2)
    manager.get_or_create_session("a").put("buf", LatentBuffer.create(maxlen=2)).commit("buf", 1.0)
    held = manager.get_or_create_session("b").put("buf", LatentBuffer.create(maxlen=2)).commit("buf", 2.0)
    with caplog.at_level("INFO", logger="functional_state"):
        manager.get_or_create_session("c")  # evicts "a"
        manager.get_or_create_session("d")  # evicts "b"
    detached = [r.getMessage() for r in caplog.records if "live handles keep their own copy" in r.getMessage()]
    assert detached == [
        "session 'b' evicted (LRU: the table holds at most max_sessions=2): its live handles keep "
        "their own copy; writes through them no longer reach the table (`handle.in_table` is False)"
    ]
    assert [cell.session_id for cell in manager._cells.detached()] == ["b"] and held.view("buf") == (2.0,)
