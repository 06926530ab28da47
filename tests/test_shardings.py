"""JAX shardings and copies across JAX versions (functional_state.memory.shardings)."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from functional_state.memory import shardings
from functional_state.memory.shardings import copy_to, is_single_device, single_device_sharding

ROOT = Path(__file__).resolve().parents[1]
CPU = jax.devices("cpu")[0]


def _jitted_host_array():
    """A ``pinned_host`` array a jitted call returned: on JAX 0.12's CPU client its layout names the host
    memory space, and `jax.device_put` of it failed with a raw ``UNIMPLEMENTED: Unsupported layout``."""
    host = jax.device_put(jnp.arange(12.0).reshape(4, 3), single_device_sharding(CPU, "pinned_host"))
    return jax.jit(lambda t: t)(host)


@pytest.mark.parametrize("kind", ["device", "pinned_host"])
def test_copy_to_moves_a_jitted_host_array_to_either_memory_kind(kind):
    src = _jitted_host_array()
    [out] = copy_to([src], [single_device_sharding(CPU, kind)])
    assert out.sharding.memory_kind == kind
    assert out.unsafe_buffer_pointer() != src.unsafe_buffer_pointer()  # a copy, never the source
    np.testing.assert_array_equal(np.asarray(out), np.arange(12.0).reshape(4, 3))


def test_copy_to_falls_back_only_on_the_layout_refusal(monkeypatch):
    # Forced here so the fallback runs on every JAX (only 0.12's CPU client raises it on its own).
    calls = []

    def refuse(arrays, targets, may_alias=None):
        calls.append(len(arrays))
        raise jax.errors.JaxRuntimeError("UNIMPLEMENTED: Unsupported layout used for PjRt CPU buffers: {0:S(5)}")

    monkeypatch.setattr(shardings.jax, "device_put", refuse)
    x = jnp.arange(3.0)
    [y] = copy_to([x], [single_device_sharding(CPU, "pinned_host")])
    assert calls == [1] and y.sharding.memory_kind == "pinned_host" and y.tolist() == [0.0, 1.0, 2.0]

    def other(arrays, targets, may_alias=None):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(shardings.jax, "device_put", other)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        copy_to([x], [single_device_sharding(CPU, "pinned_host")])


def test_restore_of_an_object_a_jitted_call_returned_parked():
    # Regression (jax 0.12.1, CPU): restoring a parked object that went through `jax.jit` raised the raw
    # JaxRuntimeError `Unsupported layout used for PjRt CPU buffers: {1,0:S(5)}`.
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    s = fs.put(s, "a", "kv", fs.PytreeValue.create({"x": jnp.ones((4, 3))}))
    s, _ = fs.park(s, "a", "kv")
    s = fs.with_sessions(s, jax.jit(lambda tree: tree)(fs.sessions(s)))
    s, _ = fs.restore(s, "a", "kv")
    view = fs.view(s, "a", "kv")
    assert view["x"].sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(view["x"]), np.ones((4, 3)))


def test_is_single_device_tells_one_buffer_from_a_mesh():
    assert is_single_device(jnp.ones(2).sharding)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    assert not is_single_device(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def test_the_package_uses_no_deprecated_jax_name():
    # Regression (jax 0.12): `jax.sharding.SingleDeviceSharding` warned DeprecationWarning on import.
    code = "import functional_state, functional_state.persist.read, functional_state.persist.encode"
    out = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
