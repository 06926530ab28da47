from __future__ import annotations

import gc
import logging
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import (
    ArrayRing,
    InvalidArgumentError,
    InvalidTypeError,
    LatentBuffer,
    ManagerState,
    ObjectNotFoundError,
    SessionAdmissionError,
    SessionExistsError,
    SessionStateError,
    SessionStateLostError,
    StateShapeError,
)
from helpers import assert_unchanged, snapshot


def _populated(max_sessions=4):
    state = ManagerState.create(max_sessions=max_sessions)
    for sid in ("a", "b"):
        state, _ = fs.get_or_create(state, sid)
        state = fs.put(state, sid, "frames", LatentBuffer.create(maxlen=3))
        state = fs.put(state, sid, "ring", ArrayRing.create(2, (4,)))
        state = fs.commit(state, sid, "frames", torch.arange(4.0))
        state = fs.commit(state, sid, "ring", jnp.ones(4))
        state = fs.set_attr(state, sid, "feat_map", [np.zeros(8)])
    return state


def test_none_means_default():
    state, _ = fs.get_or_create(ManagerState.create(), None)
    assert state.session_ids == ("default",)
    state, _ = fs.get_or_create(state, "default")
    assert (state.hits, state.misses) == (1, 1)
    assert None in state and "default" in state and 3 not in state


def test_hit_moves_to_most_recent_and_miss_over_cap_drops_lru():
    state = ManagerState.create(max_sessions=2)
    state, _ = fs.get_or_create(state, "a")
    state, _ = fs.get_or_create(state, "b")
    state, _ = fs.get_or_create(state, "a")  # hit: a is now most recent
    assert state.session_ids == ("b", "a")
    state, _ = fs.get_or_create(state, "c")  # drops b
    assert state.session_ids == ("a", "c")
    assert (state.hits, state.misses, state.evictions) == (1, 3, 1)


