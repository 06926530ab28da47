"""Regression (issue 24, park9): a JAX array already in a host memory kind is copied by a park and a restore.

``jax.device_put`` to the sharding an array already has returns that very array. A park of an array living in
``pinned_host`` (JAX's host offloading puts arrays there) so kept the source's own buffer as its "host copy":
when the source was deleted (donated by a fork's step, say) the parked copy died with it, and the restore
raised JAX's ``Array has been deleted``. The restore had the same flaw the other way round: the restored
array was the parked host array, so donating it destroyed the parked copy a later restore rebuilds from.
"""

import jax
import jax.numpy as jnp
import numpy as np

from functional_state import DenseValue
from functional_state.memory.parking import park_values, restore_values


def _pinned(x: jax.Array) -> jax.Array:
    return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))


def test_a_parked_host_array_survives_the_deletion_of_its_source():
    source = _pinned(jnp.arange(8.0))
    parked = park_values({"a": source})
    host = parked.slots[0].host
    assert host is not source and host.unsafe_buffer_pointer() != source.unsafe_buffer_pointer()
    source.delete()  # (what donating it to a jitted call does)
    back = restore_values(parked)["a"]
    assert back.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(back), np.arange(8.0))


def test_a_restored_host_array_is_not_the_parked_copy():
    parked = park_values({"a": _pinned(jnp.arange(6, dtype=jnp.int32))})
    first = restore_values(parked)["a"]
    assert first.unsafe_buffer_pointer() != parked.slots[0].host.unsafe_buffer_pointer()
    first.delete()
    np.testing.assert_array_equal(np.asarray(restore_values(parked)["a"]), np.arange(6))


def test_an_object_over_a_host_array_restores_after_its_source_and_first_restore_are_donated():
    source = _pinned(jnp.full((4,), 3.0))
    parked = DenseValue.create(source).park()
    source.delete()
    first = parked.restore()
    first.value.delete()  # the memo now holds a deleted array: restore rebuilds from the host copy
    np.testing.assert_array_equal(np.asarray(parked.restore().value), np.full((4,), 3.0))
