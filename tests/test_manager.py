import threading

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import (
    ArrayRing,
    LatentBuffer,
    ManagerState,
    ReentrantWriteError,
    SessionAdmissionError,
    SessionExistsError,
    SessionStateLostError,
    SessionStateManager,
)
from helpers import assert_unchanged, snapshot


def _finishes(fn, timeout=10.0):
    """Run ``fn`` in a thread; True if it returned within ``timeout`` (a deadlock would not)."""
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # surfaced by the caller
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if errors:
        raise errors[0]
    return not t.is_alive()


def test_handles_of_one_session_see_each_others_writes():
    m = SessionStateManager()
    h1 = m.get_or_create_session("s")
    h1.put("buf", LatentBuffer.create())
    h2 = m.get_or_create_session("s")
    h2.commit("buf", 1)
    h1.commit("buf", 2)
    assert h1.view("buf") == h2.view("buf") == (1, 2)
    assert fs.lookup(m.state, "s").get("buf").view() == (1, 2)


def test_state_is_an_immutable_snapshot():
    m = SessionStateManager()
    h = m.get_or_create_session("s").put("buf", LatentBuffer.create())
    before = m.state
    h.commit("buf", 1)
    assert fs.lookup(before, "s").get("buf").view() == ()
    assert isinstance(m.state, ManagerState) and m.state is not before


def test_evicted_handle_keeps_its_state_and_never_resurrects():
    m = SessionStateManager(max_sessions=1)
    h = m.get_or_create_session("a").put("buf", LatentBuffer.create()).commit("buf", 1)
    m.get_or_create_session("b")  # evicts a
    assert "a" not in m and not h.in_table
    h.commit("buf", 2)  # keeps working
    assert h.view("buf") == (1, 2)
    assert "a" not in m and m.state.session_ids == ("b",)
    with pytest.raises(SessionStateLostError):
        m.get_session("a")
    # A new incarnation under the same id is fresh, and the old handle never writes into it.
    fresh = m.get_or_create_session("a")
    assert "buf" not in fresh.state
    h.commit("buf", 3)
    assert "buf" not in fresh.state and h.view("buf") == (1, 2, 3)


def test_dropped_handle_keeps_its_state():
    m = SessionStateManager()
    h = m.get_or_create_session("a").set_attr("x", 5)
    assert m.drop_session("a") and not m.drop_session("a")
    assert h.get_attr("x") == 5 and len(m) == 0 and bool(m)


def test_handle_evict_and_reset():
    m = SessionStateManager()
    h = m.get_or_create_session().put("buf", LatentBuffer.create()).commit("buf", np.zeros(100, np.uint8))
    assert m.nbytes_by_device() == {"cpu": 100}
    assert h.evict("buf") == 100
    assert m.stats()["total_nbytes"] == 0
    h.set_attr("k", torch.zeros(3)).reset()
    assert h.get_attr("k", None) is None and not h.get("buf").allocated
    assert h.session_id == "default"


def test_get_or_create_object_through_a_handle():
    m = SessionStateManager()
    h = m.get_or_create_session("s")
    buf = h.get_or_create("buf", lambda: LatentBuffer.create(maxlen=2), LatentBuffer)
    assert h.get("buf") is buf
    assert h.get_or_create("buf", lambda: LatentBuffer.create(maxlen=9), LatentBuffer) is buf


def test_fork_through_the_shell():
    m = SessionStateManager()
    h = m.get_or_create_session("a").put("buf", LatentBuffer.create()).commit("buf", 1)
    f = m.fork_session("a", "b")
    f.commit("buf", 2)
    assert h.view("buf") == (1,) and f.view("buf") == (1, 2)


def test_fork_onto_none_resolves_like_the_pure_function_and_failures_change_nothing():
    # Regression: fork_session("a", None) inserted "default" (evicting the LRU session) and then raised
    # KeyError: None.
    m = SessionStateManager(max_sessions=2)
    m.get_or_create_session("a")
    m.get_or_create_session("b")
    f = m.fork_session("a", None)
    assert f.session_id == "default" and m.state.session_ids == ("a", "default")
    before = snapshot(m.state)
    for bad in (
        lambda: m.fork_session("a", "default"),
        lambda: m.fork_session("zzz", "c"),
        lambda: m.fork_session("a", 7),
    ):
        with pytest.raises(fs.SessionStateError):
            bad()
        assert_unchanged(m.state, before)


def test_none_is_the_default_session_everywhere():
    m = SessionStateManager()
    m.get_or_create_session(None)
    assert None in m and "default" in m and 5 not in m
    assert m.get_session(None).session_id == "default"
    assert m.drop_session(None) and None not in m


def test_admission_and_raise_cap():
    m = SessionStateManager(max_sessions=1, evict_when_full=False)
    m.get_or_create_session("a")
    with pytest.raises(SessionAdmissionError):
        m.get_or_create_session("b")
    m.raise_max_sessions(2)
    m.get_or_create_session("b")
    assert len(m) == 2
    with pytest.raises(fs.InvalidArgumentError):
        m.raise_max_sessions(1)
    with pytest.raises(SessionExistsError):
        m.fork_session("a", "b")


