"""Sharded and replicated JAX arrays on 8 fake CPU devices (in a subprocess: the flag must precede JAX)."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import functional_state as fs

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("x",))
    x = jnp.arange(8 * 1024, dtype=jnp.float32)                     # 32 KiB
    sharded = jax.device_put(x, NamedSharding(mesh, P("x")))
    replicated = jax.device_put(x, NamedSharding(mesh, P()))
    shard_sum = sum(s.data.on_device_size_in_bytes() for s in sharded.addressable_shards)
    repl_sum = sum(s.data.on_device_size_in_bytes() for s in replicated.addressable_shards)
    # Distinct buffers over all three arrays (JAX may reuse x's buffer for the replica on device 0).
    distinct = {
        (s.data.unsafe_buffer_pointer(), s.data.on_device_size_in_bytes())
        for a in (sharded, replicated, x) for s in a.addressable_shards
    }

    state = fs.ManagerState.create()
    state, _ = fs.get_or_create(state, "a")
    state = fs.put(state, "a", "ring", fs.ArrayRing.create(2, (8 * 1024,)))
    state = fs.set_attr(state, "a", "sharded", sharded)
    state = fs.set_attr(state, "a", "again", sharded)
    print(json.dumps({
        "n_devices": len(devices),
        "shards": len(sharded.addressable_shards),
        "replicas": len(replicated.addressable_shards),
        "shard_sum": shard_sum,
        "repl_sum": repl_sum,
        "distinct_sum": sum(size for _, size in distinct),
        "x_reused": any(s.data.unsafe_buffer_pointer() == x.unsafe_buffer_pointer() for s in replicated.addressable_shards),
        "sharded": fs.nbytes_by_device(sharded),
        "replicated": fs.nbytes_by_device(replicated),
        "both": fs.nbytes_by_device(sharded, replicated, x),
        "stats": fs.stats(state),
    }))
    """
)


def test_sharded_and_replicated_arrays_on_eight_fake_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["n_devices"] == 8 and r["shards"] == 8 and r["replicas"] == 8
    assert r["shard_sum"] == 32 * 1024 and r["repl_sum"] == 8 * 32 * 1024
    assert r["sharded"] == {"cpu": r["shard_sum"]}  # one host pool, one key
    assert r["replicated"] == {"cpu": r["repl_sum"]}  # a replica per device: 8 buffers
    # Sum of distinct shard buffers; the replica that reuses x's buffer (if JAX did so) counts once.
    assert r["both"] == {"cpu": r["distinct_sum"]}
    assert r["distinct_sum"] == r["shard_sum"] + r["repl_sum"] + (0 if r["x_reused"] else 32 * 1024)
    ring_bytes = 2 * 8 * 1024 * 4
    assert r["stats"]["nbytes:cpu"] == ring_bytes + r["shard_sum"] == r["stats"]["total_nbytes"]
