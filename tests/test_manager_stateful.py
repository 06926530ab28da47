"""A hypothesis state machine: the pure manager against a plain OrderedDict model of the LRU table."""

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import functional_state as fs
from functional_state import LatentBuffer, ManagerState, SessionStateLostError
from helpers import assert_unchanged, snapshot

IDS = st.sampled_from([f"s{i}" for i in range(6)])


class ManagerMachine(RuleBasedStateMachine):
    @initialize(cap=st.integers(1, 4))
    def init(self, cap):
        self.state = ManagerState.create(max_sessions=cap)
        self.cap = cap
        self.model: OrderedDict[str, list[int]] = OrderedDict()  # id -> committed values, LRU first
        self.hits = self.misses = self.evictions = 0
        self.counter = 0

    def _pure(self, fn):
        """Run fn on the current state and check that the input was left untouched."""
        snap = snapshot(self.state)
        out = fn(self.state)
        assert_unchanged(self.state, snap)
        return out

    @rule(sid=IDS)
    def get_or_create(self, sid):
        self.state, session = self._pure(lambda s: fs.get_or_create(s, sid))
        if sid in self.model:
            self.model.move_to_end(sid)
            self.hits += 1
        else:
            if len(self.model) >= self.cap:
                self.model.popitem(last=False)
                self.evictions += 1
            self.model[sid] = []
            self.misses += 1
            self.state = fs.put(self.state, sid, "buf", LatentBuffer.create())

    @rule(sid=IDS)
    def commit(self, sid):
        self.counter += 1
        value = self.counter
        if sid not in self.model:
            with pytest.raises(SessionStateLostError):
                fs.commit(self.state, sid, "buf", np.array(value, np.int64))
            return
        self.state = self._pure(lambda s: fs.commit(s, sid, "buf", np.array(value, np.int64)))
        self.model[sid].append(value)

    @rule(sid=IDS)
    def evict(self, sid):
        if sid not in self.model:
            return
        self.state, freed = self._pure(lambda s: fs.evict(s, sid, "buf"))
        assert freed == 8 * len(self.model[sid])
        self.state = fs.put(self.state, sid, "buf", LatentBuffer.create())
        self.model[sid] = []

    @rule(sid=IDS)
    def drop(self, sid):
        self.state, existed = self._pure(lambda s: fs.drop_session(s, sid))
        assert existed == (sid in self.model)
        self.model.pop(sid, None)

    @rule(sid=IDS)
    def reset(self, sid):
        if sid not in self.model:
            return
        self.state = self._pure(lambda s: fs.reset_session(s, sid))
        self.state = fs.put(self.state, sid, "buf", LatentBuffer.create())
        self.model[sid] = []

    @precondition(lambda self: self.cap < 8)
    @rule(extra=st.integers(0, 2))
    def raise_cap(self, extra):
        self.state = self._pure(lambda s: fs.raise_max_sessions(s, self.cap + extra))
        self.cap += extra

    @invariant()
    def matches_model(self):
        if not hasattr(self, "model"):
            return
        assert self.state.session_ids == tuple(self.model)
        for sid, values in self.model.items():
            assert [int(x) for x in fs.view(self.state, sid, "buf")] == values
        s = fs.stats(self.state)
        assert (s["hits"], s["misses"], s["evictions"], s["max_sessions"]) == (
            self.hits, self.misses, self.evictions, self.cap,
        )
        assert s["total_nbytes"] == 8 * sum(len(v) for v in self.model.values())


ManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestManagerMachine = ManagerMachine.TestCase