def _calls_during(fn):
    """How many Python and C function calls ``fn()`` makes: a deterministic measure of its work."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    # A collection during ``fn`` runs finalizers of garbage other tests left (each a counted call): not its work.
    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return count


def test_a_miss_costs_the_same_after_any_number_of_hits():
    # Regression: eviction walked recency ticks up from the oldest live one, and every hit retired a tick,
    # so the first miss after n hits did O(n) work (295 ms after 400k hits), from every old state too.
    fresh = ManagerState.create(max_sessions=2)
    fresh, _ = fs.get_or_create(fresh, "a")
    fresh, _ = fs.get_or_create(fresh, "b")
    worn = fresh
    for i in range(20_000):
        worn, _ = fs.get_or_create(worn, "ab"[i % 2])
    assert worn.hits == 20_000
    fresh_calls = _calls_during(lambda: fs.get_or_create(fresh, "c"))
    worn_calls = _calls_during(lambda: fs.get_or_create(worn, "c"))
    # The eviction may skip a few log entries that later hits superseded (at most a few per session: the
    # log is compacted at 4x the table), never a number that grows with the hits.
    assert worn_calls <= 2 * fresh_calls, (fresh_calls, worn_calls)
    assert fs.get_or_create(worn, "c")[0].session_ids == ("b", "c")


def test_every_table_operation_does_bounded_work_at_any_size():
    small, large = ManagerState.create(max_sessions=8), ManagerState.create(max_sessions=20_000)
    for i in range(8):
        small, _ = fs.get_or_create(small, f"s{i}")
    for i in range(20_000):
        large, _ = fs.get_or_create(large, f"s{i}")
    ops = {
        "hit": lambda s: fs.get_or_create(s, "s3"),
        "miss with eviction": lambda s: fs.get_or_create(s, "new"),
        "drop": lambda s: fs.drop_session(s, "s5"),
        "fork": lambda s: fs.fork_session(s, "s2", "forked"),
        "commit": lambda s: fs.set_attr(s, "s4", "k", 1),
    }
    for name, op in ops.items():
        # Warm one-time caches (the logger's level cache fills on its first call in a test), on both tables:
        # each op derives from the same table, whose session map is then as many diffs from its root (a
        # read walks them, a write reroots them: work by distance, not by size) in both.
        op(small)
        op(large)
        assert _calls_during(lambda: op(large)) <= _calls_during(lambda: op(small)) + 2, name


def test_recency_matches_an_ordered_dict_over_a_long_history_and_from_old_states():
    # The recency log (a tick per node, an append-only log compacted at 4x the table, tables derived from
    # older ones branching off it) against the plain model: an OrderedDict moved to the end on each use.
    # Old states are revisited and continued from, so branched log segments and compactions are exercised.
    rng = np.random.default_rng(0)
    state = ManagerState.create(max_sessions=8)
    model: dict = {}  # insertion-ordered: the model's LRU order
    saved = []  # (state, its session ids then)
    for step in range(3000):
        sid, other = f"s{rng.integers(12)}", f"s{rng.integers(12)}"
        kind = rng.integers(6)
        if kind <= 2:  # get_or_create: a hit or a miss that may evict
            state, _ = fs.get_or_create(state, sid)
            model.pop(sid, None)
            model[sid] = None
            if len(model) > 8:
                del model[next(iter(model))]
        elif kind == 3 and sid in model:
            state, _ = fs.get_session(state, sid)
            model[sid] = model.pop(sid)
        elif kind == 4 and sid in model and other not in model:
            state = fs.fork_session(state, sid, other)
            model[sid] = model.pop(sid)
            if len(model) >= 8:
                del model[next(iter(model))]
            model[other] = None
        elif kind == 5:
            state, _ = fs.drop_session(state, sid)
            model.pop(sid, None)
        ids = tuple(model)
        assert state.session_ids == ids, step
        assert (state.least_recent, state.most_recent) == ((ids[0], ids[-1]) if ids else (None, None)), step
        assert list(fs.sessions(state)) == list(ids)
        if step % 97 == 0:
            saved.append((state, ids))
        if step % 331 == 330:  # continue from an older state: its log branches
            state, ids = saved[rng.integers(len(saved))]
            model = dict.fromkeys(ids)
    for old, ids in saved:  # no later operation changed what an old state reads
        assert old.session_ids == ids


def test_an_op_on_an_old_state_allocates_as_little_as_on_the_newest():
    # A table derived from an older one branches the shared recency log in O(1) (a new segment), rather
    # than copying the old table's window of the log (O(sessions)).
    import tracemalloc

    large = ManagerState.create(max_sessions=20_000)
    for i in range(20_000):
        large, _ = fs.get_or_create(large, f"s{i}")
    newest, _ = fs.get_or_create(large, "s7")  # `large` is now an old state: the log grew past its window
    peaks = {}
    for name, base in (("newest", newest), ("old", large)):
        tracemalloc.start()
        for sid in ("s3", "s9", "new"):
            fs.get_or_create(base, sid)
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks["old"] < 20_000, peaks  # a copied window would be 2 x 8 bytes x 20k sessions


def _table_writes(state, fn):
    """Writes (``set``, ``delete``) and reroots that ``fn()`` makes to the dict ``state``'s session map shares
    with the versions derived from it: each one moves the family's sequence number on by two."""
    family = state._nodes._family
    before = family.seq
    fn()
    return (family.seq - before) // 2


def test_a_hit_and_its_commit_write_one_table_node():
    # Regression (issue 24): a hit relinked up to four nodes of a doubly linked list, and the commit that
    # followed rewrote the same node again. A hit now writes no node; its commit stores the new recency.
    state = ManagerState.create(max_sessions=64)
    for i in range(64):
        state, _ = fs.get_or_create(state, f"s{i}")
        state = fs.put(state, f"s{i}", "buf", LatentBuffer.create(maxlen=4))
    state = fs.commit(fs.get_or_create(state, "s40")[0], "s40", "buf", 1)

    def op():
        s, _ = fs.get_or_create(state, "s20")
        return fs.commit(s, "s20", "buf", 2)

    assert _table_writes(state, op) == 1
    after = op()
    assert after.most_recent == "s20" and after.session_ids[-2:] == ("s40", "s20")
    assert fs.view(after, "s20", "buf") == (2,)


def test_hits_and_commits_leave_nothing_for_the_garbage_collector():
    # Each recency-log entry is a str and an int in two lists, not a pair: a tracked pair per hit filled the
    # collector's generations and set off full collections (~1 s each over a 100k-session heap).
    state = ManagerState.create(max_sessions=64)
    for i in range(64):
        state, _ = fs.get_or_create(state, f"s{i}")
        state = fs.put(state, f"s{i}", "buf", LatentBuffer.create(maxlen=4))
    item = np.zeros(2)
    enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        before = gc.get_count()[0]
        for i in range(5_000):
            sid = f"s{(i * 7) % 64}"
            state, _ = fs.get_or_create(state, sid)
            state = fs.commit(state, sid, "buf", item)
        grown = gc.get_count()[0] - before
    finally:
        if enabled:
            gc.enable()
    assert grown < 500, grown  # one tracked object per op would be 5,000


