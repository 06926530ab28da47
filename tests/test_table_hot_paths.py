"""The manager op's hot paths written out for speed (issue 24) keep the behaviour of the code they replace:
the ring commit's inline construction, put's cheap checks, the bare eviction
scan and the kept compaction limit."""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from functional_state.core.pytree import _make_replace
from functional_state.errors import InvalidTypeError
from functional_state.table import lru
from functional_state.table.manager_state import COMPACT_AT
from helpers import assert_unchanged, snapshot


def _fields(buf: fs.LatentBuffer) -> list:
    return [getattr(buf, f.name) for f in dataclasses.fields(buf)]


@pytest.mark.parametrize("fast", [True, False], ids=["inline", "generic replace"])
@pytest.mark.parametrize("maxlen", [None, 1, 3])
def test_ring_commit_builds_a_frozen_latent_buffer_either_way(fast, maxlen):
    commit = fs.LatentBuffer.commit if fast else fs.StateObject.commit
    buf = fs.LatentBuffer.create(maxlen=maxlen, recompute_cost=2.0)
    items = [np.full(2, i) for i in range(5)]
    for x in items:
        before = snapshot(buf)
        new = commit(buf, x)
        assert_unchanged(buf, before)  # the receiver is never changed
        buf = new
    want = tuple(items if maxlen is None else items[-maxlen:])
    assert type(buf) is fs.LatentBuffer
    assert _fields(buf) == [want, None, None, maxlen, "resident", None, 2.0]
    assert buf._acct_cache is None  # set: the ledger reads it without catching an unset slot
    with pytest.raises(dataclasses.FrozenInstanceError):
        buf.items = ()  # type: ignore[misc]
    leaves, treedef = jax.tree_util.tree_flatten(buf)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(again) is fs.LatentBuffer and again.view() == buf.view()
    # pytree registration is the class's: jit over an inline-built buffer traces it like any other.
    total = jax.jit(lambda b: sum(jnp.sum(x) for x in b.items))(buf)
    assert float(total) == float(sum(np.sum(x) for x in want))


def test_replace_sets_every_field_through_its_descriptor():
    """The generated replace builds through the slot descriptors (also for a subclass declared without the
    decorator): the same frozen object, every field kept or changed."""
    buf = fs.LatentBuffer.create(maxlen=3, recompute_cost=2.0).commit(1)
    names = [f.name for f in dataclasses.fields(buf)]
    plain = _make_replace(fs.LatentBuffer, names)
    for replace in (plain, fs.LatentBuffer._replace):
        new = replace(buf, items=(7,), status="evicted")
        assert type(new) is fs.LatentBuffer
        assert _fields(new) == [(7,), None, None, 3, "evicted", None, 2.0] and _fields(buf)[0] == (1,)
        with pytest.raises(dataclasses.FrozenInstanceError):
            new.items = ()  # type: ignore[misc]
        with pytest.raises(TypeError):
            replace(buf, itemz=())

    class Sub(fs.LatentBuffer):
        __slots__ = ()

    sub = fs.LatentBuffer._replace(Sub.create(maxlen=2), items=(1,))
    assert type(sub) is Sub and sub.items == (1,) and sub.maxlen == 2


def _replay(ops: list[tuple[str, str]], hit) -> fs.ManagerState:
    """The table after ``ops`` (("use", sid) or ("drop", sid)), a hit taken by ``hit(state, sid)``."""
    state = fs.ManagerState.create(max_sessions=8)
    for op, sid in ops:
        if op == "drop":
            state, _ = fs.drop_session(state, sid)
        elif sid in state:
            state = hit(state, sid)
        else:
            state, _ = fs.get_or_create(state, sid)
    return state


def _ops(rng: random.Random, n: int) -> list[tuple[str, str]]:
    return [("drop" if rng.random() < 0.05 else "use", f"s{rng.randrange(14)}") for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_get_or_create_hit_is_touch_and_an_ordered_dict(seed):
    # get_or_create and get_session both take `lru.touch`: their orders must agree with an OrderedDict.
    ops = _ops(random.Random(seed), 3000)
    inlined = _replay(ops, lambda s, sid: fs.get_or_create(s, sid)[0])
    touched = _replay(ops, lambda s, sid: fs.get_session(s, sid)[0])
    model: OrderedDict[str, None] = OrderedDict()
    for op, sid in ops:
        if op == "drop":
            model.pop(sid, None)
            continue
        if sid in model:
            model.move_to_end(sid)
        else:
            model[sid] = None
            if len(model) > 8:
                model.popitem(last=False)
    for state in (inlined, touched):
        assert state.session_ids == tuple(model)
        assert state.most_recent == next(reversed(model))
    assert (inlined.hits, inlined.misses, inlined.evictions) == (touched.hits, touched.misses, touched.evictions)


def test_evictions_from_a_table_derived_from_an_old_one_scan_its_parent_segment():
    # A table derived from an old one starts a new log segment: its oldest entries are read from the parent.
    state = fs.ManagerState.create(max_sessions=4)
    for sid in "abcd":
        state, _ = fs.get_or_create(state, sid)
    old = state
    for sid in "abab":  # the newest table moves on; `old`'s window now ends before the log does
        state, _ = fs.get_or_create(state, sid)
    branch, _ = fs.get_or_create(old, "c")  # a hit on the old table: a new segment
    before = snapshot(branch)
    evicted = []
    after, _ = fs.get_or_create(branch, "e")
    after2 = lru.insert(after, "f", fs.SessionState.empty(), "get_or_create", 1, evicted)
    assert_unchanged(branch, before)
    assert after.session_ids == ("b", "d", "c", "e")  # "a" (oldest, in the parent segment) left first
    assert after2.session_ids == ("d", "c", "e", "f") and [e[0] for e in evicted] == ["b"]
    assert state.session_ids == ("c", "d", "a", "b")  # the newest table is unaffected


def test_the_kept_compaction_limit_bounds_the_window_after_hits_misses_and_drops():
    state = fs.ManagerState.create(max_sessions=6)
    rng = random.Random(0)
    for op, sid in _ops(rng, 5000):
        if op == "drop":
            state, _ = fs.drop_session(state, sid)
        else:
            state, _ = fs.get_or_create(state, sid)
        r = state._recency
        assert r.limit == r.start + COMPACT_AT * len(state)
        assert r.end - r.start <= COMPACT_AT * len(state) + COMPACT_AT  # compacted when it reaches the limit


def test_put_refuses_bad_input_after_its_cheap_checks_have_seen_good_input():
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    s = fs.put(s, "a", "b", fs.LatentBuffer.create())  # LatentBuffer is now a known StateObject class
    before = snapshot(s)
    with pytest.raises(InvalidTypeError, match="expected a StateObject"):
        fs.put(s, "a", "c", [1, 2])
    with pytest.raises(InvalidTypeError, match="names must be non-empty str"):
        fs.put(s, "a", "", fs.LatentBuffer.create())
    with pytest.raises(InvalidTypeError, match="names must be non-empty str"):
        fs.put(s, "a", 3, fs.LatentBuffer.create())  # type: ignore[arg-type]
    with pytest.raises(fs.SessionStateLostError):
        fs.put(s, "nobody", "b", fs.LatentBuffer.create())
    assert_unchanged(s, before)
    s2 = fs.put(s, "a", "c", fs.LatentBuffer.create(recompute_source="b"))
    assert fs.lookup(s2, "a").names == ("b", "c")
    with pytest.raises(fs.InvalidArgumentError, match="recompute source"):
        fs.put(s, "a", "d", fs.LatentBuffer.create(recompute_source="nothing"))
