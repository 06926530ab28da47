"""The incrementally kept byte totals equal a full walk after every step: forks, views, bridge aliases, parks."""

import contextlib

import jax.numpy as jnp
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import functional_state as fs
from functional_state import DenseValue, LatentBuffer, ManagerState, SharedStorageError
from functional_state.memory import accounting
from torch_bridge import to_jax

IDS = st.sampled_from(["a", "b", "c", "d"])
NAMES = st.sampled_from(["buf", "ring", "cache"])


def _pools(s: dict) -> dict:
    return {k: v for k, v in s.items() if k.startswith("nbytes:")}


class IncrementalAccounting(RuleBasedStateMachine):
    @initialize()
    def init(self):
        self.state = ManagerState.create(max_sessions=3)
        fs.stats(self.state)  # start tracking: every later state keeps the totals incrementally
        self.storages = [torch.zeros(64)]  # tensors to take views of, so storages get shared

    def _sessions(self):
        return [sid for sid in ("a", "b", "c", "d") if sid in self.state]

    @rule(sid=IDS)
    def create(self, sid):
        self.state, session = fs.get_or_create(self.state, sid)
        if "buf" not in session:
            self.state = fs.put(self.state, sid, "buf", LatentBuffer.create(maxlen=3))
            self.state = fs.put(self.state, sid, "cache", DenseValue.create([torch.ones(8), None]))

    @precondition(lambda self: self._sessions())
    @rule(data=st.data(), kind=st.sampled_from(["fresh", "view", "alias", "jax"]))
    def commit(self, data, kind):
        sid = data.draw(st.sampled_from(self._sessions()))
        base = data.draw(st.sampled_from(self.storages))
        if kind == "fresh":
            item = torch.randn(data.draw(st.integers(1, 40)))
            self.storages.append(item)
        elif kind == "view":
            item = base[data.draw(st.integers(0, base.numel() - 1)) :]
        elif kind == "alias":
            item = to_jax(base[16:] if base.numel() > 32 else base)  # a bridge alias: keeps all of base alive
        else:
            item = jnp.full((data.draw(st.integers(1, 9)),), 1.0)
        buf = fs.lookup(self.state, sid).get("buf")
        if buf.resident:
            self.state = fs.commit(self.state, sid, "buf", item)

    @precondition(lambda self: self._sessions())
    @rule(data=st.data())
    def set_attr(self, data):
        sid = data.draw(st.sampled_from(self._sessions()))
        base = data.draw(st.sampled_from(self.storages))
        self.state = fs.set_attr(self.state, sid, "alias", base[1:])  # may alias an object's storage

    @precondition(lambda self: self._sessions())
    @rule(data=st.data())
    def set_item(self, data):
        sid = data.draw(st.sampled_from(self._sessions()))
        cache = fs.lookup(self.state, sid).get("cache")
        if cache.resident and cache.value is not None:
            t = data.draw(st.sampled_from(self.storages))
            self.state = fs.update_session(self.state, sid, lambda s: s.update("cache", lambda c: c.set_item(0, t)))

    @precondition(lambda self: self._sessions())
    @rule(data=st.data(), dst=IDS)
    def fork(self, data, dst):
        src = data.draw(st.sampled_from(self._sessions()))
        if dst not in self.state:
            self.state = fs.fork_session(self.state, src, dst)

    @rule(sid=IDS)
    def drop(self, sid):
        self.state, _ = fs.drop_session(self.state, sid)

    @precondition(lambda self: self._sessions())
    @rule(data=st.data(), name=NAMES)
    def evict(self, data, name):
        sid = data.draw(st.sampled_from(self._sessions()))
        if name in fs.lookup(self.state, sid):
            self.state, _ = fs.evict(self.state, sid, name)

    @precondition(lambda self: self._sessions())
    @rule(data=st.data(), name=st.sampled_from(["buf", "cache"]), sharers=st.booleans())
    def park_or_restore(self, data, name, sharers):
        sid = data.draw(st.sampled_from(self._sessions()))
        obj = fs.lookup(self.state, sid).get(name)
        if obj.parked:
            self.state, _ = fs.restore(self.state, sid, name)
        elif obj.resident:
            with contextlib.suppress(SharedStorageError):  # refused: something else holds the storage
                self.state, _ = fs.park(self.state, sid, name, with_sharers=sharers)

    @precondition(lambda self: self._sessions())
    @rule(data=st.data())
    def reset(self, data):
        sid = data.draw(st.sampled_from(self._sessions()))
        self.state = fs.reset_session(self.state, sid)
        self.state = fs.put(self.state, sid, "buf", LatentBuffer.create(maxlen=3))

    @invariant()
    def totals_equal_a_full_walk(self):
        if not hasattr(self, "state"):
            return
        assert self.state._acct is not None  # tracked all along, never rebuilt
        incremental = _pools(fs.stats(self.state))
        walked = _pools(fs.stats(self.state, exact=True))
        assert incremental == walked
        assert incremental == {f"nbytes:{k}": v for k, v in fs.nbytes_by_device(fs.sessions(self.state)).items()}


