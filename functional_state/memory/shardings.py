"""JAX shardings and copies between memory kinds, the same on every JAX this package supports (0.7.1 to 0.12).

JAX 0.12 deprecates the class `jax.sharding.SingleDeviceSharding` for `make_single_device_sharding` (absent
from JAX 0.7) and `is_single_device_sharding` (absent before 0.12); the two functions here use whichever the
installed JAX has.
On JAX 0.12's CPU client, an array a jitted call returned in the ``pinned_host`` memory kind carries the host
memory space in its layout, and `jax.device_put` of it fails (``UNIMPLEMENTED: Unsupported layout used for
PjRt CPU buffers``): `copy_to` moves such an array with a jitted copy instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["copy_to", "is_single_device", "single_device_sharding"]


def _is_single_device_class(sharding: Any) -> bool:
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)


is_single_device: Callable[[Any], bool] = getattr(jax.sharding, "is_single_device_sharding", _is_single_device_class)
"""Whether ``sharding`` places an array on one device (one buffer)."""


def single_device_sharding(device: jax.Device, memory_kind: str | None = None) -> jax.sharding.Sharding:
    """The sharding of one buffer on ``device`` (in ``memory_kind``, where given).

    Example:
      >>> import jax
      >>> single_device_sharding(jax.devices("cpu")[0]).device_set == {jax.devices("cpu")[0]}
      True
    """
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    if make is None:  # (a JAX before the function, which has only the class)
        return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
    return make(device, memory_kind=memory_kind)


def copy_to(arrays: Sequence[jax.Array], targets: Sequence[jax.sharding.Sharding]) -> list[jax.Array]:
    """Fresh copies of ``arrays``, each placed by its target sharding (never the source array itself).

    One `jax.device_put` for them all; where JAX's CPU client refuses an array's host layout (see the module
    docstring), each array is copied by a jitted copy compiled once per target.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.arange(3.0)
      >>> [y] = copy_to([x], [x.sharding.with_memory_kind("pinned_host")])
      >>> y.sharding.memory_kind, y.tolist()
      ('pinned_host', [0.0, 1.0, 2.0])
    """
    try:
        return list(jax.device_put(list(arrays), list(targets), may_alias=False))
    except jax.errors.JaxRuntimeError as e:
        if "Unsupported layout" not in str(e):
            raise
    return [_jitted_copy(target)(a) for a, target in zip(arrays, targets)]


@functools.cache
def _jitted_copy(target: jax.sharding.Sharding) -> Callable[[jax.Array], jax.Array]:
    # jnp.copy, not the identity: jit forwards an input it returns unchanged, which would hand back the source.
    return jax.jit(jnp.copy, out_shardings=target)