def test_get_session_never_creates():
    state = _populated()
    with pytest.raises(SessionStateLostError, match="'zzz' is not in the table"):
        fs.get_session(state, "zzz")
    state2, session = fs.get_session(state, "a")
    assert session is fs.lookup(state, "a") and state2.session_ids == ("b", "a") and state2.hits == state.hits + 1
    dropped, existed = fs.drop_session(state, "a")
    assert existed and "a" not in dropped and len(dropped) == 1
    with pytest.raises(SessionStateLostError):
        fs.get_session(dropped, "a")
    assert fs.drop_session(dropped, "a") == (dropped, False)


def test_lookup_and_incarnation_do_not_touch_recency():
    state = _populated()
    assert fs.lookup(state, "a") is fs.sessions(state)["a"]
    assert fs.lookup(state, "zzz", None) is None
    uid = fs.incarnation(state, "a")
    assert uid is not None and fs.incarnation(state, "zzz") is None
    assert state.session_ids == ("a", "b") and state.hits == 0
    again, _ = fs.get_or_create(fs.drop_session(state, "a")[0], "a")
    assert fs.incarnation(again, "a") not in (None, uid)  # a new life under the same id


PER_SESSION = {
    "put": lambda s: fs.put(s, "x", "n", LatentBuffer.create()),
    "stage": lambda s: fs.stage(s, "x", "n", 1),
    "commit": lambda s: fs.commit(s, "x", "n", 1),
    "discard": lambda s: fs.discard(s, "x", "n"),
    "view": lambda s: fs.view(s, "x", "n"),
    "set_attr": lambda s: fs.set_attr(s, "x", "k", 1),
    "get_attr": lambda s: fs.get_attr(s, "x", "k"),
    "del_attr": lambda s: fs.del_attr(s, "x", "k"),
    "reset_session": lambda s: fs.reset_session(s, "x"),
    "evict": lambda s: fs.evict(s, "x", "n"),
    "fork_session": lambda s: fs.fork_session(s, "x", "y"),
    "update_session": lambda s: fs.update_session(s, "x", lambda x: x),
    "get_session": lambda s: fs.get_session(s, "x"),
    "lookup": lambda s: fs.lookup(s, "x"),
    "step": lambda s: fs.step(s, "x", "n", ArrayRing.commit),
}


@pytest.mark.parametrize("name", sorted(PER_SESSION))
def test_lost_session_errors_name_the_function_called(name):
    with pytest.raises(SessionStateLostError, match=rf"^`{name}`: session 'x' is not in the table"):
        PER_SESSION[name](ManagerState.create())


@pytest.mark.parametrize("name", sorted(PER_SESSION))
def test_a_manager_passed_to_a_pure_function_says_to_use_its_state(name):
    with pytest.raises(
        InvalidTypeError, match=rf"`{name}` takes a ManagerState, got a SessionStateManager: pass `manager.state`"
    ):
        PER_SESSION[name](fs.SessionStateManager())
    with pytest.raises(InvalidTypeError, match="takes a ManagerState"):
        PER_SESSION[name]({"x": 1})


def test_unknown_object_names_the_function_and_objects():
    state = _populated()
    for name, call in {
        "commit": lambda: fs.commit(state, "a", "nope", 1),
        "stage": lambda: fs.stage(state, "a", "nope", 1),
        "view": lambda: fs.view(state, "a", "nope"),
        "evict": lambda: fs.evict(state, "a", "nope"),
        "step": lambda: fs.step(state, "a", "nope", ArrayRing.commit),
    }.items():
        with pytest.raises(ObjectNotFoundError, match=rf"^`{name}`: .*'nope'.*\['frames', 'ring'\]"):
            call()


def test_stage_commit_discard_view_through_the_table():
    state = _populated()
    state = fs.stage(state, "a", "frames", torch.zeros(4))
    assert len(fs.view(state, "a", "frames")) == 2
    assert len(fs.view(state, "a", "frames", include_staged=False)) == 1
    assert len(fs.view(fs.discard(state, "a", "frames"), "a", "frames")) == 1
    committed = fs.commit(state, "a", "frames")
    assert len(fs.view(committed, "a", "frames", include_staged=False)) == 2
    assert len(fs.view(committed, "b", "frames")) == 1  # other sessions untouched


