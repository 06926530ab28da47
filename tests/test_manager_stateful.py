"""A hypothesis state machine: the pure manager against a plain OrderedDict model of the LRU table."""

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import functional_state as fs
from functional_state import (
    LatentBuffer,
    ManagerState,
    SessionAdmissionError,
    SessionExistsError,
    SessionStateLostError,
)
from helpers import assert_unchanged, snapshot

IDS = st.sampled_from([f"s{i}" for i in range(6)])
ITEM_BYTES = 8  # each committed value is its own int64 array


class ManagerMachine(RuleBasedStateMachine):
    @initialize(cap=st.integers(1, 4), evict_when_full=st.booleans())
    def init(self, cap, evict_when_full):
        self.state = ManagerState.create(max_sessions=cap, evict_when_full=evict_when_full)
        self.cap = cap
        self.evict_when_full = evict_when_full
        # id -> committed value ids, least recently used first; forks share value ids (and buffers)
        self.model: OrderedDict[str, list[int]] = OrderedDict()
        self.hits = self.misses = self.evictions = 0
        self.counter = 0

    def _pure(self, fn):
        """Run fn on the current state and check that the input was left untouched."""
        snap = snapshot(self.state)
        out = fn(self.state)
        assert_unchanged(self.state, snap)
        return out

    def _refused(self, error, fn):
        """fn must raise ``error`` and leave the state bitwise unchanged."""
        snap = snapshot(self.state)
        with pytest.raises(error):
            fn(self.state)
        assert_unchanged(self.state, snap)

    def _make_room(self, keep=None):
        """Model an insertion into a full table: drop the LRU session (never ``keep``)."""
        if len(self.model) >= self.cap:
            victim = next(iter(self.model))
            assert victim != keep
            self.model.pop(victim)
            self.evictions += 1

    @rule(sid=IDS)
    def get_or_create(self, sid):
        if sid in self.model:
            self.state, _ = self._pure(lambda s: fs.get_or_create(s, sid))
            self.model.move_to_end(sid)
            self.hits += 1
            return
        if len(self.model) >= self.cap and not self.evict_when_full:
            self._refused(SessionAdmissionError, lambda s: fs.get_or_create(s, sid))
            return
        self.state, session = self._pure(lambda s: fs.get_or_create(s, sid))
        assert len(session.objects) == 0
        self._make_room()
        self.model[sid] = []
        self.misses += 1
        self.state = fs.put(self.state, sid, "buf", LatentBuffer.create())

    @rule(sid=IDS)
    def get_session(self, sid):
        if sid not in self.model:
            self._refused(SessionStateLostError, lambda s: fs.get_session(s, sid))
            return
        self.state, session = self._pure(lambda s: fs.get_session(s, sid))
        assert [int(x) for x in session.get("buf").view()] == self.model[sid]
        self.model.move_to_end(sid)
        self.hits += 1

    @rule(sid=IDS)
    def commit(self, sid):
        self.counter += 1
        value = self.counter
        if sid not in self.model:
            self._refused(SessionStateLostError, lambda s: fs.commit(s, sid, "buf", np.array(value, np.int64)))
            return
        self.state = self._pure(lambda s: fs.commit(s, sid, "buf", np.array(value, np.int64)))
        self.model[sid].append(value)

    @rule(src=IDS, dst=IDS)
    def fork(self, src, dst):
        fork = lambda s: fs.fork_session(s, src, dst)
        if src not in self.model:
            self._refused(SessionStateLostError, fork)
            return
        if dst in self.model:
            self._refused(SessionExistsError, fork)
            return
        if self.cap == 1 or (len(self.model) >= self.cap and not self.evict_when_full):
            self._refused(SessionAdmissionError, fork)
            return
        self.state = self._pure(fork)
        self.model.move_to_end(src)  # a fork is a use of its source ...
        self._make_room(keep=src)  # ... so the source is never the one dropped
        self.model[dst] = list(self.model[src])

    @rule(sid=IDS)
    def evict(self, sid):
        if sid not in self.model:
            self._refused(SessionStateLostError, lambda s: fs.evict(s, sid, "buf"))
            return
        self.state, freed = self._pure(lambda s: fs.evict(s, sid, "buf"))
        assert freed == ITEM_BYTES * len(self.model[sid])
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

    @rule()
    def remember(self):
        """Keep this state and its model: `rewind` continues from it after later operations."""
        self.saved = (self.state, OrderedDict((k, list(v)) for k, v in self.model.items()), self.hits)
        self.saved += (self.misses, self.evictions, self.cap)

    @precondition(lambda self: getattr(self, "saved", None) is not None)
    @rule()
    def rewind(self):
        """Continue from an older state (its recency log branches); what it reads must not have changed."""
        self.state, model, self.hits, self.misses, self.evictions, self.cap = self.saved
        self.model = OrderedDict((k, list(v)) for k, v in model.items())

    @invariant()
    def matches_model(self):
        if not hasattr(self, "model"):
            return
        assert self.state.session_ids == tuple(self.model)  # the eviction order is the model's
        ids = tuple(self.model)
        assert (self.state.least_recent, self.state.most_recent) == ((ids[0], ids[-1]) if ids else (None, None))
        assert list(fs.sessions(self.state)) == list(self.model)
        for sid, values in self.model.items():
            assert [int(x) for x in fs.view(self.state, sid, "buf")] == values
        s = fs.stats(self.state)
        assert (s["sessions"], s["hits"], s["misses"], s["evictions"], s["max_sessions"]) == (
            len(self.model),
            self.hits,
            self.misses,
            self.evictions,
            self.cap,
        )
        distinct = {v for values in self.model.values() for v in values}  # a fork's buffers count once
        assert s["total_nbytes"] == ITEM_BYTES * len(distinct)


ManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestManagerMachine = ManagerMachine.TestCase
