"""`RerootMap`: every version reads the same forever, whatever was derived from it and in whatever order the
versions are read; copies take one version; unreachable versions and the values only they held are freed;
threads reading old versions and writing new ones see each version whole."""

import copy
import gc
import pickle
import random
import sys
import threading
import weakref

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

import functional_state as fs
from functional_state.table.reroot_map import RerootMap

KEYS = st.sampled_from(["a", "b", "c", "d", 1, 2, (3, 4)])


def _reads(m: RerootMap) -> dict:
    """Everything a version says about itself, through each read."""
    got = dict(m.items())
    assert len(m) == len(got) == len(m.keys()) == len(m.values())
    assert set(m) == set(m.keys()) == set(got)
    assert sorted(map(repr, m.values())) == sorted(map(repr, got.values()))
    for key, value in got.items():
        assert key in m and m[key] is value and m.get(key) is value
    assert "absent" not in m and m.get("absent", 7) == 7
    return got


class RerootMachine(RuleBasedStateMachine):
    """Versions kept forever, written and read in any order, each against a dict copied at its creation."""

    versions = Bundle("versions")

    @initialize(target=versions, start=st.dictionaries(KEYS, st.integers(0, 3), max_size=4))
    def start(self, start):
        self.model: dict[int, dict] = {}
        return self._keep(RerootMap(start), dict(start))

    def _keep(self, m, expected):
        self.model[id(m)] = (m, expected)
        return m

    @rule(target=versions, m=versions, key=KEYS, value=st.integers(0, 3))
    def set(self, m, key, value):
        expected = dict(self.model[id(m)][1])
        expected[key] = value
        return self._keep(m.set(key, value), expected)

    @rule(target=versions, m=versions, key=KEYS)
    def delete(self, m, key):
        expected = dict(self.model[id(m)][1])
        if key not in expected:
            with pytest.raises(KeyError):
                m.delete(key)
            return self._keep(m, expected)
        del expected[key]
        return self._keep(m.delete(key), expected)

    @rule(m=versions, key=KEYS)
    def read_one(self, m, key):
        expected = self.model[id(m)][1]
        assert (key in m) == (key in expected)
        assert m.get(key, "none") == expected.get(key, "none")

    @rule(m=versions)
    def read_all(self, m):
        assert _reads(m) == self.model[id(m)][1]

    @rule(m=versions)
    def copied(self, m):
        for twin in (pickle.loads(pickle.dumps(m)), copy.copy(m), copy.deepcopy(m)):
            assert dict(twin.items()) == self.model[id(m)][1]
            twin.set("copy", 0)  # a family of its own: the original still reads the same
        assert dict(m.items()) == self.model[id(m)][1]

    @invariant()
    def every_version_reads_the_same(self):
        for m, expected in self.model.values():
            assert dict(m.items()) == expected and len(m) == len(expected)


RerootMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestRerootMachine = RerootMachine.TestCase


def test_a_version_reads_the_same_after_any_writes_and_reroots():
    rng = random.Random(0)
    versions = [(RerootMap(), {})]
    for _ in range(3_000):
        m, expected = rng.choice(versions[-5:] if rng.random() < 0.8 else versions)
        key = rng.randrange(20)
        expected = dict(expected)
        if key in expected and rng.random() < 0.3:
            del expected[key]
            versions.append((m.delete(key), expected))
        else:
            expected[key] = rng.random()
            versions.append((m.set(key, expected[key]), expected))
    for m, expected in rng.sample(versions, 300) + versions[:50]:
        assert dict(m.items()) == expected and len(m) == len(expected)


def test_the_docstring_example():
    a = RerootMap({"x": 1})
    b = a.set("y", 2).delete("x")
    assert (sorted(a.items()), sorted(b.items())) == ([("x", 1)], [("y", 2)])


def test_refused_writes_change_no_version():
    a = RerootMap({"x": 1})
    b = a.set("y", 2)
    with pytest.raises(KeyError):
        a.delete("y")
    with pytest.raises(TypeError):
        b.set(["unhashable"], 3)
    assert dict(a.items()) == {"x": 1} and dict(b.items()) == {"x": 1, "y": 2}
    with pytest.raises(KeyError):
        b["z"]


class _Value:
    """A value a weak reference can follow."""


def test_a_value_only_an_unreachable_version_held_is_freed():
    gc.disable()  # freed by reference counting alone: no version is in a cycle
    try:
        old_value, new_value = _Value(), _Value()
        old = RerootMap({"k": old_value})
        new = old.set("k", new_value)
        w_old, w_new = weakref.ref(old_value), weakref.ref(new_value)
        del old_value, new_value
        assert new["k"] is w_new() and old["k"] is w_old()
        del old  # (read along its path: the family's root stayed at `new`)
        assert w_old() is None and new["k"] is w_new()
        newer = new.set("k", 0)
        del new
        assert w_new() is None and newer["k"] == 0
    finally:
        gc.enable()


