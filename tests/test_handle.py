"""Tests of `shell/handle.py`.

`SessionHandle.table_only` (issue 24): a handle whose every read and write refuses, with nothing written,
once its incarnation left the table; what the strict DreamZero adapter writes through."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import pytest

import functional_state as fs
from functional_state import ArrayRing, LatentBuffer, SessionStateManager
from helpers import leave_table

_USES: dict[str, Callable[[fs.SessionHandle], Any]] = {
    "put": lambda h: h.put("y", LatentBuffer.create(maxlen=2)),
    "remove": lambda h: h.remove("x"),
    "commit": lambda h: h.commit("x", 2.0),
    "stage": lambda h: h.stage("x", 2.0),
    "transact": lambda h: h.transact(lambda s: s.set_attr("k", 2)),
    "update": lambda h: h.update("x", lambda b: b.commit(2.0)),
    "get_or_create": lambda h: h.get_or_create("z", lambda: LatentBuffer.create(maxlen=2)),
    "set_attr": lambda h: h.set_attr("k", 2),
    "del_attr": lambda h: h.del_attr("k"),
    "reset": lambda h: h.reset(),
    "evict": lambda h: h.evict("x"),
    "park": lambda h: h.park("x"),
    "state": lambda h: h.state,
    "get": lambda h: h.get("x"),
}


@pytest.mark.parametrize("how", ["evicted", "dropped", "replaced"])
@pytest.mark.parametrize("use", list(_USES))
def test_a_table_only_handle_refuses_every_use_once_its_incarnation_left(use: str, how: str) -> None:
    manager = SessionStateManager(max_sessions=1)
    plain = manager.get_or_create_session("a").put("x", LatentBuffer.create(maxlen=2)).commit("x", 1.0)
    plain.set_attr("k", 1)
    only = plain.table_only()
    assert only.in_table and only.state is plain.state and "table only" in repr(only)
    leave_table(manager, how)
    copy = plain.state
    with pytest.raises(fs.SessionStateLostError, match="'a'"):
        _USES[use](only)
    assert plain.state is copy  # the detached copy is untouched
    if how == "replaced":  # the new incarnation is not written either
        assert fs.lookup(manager.state, "a").get("x").view() == () and "k" not in fs.lookup(manager.state, "a").attrs


@pytest.mark.parametrize("use", list(_USES))
def test_a_table_only_handle_works_like_any_handle_while_its_incarnation_is_in_the_table(use: str) -> None:
    results = []
    for table_only in (False, True):
        manager = SessionStateManager(max_sessions=1)
        plain = manager.get_or_create_session("a").put("x", LatentBuffer.create(maxlen=2)).commit("x", 1.0)
        plain.set_attr("k", 1)
        handle = plain.table_only() if table_only else plain
        _USES[use](handle)
        session = fs.lookup(manager.state, "a")
        x = session.get("x", None)
        results.append(
            (
                sorted(session.objects),
                dict(session.attrs),
                None if x is None else (x.status, x.view() if x.resident else None),
            )
        )
    assert results[0] == results[1]


def test_a_parked_object_is_restored_through_a_table_only_handle() -> None:
    manager = SessionStateManager()
    only = manager.get_or_create_session("a").put("x", LatentBuffer.create(maxlen=2)).table_only()
    only.commit("x", 1.0).park("x")
    assert only.get("x").view() == (1.0,) and fs.lookup(manager.state, "a").get("x").resident


def _add(ring: ArrayRing, x: jnp.ndarray) -> ArrayRing:
    return ring.commit(x)


@pytest.mark.parametrize("donate", [False, True])
def test_a_handle_never_steps_a_later_incarnation_of_its_session(donate: bool) -> None:
    m = SessionStateManager()
    old = m.get_or_create_session("a").put("ring", ArrayRing.create(4, (2,)))
    old.step("ring", _add, jnp.ones(2), donate=donate)
    m.drop_session("a")
    new = m.get_or_create_session("a").put("ring", ArrayRing.create(4, (2,)))
    with pytest.raises(fs.SessionStateLostError, match="'a'"):
        old.step("ring", _add, jnp.full(2, 7.0), donate=donate)
    assert new.get("ring").view().shape == (0, 2)  # the new incarnation is untouched
    new.step("ring", _add, jnp.full(2, 3.0), donate=donate)  # its own handle steps it
    assert new.get("ring").view().tolist() == [[3.0, 3.0]]
    m.step("a", "ring", _add, jnp.full(2, 4.0))  # by id: whichever incarnation is there
    assert new.get("ring").view().shape == (2, 2)


def test_an_idle_session_keeps_no_cell_or_handle(monkeypatch: pytest.MonkeyPatch):
    # Regression (issue 39): the shell kept a `Cell` and a `SessionHandle` for every session ever handed out,
    # and the cell the session it was made with: 8 containers per session for every full collection to
    # traverse, 4 of them the shell's, 7.18x the OrderedDict manager's collection at 100k sessions. Now an
    # idle session costs what the table's costs (tests/test_session.py): 4.
    import gc

    import numpy as np

    from functional_state.shell import cells

    monkeypatch.setattr(cells, "_RECENT", 8)  # (the handles last built stay alive: 8 of 2,000 sessions here)
    item = np.zeros(16, np.float32)

    def build(n: int) -> SessionStateManager:
        manager, buf = SessionStateManager(max_sessions=n), LatentBuffer.create(maxlen=4)
        for i in range(n):
            h = manager.get_or_create_session(f"s{i}")
            h.get_or_create("buf", lambda: buf)
            for _ in range(4):
                h.commit("buf", item)
        return manager

    n = 2000
    gc.collect()
    before = len(gc.get_objects())
    manager = build(n)
    gc.collect()
    # (plus what does not grow with the table: 8 recent handles and their cells, dead weak references
    # awaiting their sweep, at most 64 in each of the two maps)
    assert (len(gc.get_objects()) - before) / n <= 4.15
    # While a handle lives, every handle of the incarnation shares its cell (and a hit returns it).
    h = manager.get_or_create_session("s1")
    assert manager.get_or_create_session("s1") is h and manager.get_session("s1") is h
    only = h.table_only()
    del h
    again = manager.get_or_create_session("s1")
    again.commit("buf", item)
    assert len(only.get("buf")) == 4 and only.get("buf") is again.get("buf")
    # An idle session's next handle reads and writes the table as before.
    assert len(manager.get_or_create_session("s7").get("buf")) == 4
    # A handle built again soon outlives its caller's reference: a per-request caller gets it back.
    manager.get_or_create_session("s9")
    first = id(manager.get_or_create_session("s9"))
    assert id(manager.get_or_create_session("s9")) == first


@pytest.mark.parametrize("leave", ["evict", "drop"])
def test_a_handle_the_shell_keeps_for_reuse_does_not_keep_a_departed_session_alive(leave: str):
    # The shell keeps the handles it built last so a caller dropping its handle per call gets the same one
    # back; a session that leaves the table must leave that too, or its last state (what a detached handle
    # reads) stays in memory after stats() counted its bytes freed.
    import gc
    import weakref

    import numpy as np

    m = SessionStateManager(max_sessions=1)
    value = np.ones(1024, np.float32)
    m.get_or_create_session("a").put("x", fs.DenseValue.create([value]))
    ref = weakref.ref(m.get_session("a").get("x"))
    del value
    if leave == "evict":
        m.get_or_create_session("b")  # the cap of one evicts "a"
    else:
        m.drop_session("a")
    gc.collect()
    assert "a" not in m.state and ref() is None, "the departed session is still alive"