IncrementalAccounting.TestCase.settings = settings(
    max_examples=200, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestIncrementalAccounting = IncrementalAccounting.TestCase


def test_stats_reads_kept_totals_instead_of_walking_objects(monkeypatch):
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    buf = LatentBuffer.create()
    for _ in range(50):
        buf = buf.commit(torch.zeros(16))
    state = fs.put(state, "a", "buf", buf)
    fs.stats(state)  # builds the totals once
    from functional_state.memory import accounting

    walked = []
    real = accounting.torch_extents
    monkeypatch.setattr(accounting, "torch_extents", lambda t, out: (walked.append(t), real(t, out)))
    assert fs.stats(state)["total_nbytes"] == 50 * 64 and walked == []  # no object is walked
    state = fs.commit(state, "a", "buf", torch.zeros(4))
    assert len(walked) == 1  # a commit into a buffer looks at the one item it adds (and any it drops)
    assert fs.stats(state)["total_nbytes"] == 50 * 64 + 16 and len(walked) == 1


def test_exact_stats_report_what_a_walk_finds():
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    x = jnp.ones(8)
    state = fs.put(state, "a", "buf", LatentBuffer.create().commit(x))
    fs.stats(state)
    x.delete()  # deleted behind the manager's back
    assert fs.stats(state, exact=True)["deleted_arrays"] == 1
    with pytest.raises(AssertionError):
        assert _pools(fs.stats(state)) == _pools(fs.stats(state, exact=True))  # the kept totals cannot know


def test_a_ring_item_resized_in_place_leaves_as_it_was_counted():
    # A model that resize_s a committed tensor moves its storage behind the manager's back. Dropping that
    # item must take away what was counted when it arrived, not fail on the extent it has now.
    state, _ = fs.get_or_create(ManagerState.create(byte_budget={"cpu": 1 << 30}), "a")
    state = fs.put(state, "a", "buf", LatentBuffer.create(maxlen=2))
    t = torch.zeros(16)
    state = fs.commit(state, "a", "buf", t)
    t.resize_(1 << 16)
    for _ in range(3):
        state = fs.commit(state, "a", "buf", torch.ones(4))
    assert _pools(fs.stats(state)) == _pools(fs.stats(state, exact=True)) == {"nbytes:cpu": 2 * 16}


def test_default_stats_reads_kept_figures_and_walks_no_session(monkeypatch):
    # Regression (issue 24): stats() re-walked every attr and every object's host copy of every session, so
    # its cost grew with the table. Closed attr values (arrays, tensors) are recorded on write; only attr
    # containers, which a model may change in place, are walked.
    state = fs.ManagerState.create(max_sessions=64)
    for i in range(40):
        state, _ = fs.get_or_create(state, f"s{i}")
        state = fs.set_attr(state, f"s{i}", "cond", jnp.full(8, float(i)))
        state = fs.put(state, f"s{i}", "ring", fs.ArrayRing.create(2, (4,)))
    state, _ = fs.park(state, "s0", "ring")
    state = fs.set_attr(state, "s1", "history", [jnp.zeros(16)])  # a container: walked
    exact = fs.stats(state, exact=True)
    fs.stats(state)  # builds the ledger (one walk), as the first call always did
    calls = []
    real = accounting.collect_extents
    monkeypatch.setattr(accounting, "collect_extents", lambda root, *a: calls.append(root) or real(root, *a))
    kept = fs.stats(state)
    assert len(calls) <= 3  # the one container (and the parked copy's bytes), never the 40 sessions
    assert {k: v for k, v in kept.items() if "bytes" in k} == {k: v for k, v in exact.items() if "bytes" in k}


def test_default_stats_cost_does_not_grow_with_the_sessions(monkeypatch):
    # Regression (issue 24): the default stats() checked every JAX array the table holds for deletion, O(arrays
    # held): 263 ms at 100k sessions. It reads kept totals now: the same work at 10 sessions as at 1,000
    # (counted, not timed: the deletion checks and the walk calls one stats() call makes).
    import jax
    import numpy as np
    from jax._src.array import ArrayImpl

    from functional_state.memory import holders

    def table(n):
        state = ManagerState.create(max_sessions=n)
        columns = jax.device_put([np.zeros(4, np.float32) for _ in range(n)])  # one buffer of its own each
        for i in range(n):
            state, _ = fs.get_or_create(state, f"s{i}")
            state = fs.put(state, f"s{i}", "buf", LatentBuffer.create(maxlen=2).commit(columns[i]))
        state = fs.set_attr(state, "s0", "cond", columns[0])  # one closed attr, one container
        state = fs.set_attr(state, "s1", "box", [torch.zeros(4)])
        fs.stats(state)  # the ledger is built once; what follows is the steady cost
        return state

    calls = {"is_deleted": 0, "walk": 0}
    real_deleted, real_walk = ArrayImpl.is_deleted, accounting.collect_extents

    def is_deleted(self):
        calls["is_deleted"] += 1
        return real_deleted(self)

    def collect_extents(*args):
        calls["walk"] += 1
        return real_walk(*args)

    small, large = table(10), table(1_000)
    monkeypatch.setattr(ArrayImpl, "is_deleted", is_deleted)
    monkeypatch.setattr(accounting, "collect_extents", collect_extents)
    monkeypatch.setattr(holders.accounting, "collect_extents", collect_extents)
    counted = []
    for state in (small, large):
        calls.update(is_deleted=0, walk=0)
        s = fs.stats(state)
        counted.append(dict(calls))
        assert s["sessions"] == len(state) and s["total_nbytes"] == len(state) * 16 + 16
    assert counted[0] == counted[1] and counted[0]["walk"] >= 1, counted  # (the container is walked)
    with monkeypatch.context() as m:  # the exact walk is the check that reads every array
        m.setattr(ArrayImpl, "is_deleted", is_deleted)
        calls.update(is_deleted=0)
        assert fs.stats(large, exact=True) == fs.stats(large)
        assert calls["is_deleted"] >= 1_000