def test_an_old_version_keeps_what_it_reads_and_frees_the_rest_when_dropped():
    first = RerootMap()
    m = first
    held = []
    for i in range(1_000):
        value = _Value()
        held.append(weakref.ref(value))
        m = m.set(i % 10, value)
    alive = sum(r() is not None for r in held)
    assert alive == 1_000  # `first` reads nothing of them, but the chain to the root runs through them all
    del first
    alive = sum(r() is not None for r in held)
    assert alive == 10  # only the newest version's values
    assert sorted(m.keys()) == list(range(10))


def test_a_long_chain_of_versions_is_freed_without_recursion():
    # Dropping the one reference to the oldest of 300k versions frees them one after another; a recursive
    # deallocation would overflow the C stack.
    first = RerootMap()
    m = first
    for i in range(300_000):
        m = m.set(i % 100, i)
    assert first.get(0) is None  # rerooted at the oldest: every link now points the other way
    del m
    assert len(first) == 0


def test_a_copy_takes_one_version_not_the_history():
    base = RerootMap({i: np.zeros(4) for i in range(8)})
    m = base
    for i in range(2_000):
        m = m.set(i % 8, np.full(1_000, i, np.float64))
    size = len(pickle.dumps(base))
    assert size < 2_000  # eight small arrays, not 2,000 arrays of 8 kB
    assert len(pickle.dumps(copy.deepcopy(base))) == size
    twin = pickle.loads(pickle.dumps(m))
    assert twin._family is not m._family and dict(twin.items()).keys() == dict(m.items()).keys()