def test_custom_lock_factory_is_used():
    made = []

    def factory():
        lock = threading.RLock()
        made.append(lock)
        return lock

    m = SessionStateManager(lock_factory=factory)
    m.get_or_create_session("x")
    assert len(made) == 1


# --- user code runs outside the lock ---------------------------------------------------------------------


def test_a_transaction_may_read_through_handles():
    # Regression: transact ran fn under the manager's (non re-entrant) lock, so reading a handle inside
    # fn deadlocked.
    m = SessionStateManager()
    h = m.get_or_create_session("s").set_attr("n", 1)

    def body():
        h.transact(lambda s: s.set_attr("n", h.get_attr("n") + m.get_or_create_session("s").get_attr("n")))

    assert _finishes(body), "transact deadlocked"
    assert h.get_attr("n") == 2


def test_a_factory_may_use_the_manager():
    m = SessionStateManager()
    h = m.get_or_create_session("s")

    def factory():
        m.get_or_create_session("other").set_attr("made_by", "factory")  # another session: fine
        assert m.stats()["sessions"] == 2
        return LatentBuffer.create()

    assert _finishes(lambda: h.get_or_create("buf", factory, LatentBuffer)), "factory deadlocked"
    assert "buf" in h.state and m.get_session("other").get_attr("made_by") == "factory"


def test_a_transaction_that_writes_its_own_session_is_refused_clearly():
    m = SessionStateManager()
    h = m.get_or_create_session("s").set_attr("n", 1)
    with pytest.raises(ReentrantWriteError, match="Return the new state"):
        h.transact(lambda s: (h.set_attr("n", 5), s)[1])
    assert h.get_attr("n") == 1


def test_a_transaction_retries_on_a_concurrent_change_and_loses_nothing():
    m = SessionStateManager()
    h = m.get_or_create_session("s").set_attr("n", 0)
    calls = []
    other_ran = threading.Event()

    def fn(s):
        calls.append(1)
        if len(calls) == 1:  # another thread commits while this one computes
            t = threading.Thread(target=lambda: (h.set_attr("other", 1), other_ran.set()))
            t.start()
            t.join()
        return s.set_attr("n", s.get_attr("n") + 1)

    h.transact(fn)
    assert other_ran.is_set() and len(calls) == 2
    assert h.get_attr("n") == 1 and h.get_attr("other") == 1


def test_eight_threads_lose_nothing():
    m = SessionStateManager(max_sessions=64)
    n_threads, n_iters = 8, 200
    gets = [0] * n_threads
    committed: dict[str, list[int]] = {}
    errors = []
    barrier = threading.Barrier(n_threads)

    def worker(t):
        try:
            barrier.wait()
            for i in range(n_iters):
                sid = f"s{(t * 7 + i) % 16}"
                h = m.get_or_create_session(sid)
                gets[t] += 1
                h.get_or_create("log", LatentBuffer.create)
                value = t * 100_000 + i
                h.commit("log", value)
                committed.setdefault(sid, []).append(value)
                if i % 50 == 49:
                    m.get_or_create_session(f"tmp{t}")
                    gets[t] += 1
                    m.drop_session(f"tmp{t}")
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    s = m.stats()
    assert s["hits"] + s["misses"] == sum(gets)
    for sid, values in committed.items():
        assert sorted(fs.lookup(m.state, sid).get("log").view()) == sorted(values)


# --- donation through the shell --------------------------------------------------------------------------


def _ring_manager():
    m = SessionStateManager()
    h = m.get_or_create_session("a").put("ring", ArrayRing.create(4, (256,)))
    h.step("ring", ArrayRing.commit, jnp.ones(256))
    return m, h


def test_shell_step_donates_when_nothing_else_holds_the_buffer():
    m, h = _ring_manager()
    old = h.get("ring").storage
    ptr = old.unsafe_buffer_pointer()
    del old
    h.step("ring", ArrayRing.commit, jnp.full((256,), 2.0), donate=True)
    assert h.get("ring").storage.unsafe_buffer_pointer() == ptr  # reused in place
    assert m.stats()["deleted_arrays"] == 0


def test_shell_step_never_donates_what_a_fork_a_snapshot_or_a_holder_still_reads():
    m, h = _ring_manager()
    fork = m.fork_session("a", "b")
    h.step("ring", ArrayRing.commit, jnp.full((256,), 2.0), donate=True)
    np.testing.assert_array_equal(fork.view("ring")[:, 0], [1.0])  # the fork's buffer is intact
    snap = m.state  # a snapshot handed out
    h.step("ring", ArrayRing.commit, jnp.full((256,), 3.0), donate=True)
    np.testing.assert_array_equal(fs.view(snap, "a", "ring")[:, 0], [1.0, 2.0])
    held = h.get("ring")  # a user variable holding the object
    h.step("ring", ArrayRing.commit, jnp.full((256,), 4.0), donate=True)
    np.testing.assert_array_equal(held.view()[:, 0], [1.0, 2.0, 3.0])
    assert m.stats()["deleted_arrays"] == 0
    np.testing.assert_array_equal(h.view("ring")[:, 0], [1.0, 2.0, 3.0, 4.0])
