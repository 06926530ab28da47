"""Park and restore: bit-exact round trips, aliasing kept, accounting that shows the move, refusals."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import (
    ArrayRing,
    DenseValue,
    LatentBuffer,
    ManagerState,
    NotAllocatedError,
    NotParkedError,
    NotResidentError,
    ObjectParkedError,
    SharedStorageError,
)
from functional_state.parking import park_values, restore_values
from helpers import assert_unchanged, snapshot
from torch_bridge import to_jax

TORCH_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
]


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _sample(dtype: torch.dtype, shape=(4, 6)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),), generator=g)
    return raw.to(torch.uint8).view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_round_trip_is_bit_exact_for_every_dtype(dtype):
    t = _sample(dtype)
    back = restore_values(park_values({"x": t}))["x"]
    assert back.dtype == t.dtype and back.shape == t.shape and back.stride() == t.stride()
    assert _bits(back) == _bits(t) and back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(0, 5),
        lambda: torch.arange(24.0).reshape(4, 6).t(),  # non-contiguous
        lambda: torch.arange(64.0)[3:40:3],  # strided view with an offset
        lambda: torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1),
        lambda: torch.complex(torch.arange(4.0), torch.ones(4)).conj(),  # conjugate-bit view
        lambda: torch._neg_view(torch.arange(6.0)),  # negative-bit view
    ],
    ids=["zero-size", "transposed", "strided", "permuted", "conj", "neg"],
)
def test_views_restore_with_their_offsets_strides_and_bits(make):
    t = make()
    back = restore_values(park_values([t]))[0]
    assert back.shape == t.shape and back.stride() == t.stride() and back.storage_offset() == t.storage_offset()
    assert back.is_conj() == t.is_conj() and back.is_neg() == t.is_neg()
    assert torch.equal(back.resolve_conj().resolve_neg(), t.resolve_conj().resolve_neg())


def test_views_of_one_storage_park_once_and_restore_as_views_of_one_storage():
    base = torch.arange(1000.0)
    views = [base[:10], base[500:], base.reshape(10, 100).t(), base]
    other = torch.ones(7)
    parked = park_values(views + [other])
    assert len(parked.storages) == 2 and parked.nbytes == 4000 + 28  # one copy per storage, packed
    back = restore_values(parked)
    ptrs = {v.untyped_storage().data_ptr() for v in back[:4]}
    assert len(ptrs) == 1 and back[4].untyped_storage().data_ptr() not in ptrs  # aliasing kept, never merged
    for a, b in zip(back, views + [other]):
        assert torch.equal(a, b) and a.stride() == b.stride()
    back[3][0] = -1.0  # writes through one restored view show in the others, as before
    assert back[0][0] == -1.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.bool_, jnp.complex64, jnp.int8, jnp.uint32])
def test_jax_round_trip_goes_through_pinned_host_and_back(dtype):
    x = jnp.asarray(np.arange(24).reshape(4, 6) % 3).astype(dtype)
    assert x.sharding.memory_kind == "device"
    parked = park_values({"x": x})
    host = parked.leaves[0].host
    assert host.sharding.memory_kind == "pinned_host" and host.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    back = restore_values(parked)["x"]
    assert back.sharding == x.sharding and back.sharding.memory_kind == "device" and back.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_a_bridge_alias_parks_its_whole_torch_storage_and_comes_back_an_alias():
    t = torch.arange(64.0).reshape(4, 16)
    rows = to_jax(t[2:])  # a JAX alias of a view: it keeps all 256 bytes alive
    parked = park_values([rows])
    assert parked.nbytes == 256
    back = restore_values(parked)[0]
    assert isinstance(back, jax.Array) and back.shape == (2, 16)
    np.testing.assert_array_equal(np.asarray(back), t[2:].numpy())
    assert fs.nbytes_by_device(back) == {"cpu": 256}  # it aliases its own restored storage, whole


def test_numpy_and_python_values_are_kept_as_they_are():
    a = np.zeros(8)
    parked = park_values({"a": a, "n": 3, "s": "x"})
    back = restore_values(parked)
    assert back["a"] is a and back["n"] == 3 and back["s"] == "x"


def _table():
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "ring", ArrayRing.create(4, (64,)))
    state = fs.commit(state, "a", "ring", jnp.ones(64))
    state = fs.put(state, "a", "frames", LatentBuffer.create(maxlen=4).commit(torch.ones(256)).commit(torch.zeros(256)))
    return fs.put(state, "a", "cache", DenseValue.create([torch.full((128,), 3.0), None, torch.ones(2, 2)]))


@pytest.mark.parametrize("name", ["ring", "frames", "cache"])
def test_stats_show_exactly_the_parked_bytes_moving_to_the_host_pool(name):
    state = _table()
    before = fs.stats(state)
    own = sum(fs.lookup(state, "a").get(name).nbytes_by_device().values())
    parked, moved = fs.park(state, "a", name)
    after = fs.stats(parked)
    host = "cpu/pinned_host" if name == "ring" else "cpu/unpinned_host"  # JAX memory kind vs torch buffer
    assert moved == {"cpu": -own, host: own}
    assert after["nbytes:cpu"] == before["nbytes:cpu"] - own and after[f"nbytes:{host}"] == own
    assert after["parks"] == 1 and after["parked_nbytes"] == own and after["total_nbytes"] == before["total_nbytes"]
    restored, moved_back = fs.restore(parked, "a", name)
    assert moved_back == {"cpu": own, host: -own}
    again = fs.stats(restored)
    assert again["nbytes:cpu"] == before["nbytes:cpu"] and f"nbytes:{host}" not in again and again["restores"] == 1
    np.testing.assert_array_equal(
        np.asarray(jax.tree.leaves(fs.view(restored, "a", name))[0]),
        np.asarray(jax.tree.leaves(fs.view(state, "a", name))[0]),
    )


def test_park_and_restore_are_pure():
    state = _table()
    snap = snapshot(state)
    parked, _ = fs.park(state, "a", "frames")
    assert_unchanged(state, snap)  # the state before park still reads its original tensors
    snap_parked = snapshot(parked)
    fs.restore(parked, "a", "frames")
    assert_unchanged(parked, snap_parked)


def test_a_parked_object_is_refused_by_reads_and_names_restore():
    parked, _ = fs.park(_table(), "a", "ring")
    ring = fs.lookup(parked, "a").get("ring")
    assert ring.parked and not ring.resident and ring.allocated and ring.status == "parked"
    for call in (
        lambda: fs.view(parked, "a", "ring"),
        lambda: fs.commit(parked, "a", "ring", jnp.ones(64)),
        lambda: ring.latest(1),
        lambda: ring.allocate(),
        lambda: fs.step(parked, "a", "ring", ArrayRing.commit, jnp.ones(64)),
        lambda: fs.lookup(parked, "a").get_or_create("ring", lambda: ArrayRing.create(4, (64,)), ArrayRing),
    ):
        with pytest.raises(ObjectParkedError, match="parked"):
            call()
    with pytest.raises(ObjectParkedError, match="`functional_state.restore"):
        fs.view(parked, "a", "ring")


def test_bad_park_and_restore_calls_raise_specific_errors_and_change_nothing():
    state = _table()
    state = fs.put(state, "a", "empty", LatentBuffer.create(allocate=False))
    state = fs.put(state, "a", "gone", LatentBuffer.create().commit(torch.ones(4)).evict()[0])
    snap = snapshot(state)
    cases = [
        (NotAllocatedError, lambda: fs.park(state, "a", "empty")),
        (NotResidentError, lambda: fs.park(state, "a", "gone")),
        (NotParkedError, lambda: fs.restore(state, "a", "ring")),
        (fs.ObjectNotFoundError, lambda: fs.park(state, "a", "nope")),
        (fs.SessionStateLostError, lambda: fs.park(state, "zzz", "ring")),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
    parked, _ = fs.park(state, "a", "ring")
    with pytest.raises(ObjectParkedError, match="already|parked"):
        fs.park(parked, "a", "ring")
    assert_unchanged(state, snap)


def test_park_refuses_storage_something_else_holds_unless_the_sharers_are_forks_of_the_object():
    state = _table()
    t = fs.lookup(state, "a").get("frames").view()[0]
    aliased = fs.set_attr(state, "a", "alias", t[10:])
    with pytest.raises(SharedStorageError, match=r"session\(s\) \['a'\]"):
        fs.park(aliased, "a", "frames")
    forked = fs.fork_session(state, "a", "b")
    with pytest.raises(SharedStorageError, match=r"\['b'\].*with_sharers=True"):
        fs.park(forked, "a", "frames")
    parked, moved = fs.park(forked, "a", "frames", with_sharers=True)
    a, b = fs.lookup(parked, "a").get("frames"), fs.lookup(parked, "b").get("frames")
    assert a is b and a.parked and moved["cpu"] == -2048  # one shared host copy; device memory freed
    assert fs.stats(parked)["parks"] == 2
    restored, moved_back = fs.restore(parked, "a", "frames")
    assert moved_back == {"cpu": 2048}  # "b" still holds the host copy, so the host pool keeps it
    assert fs.lookup(restored, "b").get("frames").parked


def test_evicting_or_resetting_a_parked_object_frees_its_host_copy():
    parked, _ = fs.park(_table(), "a", "cache")
    evicted, freed = fs.evict(parked, "a", "cache")
    assert freed == 128 * 4 + 16 and "nbytes:cpu/unpinned_host" not in fs.stats(evicted)
    assert fs.lookup(evicted, "a").get("cache").status == "evicted"
    reset = fs.reset_session(parked, "a")
    assert fs.stats(reset)["parked_nbytes"] == 0


def test_staged_payloads_are_never_parked():
    state = fs.stage(_table(), "a", "frames", torch.full((64,), 9.0))
    parked, _ = fs.park(state, "a", "frames")
    frames = fs.lookup(parked, "a").get("frames")
    assert frames.parked and torch.equal(frames.staged, torch.full((64,), 9.0))
    restored, _ = fs.restore(parked, "a", "frames")
    assert len(fs.view(restored, "a", "frames")) == 3  # two committed + the staged one


def test_handles_restore_on_first_access_and_count_it():
    manager = fs.SessionStateManager()
    h = manager.get_or_create_session("a").put("frames", LatentBuffer.create().commit(torch.ones(256)))
    assert h.park("frames") == {"cpu": -1024, "cpu/unpinned_host": 1024}
    assert manager.stats()["parked_nbytes"] == 1024
    assert torch.equal(h.view("frames")[0], torch.ones(256))  # restored here
    h.park("frames")
    h.commit("frames", torch.zeros(256))  # a write restores too
    h.park("frames")
    h.transact(lambda s: s.update("frames", lambda b: b.commit(torch.ones(1))))  # so does a transaction
    s = manager.stats()
    assert (s["parks"], s["restores"], s["parked_nbytes"]) == (3, 3, 0) and len(h.view("frames")) == 3
    with pytest.raises(NotParkedError):
        h.restore("frames")


def test_dense_value_lifecycle_and_checks():
    d = DenseValue.create([np.zeros(2), None])
    assert len(d) == 2 and d.set_item(1, np.ones(2)).view()[1][0] == 1.0 and d.view()[1] is None
    assert len(DenseValue.create(np.zeros(3))) == 1 and len(DenseValue.create()) == 0
    with pytest.raises(fs.InvalidTypeError, match="list of arrays"):
        DenseValue.create([np.zeros(2), "text"])
    with pytest.raises(fs.InvalidArgumentError, match="out of range"):
        d.set_item(5, np.zeros(2))
    with pytest.raises(fs.InvalidArgumentError, match="not a sequence"):
        DenseValue.create(np.zeros(3)).set_item(0, np.zeros(3))
    replaced = d.commit([np.ones(1)])
    assert len(replaced) == 1 and len(d) == 2


SHARDED = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from functional_state.parking import park_values, restore_values
    import functional_state as fs

    mesh = Mesh(np.array(jax.devices()), ("x",))
    x = jax.device_put(jnp.arange(8 * 64, dtype=jnp.float32).reshape(8, 64), NamedSharding(mesh, P("x")))
    parked = park_values([x])
    host = parked.leaves[0].host
    back = restore_values(parked)[0]
    print(json.dumps({
        "host_kind": host.sharding.memory_kind,
        "host_shards": len(host.addressable_shards),
        "host_devices": sorted(str(s.device) for s in host.addressable_shards),
        "back_equal": bool((np.asarray(back) == np.asarray(x)).all()),
        "same_sharding": back.sharding == x.sharding,
        "shard_devices_same": [str(s.device) for s in back.addressable_shards] == [str(s.device) for s in x.addressable_shards],
        "host_pools": fs.nbytes_by_device(host),
        "device_pools": fs.nbytes_by_device(back),
    }))
    """
)


def test_sharded_arrays_park_per_shard_over_eight_fake_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["host_kind"] == "pinned_host" and r["host_shards"] == 8 and len(set(r["host_devices"])) == 8
    assert r["back_equal"] and r["same_sharding"] and r["shard_devices_same"]
    assert r["host_pools"] == {"cpu/pinned_host": 8 * 64 * 4} and r["device_pools"] == {"cpu": 8 * 64 * 4}


def test_storages_pack_into_bounded_host_buffers_and_restore_exactly(monkeypatch):
    from functional_state import parking

    monkeypatch.setattr(parking, "_CHUNK", 1000)  # runs of at most 1,000 bytes
    tensors = [torch.full((100,), float(i)) for i in range(7)]  # 400 bytes each: two per host buffer
    parked = park_values(tensors)
    assert len(parked.buffers) == 4 and parked.nbytes == 7 * 400
    back = restore_values(parked)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))
    assert len({t.untyped_storage().data_ptr() for t in back}) == 7  # separate storages stay separate