def test_threads_reading_old_versions_and_writing_new_ones_see_each_version_whole():
    # Readers reroot the family at old versions while writers extend it and read the newest without the
    # lock: every read must still see exactly its version.
    base = {k: 0 for k in range(64)}
    root = RerootMap(base)
    versions = [(root, base)]
    for v in range(1, 50):
        m, expected = versions[-1]
        key = v % 64
        expected = dict(expected)
        expected[key] = v
        versions.append((m.set(key, v), expected))
    errors: list[str] = []
    stop = threading.Event()

    def reader(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            m, expected = rng.choice(versions)
            key = rng.randrange(64)
            if m.get(key) != expected[key] or (rng.random() < 0.05 and dict(m.items()) != expected):
                errors.append(f"version {versions.index((m, expected))} read {key} wrong")

    def writer(seed):
        rng = random.Random(seed)
        m = versions[-1][0]
        for i in range(20_000):
            key = rng.randrange(64)
            m = m.set(key, -i)
            if m.get(key) != -i:
                errors.append("a writer's newest version read wrong")
        stop.set()

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    threads += [threading.Thread(target=writer, args=(s,)) for s in (10, 11)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can, inside reads and reroots
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:5]
    for m, expected in versions:
        assert dict(m.items()) == expected


def test_a_key_of_a_version_next_to_the_root_is_read_without_moving_the_root():
    # Regression (the shell's budget check reads the table a write came from): rerooting there made the old
    # table the root, holding its values (a replaced tensor) alive until the next write rerooted back.
    old = RerootMap({"k": "old", "j": 1})
    new = old.set("k", "new").set("x", 2)
    seq = old._family.seq
    assert old.get("k") == "old" and "x" not in old and old["j"] == 1 and old.get("x", 3) == 3
    assert old._family.seq == seq and new._data is not None  # nothing moved: `new` is still the root
    assert dict(old.items()) == {"k": "old", "j": 1} and dict(new.items()) == {"k": "new", "j": 1, "x": 2}


def test_a_near_version_is_rerooted_and_a_far_one_copied_once():
    # A snapshot read while its family keeps being written must not reroot the whole distance on every
    # switch: past half the map's size it gets a dict of its own, and the newest version stays the root.
    start = RerootMap({i: 0 for i in range(100)})
    near = start
    for i in range(10):
        near = near.set(i, 1)
    family = start._family
    seq = family.seq
    assert start.get(50) == 0 and family.seq == seq + 2  # 10 diffs away (past WALK): rerooted there
    assert near.get(50) == 0 and family.seq == seq + 4  # and back
    far = near
    for i in range(200):
        far = far.set(i % 100, i)
    seq = family.seq
    for _ in range(100):  # 210 diffs away: copied once; switching between the two reroots nothing
        assert start.get(5) == 0 and far.get(5) == 105
    assert family.seq == seq
    assert dict(start.items()) == dict.fromkeys(range(100), 0) and len(start) == 100
    assert dict(near.items()) == {i: int(i < 10) for i in range(100)}  # (read through the newest's root)
    newest = far.set("new", 1)
    assert start.get("new") is None and newest.get("new") == 1


class _RerootingKey:
    """Equal to ``"k"``; hashing it the first time runs ``action``: a reroot in the middle of a read."""

    def __init__(self, action):
        self.action = action

    def __hash__(self):
        action, self.action = self.action, None
        if action is not None:
            action()
        return hash("k")

    def __eq__(self, other):
        return other == "k" or isinstance(other, _RerootingKey)


def test_a_read_of_the_newest_version_that_a_reroot_interrupts_reads_again():
    # The newest version is read without the lock; a reroot to another version while the dict is read
    # (here from inside the lookup itself, where another thread's could land) must not leak its value.
    old = RerootMap({"k": "old"})
    new = old.set("k", "new")
    for i in range(12):  # (far enough that a read of `old` reroots, not close enough to copy)
        new = new.set(i, i)
    assert new.get(_RerootingKey(lambda: old.get("k"))) == "new"
    assert _RerootingKey(lambda: old.get("k")) in new and new[_RerootingKey(lambda: old.get("k"))] == "new"
    assert old.get("k") == "old" and new.get("k") == "new"


# --- the table on it ---------------------------------------------------------------------------------------
TABLE_IDS = st.sampled_from([f"s{i}" for i in range(5)])


class TableVersionsMachine(RuleBasedStateMachine):
    """`ManagerState`s kept forever, each derived from any earlier one, read in any order against what each
    read when it was made (a dict copy of its sessions, its LRU order, its counters)."""

    tables = Bundle("tables")

    @initialize(target=tables, cap=st.integers(1, 4))
    def start(self, cap):
        self.seen: dict[int, tuple] = {}
        return self._keep(fs.ManagerState.create(max_sessions=cap))

    def _keep(self, state):
        self.seen[id(state)] = (state, self._read(state))
        return state

    @staticmethod
    def _read(state):
        views = {sid: {name: fs.view(state, sid, name) for name in s.objects} for sid, s in fs.sessions(state).items()}
        return dict(fs.sessions(state)), views, state.session_ids, len(state), state.counters

    @rule(target=tables, state=tables, sid=TABLE_IDS)
    def get_or_create(self, state, sid):
        return self._keep(fs.get_or_create(state, sid)[0])

    @rule(target=tables, state=tables, sid=TABLE_IDS, value=st.integers(0, 9))
    def commit(self, state, sid, value):
        if sid not in state:
            return self._keep(state)
        if "buf" not in fs.sessions(state)[sid].objects:
            state = fs.put(state, sid, "buf", fs.LatentBuffer.create(maxlen=2))
        return self._keep(fs.commit(state, sid, "buf", np.full(2, value)))

    @rule(target=tables, state=tables, sid=TABLE_IDS)
    def drop(self, state, sid):
        return self._keep(fs.drop_session(state, sid)[0])

    @rule(state=tables, sid=TABLE_IDS)
    def read_one(self, state, sid):
        sessions = self.seen[id(state)][1][0]
        assert (sid in state) == (sid in sessions)
        if sid in sessions:
            assert fs.sessions(state)[sid] is sessions[sid]

    @invariant()
    def every_table_reads_the_same(self):
        for state, before in list(self.seen.values()):
            now = self._read(state)
            assert now[0].keys() == before[0].keys()
            assert all(now[0][sid] is before[0][sid] for sid in before[0])
            assert str(now[1]) == str(before[1]) and now[2:] == before[2:]


TableVersionsMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)
TestTableVersionsMachine = TableVersionsMachine.TestCase


def test_a_pickled_or_copied_table_takes_its_own_sessions_not_the_history():
    state = fs.ManagerState.create(max_sessions=8)
    for i in range(8):
        state, _ = fs.get_or_create(state, f"s{i}")
        state = fs.put(state, f"s{i}", "buf", fs.LatentBuffer.create(maxlen=1))
    old = state
    size = len(pickle.dumps(old))
    for k in range(500):  # each commit replaces a 1-item ring's 8 kB item: 4 MB of history after `old`
        state, _ = fs.get_or_create(state, f"s{k % 8}")
        state = fs.commit(state, f"s{k % 8}", "buf", np.full(1_000, k, np.float64))
    assert len(pickle.dumps(old)) < size + 2_000  # (the shared recency log's lists: a few entries)
    for twin in (pickle.loads(pickle.dumps(state)), copy.deepcopy(state)):
        assert twin.session_ids == state.session_ids and len(pickle.dumps(twin)) < 8 * 8_000 + 20_000
        assert fs.view(twin, "s3", "buf")[0][0] == fs.view(state, "s3", "buf")[0][0]
