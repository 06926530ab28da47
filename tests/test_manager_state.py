import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import (
    ArrayRing,
    LatentBuffer,
    ManagerState,
    ObjectNotFoundError,
    SessionAdmissionError,
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


def test_hit_moves_to_most_recent_and_miss_over_cap_drops_lru():
    state = ManagerState.create(max_sessions=2)
    state, _ = fs.get_or_create(state, "a")
    state, _ = fs.get_or_create(state, "b")
    state, _ = fs.get_or_create(state, "a")  # hit: a is now most recent
    assert state.session_ids == ("b", "a")
    state, _ = fs.get_or_create(state, "c")  # drops b
    assert state.session_ids == ("a", "c")
    assert (state.hits, state.misses, state.evictions) == (1, 3, 1)


def test_get_session_never_creates():
    state = _populated()
    with pytest.raises(SessionStateLostError, match="'zzz' is not in the table"):
        fs.get_session(state, "zzz")
    state2, session = fs.get_session(state, "a")
    assert session is state.sessions["a"] and state2.session_ids == ("b", "a") and state2.hits == state.hits + 1
    dropped, existed = fs.drop_session(state, "a")
    assert existed and "a" not in dropped
    with pytest.raises(SessionStateLostError):
        fs.get_session(dropped, "a")
    assert fs.drop_session(dropped, "a") == (dropped, False)


def test_lost_session_for_every_per_session_function():
    state = ManagerState.create()
    calls = [
        lambda: fs.put(state, "x", "n", LatentBuffer.create()),
        lambda: fs.stage(state, "x", "n", 1),
        lambda: fs.commit(state, "x", "n", 1),
        lambda: fs.discard(state, "x", "n"),
        lambda: fs.view(state, "x", "n"),
        lambda: fs.set_attr(state, "x", "k", 1),
        lambda: fs.get_attr(state, "x", "k"),
        lambda: fs.reset_session(state, "x"),
        lambda: fs.evict(state, "x", "n"),
        lambda: fs.fork_session(state, "x", "y"),
    ]
    for call in calls:
        with pytest.raises(SessionStateLostError):
            call()


def test_unknown_object_names_the_function_and_objects():
    state = _populated()
    with pytest.raises(ObjectNotFoundError, match=r"`commit`.*'nope'.*\['frames', 'ring'\]"):
        fs.commit(state, "a", "nope", 1)


def test_stage_commit_discard_view_through_the_table():
    state = _populated()
    state = fs.stage(state, "a", "frames", torch.zeros(4))
    assert len(fs.view(state, "a", "frames")) == 2
    assert len(fs.view(state, "a", "frames", include_staged=False)) == 1
    assert len(fs.view(fs.discard(state, "a", "frames"), "a", "frames")) == 1
    committed = fs.commit(state, "a", "frames")
    assert len(fs.view(committed, "a", "frames", include_staged=False)) == 2
    assert len(fs.view(committed, "b", "frames")) == 1  # other sessions untouched


def test_bad_payload_raises_and_state_is_unchanged():
    state = _populated()
    snap = snapshot(state)
    with pytest.raises(StateShapeError, match=r"expected shape \(4,\)"):
        fs.commit(state, "a", "ring", jnp.ones(5))
    assert_unchanged(state, snap)


def test_reset_session_keeps_the_session_in_table():
    state = fs.reset_session(_populated(), "a")
    assert "a" in state
    assert fs.get_attr(state, "a", "feat_map", None) is None
    assert not state.sessions["a"].get("frames").allocated


def test_attrs_round_trip_by_identity():
    marker = [1, 2]
    state = fs.set_attr(_populated(), "a", "m", marker)
    assert fs.get_attr(state, "a", "m") is marker


def test_evict_returns_the_bytes_that_leave_the_accounting():
    state = _populated()
    before = fs.stats(state)["total_nbytes"]
    state2, freed = fs.evict(state, "a", "ring")
    assert freed == 2 * 4 * 4
    assert fs.stats(state2)["total_nbytes"] == before - freed
    assert not state2.sessions["a"].get("ring").resident and state.sessions["a"].get("ring").resident
    # A buffer still held by an attr of the session does not leave the accounting.
    t = torch.zeros(256)
    shared = fs.set_attr(fs.commit(state, "a", "frames", t), "a", "alias", t[10:20])
    _, freed = fs.evict(shared, "a", "frames")
    assert freed == 4 * 4  # only the other committed tensor (arange(4.0)) leaves
    # Staged bytes are never freed.
    staged = fs.stage(state, "b", "frames", torch.zeros(1000))
    after, freed = fs.evict(staged, "b", "frames")
    assert freed == 16 and after.sessions["b"].get("frames").staged is not None


def test_fork_is_copy_on_write_and_copies_nothing():
    state = _populated()
    forked = fs.fork_session(state, "a", "a2")
    src, dst = forked.sessions["a"], forked.sessions["a2"]
    assert src is dst
    for x, y in zip(jax.tree_util.tree_leaves(src), jax.tree_util.tree_leaves(dst)):
        assert x is y
    ring_ptr = src.get("ring").storage.unsafe_buffer_pointer()
    snap_a = snapshot(forked.sessions["a"])
    after = fs.commit(fs.commit(forked, "a2", "ring", jnp.full(4, 9.0)), "a2", "frames", torch.ones(4))
    after = fs.set_attr(after, "a2", "step", 1)
    assert_unchanged(after.sessions["a"], snap_a)
    assert after.sessions["a"].get("ring").storage.unsafe_buffer_pointer() == ring_ptr
    snap_a2 = snapshot(after.sessions["a2"])
    after = fs.commit(after, "a", "frames", torch.full((4,), 5.0))
    assert_unchanged(after.sessions["a2"], snap_a2)
    # Carried attrs are shared by reference between forks.
    assert after.sessions["a"].get_attr("feat_map") is after.sessions["a2"].get_attr("feat_map")


def test_fork_errors():
    state = _populated()
    with pytest.raises(ValueError, match="'b' already exists"):
        fs.fork_session(state, "a", "b")


def test_fork_respects_the_cap():
    state = _populated(max_sessions=2)
    forked = fs.fork_session(state, "a", "c")
    assert forked.session_ids == ("b", "c") and forked.evictions == 1


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
    with pytest.raises(ValueError, match="n=1 is below the current cap 2"):
        fs.raise_max_sessions(state, 1)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            fs.raise_max_sessions(state, bad)
    assert state.max_sessions == 2


@pytest.mark.parametrize("kwargs", [{"max_sessions": 0}, {"max_sessions": -1}, {"max_sessions": 1.5}, {"byte_budget": -1}])
def test_create_rejects_bad_config(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ManagerState.create(**kwargs)


@pytest.mark.parametrize("sid", [3, b"x", ""])
def test_bad_session_ids(sid):
    with pytest.raises(TypeError, match="session_id"):
        fs.get_or_create(ManagerState.create(), sid)


def test_stats_keys_and_counts():
    state = ManagerState.create(max_sessions=3, byte_budget=1 << 30)
    state, _ = fs.get_or_create(state, "a")
    state = fs.set_attr(state, "a", "t", torch.zeros(10))
    s = fs.stats(state)
    assert list(s) == [
        "sessions", "max_sessions", "byte_budget", "total_nbytes", "hits", "misses", "evictions", "nbytes:cpu",
    ]
    assert s["nbytes:cpu"] == 40 and s["total_nbytes"] == 40 and s["byte_budget"] == 1 << 30


def test_manager_state_is_a_keyed_pytree():
    state = _populated()
    paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert "['a'].objects['ring'].storage" in paths
    rebuilt = jax.tree_util.tree_map(lambda x: x, state)
    assert rebuilt.session_ids == state.session_ids and rebuilt.hits == state.hits
    s2, _ = fs.get_or_create(rebuilt, "c")
    assert s2.session_ids == ("a", "b", "c")


PURE = {
    "get_or_create_hit": lambda s: fs.get_or_create(s, "a"),
    "get_or_create_miss": lambda s: fs.get_or_create(s, "new"),
    "get_session": lambda s: fs.get_session(s, "b"),
    "update_session": lambda s: fs.update_session(s, "a", lambda x: x.set_attr("k", 1)),
    "put": lambda s: fs.put(s, "a", "x", LatentBuffer.create()),
    "stage": lambda s: fs.stage(s, "a", "ring", jnp.zeros(4)),
    "commit": lambda s: fs.commit(s, "a", "ring", jnp.zeros(4)),
    "discard": lambda s: fs.discard(s, "a", "ring"),
    "view": lambda s: fs.view(s, "a", "frames"),
    "set_attr": lambda s: fs.set_attr(s, "a", "k", 2),
    "get_attr": lambda s: fs.get_attr(s, "a", "feat_map"),
    "reset_session": lambda s: fs.reset_session(s, "a"),
    "evict": lambda s: fs.evict(s, "a", "ring"),
    "drop_session": lambda s: fs.drop_session(s, "a"),
    "fork_session": lambda s: fs.fork_session(s, "a", "f"),
    "raise_max_sessions": lambda s: fs.raise_max_sessions(s, 10),
    "stats": fs.stats,
}


@pytest.mark.parametrize("name", sorted(PURE))
def test_every_pure_function_leaves_its_input_bitwise_unchanged(name):
    state = _populated(max_sessions=2)  # full: a miss or a fork also drops the LRU session
    snap = snapshot(state)
    ids, counters = state.session_ids, (state.hits, state.misses, state.evictions, state.max_sessions)
    PURE[name](state)
    assert_unchanged(state, snap)
    assert state.session_ids == ids and (state.hits, state.misses, state.evictions, state.max_sessions) == counters


def test_treescope_renders_the_table_not_the_internal_maps():
    import treescope

    text = treescope.render_to_text(_populated())
    assert "sessions={" in text and "'a': SessionState(" in text and "objects={" in text
    assert "_entries" not in text and "_order" not in text
