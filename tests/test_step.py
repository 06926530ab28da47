"""`step`: jitted updates of one object, donating only buffers nothing else holds."""

import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from functional_state import (
    ArrayRing,
    InvalidTypeError,
    LatentBuffer,
    ManagerState,
    PytreeValue,
    StateConsumedError,
)
from helpers import assert_unchanged, snapshot


def _table():
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "ring", ArrayRing.create(4, (128,)))
    return fs.step(state, "a", "ring", ArrayRing.commit, jnp.ones(128))  # a jitted, JAX-owned buffer


def _ptr(state, sid="a"):
    return fs.lookup(state, sid).get("ring").storage.unsafe_buffer_pointer()


def test_donation_reuses_the_buffer_when_nothing_else_holds_it():
    state = _table()
    ptr = _ptr(state)
    new = fs.step(state, "a", "ring", ArrayRing.commit, jnp.full((128,), 2.0), donate=True)
    assert _ptr(new) == ptr
    np.testing.assert_array_equal(fs.view(new, "a", "ring")[:, 0], [1.0, 2.0])
    assert fs.stats(new)["deleted_arrays"] == 0


def test_donation_after_a_fork_leaves_the_other_fork_intact():
    # Regression: a donated jitted commit into one fork deleted the buffer both forks share; the other
    # fork then raised "Array has been deleted" and stats() reported 0 bytes for it.
    state = fs.fork_session(_table(), "a", "b")
    before = fs.stats(state)["total_nbytes"]
    new = fs.step(state, "a", "ring", ArrayRing.commit, jnp.full((128,), 2.0), donate=True)
    np.testing.assert_array_equal(fs.view(new, "b", "ring")[:, 0], [1.0])
    np.testing.assert_array_equal(fs.view(new, "a", "ring")[:, 0], [1.0, 2.0])
    s = fs.stats(new)
    assert s["deleted_arrays"] == 0 and s["total_nbytes"] == 2 * before  # the forks no longer share


def test_donation_never_deletes_a_buffer_an_attr_or_another_object_holds():
    state = _table()
    ring = fs.lookup(state, "a").get("ring")
    state = fs.set_attr(state, "a", "alias", ring.storage)
    state = fs.put(state, "a", "copy", ring)
    del ring
    new = fs.step(state, "a", "ring", ArrayRing.commit, jnp.full((128,), 2.0), donate=True)
    assert not fs.get_attr(new, "a", "alias").is_deleted()
    np.testing.assert_array_equal(fs.view(new, "a", "copy")[:, 0], [1.0])


def test_retained_values_are_protected():
    earlier = _table()
    state = fs.set_attr(earlier, "a", "step", 1)  # shares the ring with `earlier`
    new = fs.step(state, "a", "ring", ArrayRing.commit, jnp.full((128,), 2.0), donate=True, retained=[earlier])
    np.testing.assert_array_equal(fs.view(earlier, "a", "ring")[:, 0], [1.0])
    np.testing.assert_array_equal(fs.view(new, "a", "ring")[:, 0], [1.0, 2.0])


def test_a_donating_step_consumes_its_input_state():
    state = _table()
    new = fs.step(state, "a", "ring", ArrayRing.commit, jnp.full((128,), 2.0), donate=True)
    with pytest.raises(StateConsumedError, match="consumed by `step\\(..., donate=True\\)`"):
        fs.view(state, "a", "ring")
    with pytest.raises(StateConsumedError):
        fs.stats(state)
    assert fs.stats(new)["sessions"] == 1


def test_a_user_reference_the_caller_retains_is_never_donated():
    # The donation contract (issue 23): what the caller took out of the table and still reads is protected
    # when passed in `retained` (explicit ownership, not reference counts).
    state = _table()
    held = fs.lookup(state, "a").get("ring")
    new = fs.step(state, "a", "ring", ArrayRing.commit, jnp.full((128,), 2.0), donate=True, retained=[held])
    np.testing.assert_array_equal(held.latest(1)[:, 0], [1.0])
    array = fs.lookup(new, "a").get("ring").storage
    newer = fs.step(new, "a", "ring", ArrayRing.commit, jnp.full((128,), 3.0), donate=True, retained=[array])
    assert not array.is_deleted()
    np.testing.assert_array_equal(np.asarray(array)[:2, 0], [1.0, 2.0])
    np.testing.assert_array_equal(fs.view(newer, "a", "ring")[:, 0], [1.0, 2.0, 3.0])


def test_a_user_reference_not_retained_is_the_callers_and_reads_as_deleted_never_as_wrong_values():
    # As with `jax.jit(donate_argnums=...)`: a donated input the caller kept raises JAX's error when read.
    state = _table()
    held = fs.lookup(state, "a").get("ring")
    new = fs.step(state, "a", "ring", ArrayRing.commit, jnp.full((128,), 2.0), donate=True)
    assert held.storage.is_deleted()
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(held.storage)
    np.testing.assert_array_equal(fs.view(new, "a", "ring")[:, 0], [1.0, 2.0])


