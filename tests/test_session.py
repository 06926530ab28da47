import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functional_state import ArrayRing, LatentBuffer, ObjectNotFoundError, SessionState
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
    with pytest.raises(KeyError, match="carries no attr 'missing'"):
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
    evicted = s.put("frames", s.get("frames").evict()[0])
    s4, obj = evicted.get_or_create("frames", factory, LatentBuffer)  # not resident
    assert obj.resident and s4.get("frames") is obj
    assert len(built) == 3
    with pytest.raises(TypeError, match="expected ArrayRing"):
        s.get_or_create("x", factory, ArrayRing)


def test_reset_resets_objects_and_clears_attrs():
    s, _ = _session()
    r = s.reset()
    assert r.attrs == {} and r.names == ("frames", "ring")
    assert all(not r.get(n).allocated for n in r.names)


def test_mappings_are_read_only():
    s, _ = _session()
    with pytest.raises(TypeError):
        s.attrs["x"] = 1
    with pytest.raises(TypeError):
        s.objects["x"] = LatentBuffer.create()


def test_put_rejects_non_state_objects():
    with pytest.raises(TypeError, match="set_attr"):
        SessionState.empty().put("x", np.zeros(3))
    with pytest.raises(TypeError, match="non-empty str"):
        SessionState.empty().put("", LatentBuffer.create())


def test_pytree_keys_are_sorted_and_deterministic():
    s = SessionState.empty().put("b", LatentBuffer.create().commit(jnp.ones(1))).put("a", ArrayRing.create(1, (1,)))
    s = s.set_attr("z", jnp.zeros(1)).set_attr("c", jnp.zeros(1))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s)[0]]
    assert paths == [
        ".objects['a'].storage", ".objects['a'].head", ".objects['a'].size",
        ".objects['b'].items[0]", ".attrs['c']", ".attrs['z']",
    ]
    rebuilt = jax.tree_util.tree_map(lambda x: x + 1, s)
    assert float(rebuilt.get("b").view()[0][0]) == 2.0


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
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_pure(name):
    s, _ = _session()
    snap = snapshot(s)
    OPS[name](s)
    assert_unchanged(s, snap)
