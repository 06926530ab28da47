"""Any pytree as session state (`PytreeValue`), `step(has_aux=True)`, and a jit-safe sessions tree (issue 21)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from helpers import assert_unchanged, snapshot


class Pair(typing.NamedTuple):
    k: jax.Array
    v: jax.Array


def _tree(x: float = 0.0) -> dict:
    f32 = jnp.float32
    return {
        "k": jnp.full((2, 3), x, f32),
        "layers": [Pair(jnp.full(4, x, f32), jnp.arange(4, dtype=f32) + f32(x)), None],
        "n": (jnp.asarray(x, jnp.int32),),
    }


def _table(tree=None):
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    return fs.put(s, "a", "kv", fs.PytreeValue.create(_tree() if tree is None else tree))


def _same(a, b) -> bool:
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
        return False
    return all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    )


def test_view_returns_the_same_type_and_structure():
    v = fs.PytreeValue.create(_tree(2.0))
    out = v.view()
    assert isinstance(out["layers"][0], Pair) and out["layers"][1] is None
    assert _same(out, _tree(2.0))
    assert out is not v.view() and out["layers"] is not v.view()["layers"]  # a new container per read


@pytest.mark.parametrize(
    ("bad", "path"),
    [
        (lambda t: {**t, "k": jnp.zeros((2, 4))}, "['k']"),
        (lambda t: {**t, "k": jnp.zeros((2, 3), jnp.int32)}, "['k']"),
        (lambda t: {**t, "layers": [t["layers"][0], jnp.zeros(1)]}, "['layers'][1]"),
        (lambda t: {**t, "extra": jnp.zeros(1)}, "['extra']"),
    ],
)
def test_commit_refuses_another_layout_naming_the_key_path(bad, path):
    s = _table()
    snap = snapshot(s)
    with pytest.raises(fs.StateShapeError, match=re_escape(path)):
        fs.commit(s, "a", "kv", bad(_tree()))
    assert_unchanged(s, snap)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_create_refuses_non_array_leaves():
    with pytest.raises(fs.InvalidTypeError, match=r"\['n'\]"):
        fs.PytreeValue.create({"n": 3})


def test_park_restore_fork_are_exact_and_forks_are_snapshots():
    s = fs.commit(_table(), "a", "kv", _tree(1.0))
    s = fs.fork_session(s, "a", "b")
    s = fs.commit(s, "a", "kv", _tree(5.0))
    assert _same(fs.view(s, "b", "kv"), _tree(1.0)) and _same(fs.view(s, "a", "kv"), _tree(5.0))
    mutable = fs.view(s, "b", "kv")
    mutable["k"] = jnp.zeros(1)  # a reader's change to its container is never seen by anyone else
    assert _same(fs.view(s, "b", "kv"), _tree(1.0))
    before = fs.stats(s)
    parked, _ = fs.park(s, "a", "kv")
    assert fs.get_session(parked, "a")[1].get("kv").parked
    restored, _ = fs.restore(parked, "a", "kv")
    assert _same(fs.view(restored, "a", "kv"), _tree(5.0))
    assert fs.stats(restored)["total_nbytes"] == before["total_nbytes"]


def test_accounting_counts_each_buffer_once():
    shared = jnp.ones(1000, jnp.float32)
    v = fs.PytreeValue.create({"a": shared, "b": shared})
    assert fs.total_nbytes(v) == 4000


@pytest.mark.parametrize("parked", [False, True])
def test_checkpoint_round_trips_plain_containers_and_nnx_free_namedtuples(tmp_path, parked):
    tree = {"k": jnp.arange(6.0).reshape(2, 3), "layers": [(jnp.ones(2), None)], "pos": np.arange(3)}
    s = _table(tree)
    if parked:
        s, _ = fs.park(s, "a", "kv")
    fs.save_session(s, "a", tmp_path / "ck")
    loaded = fs.load_session(fs.ManagerState.create(), "a", tmp_path / "ck")
    obj = fs.get_session(loaded, "a")[1].get("kv")
    assert obj.parked == parked
    if parked:
        loaded, _ = fs.restore(loaded, "a", "kv")
    assert _same(fs.view(loaded, "a", "kv"), tree)


def test_checkpoint_of_a_registered_type_loads_in_a_fresh_process(tmp_path):
    s = fs.commit(_table(), "a", "kv", _tree(3.0))
    fs.save_session(s, "a", tmp_path / "ck")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, "tests")  # the module pytest imported the NamedTuple from, under the same name
        import functional_state as fs
        from test_pytree_interop import _tree, _same
        s = fs.load_session(fs.ManagerState.create(), "a", {str(tmp_path / "ck")!r})
        assert _same(fs.view(s, "a", "kv"), _tree(3.0))
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def _advance(v: fs.PytreeValue, x):
    tree = v.view()
    new = jax.tree_util.tree_map(lambda a: a + x.astype(a.dtype), tree)
    return v.commit(new), new["k"].sum()


def test_step_has_aux_returns_the_aux_and_traces_once():
    s = _table()
    traces = []

    def fn(v, x):
        traces.append(1)
        return _advance(v, x)

    for i in range(3):
        s, total = fs.step(s, "a", "kv", fn, jnp.float32(1.0), has_aux=True)
        assert float(total) == 6.0 * (i + 1)
    assert len(traces) == 1


def test_step_has_aux_refuses_a_non_pair():
    s = _table()
    snap = snapshot(s)
    with pytest.raises(fs.InvalidTypeError, match="pair"):
        fs.step(s, "a", "kv", lambda v, x: v.commit(v.view()), jnp.float32(1.0), has_aux=True)
    assert_unchanged(s, snap)


def test_donated_step_with_a_fork_present_keeps_the_fork_readable():
    s = fs.commit(_table(), "a", "kv", _tree(1.0))
    s = fs.fork_session(s, "a", "b")
    s, _ = fs.step(s, "a", "kv", _advance, jnp.float32(1.0), donate=True, has_aux=True)
    assert _same(fs.view(s, "b", "kv"), _tree(1.0))
    assert _same(fs.view(s, "a", "kv"), _tree(2.0))
    # Without a fork, the step really donates: the old leaves are deleted.
    old = fs.get_session(s, "a")[1].get("kv").leaves
    s, _ = fs.step(s, "a", "kv", _advance, jnp.float32(1.0), donate=True, has_aux=True)
    assert _same(fs.view(s, "a", "kv"), _tree(3.0))
    del old


def _mixed_table():
    s = fs.commit(_table(), "a", "kv", _tree(1.0))
    s = fs.put(s, "a", "other", fs.PytreeValue.create({"x": jnp.ones(3, jnp.float32)}))
    s = fs.set_attr(s, "a", "n", 3)
    s = fs.set_attr(s, "a", "prompt", "hello")
    s = fs.set_attr(s, "a", "cond", jnp.ones(2, jnp.float32))
    s, _ = fs.park(s, "a", "other")
    return s


def test_jit_over_sessions_with_parked_objects_and_non_array_attrs():
    """Regression: a parked object or a str attr made `jax.jit` over `sessions` raise TypeError, and an int
    attr came back as a JAX array."""
    s = _mixed_table()
    traces = []

    @jax.jit
    def bump(tree):
        traces.append(1)
        return {
            sid: sess.update("kv", lambda v: v.commit(jax.tree_util.tree_map(lambda a: a + 1, v.view())))
            for sid, sess in tree.items()
        }

    out = bump(fs.sessions(s))
    assert type(out["a"].get_attr("n")) is int and out["a"].get_attr("prompt") == "hello"
    s2 = fs.with_sessions(s, out)
    assert _same(fs.view(s2, "a", "kv"), _tree(2.0))
    s2, _ = fs.restore(s2, "a", "other")
    assert _same(fs.view(s2, "a", "other"), {"x": jnp.ones(3, jnp.float32)})
    bump(fs.sessions(s))
    assert len(traces) == 1
    bump(fs.sessions(fs.set_attr(s, "a", "prompt", "bye")))  # a static attr changed: documented retrace
    assert len(traces) == 2


def test_session_unflatten_accepts_any_children():
    """Regression: unflatten called `immutables.Map(children)`, so `tree_map(..., is_leaf=...)` with
    non-mapping results failed (and orbax's save with it)."""
    session = fs.get_session(_mixed_table(), "a")[1]
    names = jax.tree_util.tree_map(lambda x: type(x).__name__, session, is_leaf=lambda x: isinstance(x, fs.StateObject))
    assert dict(names.objects) == {"kv": "PytreeValue", "other": "PytreeValue"}
    assert names.get_attr("n") == 3 and names.get_attr("cond") == "ArrayImpl"
    leaves, treedef = jax.tree_util.tree_flatten(session)
    again = jax.tree_util.tree_unflatten(treedef, [object()] * len(leaves))
    assert jax.tree_util.tree_structure(again) == treedef


def test_orbax_standard_checkpointer_saves_a_session(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    session = fs.get_session(fs.commit(_table(), "a", "kv", _tree(4.0)), "a")[1]
    session = session.set_attr("step", 7)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "orbax", session)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "orbax", jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, session))
    assert _same(restored.get("kv").view(), _tree(4.0)) and restored.get_attr("step") == 7


