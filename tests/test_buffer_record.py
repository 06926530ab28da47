"""A step over a structure and buffers already seen reads their extents from a record, not from a walk
(issue 37), while every holder question is still asked anew: a buffer shared since (a fork, an attr, a
retained object) is copied, never donated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from functional_state import ManagerState, PytreeValue
from functional_state.memory import accounting
from functional_state.table import buffer_record

LEAVES = 12


@pytest.fixture(autouse=True)
def _no_engine_pool(monkeypatch):
    """The record is off while any engine pool's storages are registered in the process (a pool's blocks can
    lie inside a leaf's buffer, which the record's key cannot see), and pools an earlier test module made may
    still be registered (CI's full run found it): these tests hold no pool, so they run as a process without
    one."""
    monkeypatch.setattr(accounting, "POOL_STORAGES", {})


def _add(value, x):
    return value.commit(jax.tree_util.tree_map(lambda a: a + x, value.view()))


def _table():
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    tree = {f"k{i}": jnp.full((4, 8), float(i)) for i in range(LEAVES)}
    return fs.put(state, "a", "kv", PytreeValue.create(tree))


def _step(state, x=1.0, **kw):
    return fs.step(state, "a", "kv", _add, jnp.float32(x), donate=True, **kw)


@pytest.fixture
def walks(monkeypatch):
    """Counts the JAX arrays the extent walk reads (every walk of a JAX leaf goes through `jax_extents`)."""
    calls = {"n": 0}
    real = accounting.jax_extents

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(accounting, "jax_extents", counted)
    return calls


def _snapshot(state, sid):
    return {k: np.asarray(v).copy() for k, v in fs.view(state, sid, "kv").items()}


def test_a_second_step_over_the_same_structure_does_not_walk(walks):
    state = _step(_step(_table()))  # the first steps record the structure and its buffers
    walks["n"] = 0
    for _ in range(3):
        state = _step(state, 2.0)
    assert walks["n"] == 0, "a step over a structure and buffers already seen walked the object again"
    np.testing.assert_array_equal(fs.view(state, "a", "kv")["k3"], np.full((4, 8), 3.0 + 2 + 6))
    assert fs.stats(state) == fs.stats(state, exact=True)


def test_a_buffer_newly_shared_by_a_fork_is_copied_not_donated():
    state = _step(_step(_table()))  # recorded: the next step would find these buffers in the record
    state = fs.fork_session(state, "a", "b")  # shared since the record was made
    before = _snapshot(state, "b")
    state = _step(state, 5.0)
    after = _snapshot(state, "b")  # would raise "Array has been deleted" had a recorded answer been trusted
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    np.testing.assert_array_equal(fs.view(state, "a", "kv")["k0"], np.full((4, 8), 7.0))
    assert fs.stats(state, exact=True)["deleted_arrays"] == 0
    assert fs.stats(state) == fs.stats(state, exact=True)


def test_a_buffer_newly_held_by_an_attr_or_a_retained_object_is_copied():
    state = _step(_step(_table()))
    obj = fs.lookup(state, "a").get("kv")
    state = fs.set_attr(state, "a", "alias", obj.view()["k1"])
    state = _step(state, retained=(obj,))  # the object taken out and still read: retained by the caller
    np.testing.assert_array_equal(np.asarray(fs.get_attr(state, "a", "alias")), np.full((4, 8), 3.0))
    np.testing.assert_array_equal(np.asarray(obj.view()["k5"]), np.full((4, 8), 7.0))
    assert fs.stats(state) == fs.stats(state, exact=True)


def test_the_ledger_reads_the_record_of_the_stepped_object():
    state = _step(_step(_table()))
    new = _step(state)
    obj = fs.lookup(new, "a").get("kv")
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    walked = obj.ledger_extents()
    per_leaf = buffer_record.leaf_extents(obj, leaves, treedef)
    assert walked == frozenset(e for extents in per_leaf for e in extents)
    assert walked == frozenset(e for leaf in leaves for e in fs.core.state_object.value_extents(leaf))


def test_no_record_for_a_leaf_deleted_or_not_a_jax_array():
    obj = PytreeValue.create({"a": jnp.zeros(3), "b": np.zeros(3)})
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    assert buffer_record.buffer_key(obj, leaves, treedef) is None
    gone = PytreeValue.create({"a": jnp.zeros(3)})
    leaves, treedef = jax.tree_util.tree_flatten(gone)
    assert buffer_record.buffer_key(gone, leaves, treedef) is not None
    leaves[0].delete()
    assert buffer_record.buffer_key(gone, leaves, treedef) is None
    assert buffer_record.leaf_extents(gone, leaves, treedef) == (None,)


def test_a_batched_step_over_the_same_slots_does_not_walk(walks):
    pytest.importorskip("flax")
    import test_nnx  # (the tests' tiny NNX decoder)

    from functional_state.nnx import SessionCaches

    batch = SessionCaches(test_nnx.make_model()).batched(4)
    s = batch.create(ManagerState.create())
    for sid in ("a", "b"):
        s = batch.join(s, sid)
    x = batch.inputs(s, {"a": np.full((1, 1), 3, np.int32), "b": np.full((1, 1), 4, np.int32)})
    for _ in range(2):
        s, _ = batch.step(s, ["a", "b"], x)
    walks["n"] = 0
    s, _ = batch.step(s, ["a", "b"], x)
    assert walks["n"] == 0, "a batched step over the same stacked structure walked it again"
    assert fs.stats(s) == fs.stats(s, exact=True)


def test_the_record_lists_every_extent_and_knows_a_buffer_held_twice():
    # A step donates an object as is only when its record says each leaf's bytes are its own: an object
    # holding one buffer under two leaves must be recorded as not separate, or XLA is asked to donate it twice.
    x, y = jnp.arange(4.0), jnp.ones(4)
    for tree, separate in (({"p": x, "q": y}, True), ({"p": x, "q": x}, False)):
        obj = PytreeValue.create(tree)
        leaves, treedef = jax.tree_util.tree_flatten(obj)
        record = buffer_record.leaf_record(obj, leaves, treedef)
        assert record.every == tuple(e for leaf in leaves for e in fs.core.state_object.value_extents(leaf))
        assert record.separate is separate
        assert buffer_record.leaf_record(obj, leaves, treedef) is record  # (recorded: read back, not walked)


def test_a_recorded_object_holding_a_buffer_twice_is_still_copied_once():
    x = jnp.arange(4.0) + 1
    obj = PytreeValue.create({"p": x, "q": x})
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    buffer_record.leaf_record(obj, leaves, treedef)  # recorded, as an earlier step over these buffers would
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "kv", obj)
    state = fs.step(state, "a", "kv", lambda v: v.commit({"p": v.view()["p"] + 1, "q": v.view()["q"] * 2}), donate=True)
    got = fs.view(state, "a", "kv")
    np.testing.assert_array_equal(np.asarray(got["p"]), [2.0, 3.0, 4.0, 5.0])
    np.testing.assert_array_equal(np.asarray(got["q"]), [2.0, 4.0, 6.0, 8.0])
    assert fs.stats(state, exact=True)["deleted_arrays"] == 0
    assert fs.stats(state) == fs.stats(state, exact=True)


def test_a_step_over_a_new_structure_walks_it_and_donates_safely(walks):
    state = _step(_step(_table()))
    grown = PytreeValue.create({**fs.view(state, "a", "kv"), "extra": jnp.zeros((2, 2))})  # a changed treedef
    state = fs.put(state, "a", "kv", grown)
    walks["n"] = 0
    state = _step(state)
    assert walks["n"] > 0, "a step over a structure never seen read a record instead of walking it"
    np.testing.assert_array_equal(fs.view(state, "a", "kv")["extra"], np.ones((2, 2)))
    assert fs.stats(state) == fs.stats(state, exact=True)


def test_a_stepped_object_is_found_again_without_a_walk_and_forgotten_with_it():
    state = _step(_step(_table()))
    obj = fs.lookup(state, "a").get("kv")
    known = buffer_record.object_record(obj)  # remembered when the step returned it
    assert buffer_record.object_record(obj) is known
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    assert known.treedef == treedef and all(a is b for a, b in zip(known.leaves, leaves))
    assert known.record.every == tuple(e for leaf in leaves for e in fs.core.state_object.value_extents(leaf))
    # The memory of it keeps neither the object nor its buffers alive once the table lets them go.
    import gc
    import weakref

    leaf = weakref.ref(leaves[0])
    del state, obj, known, leaves
    gc.collect()
    assert leaf() is None, "the record of a dropped object kept its buffer alive"


def test_a_remembered_object_is_walked_again_once_a_leaf_is_aliased_or_a_pool_is_registered(monkeypatch):
    state = _step(_step(_table()))
    obj = fs.lookup(state, "a").get("kv")
    known = buffer_record.object_record(obj)
    owner = np.zeros(64, np.float32)  # (a leaf now reported as lying inside this allocation)
    accounting.register_alias(known.leaves[0], owner)
    walked = buffer_record.object_record(obj).record
    assert walked.every[0] == fs.core.state_object.value_extents(owner)[0], "a stale record answered for an alias"
    assert walked.every == tuple(e for leaf in known.leaves for e in fs.core.state_object.value_extents(leaf))
    monkeypatch.setattr(accounting, "POOL_STORAGES", {"pool": object()})
    assert buffer_record.object_record(obj).record is not known.record


# --- torch leaves: a DenseValue of a model's K/V tensors (issue 38) ------------------------------------------

torch = pytest.importorskip("torch")


def _dense_table(value):
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "kv", fs.DenseValue.create(value))
    fs.stats(state)  # (the ledger is built on first use: every later write keeps it)
    return state


def _exact_walk(obj):
    """The figures a walk of ``obj`` gives (a replica with no memo, walked as every object was before)."""
    from functional_state.core.state_object import _walked

    return _walked(obj._replace(staged=obj.staged))


def _assert_figures_exact(state):
    obj = fs.lookup(state, "a").get("kv")
    assert obj.ledger_extents() == _exact_walk(obj) and obj.ledger_leaf_extents() == _exact_walk(obj).extra
    assert fs.stats(state) == fs.stats(state, exact=True)


def test_a_torch_dense_commit_reads_its_storages_without_a_walk(monkeypatch):
    """Seen failing before the torch branch of `seed_extents`: every commit walked the new object."""
    state = _dense_table([torch.zeros(2, 8), torch.zeros(2, 8)])
    calls = {"n": 0}
    real = accounting.collect_extents

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(accounting, "collect_extents", counted)
    for n in range(3, 6):
        state = fs.commit(state, "a", "kv", [torch.ones(n, 8), torch.ones(n, 8)])
    assert calls["n"] == 0
    monkeypatch.setattr(accounting, "collect_extents", real)
    _assert_figures_exact(state)


def _resized(value):
    value[0].resize_(64, 8)  # in place: the same tensor object, a larger storage
    return list(value)


def _replaced(value):
    return [torch.zeros(5, 8), value[1]]


def _aliased(value):
    base = torch.zeros(4, 8)
    return [base[:2], base[2:]]  # two leaves, one storage: counted once


def _from_numpy(value):
    return [torch.from_numpy(np.zeros((2, 8), np.float32)), value[1]]  # a storage torch did not allocate


def _parameter(value):
    return [torch.nn.Parameter(torch.zeros(2, 8), requires_grad=False), value[1]]  # a subclass: walked


@pytest.mark.parametrize("change", [_resized, _replaced, _aliased, _from_numpy, _parameter])
def test_a_torch_dense_commit_counts_what_its_tensors_hold_now(change):
    value = [torch.zeros(2, 8), torch.zeros(2, 8)]
    state = _dense_table(value)
    state = fs.commit(state, "a", "kv", change(list(fs.view(state, "a", "kv"))))
    _assert_figures_exact(state)
    state = fs.commit(state, "a", "kv", [torch.zeros(3, 8), torch.zeros(3, 8)])
    _assert_figures_exact(state)


def test_a_torch_dense_commit_after_a_fork_keeps_the_shared_storages_counted_once():
    state = _dense_table([torch.zeros(2, 8), torch.zeros(2, 8)])
    state = fs.fork_session(state, "a", "b")
    shared = fs.view(state, "b", "kv")
    state = fs.commit(state, "a", "kv", [shared[0], torch.zeros(7, 8)])  # one storage still shared with b
    _assert_figures_exact(state)
    assert fs.stats(state)["nbytes:cpu"] == 4 * (2 * 8 + 2 * 8 + 7 * 8)


def test_parking_a_torch_dense_value_walks_it_no_second_time(monkeypatch):
    """Seen failing before: `park` walked the object's committed storage again beside its kept figures."""
    from functional_state.memory import holders

    state = _dense_table([torch.zeros(2, 8), torch.zeros(2, 8)])
    calls = {"n": 0}
    real = holders.holder_extents

    def counted(tree):
        calls["n"] += 1
        return real(tree)

    monkeypatch.setattr(holders, "holder_extents", counted)
    parked, _ = fs.park(state, "a", "kv")
    assert calls["n"] == 0
    assert fs.stats(parked) == fs.stats(parked, exact=True)
    restored, _ = fs.restore(parked, "a", "kv")
    _assert_figures_exact(restored)


def test_parking_a_torch_dense_value_another_object_shares_is_still_refused():
    state = _dense_table([torch.zeros(2, 8), torch.zeros(2, 8)])
    state = fs.put(state, "a", "other", fs.DenseValue.create([fs.view(state, "a", "kv")[0]]))
    before = fs.stats(state)
    with pytest.raises(fs.SharedStorageError, match="shares its storage"):
        fs.park(state, "a", "kv")
    assert fs.stats(state) == before == fs.stats(state, exact=True)


def test_a_parked_torch_dense_value_is_counted_from_its_host_copy_alone(monkeypatch):
    """Seen failing before: the ledger walked the parked object whole (its fields and its pytree leaves)."""
    state = _dense_table([torch.zeros(2, 8), torch.zeros(300, 8)])
    obj = fs.lookup(state, "a").get("kv")
    parked_obj = obj.park()
    assert buffer_record.seed_extents(parked_obj)
    assert parked_obj.ledger_extents() == _exact_walk(parked_obj)
    assert parked_obj.ledger_leaf_extents() == _exact_walk(parked_obj).extra
    parked, _ = fs.park(state, "a", "kv")
    assert fs.stats(parked) == fs.stats(parked, exact=True)
    assert fs.stats(parked)["parked_nbytes"] == 4 * (2 * 8 + 300 * 8)
