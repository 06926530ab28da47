import gc
import pickle
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from functional_state import (
    ArrayRing,
    AttrNotFoundError,
    InvalidArgumentError,
    InvalidTypeError,
    LatentBuffer,
    ObjectNotFoundError,
    SessionState,
)
from helpers import assert_unchanged, snapshot


def _session():
    feat_map = [np.zeros(4), None]
    return (
        SessionState.empty()
        .put("frames", LatentBuffer.create(maxlen=4).commit(np.ones(3)))
        .put("ring", ArrayRing.create(2, (3,)))
        .set_attr("feat_map", feat_map)
        .set_attr("step", 7)
    ), feat_map


def test_attrs_are_carried_by_identity():
    s, feat_map = _session()
    assert s.get_attr("feat_map") is feat_map
    feat_map.append("mutated in place")
    assert s.get_attr("feat_map")[-1] == "mutated in place"
    assert s.get_attr("missing", None) is None
    with pytest.raises(AttrNotFoundError, match="carries no attr 'missing'"):
        s.get_attr("missing")
    with pytest.raises(KeyError):  # still a KeyError for callers that catch the builtin
        s.get_attr("missing")


def test_get_missing_object_names_what_exists():
    s, _ = _session()
    with pytest.raises(ObjectNotFoundError, match=r"'nope'.*\['frames', 'ring'\]"):
        s.get("nope")


def test_get_or_create_rebuilds_when_absent_wrong_type_or_not_resident():
    s, _ = _session()
    built = []

    def factory():
        built.append(1)
        return LatentBuffer.create(maxlen=2)

    s1, obj = s.get_or_create("frames", factory, LatentBuffer)
    assert s1 is s and obj is s.get("frames") and not built
    s2, obj = s.get_or_create("ring", factory, LatentBuffer)  # wrong type
    assert isinstance(obj, LatentBuffer) and s2.get("ring") is obj
    s3, _ = s.get_or_create("new", factory)  # absent
    assert "new" in s3 and "new" not in s
    evicted = s.put("frames", s.get("frames").evict()[0])
    s4, obj = evicted.get_or_create("frames", factory, LatentBuffer)  # not resident
    assert obj.resident and s4.get("frames") is obj
    assert len(built) == 3
    with pytest.raises(InvalidTypeError, match="expected ArrayRing"):
        s.get_or_create("x", factory, ArrayRing)


def test_reset_resets_objects_and_clears_attrs():
    s, _ = _session()
    r = s.reset()
    assert len(r.attrs) == 0 and r.names == ("frames", "ring")
    assert all(not r.get(n).allocated for n in r.names)


def test_mappings_are_read_only():
    s, _ = _session()
    with pytest.raises(TypeError):
        s.attrs["x"] = 1
    with pytest.raises(TypeError):
        s.objects["x"] = LatentBuffer.create()
    with pytest.raises(AttributeError, match="no setter"):
        s.attrs = {}


def test_construction_always_copies_its_mappings():
    # Regression: a SessionState built from a MappingProxyType kept the proxy, so it changed with its dict.
    backing = {"step": 1}
    s = SessionState(attrs=MappingProxyType(backing), objects={"b": LatentBuffer.create()})
    backing["step"] = 2
    backing["new"] = 3
    assert s.get_attr("step") == 1 and "new" not in s.attrs


def test_put_rejects_non_state_objects():
    with pytest.raises(InvalidTypeError, match="set_attr"):
        SessionState.empty().put("x", np.zeros(3))
    with pytest.raises(InvalidTypeError, match="non-empty str"):
        SessionState.empty().put("", LatentBuffer.create())
    with pytest.raises(InvalidTypeError, match="expected a StateObject"):
        SessionState(objects={"x": 1})