def test_writes_keep_recency_and_counters():
    state = _populated()
    after = fs.commit(fs.set_attr(state, "a", "k", 1), "a", "frames", torch.ones(4))
    assert after.session_ids == state.session_ids and (after.hits, after.misses) == (state.hits, state.misses)


def test_bad_payload_raises_and_state_is_unchanged():
    state = _populated()
    snap = snapshot(state)
    with pytest.raises(StateShapeError, match=r"expected \(4,\)"):
        fs.commit(state, "a", "ring", jnp.ones(5))
    assert_unchanged(state, snap)


def test_reset_session_keeps_the_session_in_table():
    state = fs.reset_session(_populated(), "a")
    assert "a" in state
    assert fs.get_attr(state, "a", "feat_map", None) is None
    assert not fs.lookup(state, "a").get("frames").allocated


def test_attrs_round_trip_by_identity_and_del_attr():
    marker = [1, 2]
    state = fs.set_attr(_populated(), "a", "m", marker)
    assert fs.get_attr(state, "a", "m") is marker
    gone = fs.del_attr(state, "a", "m")
    with pytest.raises(fs.AttrNotFoundError, match="carries no attr 'm'"):
        fs.get_attr(gone, "a", "m")
    assert fs.get_attr(state, "a", "m") is marker


def test_evict_returns_the_bytes_that_leave_the_accounting():
    state = _populated()
    before = fs.stats(state)["total_nbytes"]
    state2, freed = fs.evict(state, "a", "ring")
    assert freed == 2 * 4 * 4
    assert fs.stats(state2)["total_nbytes"] == before - freed
    assert not fs.lookup(state2, "a").get("ring").resident and fs.lookup(state, "a").get("ring").resident
    # A buffer still held by an attr of the session does not leave the accounting.
    t = torch.zeros(256)
    shared = fs.set_attr(fs.commit(state, "a", "frames", t), "a", "alias", t[10:20])
    _, freed = fs.evict(shared, "a", "frames")
    assert freed == 4 * 4  # only the other committed tensor (arange(4.0)) leaves
    # Staged bytes are never freed.
    staged = fs.stage(state, "b", "frames", torch.zeros(1000))
    after, freed = fs.evict(staged, "b", "frames")
    assert freed == 16 and fs.lookup(after, "b").get("frames").staged is not None


def test_fork_shares_objects_and_copies_nothing():
    state = _populated()
    forked = fs.fork_session(state, "a", "a2")
    src, dst = fs.lookup(forked, "a"), fs.lookup(forked, "a2")
    # No attr declares a fork policy: the session's maps (and so every object and attr) are shared; only the
    # small session record differs, each carrying its own tick and incarnation in the table.
    assert src._objects is dst._objects and src._attrs is dst._attrs
    ring_ptr = src.get("ring").storage.unsafe_buffer_pointer()
    snap_a = snapshot(fs.lookup(forked, "a"))
    after = fs.commit(fs.commit(forked, "a2", "ring", jnp.full(4, 9.0)), "a2", "frames", torch.ones(4))
    after = fs.set_attr(after, "a2", "step", 1)
    assert_unchanged(fs.lookup(after, "a"), snap_a)
    assert fs.lookup(after, "a").get("ring").storage.unsafe_buffer_pointer() == ring_ptr
    snap_a2 = snapshot(fs.lookup(after, "a2"))
    after = fs.commit(after, "a", "frames", torch.full((4,), 5.0))
    assert_unchanged(fs.lookup(after, "a2"), snap_a2)
    # "share" (the default policy) carries attrs by reference into both forks.
    assert fs.get_attr(after, "a", "feat_map") is fs.get_attr(after, "a2", "feat_map")


