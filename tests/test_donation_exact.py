"""A donating `step` keeps every other holder of the stepped object's buffers readable and bit-exact (issue 24):
forks, attr aliases (closed values and containers changed in place), retained outside references, parked
sharers. The holder answer comes from the table's ledger; `tests/test_holder_index.py` checks it against the
full walk."""

import jax.numpy as jnp
import numpy as np

import functional_state as fs
from functional_state import ArrayRing, ManagerState


def _table(*sids):
    state = ManagerState.create()
    for sid in sids:
        state, _ = fs.get_or_create(state, sid)
    state = fs.put(state, sids[0], "ring", ArrayRing.create(4, (16,)))
    return fs.step(state, sids[0], "ring", ArrayRing.commit, jnp.ones(16))  # JAX-owned buffers


def _ring(state, sid="a", name="ring"):
    return fs.lookup(state, sid).get(name)


def _bits(ring):
    return [np.asarray(x).copy() for x in (ring.storage, ring.head, ring.size)]


def _donate(state, **kw):
    return fs.step(state, "a", "ring", ArrayRing.commit, jnp.full(16, 2.0), donate=True, **kw)


def _assert_same(ring, bits):
    for got, want in zip(_bits(ring), bits):
        np.testing.assert_array_equal(got, want)


def test_a_fork_keeps_reading_its_ring():
    state = fs.fork_session(_table("a"), "a", "b")
    bits = _bits(_ring(state, "b"))
    new = _donate(state)
    _assert_same(_ring(new, "b"), bits)
    np.testing.assert_array_equal(fs.view(new, "a", "ring")[:, 0], [1.0, 2.0])
    assert fs.stats(new, exact=True)["deleted_arrays"] == 0


def test_attr_aliases_keep_reading_the_buffers_they_alias():
    state = _table("a", "b", "c")
    ring = _ring(state)
    state = fs.set_attr(state, "a", "storage", ring.storage)  # an alias in the session itself
    state = fs.set_attr(state, "b", "head", (ring.head, 3))  # a position leaf, inside a tuple, elsewhere
    later = []
    state = fs.set_attr(state, "c", "later", later)
    later.append(ring.size)  # a container changed in place after it was written
    bits = _bits(ring)
    del ring
    new = _donate(state)
    for got, want in zip(
        (fs.get_attr(new, "a", "storage"), fs.get_attr(new, "b", "head")[0], fs.get_attr(new, "c", "later")[0]), bits
    ):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert fs.stats(new, exact=True)["deleted_arrays"] == 0


def test_retained_outside_references_keep_reading():
    state = _table("a")
    held = _ring(state)
    older = fs.set_attr(state, "a", "note", 1)  # another table sharing the ring
    bits = _bits(held)
    new = fs.step(older, "a", "ring", ArrayRing.commit, jnp.full(16, 2.0), donate=True, retained=[held, state])
    _assert_same(held, bits)
    _assert_same(_ring(state), bits)
    np.testing.assert_array_equal(fs.view(new, "a", "ring")[:, 0], [1.0, 2.0])


def test_a_parked_sharer_restores_bit_exact_after_its_fork_donated():
    state = fs.fork_session(_table("a"), "a", "b")
    bits = _bits(_ring(state, "b"))
    state, _ = fs.park(state, "b", "ring", with_sharers=True)  # one host copy for both forks
    state, _ = fs.restore(state, "a", "ring")  # "a" resident again; "b"'s parked ring shares its positions
    new = _donate(state)
    restored, _ = fs.restore(new, "b", "ring")
    _assert_same(_ring(restored, "b"), bits)
    assert fs.stats(restored, exact=True)["deleted_arrays"] == 0


def test_a_ring_nothing_else_holds_is_donated_in_place():
    state = _table("a", "b")
    ptr = _ring(state).storage.unsafe_buffer_pointer()
    new = _donate(state)
    assert _ring(new).storage.unsafe_buffer_pointer() == ptr