def test_pytree_keys_are_sorted_and_deterministic():
    s = SessionState.empty().put("b", LatentBuffer.create().commit(jnp.ones(1))).put("a", ArrayRing.create(1, (1,)))
    s = s.set_attr("z", jnp.zeros(1)).set_attr("c", jnp.zeros(1))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s)[0]]
    assert paths == [
        ".objects['a'].storage",
        ".objects['a'].head",
        ".objects['a'].size",
        ".objects['b'].items[0]",
        ".attrs['c']",
        ".attrs['z']",
    ]
    rebuilt = jax.tree_util.tree_map(lambda x: x + 1, s)
    assert float(rebuilt.get("b").view()[0][0]) == 2.0


def test_recompute_sources_are_names_checked_on_put():
    s = SessionState.empty().put("latents", LatentBuffer.create().commit(np.ones(4)))
    derived = LatentBuffer.create(recompute_source="latents")
    s2 = s.put("quantised", derived)
    assert s2.recomputable("quantised") and not s2.recomputable("latents")
    evicted, _ = s2.evict("latents")
    assert not evicted.recomputable("quantised")  # the source is no longer resident
    with pytest.raises(InvalidArgumentError, match="recompute source 'nope'.*is not an object"):
        s.put("q", LatentBuffer.create(recompute_source="nope"))
    with pytest.raises(InvalidArgumentError, match="cycle: a -> a"):
        s.put("a", LatentBuffer.create(recompute_source="a"))
    s3 = s2.put("latents", LatentBuffer.create())
    with pytest.raises(InvalidArgumentError, match="cycle: latents -> quantised -> latents"):
        s3.put("latents", LatentBuffer.create(recompute_source="quantised"))
    with pytest.raises(InvalidArgumentError, match=r"\['quantised'\] name it as their recompute source"):
        s2.remove("latents")
    with pytest.raises(InvalidArgumentError, match="cycle"):
        SessionState(
            objects={"a": LatentBuffer.create(recompute_source="b"), "b": LatentBuffer.create(recompute_source="a")}
        )


def test_recompute_source_is_static_data_and_stable_under_jit():
    # Regression: the source was an object compared by identity in aux data, so rings with different
    # sources compiled separately and the jit cache kept the sources alive.
    traces = []

    @jax.jit
    def step(session):
        traces.append(1)
        return session.update("ring", lambda r: r.commit(jnp.ones(3)))

    for _ in range(3):
        s = (
            SessionState.empty()
            .put("src", LatentBuffer.create())
            .put("ring", ArrayRing.create(2, (3,), recompute_source="src"))
        )
        step(s)
    assert len(traces) == 1


def test_set_attr_records_fork_policies_and_forked_applies_them():
    t = torch.zeros(4)
    s = SessionState.empty().set_attr("l", [t], on_fork="copy_container").set_attr("c", [t], on_fork="clone")
    s = s.set_attr("plain", [t])
    assert dict(s.attr_policies) == {"l": "copy_container", "c": "clone"}
    assert dict(s.set_attr("l", [t]).attr_policies)["l"] == "copy_container"  # None keeps the policy
    assert "l" not in s.set_attr("l", [t], on_fork="share").attr_policies
    assert "l" not in s.del_attr("l").attr_policies
    f = s.forked()
    assert f.get_attr("plain") is s.get_attr("plain")
    assert f.get_attr("l") is not s.get_attr("l") and f.get_attr("l")[0] is t
    assert f.get_attr("c")[0] is not t and torch.equal(f.get_attr("c")[0], t)
    assert SessionState.empty().set_attr("x", 1).forked().get_attr("x") == 1
    with pytest.raises(InvalidArgumentError, match="on_fork must be one of"):
        s.set_attr("x", 1, on_fork="deep")


def test_session_evict_reports_marginal_bytes():
    t = torch.zeros(100, dtype=torch.uint8)
    s = SessionState.empty().put("a", LatentBuffer.create().commit(t)).put("b", LatentBuffer.create().commit(t[1:]))
    s2, freed = s.evict("a")
    assert freed == 0 and not s2.get("a").resident
    _, freed = s2.evict("b")
    assert freed == 100
    with pytest.raises(ObjectNotFoundError, match="`evict`"):
        s.evict("zzz")