def test_donated_step_never_deletes_a_buffer_an_attr_of_another_session_holds():
    s = fs.commit(_table(), "a", "kv", _tree(1.0))
    s, _ = fs.get_or_create(s, "b")
    k = fs.view(s, "a", "kv")["k"]
    s = fs.set_attr(s, "b", "keep", k)  # the accounting tracks objects only; attrs are checked apart
    del k
    s, _ = fs.step(s, "a", "kv", _advance, jnp.float32(1.0), donate=True, has_aux=True)
    assert not fs.get_attr(s, "b", "keep").is_deleted()
    np.testing.assert_array_equal(np.asarray(fs.get_attr(s, "b", "keep")), np.full((2, 3), 1.0, np.float32))


def test_donated_step_donates_when_nothing_else_holds_the_buffers():
    import weakref

    s = fs.commit(_table(), "a", "kv", _tree(1.0))
    for i in range(20):  # other sessions with caches of their own: not holders
        s, _ = fs.get_or_create(s, f"other{i}")
        s = fs.put(s, f"other{i}", "kv", fs.PytreeValue.create(_tree(float(i))))
    s = fs.fork_session(s, "a", "fork")
    shared = [weakref.ref(x) for x in fs.lookup(s, "a").get("kv").leaves]  # weak: not a holder
    s, _ = fs.step(s, "a", "kv", _advance, jnp.float32(1.0), donate=True, has_aux=True)
    assert not any(r().is_deleted() for r in shared)  # the fork holds them: copied, the copies donated
    own = [weakref.ref(x) for x in fs.lookup(s, "a").get("kv").leaves]
    consumed = s  # keeps the old leaves alive, so they can be seen deleted (the table refuses it now)
    s, _ = fs.step(s, "a", "kv", _advance, jnp.float32(1.0), donate=True, has_aux=True)
    assert all(r().is_deleted() for r in own)  # nothing else held them: donated, not copied
    del consumed
    assert _same(fs.view(s, "a", "kv"), _tree(3.0)) and _same(fs.view(s, "fork", "kv"), _tree(1.0))


def test_orbax_standard_checkpointer_and_is_leaf_tree_map_over_a_session_of_shipped_types(tmp_path):
    """Regression (issue 21): `SessionState`'s unflatten called `immutables.Map(children)`, so orbax's
    `StandardCheckpointer().save(path, session)` failed ('SaveArgs' object is not iterable: orbax maps an empty
    node, here the attrs, to one SaveArgs) and so did a `tree_map` with `is_leaf` whose results are not
    mappings. Uses only types older than the fix, so it runs on the commit before it."""
    ocp = pytest.importorskip("orbax.checkpoint")
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    s = fs.put(s, "a", "dense", fs.DenseValue.create(jnp.arange(4.0)))
    session = fs.get_session(s, "a")[1]  # no attrs
    kinds = jax.tree_util.tree_map(
        lambda x: type(x).__name__, session, is_leaf=lambda x: isinstance(x, (dict, fs.StateObject))
    )
    assert kinds.get("dense") == "DenseValue"
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "orbax", session)
        ckpt.wait_until_finished()
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, session)
        restored = ckpt.restore(tmp_path / "orbax", abstract)
    np.testing.assert_array_equal(np.asarray(restored.get("dense").view()), np.arange(4.0))