def test_fork_applies_attr_fork_policies():
    t = torch.zeros(4)
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.set_attr(state, "a", "shared", [t])
    state = fs.set_attr(state, "a", "feat_map", [t, t], on_fork="copy_container")
    state = fs.set_attr(state, "a", "cache", {"k": t}, on_fork="clone")
    before = fs.stats(state)["total_nbytes"]
    forked = fs.fork_session(state, "a", "b")
    a, b = fs.lookup(forked, "a"), fs.lookup(forked, "b")
    assert a.get_attr("shared") is b.get_attr("shared")
    assert a.get_attr("feat_map") is not b.get_attr("feat_map")
    assert all(x is y for x, y in zip(a.get_attr("feat_map"), b.get_attr("feat_map")))  # items shared
    assert b.get_attr("cache")["k"] is not t and b.get_attr("cache")["k"].data_ptr() != t.data_ptr()
    assert fs.stats(forked)["total_nbytes"] == before + 16  # the clone is new storage, and is counted
    b.get_attr("feat_map")[0] = torch.ones(4)  # item assignment in one fork ...
    assert a.get_attr("feat_map")[0] is t  # ... is never seen by the other
    assert dict(b.attr_policies) == {"feat_map": "copy_container", "cache": "clone"}


def test_fork_is_a_use_of_the_source_and_never_evicts_it():
    state = ManagerState.create(max_sessions=2)
    for sid in ("a", "b"):
        state, _ = fs.get_or_create(state, sid)
    forked = fs.fork_session(state, "a", "a2")  # a was the LRU: forking makes it recent, so b is dropped
    assert forked.session_ids == ("a", "a2") and forked.evictions == 1
    single = fs.get_or_create(ManagerState.create(max_sessions=1), "a")[0]
    with pytest.raises(SessionAdmissionError, match="holds at most 1 session"):
        fs.fork_session(single, "a", "b")


def test_fork_errors_leave_the_table_unchanged():
    state = _populated(max_sessions=2)
    snap = snapshot(state)
    with pytest.raises(SessionExistsError, match="'b' already exists"):
        fs.fork_session(state, "a", "b")
    with pytest.raises(InvalidTypeError, match="session_id must be a non-empty str"):
        fs.fork_session(state, "a", 3)
    with pytest.raises(SessionStateLostError):
        fs.fork_session(state, "zzz", "c")
    assert_unchanged(state, snap)
    assert fs.fork_session(state, "a", None).session_ids == ("a", "default")  # None means "default"


def test_admission_control():
    state = ManagerState.create(max_sessions=2, evict_when_full=False)
    state, _ = fs.get_or_create(state, "a")
    state, _ = fs.get_or_create(state, "b")
    snap = snapshot(state)
    with pytest.raises(SessionAdmissionError, match=r"full \(2/2 sessions\).*'c' is refused"):
        fs.get_or_create(state, "c")
    assert_unchanged(state, snap)
    state, _ = fs.get_or_create(state, "a")  # residents are still served
    assert state.hits == 1
    with pytest.raises(SessionAdmissionError):
        fs.fork_session(state, "a", "c")
    state, _ = fs.drop_session(state, "b")
    state, _ = fs.get_or_create(state, "c")
    assert state.session_ids == ("a", "c") and state.evictions == 0


def test_raise_max_sessions():
    state = ManagerState.create(max_sessions=2)
    assert fs.raise_max_sessions(state, 5).max_sessions == 5
    assert fs.raise_max_sessions(state, 2).max_sessions == 2
    with pytest.raises(InvalidArgumentError, match="n=1 is below the current cap 2"):
        fs.raise_max_sessions(state, 1)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="positive int"):
            fs.raise_max_sessions(state, bad)
    assert state.max_sessions == 2


@pytest.mark.parametrize(
    "kwargs", [{"max_sessions": 0}, {"max_sessions": -1}, {"max_sessions": 1.5}, {"byte_budget": -1}]
)
def test_create_rejects_bad_config(kwargs):
    with pytest.raises(InvalidArgumentError, match=next(iter(kwargs))):
        ManagerState.create(**kwargs)
    with pytest.raises(InvalidTypeError, match="ManagerState.create"):
        ManagerState()


@pytest.mark.parametrize("sid", [3, b"x", ""])
def test_bad_session_ids(sid):
    with pytest.raises(InvalidTypeError, match="`get_or_create`: session_id"):
        fs.get_or_create(ManagerState.create(), sid)


def test_stats_keys_and_counts():
    state = ManagerState.create(max_sessions=3, byte_budget=1 << 30)
    state, _ = fs.get_or_create(state, "a")
    state = fs.set_attr(state, "a", "t", torch.zeros(10))
    s = fs.stats(state)
    assert list(s) == [
        "sessions",
        "max_sessions",
        "byte_budget",
        "total_nbytes",
        "hits",
        "misses",
        "evictions",
        "parks",
        "restores",
        "parked_nbytes",
        "deleted_arrays",
        "unaccounted_objects",
        "nbytes:cpu",
    ]
    assert s["nbytes:cpu"] == 40 and s["total_nbytes"] == 40 and s["byte_budget"] == {"*": 1 << 30}