def test_bool_and_repr():
    s, _ = _session()
    assert bool(SessionState.empty())
    assert repr(s) == (
        "SessionState(objects={'frames': LatentBuffer(items=(f64[3],), maxlen=4, status='resident'), "
        "'ring': ArrayRing(storage=f32[2,3], size=i32[], capacity=2)}, attrs={'feat_map': [f64[4], None], 'step': 7})"
    )


OPS = {
    "get": lambda s: s.get("frames"),
    "put": lambda s: s.put("x", LatentBuffer.create()),
    "remove": lambda s: s.remove("frames"),
    "get_or_create": lambda s: s.get_or_create("y", LatentBuffer.create),
    "update": lambda s: s.update("frames", lambda b: b.commit(np.zeros(3))),
    "set_attr": lambda s: s.set_attr("step", 8),
    "del_attr": lambda s: s.del_attr("step"),
    "reset": lambda s: s.reset(),
    "nbytes": lambda s: s.nbytes_by_device(),
    "evict": lambda s: s.evict("frames"),
    "forked": lambda s: s.set_attr("feat_map", s.get_attr("feat_map"), on_fork="clone").forked(),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_pure(name):
    s, _ = _session()
    snap = snapshot(s)
    OPS[name](s)
    assert_unchanged(s, snap)


def test_notebooks_render_states_with_treescope():
    pytest.importorskip("treescope")
    import functional_state as fs

    s, _ = _session()
    table, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    for value in (s, s.get("ring"), s.get("frames"), table):
        html = value._repr_html_()
        assert html is not None and "treescope" in html


def _tracked_added_per_session(build, n: int) -> float:
    gc.collect()
    before = len(gc.get_objects())
    held = build(n)
    gc.collect()  # (untracks the tuples and dicts that hold only untracked values, as every collection does)
    added = len(gc.get_objects()) - before
    del held
    return added / n


def test_a_table_session_keeps_three_tracked_containers():
    # Regression (issue 39): each session kept five containers the collector traverses on every full
    # collection (its node, `SessionState`, the objects HAMT's `Map` and root node, the object): 2.37x the
    # OrderedDict manager's collection at 100k sessions. The objects became a dict (four: node, session, dict,
    # object), and the table now stores the session itself, carrying its tick and incarnation: no node.
    import functional_state as fs

    item = np.zeros(16, np.float32)  # (a numpy array is not tracked: only the table's own containers count)

    def build(n):
        state, buf = fs.ManagerState.create(max_sessions=n), LatentBuffer.create(maxlen=4)
        for i in range(n):
            state, _ = fs.get_or_create(state, f"s{i}")
            state = fs.put(state, f"s{i}", "buf", buf)
            for _ in range(4):
                state = fs.commit(state, f"s{i}", "buf", item)
        return state

    assert _tracked_added_per_session(build, 500) <= 3.05


def test_objects_past_the_small_size_are_a_persistent_map_and_every_write_is_pure():
    from functional_state.core.session import SMALL_OBJECTS

    states = [SessionState.empty()]
    for i in range(SMALL_OBJECTS + 3):  # across the dict -> HAMT crossover
        states.append(states[-1].put(f"o{i:02d}", LatentBuffer.create(maxlen=2)))
    snaps = [snapshot(s) for s in states]
    big = states[-1].update("o00", lambda b: b.commit(1.0)).remove("o01")
    for _ in range(SMALL_OBJECTS + 1):  # and back below it
        big = big.remove(big.names[-1])
    for s, snap in zip(states, snaps):
        assert_unchanged(s, snap)
    assert [len(s.objects) for s in states] == list(range(SMALL_OBJECTS + 4))
    assert big.names == ("o00",) and len(big.get("o00")) == 1 and len(states[-1].get("o00")) == 0
    large = states[-1]
    assert type(large.objects) is not MappingProxyType  # (the HAMT is immutable itself)
    leaves, tree = jax.tree_util.tree_flatten(large)
    again = jax.tree_util.tree_unflatten(tree, leaves)
    assert again.names == large.names and all(type(again.get(n)) is LatentBuffer for n in large.names)
    for s in (states[2], large):
        copy = pickle.loads(pickle.dumps(s))
        assert copy.names == s.names
