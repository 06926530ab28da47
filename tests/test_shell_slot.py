"""The shell's one-step installs (issue 24): a handle reads and writes the installed table through the
manager's `Slot`; a miss detaches what it evicted before installing the table that no longer holds it."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np
import pytest

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager
from functional_state import table as ms
from functional_state.shell import cells as shell_cells
from functional_state.shell import slot as shell_slot
from helpers import race


class _Watched(shell_cells.Cell):
    """A cell that runs ``on_copy(cell)`` when it is given a copy (a detach), before storing it."""

    __slots__ = ("_copy",)
    on_copy: Any = None

    @property  # type: ignore[override]
    def session(self) -> Any:
        return self._copy

    @session.setter
    def session(self, value: Any) -> None:
        if _Watched.on_copy is not None and hasattr(self, "_copy"):
            _Watched.on_copy(self)
        self._copy = value


def test_a_lock_free_read_during_an_eviction_sees_the_sessions_last_state(monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: a miss installed the table without the evicted session first and gave the evicted handle
    # its copy after, so a lock-free read in between (another thread's `h.state`) found neither the session
    # in the table nor the copy, and read the empty session the handle was made on.
    monkeypatch.setattr(shell_cells, "Cell", _Watched)
    m = SessionStateManager(max_sessions=1)
    h = m.get_or_create_session("a").put("buf", LatentBuffer.create(maxlen=2)).commit("buf", 1.0)
    seen: list[Any] = []
    monkeypatch.setattr(_Watched, "on_copy", lambda cell: seen.append(h.state))  # what a reader sees then
    m.get_or_create_session("b")  # evicts "a"
    assert len(seen) == 1 and "buf" in seen[0] and seen[0].get("buf").view() == (1.0,)
    assert not h.in_table and h.view("buf") == (1.0,)


class _FailingEngine:
    """A paged pool whose ``free`` raises ``fail`` times, running ``on_free`` first (outside the lock)."""

    def __init__(self) -> None:
        self.allocated: set[int] = set()
        self.fail, self.on_free, self._next = 0, (lambda: None), 0
        self.pool = fs.PagedKVPool(np.zeros((8, 4), np.float32), free=self.free, name="kv")

    def allocate(self, n: int) -> tuple[int, ...]:
        ids = tuple(range(self._next, self._next + n))
        self._next += n
        self.allocated.update(ids)
        return ids

    def free(self, ids: tuple[int, ...]) -> None:
        self.on_free()
        if self.fail:
            self.fail -= 1
            raise RuntimeError("free failed (injected)")
        self.allocated.difference_update(ids)


def test_a_free_that_fails_after_a_hit_landed_keeps_the_drop_and_the_hit() -> None:
    # A hit is installed in one step, without the retry loop's epoch: the take-back of a write whose free
    # failed must still see that the table changed since (the table installed is not the write's), or it
    # would reinstall the table before the drop and lose the hit.
    engine = _FailingEngine()
    m = SessionStateManager()
    m.get_or_create_session("a").put("kv", fs.PagedKVHandle.create(engine.pool, engine.allocate(2)))
    m.get_or_create_session("c")
    hits = m.stats()["hits"]
    engine.fail = 2  # the free after the install, and its immediate retry as a debt

    def hit_on_another_thread() -> None:
        t = threading.Thread(target=lambda: m.get_or_create_session("c"))
        t.start()
        t.join()

    engine.on_free = lambda: (hit_on_another_thread(), setattr(engine, "on_free", lambda: None))  # (once)
    m.drop_session("a")
    assert "a" not in m and m.stats()["hits"] == hits + 1 and engine.allocated == {0, 1}  # (owed)
    m.drop_session("c")  # the next write that frees blocks hands back what was owed
    assert engine.allocated == set() and m.stats() == m.stats(exact=True)
    del engine.pool  # (the pool's callbacks hold the engine: no cycle left for the collector)


@pytest.mark.parametrize("lock", ["lock", pytest.param("none", marks=pytest.mark.xfail(strict=True))])
def test_threads_hitting_missing_and_committing_lose_nothing(lock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The one-step paths (a hit, a miss that evicts, a handle commit) are compare-and-swaps only under the lock;
    # without it (the xfail case) updates of the table are lost: commits, counters.
    monkeypatch.setattr(shell_slot, "LIVE_POOLS", {})  # (engine pools other tests keep alive: the long path)
    factory = threading.Lock if lock == "lock" else contextlib.nullcontext
    commit = ms.commit

    def slow_commit(*args: Any) -> Any:  # yields the interpreter between reading the table and installing
        out = commit(*args)
        time.sleep(0)
        return out

    monkeypatch.setattr(ms, "commit", slow_commit)
    n_threads, rounds = 6, 150
    m = SessionStateManager(max_sessions=2 * n_threads, lock_factory=factory)
    barrier = threading.Barrier(n_threads, timeout=30)  # (a worker that raised first must not hang the rest)
    logs: dict[int, Any] = {}

    def worker(t: int) -> None:
        h = logs[t] = m.get_or_create_session(f"t{t}")
        h.get_or_create("log", LatentBuffer.create)
        barrier.wait()
        for i in range(rounds):
            m.get_or_create_session(f"t{t}")  # a hit, or a miss if it was evicted meanwhile
            h.commit("log", i)  # into the table, or (evicted) into the handle's own copy: never lost
            m.get_or_create_session(f"t{t}-{i}")  # a miss, evicting the least recent session

    race(worker, n_threads)
    stats = m.stats()
    assert stats["hits"] + stats["misses"] == n_threads * (1 + 2 * rounds)  # each lookup counted once
    assert stats["misses"] - stats["evictions"] == len(m) == 2 * n_threads
    for t, h in logs.items():
        assert h.view("log") == tuple(range(rounds)), t


def test_a_commit_through_a_handle_is_one_lock_and_one_pure_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    acquired: list[int] = []

    class CountingLock:
        def __init__(self) -> None:
            self._lock = threading.Lock()

        def __enter__(self) -> None:
            acquired.append(1)
            self._lock.acquire()

        def __exit__(self, *exc: Any) -> None:
            self._lock.release()

    monkeypatch.setattr(shell_slot, "LIVE_POOLS", {})  # (engine pools other tests keep alive: the long path)
    m = SessionStateManager(lock_factory=CountingLock)
    h = m.get_or_create_session("a")
    h.get_or_create("buf", lambda: LatentBuffer.create(maxlen=4))
    del acquired[:]
    assert m.get_or_create_session("a") is h
    assert h.get_or_create("buf", LatentBuffer.create) is h.get("buf")  # a read: no lock
    h.commit("buf", np.ones(2))
    assert len(acquired) == 2  # the hit and the commit, each one acquisition


def _leave(m: SessionStateManager, how: str, tmp_path: Any) -> None:
    """Take session "a" out of ``m`` as ``how`` says, then make a new incarnation of "a"."""
    if how == "evicted":
        m.get_or_create_session("b")  # (max_sessions=1)
    elif how == "dropped":
        m.drop_session("a")
    elif how == "loaded":
        m.save(tmp_path / "ckpt")
        m.get_or_create_session("a").commit("buf", np.full(2, 99.0))
        m.load(tmp_path / "ckpt")  # the same id (and incarnation number) back, from the checkpoint
        return
    m.get_or_create_session("a").put("buf", LatentBuffer.create(maxlen=4))


@pytest.mark.parametrize("how", ["evicted", "dropped", "loaded"])
def test_a_handle_whose_session_left_never_writes_the_new_incarnation(how: str, tmp_path: Any) -> None:
    # The one-step writes do not look the incarnation up under the lock: a handle that has not left names the
    # table's incarnation. Every way out of the table must therefore mark the old handle as left first.
    m = SessionStateManager(max_sessions=1)
    old = m.get_or_create_session("a").put("buf", LatentBuffer.create(maxlen=4)).commit("buf", np.ones(2))
    _leave(m, how, tmp_path)
    digest = lambda: [x.tolist() for x in fs.lookup(m.state, "a").get("buf").view()]
    new_view = digest()
    with contextlib.suppress(fs.SessionStateLostError):  # (a dropped or replaced handle refuses writes)
        old.commit("buf", np.zeros(2))
        old.set_attr("k", 1)
    assert not old.in_table and digest() == new_view
    assert fs.lookup(m.state, "a").get_attr("k", None) is None


def test_detached_handles_from_before_and_after_a_load_are_both_kept(tmp_path: Any) -> None:
    """A loaded table numbers its incarnations from 0 again: a handle detached by the load and one detached
    after it may share a number, and both must stay known (a donating step must not free what either holds)."""
    import jax.numpy as jnp

    m = SessionStateManager()
    a = m.get_or_create_session("a").put("ring", fs.ArrayRing.create(4, (256,)))
    a.step("ring", fs.ArrayRing.commit, jnp.ones(256))
    m.save(tmp_path / "t")
    m.load(tmp_path / "t")  # `a` keeps its copy
    again = m.get_or_create_session("a")
    c = m.get_or_create_session("c").put("ring", a.get("ring"))  # c shares the old copy's buffers
    m.drop_session("a")  # `again` detached too
    assert {id(cell) for cell in m._cells.detached()} >= {id(a._cell), id(again._cell)}
    c.step("ring", fs.ArrayRing.commit, jnp.full(256, 2.0), donate=True)
    assert np.asarray(a.view("ring"))[:, 0].tolist() == [1.0]
    assert m.stats() == m.stats(exact=True)


def test_a_new_session_after_an_eviction_gets_its_own_handle_and_a_held_one_keeps_its_copy() -> None:
    # A miss that evicts a session gives the new session a handle of its own; a handle still held on the
    # evicted one keeps its own copy (and stays that session's handle), however the new session is used.
    manager = SessionStateManager(max_sessions=1)
    manager.get_or_create_session("a").put("x", LatentBuffer.create(maxlen=2)).commit("x", 1.0)
    b = manager.get_or_create_session("b")  # evicts "a": its handle was not kept
    assert b.session_id == "b" and b.in_table and not b.state.objects and b.get("x", None) is None
    b.put("x", LatentBuffer.create(maxlen=2)).commit("x", 2.0)
    assert manager.get_or_create_session("b") is b and b.view("x") == (2.0,)
    with pytest.raises(fs.SessionStateLostError, match="'a' was evicted"):
        manager.get_session("a")  # why "a" left is still known
    c = manager.get_or_create_session("c")  # evicts "b", whose handle ``b`` is held
    assert c is not b and b.session_id == "b" and not b.in_table and b.view("x") == (2.0,)
    b.commit("x", 3.0)  # the detached copy takes writes; the table never sees them
    assert b.view("x") == (2.0, 3.0) and "b" not in manager and not c.state.objects
    with pytest.raises(fs.SessionStateLostError):
        b.held("x")