def test_a_deleted_array_is_reported_not_silently_zero():
    # The exact walk reports every deleted array; the default, which reads kept totals, reports those its
    # walk of attr containers meets (a closed value, an array, keeps the bytes it arrived with).
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    x, y = jnp.ones(256), jnp.ones(64)
    state = fs.set_attr(fs.set_attr(state, "a", "x", x), "a", "box", [y])
    assert fs.stats(state)["deleted_arrays"] == 0 and fs.stats(state) == fs.stats(state, exact=True)
    x.delete()
    y.delete()
    s = fs.stats(state, exact=True)
    assert s["deleted_arrays"] == 2 and s["total_nbytes"] == 0
    s = fs.stats(state)
    assert s["deleted_arrays"] == 1 and s["total_nbytes"] == 1024


def test_manager_state_is_not_a_pytree_and_says_what_to_use():
    state = _populated()
    with pytest.raises(InvalidTypeError, match=r"fs\.sessions\(state\)"):
        jax.jit(lambda s: 0)(state)
    with pytest.raises(InvalidTypeError, match="not a pytree"):
        jax.tree.map(lambda x: x, state)


def test_sessions_and_with_sessions_round_trip_a_mapped_tree():
    state = _populated()
    tree = fs.sessions(state)
    assert list(tree) == ["a", "b"]
    paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
    assert "['a'].objects['ring'].storage" in paths
    doubled = jax.tree.map(lambda x: x * 2 if isinstance(x, jax.Array) else x, tree)
    back = fs.with_sessions(state, doubled)
    assert back.session_ids == state.session_ids and back.hits == state.hits
    np.testing.assert_array_equal(fs.view(back, "a", "ring")[0], [2, 2, 2, 2])
    with pytest.raises(InvalidArgumentError, match=r"missing \['b'\], unknown \['z'\]"):
        fs.with_sessions(state, {"a": tree["a"], "z": tree["b"]})
    with pytest.raises(InvalidTypeError, match="values must be SessionState"):
        fs.with_sessions(state, {"a": tree["a"], "b": 1})


def test_states_that_differ_only_in_recency_have_equal_session_treedefs():
    state = _populated()
    touched, _ = fs.get_or_create(state, "a")
    touched, _ = fs.get_session(touched, "b")
    assert touched.session_ids != state.session_ids or touched.hits != state.hits
    assert jax.tree.structure(fs.sessions(state)) == jax.tree.structure(fs.sessions(touched))
    jax.tree.map(lambda x, y: None, fs.sessions(state), fs.sessions(touched))  # no "different metadata"


def test_jitted_step_over_sessions_traces_once_across_host_side_bookkeeping():
    state = ManagerState.create(max_sessions=64)
    state, _ = fs.get_or_create(state, "a")
    state = fs.put(state, "a", "ring", ArrayRing.create(4, (8,)))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def advance(session):
        return session.update("ring", lambda r: r.commit(jnp.full((8,), 1.0, jnp.float32)))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def advance_all(tree):
        return {sid: s.update("ring", lambda r: r.commit(jnp.zeros((8,), jnp.float32))) for sid, s in tree.items()}

    for i in range(1000):
        state = fs.update_session(state, "a", advance)
        state, _ = fs.get_or_create(state, "a")  # hit
        state, _ = fs.get_or_create(state, f"tmp{i % 5}")  # miss, then hits
        if i % 100 == 0:
            state = fs.fork_session(state, "a", f"fork{i}")
            state, _ = fs.drop_session(state, f"fork{i}")
    for _ in range(3):
        only_a = {"a": fs.lookup(state, "a")}
        state = fs.update_session(state, "a", lambda s: advance_all(only_a)["a"])
    assert int(fs.lookup(state, "a").get("ring").size) == 4


