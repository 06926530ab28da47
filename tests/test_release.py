"""Tests of `shell/release.py` (engine blocks handed back) and the shell's take-back of a write.

A write taken back after a failed engine ``free`` never lets the shell issue an incarnation number twice
(issue 24), and `with_issued`, the table accessor that keeps the counter, is pure."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import functional_state as fs
from functional_state import SessionStateManager


class _Engine:
    """A paged pool whose ``free`` runs ``on_free`` (outside the lock) and then raises ``fail`` times."""

    def __init__(self) -> None:
        self.allocated: set[int] = set()
        self.fail, self.on_free = 0, (lambda: None)
        self.pool = fs.PagedKVPool(np.zeros((8, 4), np.float32), free=self.free, name="kv")

    def free(self, ids: tuple[int, ...]) -> None:
        self.on_free()
        if self.fail:
            self.fail -= 1
            raise RuntimeError("free failed (injected)")
        self.allocated.difference_update(ids)


def test_a_miss_taken_back_after_a_failed_free_never_reissues_its_number() -> None:
    # Regression: `_take_back` reinstalled the table before the miss, whose counter is behind the number the
    # miss issued; the retry then issued that number again, to another incarnation of the table.
    engine = _Engine()
    m = SessionStateManager(max_sessions=1)
    engine.allocated.update((0, 1))
    m.get_or_create_session("a").put("kv", fs.PagedKVHandle.create(engine.pool, (0, 1)))
    before = m.state
    seen: list[Any] = []
    engine.fail = 1
    engine.on_free = lambda: seen.append(fs.incarnation(m.state, "b"))  # the taken-back table, read lock-free
    with pytest.raises(fs.KVFreeError, match="injected"):
        m.get_or_create_session("b")  # evicts "a", whose blocks' free fails: the miss is taken back
    assert seen and seen[0] is not None and "a" in m and "b" not in m
    assert fs.sessions(m.state) == fs.sessions(before) and m.state.issued > seen[0]
    engine.on_free = lambda: None
    m.get_or_create_session("b")  # the retry frees what is owed
    assert "b" in m and engine.allocated == set()
    assert fs.incarnation(m.state, "b") != seen[0]  # one shell, one number per incarnation
    del engine.pool


def test_a_drop_taken_back_reinstalls_the_very_table() -> None:
    engine = _Engine()
    m = SessionStateManager()
    m.get_or_create_session("a").put("kv", fs.PagedKVHandle.create(engine.pool, (0, 1)))
    before, engine.fail = m.state, 1
    with pytest.raises(fs.KVFreeError):
        m.drop_session("a")  # issues no number: the table before it comes back as it was
    assert m.state is before
    del engine.pool


def test_an_eviction_taken_back_leaves_the_handle_live_and_a_later_one_lists_it_once() -> None:
    # The detached cells are a list of weak references: taking an eviction back must take the cell out of
    # it (else a live cell is reported detached, and listed twice once it leaves again).
    engine = _Engine()
    m = SessionStateManager(max_sessions=1)
    engine.allocated.update((0, 1))
    a = m.get_or_create_session("a").put("kv", fs.PagedKVHandle.create(engine.pool, (0, 1)))
    engine.fail = 1
    with pytest.raises(fs.KVFreeError, match="injected"):
        m.get_or_create_session("b")  # evicts "a", whose blocks' free fails: the miss is taken back
    assert a.in_table and all(cell is not a._cell for cell in m._cells.detached())
    m.get_or_create_session("b")  # evicts "a" for good
    assert not a.in_table and [cell for cell in m._cells.detached() if cell is a._cell] == [a._cell]
    del engine.pool