def test_step_never_swaps_the_process_wide_warning_filters(monkeypatch):
    # Regression (issue 23): `warnings.catch_warnings()` inside step replaced the process-wide filters on
    # each call, racing with other threads; the donation warning is now filtered once, at import.
    import warnings

    state = _table()
    calls = []
    real = warnings.catch_warnings
    monkeypatch.setattr(warnings, "catch_warnings", lambda *a, **k: calls.append(1) or real(*a, **k))
    fs.step(state, "a", "ring", ArrayRing.commit, jnp.full((128,), 2.0), donate=True)
    assert calls == []


def test_without_donation_step_is_pure_and_traces_once():
    traces = []

    def commit(ring, frame):
        traces.append(1)
        return ring.commit(frame)

    state = _table()
    for i in range(50):
        state = fs.step(state, "a", "ring", commit, jnp.full((128,), float(i)))
        state, _ = fs.get_or_create(state, f"other{i % 3}")  # host-side bookkeeping between steps
        state = fs.step(state, "a", "ring", commit, jnp.full((128,), float(i)), donate=True)
    assert len(traces) <= 2  # at most one trace per (function, donate), not one per step
    np.testing.assert_array_equal(fs.view(state, "a", "ring")[:, 0], [48, 48, 49, 49])


@pytest.mark.parametrize("donate", [False, True])
def test_step_checks_what_fn_returns_before_donating_anything(donate):
    state = _table()
    snap = snapshot(state)
    with pytest.raises(InvalidTypeError, match="fn must return a ArrayRing"):
        fs.step(state, "a", "ring", lambda ring: ring.storage, donate=donate)
    assert_unchanged(state, snap)  # refused: nothing donated, nothing consumed


def test_a_wrong_return_type_under_a_new_argument_structure_is_refused_before_donating():
    """The return type is checked as jit traces, once per input structure (issue 37: no per-step walk of the
    arguments' structure): a structure seen first at the tenth step is checked before that step runs."""

    def sometimes(ring, frame, extra=None):
        return ring.storage if extra is not None else ring.commit(frame)

    state = _table()
    for i in range(3):
        state = fs.step(state, "a", "ring", sometimes, jnp.full((128,), float(i)), donate=True)
    snap = snapshot(state)
    with pytest.raises(InvalidTypeError, match="got an array of shape"):
        fs.step(state, "a", "ring", sometimes, jnp.ones(128), {"x": jnp.ones(2)}, donate=True)
    assert_unchanged(state, snap)
    state = fs.step(state, "a", "ring", sometimes, jnp.full((128,), 9.0), donate=True)
    assert float(fs.view(state, "a", "ring")[-1, 0]) == 9.0


def test_step_on_a_latent_buffer_of_jax_arrays():
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "buf", LatentBuffer.create(maxlen=2).commit(jnp.zeros(3)))
    state = fs.step(state, "a", "buf", lambda b, x: b.commit(x), jnp.ones(3), donate=True)
    assert [float(x[0]) for x in fs.view(state, "a", "buf")] == [0.0, 1.0]


def _twice(kind):
    """An object holding one JAX-owned buffer under two leaves (issue 34, item 2)."""
    x = jnp.arange(4.0) + 1
    if kind == "pytree":
        return PytreeValue.create({"p": x, "q": x})
    return LatentBuffer.create().commit(x).commit(x)


def _update_twice(obj):
    if isinstance(obj, PytreeValue):
        tree = obj.view()
        return obj.commit({"p": tree["p"] + 1, "q": tree["q"] * 2})
    a, b = obj.view()
    return obj._replace(items=(a + 1, b * 2))


_WANT = [[2.0, 3.0, 4.0, 5.0], [2.0, 4.0, 6.0, 8.0]]


@pytest.mark.parametrize("kind", ["pytree", "latent"])
def test_a_donating_step_copies_a_buffer_the_object_holds_twice(kind):
    # It raised XLA's "Attempt to donate the same buffer twice": only holders outside the object were copied.
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "obj", _twice(kind))
    new = fs.step(state, "a", "obj", _update_twice, donate=True)
    got = fs.view(new, "a", "obj")
    got = [got["p"], got["q"]] if kind == "pytree" else list(got)
    np.testing.assert_array_equal(np.asarray(got), _WANT)
    assert fs.stats(new, exact=True)["deleted_arrays"] == 0
    assert fs.stats(new) == fs.stats(new, exact=True)


@pytest.mark.parametrize("kind", ["pytree", "latent"])
def test_a_donating_shell_step_copies_a_buffer_the_object_holds_twice(kind):
    m = fs.SessionStateManager()
    h = m.get_or_create_session("a").put("obj", _twice(kind))
    h.step("obj", _update_twice, donate=True)
    got = h.view("obj")
    got = [got["p"], got["q"]] if kind == "pytree" else list(got)
    np.testing.assert_array_equal(np.asarray(got), _WANT)
    assert m.stats()["deleted_arrays"] == 0