PURE = {
    "get_or_create_hit": lambda s: fs.get_or_create(s, "a"),
    "get_or_create_miss": lambda s: fs.get_or_create(s, "new"),
    "get_session": lambda s: fs.get_session(s, "b"),
    "lookup": lambda s: fs.lookup(s, "b"),
    "incarnation": lambda s: fs.incarnation(s, "b"),
    "sessions": fs.sessions,
    "with_sessions": lambda s: fs.with_sessions(s, fs.sessions(s)),
    "update_session": lambda s: fs.update_session(s, "a", lambda x: x.set_attr("k", 1)),
    "put": lambda s: fs.put(s, "a", "x", LatentBuffer.create()),
    "stage": lambda s: fs.stage(s, "a", "ring", jnp.zeros(4)),
    "commit": lambda s: fs.commit(s, "a", "ring", jnp.zeros(4)),
    "discard": lambda s: fs.discard(s, "a", "ring"),
    "view": lambda s: fs.view(s, "a", "frames"),
    "set_attr": lambda s: fs.set_attr(s, "a", "k", 2, on_fork="clone"),
    "get_attr": lambda s: fs.get_attr(s, "a", "feat_map"),
    "del_attr": lambda s: fs.del_attr(s, "a", "feat_map"),
    "reset_session": lambda s: fs.reset_session(s, "a"),
    "evict": lambda s: fs.evict(s, "a", "ring"),
    "drop_session": lambda s: fs.drop_session(s, "a"),
    "fork_session": lambda s: fs.fork_session(s, "a", "f"),
    "raise_max_sessions": lambda s: fs.raise_max_sessions(s, 10),
    "stats": fs.stats,
    "step": lambda s: fs.step(s, "a", "ring", ArrayRing.commit, jnp.zeros(4)),
}


@pytest.mark.parametrize("name", sorted(PURE))
def test_every_pure_function_leaves_its_input_bitwise_unchanged(name):
    state = _populated(max_sessions=2)  # full: a miss or a fork also drops the LRU session
    state = fs.set_attr(state, "a", "copied", [np.ones(2)], on_fork="copy_container")
    snap = snapshot(state)
    PURE[name](state)
    assert_unchanged(state, snap)


def test_every_error_is_a_session_state_error():
    state = _populated()
    calls = [
        lambda: fs.get_attr(state, "a", "nope"),
        lambda: fs.fork_session(state, "a", "b"),
        lambda: fs.get_or_create(state, 3),
        lambda: fs.raise_max_sessions(state, 0),
        lambda: fs.commit(state, "a", "nope", 1),
        lambda: fs.commit(state, "a", "ring", jnp.ones(3)),
        lambda: fs.get_session(state, "zzz"),
        lambda: fs.put(state, "a", "x", np.ones(2)),
        lambda: fs.with_sessions(state, {}),
        lambda: ArrayRing.create(4, 16),
        lambda: LatentBuffer.create(maxlen=0),
        lambda: fs.SessionState.empty().set_attr("k", 1, on_fork="deep"),
    ]
    for call in calls:
        with pytest.raises(SessionStateError):
            call()
    with pytest.raises(KeyError):  # the builtin stays a base where callers expect it
        fs.get_attr(state, "a", "nope")


def test_treescope_renders_the_table_not_the_internal_map():
    treescope = pytest.importorskip("treescope")

    text = treescope.render_to_text(_populated())
    assert "sessions={" in text and "'a': SessionState(" in text and "objects={" in text
    assert "_nodes" not in text


def test_repr_and_bool():
    state = ManagerState.create()
    assert bool(state) and len(state) == 0
    assert repr(_populated()) == "ManagerState(sessions=2/4, hits=0, misses=2, evictions=0, ids=['a', 'b'])"


def test_evictions_parks_restores_and_drops_are_logged(caplog):
    # Regression: the table's releases were silent; debug for routine events, info for a dropped session.
    state = ManagerState.create(max_sessions=2)
    for sid in ("a", "b"):
        state, _ = fs.get_or_create(state, sid)
        state = fs.put(state, sid, "ring", ArrayRing.create(2, (4,)))
    with caplog.at_level(logging.DEBUG, logger="functional_state"):
        parked, _ = fs.park(state, "a", "ring")
        restored, _ = fs.restore(parked, "a", "ring")
        evicted, _ = fs.evict(restored, "b", "ring")
        full, _ = fs.get_or_create(evicted, "c")  # drops "a", the least recent
        fs.drop_session(full, "b")
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "functional_state"]
    levels = dict(zip(("park", "restore", "evict", "LRU eviction", "drop_session"), [None] * 5))
    for level, message in records:
        for key in levels:
            if message.startswith(key):
                levels[key] = level
                assert "'a'" in message or "'b'" in message or "a/ring" in message, message
    assert levels == {
        "park": logging.DEBUG,
        "restore": logging.DEBUG,
        "evict": logging.DEBUG,
        "LRU eviction": logging.INFO,  # (issue 40: an operator sees evictions at INFO)
        "drop_session": logging.INFO,
    }, records
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="functional_state"):
        fs.evict(restored, "b", "ring")
    assert not caplog.records  # routine events stay below INFO


