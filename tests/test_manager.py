import threading

import numpy as np
import pytest
import torch

from functional_state import (
    LatentBuffer,
    ManagerState,
    SessionAdmissionError,
    SessionStateLostError,
    SessionStateManager,
)


def test_handles_of_one_session_see_each_others_writes():
    m = SessionStateManager()
    h1 = m.get_or_create_session("s")
    h1.put("buf", LatentBuffer.create())
    h2 = m.get_or_create_session("s")
    h2.commit("buf", 1)
    h1.commit("buf", 2)
    assert h1.view("buf") == h2.view("buf") == (1, 2)
    assert m.state.sessions["s"].get("buf").view() == (1, 2)


def test_state_is_an_immutable_snapshot():
    m = SessionStateManager()
    h = m.get_or_create_session("s").put("buf", LatentBuffer.create())
    before = m.state
    h.commit("buf", 1)
    assert before.sessions["s"].get("buf").view() == ()
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
    assert h.get_attr("x") == 5 and len(m) == 0


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


def test_admission_and_raise_cap():
    m = SessionStateManager(max_sessions=1, evict_when_full=False)
    m.get_or_create_session("a")
    with pytest.raises(SessionAdmissionError):
        m.get_or_create_session("b")
    m.raise_max_sessions(2)
    m.get_or_create_session("b")
    assert len(m) == 2
    with pytest.raises(ValueError):
        m.raise_max_sessions(1)


def test_custom_lock_factory_is_used():
    made = []

    def factory():
        lock = threading.RLock()
        made.append(lock)
        return lock

    m = SessionStateManager(lock_factory=factory)
    m.get_or_create_session("x")
    assert len(made) == 1


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
        assert sorted(m.state.sessions[sid].get("log").view()) == sorted(values)
