"""The shell's lock discipline (issue 20): engine callbacks and user code run outside the manager's lock, a
failing callback loses nothing, and a detached handle's writes are the table's own verbs."""

import contextlib
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from functional_state import ArrayRing, LatentBuffer, SessionStateManager, table
from functional_state.shell.writes import Writes
from helpers import finishes, race


def _on_another_thread(fn):
    """Run ``fn`` on another thread and wait for it (what an engine callback that asks a worker does)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(5.0)
    assert not t.is_alive(), "the other thread's manager call blocked"


class _Engine:
    """A paged pool whose callbacks may call back into the manager from another thread, or raise."""

    def __init__(self, blocks=8):
        self.layer = np.zeros((blocks, 4), np.float32)
        self.allocated: set[int] = set()
        self.on_free = self.on_offload = lambda: None
        self.fail_free = 0
        self.pool = fs.PagedKVPool(self.layer, free=self.free, offload=self.offload, reload=self.reload, name="kv")
        self._next = 0

    def allocate(self, n):
        ids = tuple(range(self._next, self._next + n))
        self._next += n
        self.allocated.update(ids)
        return ids

    def free(self, ids):
        self.on_free()
        if self.fail_free:
            self.fail_free -= 1
            raise RuntimeError("free failed (injected)")
        assert set(ids) <= self.allocated, f"double free {ids}"
        self.allocated.difference_update(ids)

    def offload(self, ids):
        self.on_offload()
        return self.layer[list(ids)].copy()

    def reload(self, token):
        ids = self.allocate(len(token))
        self.layer[list(ids)] = token
        return ids


def _kv_manager(**kw):
    engine = _Engine()
    m = SessionStateManager(**kw)
    m.get_or_create_session("a").put("kv", fs.PagedKVHandle.create(engine.pool, engine.allocate(2)))
    return engine, m


def test_an_engine_free_that_waits_on_another_threads_manager_call_does_not_deadlock():
    # Regression: `free` ran under the manager's lock, so a callback waiting for a thread that uses the
    # manager (a write, a hit) never returned.
    engine, m = _kv_manager()
    engine.on_free = lambda: _on_another_thread(lambda: m.get_or_create_session("b").set_attr("k", 1))
    assert finishes(lambda: m.drop_session("a"))
    assert engine.allocated == set() and "a" not in m and fs.lookup(m.state, "b").get_attr("k") == 1


def test_an_engine_offload_that_waits_on_another_threads_manager_call_does_not_deadlock():
    engine, m = _kv_manager()
    engine.on_offload = lambda: _on_another_thread(lambda: m.get_or_create_session("b"))
    assert finishes(lambda: m.park("a", "kv"))
    assert fs.lookup(m.state, "a").get("kv").parked and "b" in m


def test_a_step_functions_first_trace_runs_outside_the_lock():
    # Regression: `step` traced the user's function under the manager's lock.
    m = SessionStateManager()
    m.get_or_create_session("a").put("ring", ArrayRing.create(4, (8,)))
    traced = []

    def fn(ring, x):
        traced.append(True)  # runs once, at the trace
        _on_another_thread(lambda: m.get_or_create_session("b"))
        return ring.commit(x)

    assert finishes(lambda: m.step("a", "ring", fn, jnp.ones(8), donate=True))
    assert traced == [True] and fs.lookup(m.state, "a").get("ring").view().shape == (1, 8) and "b" in m


@pytest.mark.parametrize("verb", ["drop", "evict", "miss"])
def test_a_failing_free_changes_nothing_and_keeps_stats_exact(verb):
    engine, m = _kv_manager(max_sessions=1)
    h = m.get_or_create_session("a")
    before, stats = m.state, m.stats(exact=True)
    engine.fail_free = 1
    write = {
        "drop": lambda: m.drop_session("a"),
        "evict": lambda: h.evict("kv"),
        "miss": lambda: m.get_or_create_session("b"),
    }
    with pytest.raises(fs.KVFreeError, match="injected"):
        write[verb]()
    assert h.in_table and h.get("kv").block_ids == (0, 1)
    if verb == "miss":  # the table before, its counter past the number the miss issued (never reissued)
        assert fs.sessions(m.state) == fs.sessions(before) and m.state.issued == before.issued + 1
    else:
        assert m.state is before
    assert m.stats() == m.stats(exact=True) == stats and engine.allocated == {0, 1}
    write[verb]()  # the retry frees what is owed, once
    assert engine.allocated == set() and m.stats() == m.stats(exact=True)


def test_a_failing_offload_changes_nothing_and_keeps_stats_exact():
    engine, m = _kv_manager()
    before, stats = m.state, m.stats(exact=True)

    def fail():
        raise RuntimeError("offload failed (injected)")

    engine.on_offload = fail
    with pytest.raises(RuntimeError, match="injected"):
        m.park("a", "kv")
    assert m.state is before and m.stats() == m.stats(exact=True) == stats and engine.allocated == {0, 1}


def test_a_free_that_fails_after_another_write_landed_keeps_both_and_the_blocks_go_back_later(caplog):
    # The other write was built on the drop, so the drop cannot be taken back: it stays, and the engine is
    # still owed the blocks, handed back by the next write that frees blocks.
    engine, m = _kv_manager()
    m.get_or_create_session("c").put("kv", fs.PagedKVHandle.create(engine.pool, engine.allocate(1)))
    engine.fail_free = 2  # the free after the install, and its immediate retry as a debt
    engine.on_free = lambda: _on_another_thread(lambda: m.get_or_create_session("b").set_attr("k", 1))
    with caplog.at_level("WARNING", logger="functional_state"):
        assert m.drop_session("a")
    engine.on_free = lambda: None
    assert "a" not in m and "b" in m and engine.allocated == {0, 1, 2}
    assert any("retried later" in r.getMessage() for r in caplog.records)
    m.drop_session("c")  # frees c's block, and a's that were owed
    assert engine.allocated == set() and m.stats() == m.stats(exact=True)


def test_a_detached_handles_park_is_the_tables_park():
    # Regression: a detached handle's park skipped the sharing check and returned {}.
    m = SessionStateManager(max_sessions=1)
    ring = ArrayRing.create(4, (256,))
    h = m.get_or_create_session("a").put("ring", ring).set_attr("alias", ring.storage)
    m.get_or_create_session("b")  # evicts a: h is detached
    assert not h.in_table
    with pytest.raises(fs.SharedStorageError, match="shares its storage"):
        h.park("ring")  # the attr holds the same buffer: parking would free nothing
    h.del_attr("alias")
    assert h.park("ring") == {"cpu": -4096, "cpu/pinned_host": 4096}
    assert h.restore("ring") == {"cpu": 4096, "cpu/pinned_host": -4096} and h.get("ring").resident


def test_get_with_a_class_checks_the_type():
    m = SessionStateManager()
    h = m.get_or_create_session("a").put("buf", LatentBuffer.create())
    buf: LatentBuffer = h.get("buf", cls=LatentBuffer)
    assert buf.maxlen is None
    with pytest.raises(fs.InvalidTypeError, match="'buf' is a LatentBuffer, not a ArrayRing"):
        h.get("buf", cls=ArrayRing)


@pytest.mark.parametrize("lock", ["lock", pytest.param("none", marks=pytest.mark.xfail(strict=True))])
def test_many_threads_committing_to_one_session_lose_nothing(lock, monkeypatch):
    # The lock makes the install a compare-and-swap; without it (the xfail case) commits are lost. The
    # install yields the interpreter first in both cases, so the race window is wide enough to be seen.
    factory = threading.Lock if lock == "lock" else contextlib.nullcontext
    install = Writes.install

    def slow_install(self, decision):
        time.sleep(0)
        return install(self, decision)

    commit = table.commit

    def slow_commit(*args):  # the pure commit the handle's one-step write calls: between reading and installing
        out = commit(*args)
        time.sleep(0)
        return out

    monkeypatch.setattr(Writes, "install", slow_install)
    monkeypatch.setattr(table, "commit", slow_commit)
    m = SessionStateManager(lock_factory=factory)
    m.get_or_create_session("a").put("log", LatentBuffer.create())
    n_threads, n = 8, 150
    barrier = threading.Barrier(n_threads, timeout=30)  # (a worker that raised first must not hang the rest)

    def worker(t):
        barrier.wait()
        h = m.get_or_create_session("a")
        for i in range(n):
            h.commit("log", t * 1000 + i)

    race(worker, n_threads)
    assert len(fs.lookup(m.state, "a").get("log").view()) == n_threads * n