@pytest.mark.parametrize("make", [lambda: np.ones(256, np.float32), lambda: torch.ones(256), lambda: jnp.ones(256)])
def test_stats_and_exact_stats_agree_on_parked_bytes(make):
    # Regression (issue 19): the kept figure summed only the host pools, so a parked numpy array (which
    # park keeps where it is) showed parked_nbytes 0 against the exact walk's 1 KiB.
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "x", fs.DenseValue.create(make()))
    s, _ = fs.park(s, "a", "x")
    fast, exact = fs.stats(s), fs.stats(s, exact=True)
    assert fast == exact and fast["parked_nbytes"] == 1024


def test_with_issued_is_pure_keeps_everything_but_the_counter_and_refuses_a_reissue() -> None:
    from functional_state.table.manager_state import with_issued  # (here: the shell tests above run on any base)

    state, _ = fs.get_or_create(fs.ManagerState.create(4), "a")
    state = fs.commit(fs.put(state, "a", "x", LatentBuffer.create(maxlen=2)), "a", "x", np.ones(2))
    snap = snapshot(state)
    moved = with_issued(state, state.issued + 5)
    assert_unchanged(state, snap)
    assert moved.issued == state.issued + 5 and moved.counters == state.counters
    assert moved.session_ids == state.session_ids and fs.incarnation(moved, "a") == fs.incarnation(state, "a")
    assert fs.lookup(moved, "a") is fs.lookup(state, "a") and moved.max_sessions == state.max_sessions
    nxt, _ = fs.get_or_create(moved, "b")
    assert fs.incarnation(nxt, "b") == state.issued + 5
    assert with_issued(state, state.issued) is state
    for bad in (state.issued - 1, True, 1.5, None):
        with pytest.raises(fs.InvalidArgumentError, match="with_issued"):
            with_issued(state, bad)  # type: ignore[arg-type]
    assert_unchanged(state, snap)


def test_add_to_counter_adds_to_that_counter_alone_and_refuses_a_name_that_is_no_counter():
    # (A misspelt counter changed nothing, silently; it now raises.)
    from functional_state.table.manager_state import add_to_counter

    s = ManagerState.create()
    after = add_to_counter(add_to_counter(s, "parks", 3), "restores", 2)
    assert after.counters == s.counters._replace(parks=s.counters.parks + 3, restores=s.counters.restores + 2)
    assert s.counters.parks == 0  # pure
    with pytest.raises(AttributeError):
        add_to_counter(s, "park", 1)


@pytest.mark.parametrize("clone", ["pickle", "deepcopy"])
def test_a_cloned_table_accounts_for_its_own_buffers_not_the_originals(clone):
    """A pickled or deep-copied table held its original's ledger, keyed by the original buffers' addresses:
    a buffer later allocated where one of those was (freed with the original, e.g. in another process) was
    taken for one already held and not counted, so the budget under-counted (seen: 256 KiB of 512 KiB). The
    clone builds its ledger over its own buffers. Seen failing before (the clone's extents not in its ledger)."""
    import copy
    import pickle

    from functional_state.table.ledger import value_extents
    from functional_state.table.manager_state import ledger_of

    state, _ = fs.get_or_create(ManagerState.create(byte_budget=1 << 30), "a")
    state = fs.put(state, "a", "kv", fs.DenseValue.create((torch.ones(1 << 16),)))
    fs.stats(state)  # (the ledger is built)
    again = pickle.loads(pickle.dumps(state)) if clone == "pickle" else copy.deepcopy(state)
    extents = value_extents(fs.view(again, "a", "kv")[0])
    assert extents and all(e in ledger_of(again).refs for e in extents)
    stale = value_extents(fs.view(state, "a", "kv")[0])
    assert not any(e in ledger_of(again).refs for e in stale)
    assert fs.stats(again) == fs.stats(again, exact=True)
