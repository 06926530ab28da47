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
from functional_state.memory import accounting, host_buffers, parking
from functional_state.memory.parking import park_values, restore_values
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
    from functional_state.memory.parking import park_values, restore_values
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
    from functional_state.memory import parking

    monkeypatch.setattr(parking, "_CHUNK", 1000)  # runs of at most 1,000 bytes
    tensors = [torch.full((100,), float(i)) for i in range(7)]  # 400 bytes each: two per host buffer
    parked = park_values(tensors)
    assert len(parked.buffers) == 4 and parked.nbytes == 7 * 400
    back = restore_values(parked)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))
    assert len({t.untyped_storage().data_ptr() for t in back}) == 7  # separate storages stay separate


# --- issue 19: sharers under any name, measured moves, one device copy, donated arrays, requires_grad ------


def _pools(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k.startswith("nbytes:")}


def _exact_delta(before, after) -> dict:
    """The change in bytes per pool between two tables, as stats(exact=True) measures it."""
    b, a = _pools(fs.stats(before, exact=True)), _pools(fs.stats(after, exact=True))
    return {k[len("nbytes:") :]: a.get(k, 0) - b.get(k, 0) for k in sorted({*a, *b}) if a.get(k, 0) != b.get(k, 0)}


def test_a_budgeted_write_parks_an_object_two_sessions_hold_under_different_names():
    # Regression: the planner groups sharers by object identity, but `park(with_sharers=True)` matched them by
    # name, so a write that needed this park raised SharedStorageError instead of parking.
    manager = fs.SessionStateManager(byte_budget={"cpu": 3000})
    cache = DenseValue.create(torch.ones(512))  # 2,048 bytes
    manager.get_or_create_session("a").put("x", cache)
    manager.get_or_create_session("b").put("y", cache)
    manager.get_or_create_session("c").put("z", DenseValue.create(torch.ones(256)))  # over budget: parks x/y
    a, b = manager.state, manager.state
    x, y = fs.lookup(a, "a").get("x"), fs.lookup(b, "b").get("y")
    assert x is y and x.parked  # one shared host copy, under both names
    s = manager.stats(exact=True)
    assert (s["nbytes:cpu"], s["nbytes:cpu/unpinned_host"], s["parks"]) == (1024, 2048, 2)
    assert torch.equal(manager.get_session("b").view("y"), torch.ones(512))  # restored on access, intact


def test_with_sharers_parks_the_very_object_under_every_name_and_refuses_other_holders():
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    cache = DenseValue.create(torch.ones(64))
    state = fs.put(fs.put(state, "a", "x", cache), "a", "again", cache)
    state, _ = fs.get_or_create(state, "b")
    state = fs.put(state, "b", "y", cache)
    snap = snapshot(state)
    with pytest.raises(SharedStorageError, match=r"\['a/again', 'b/y'\] hold this very object.*with_sharers=True"):
        fs.park(state, "a", "x")
    parked, moved = fs.park(state, "a", "x", with_sharers=True)
    assert_unchanged(state, snap)
    objs = [fs.lookup(parked, s).get(n) for s, n in (("a", "x"), ("a", "again"), ("b", "y"))]
    assert all(o is objs[0] and o.parked for o in objs) and parked.parks == 3
    assert moved == _exact_delta(state, parked) == {"cpu": -256, "cpu/unpinned_host": 256}
    # A different object over the same storage is not the object: it still holds the device memory.
    other = fs.put(state, "b", "view", DenseValue.create(cache.value[:8]))
    with pytest.raises(SharedStorageError, match=r"\['b'\]"):
        fs.park(other, "a", "x", with_sharers=True)


def _torch_cache(state):
    return fs.put(state, "a", "o", DenseValue.create([torch.ones(100), torch.zeros(3, 5)]))


def _jax_ring(state):
    return fs.commit(fs.put(state, "a", "o", ArrayRing.create(4, (64,))), "a", "o", jnp.ones(64))


def _numpy_cache(state):
    return fs.put(state, "a", "o", DenseValue.create([np.ones(10), np.zeros(4)]))


def _mixed(state):
    t = torch.arange(32.0)
    return fs.put(state, "a", "o", DenseValue.create([t, to_jax(t), jnp.ones(16), np.ones(8), t[4:]]))


def _frames(state):
    return fs.put(state, "a", "o", LatentBuffer.create(maxlen=3).commit(torch.ones(64)).commit(jnp.ones(8)))


def _jax_array_twice(state):
    x = jnp.arange(50.0)
    return fs.put(state, "a", "o", DenseValue.create([x, x]))


def _staged_torch_shares_committed(state):
    t = torch.ones(256)
    return fs.put(state, "a", "o", DenseValue.create(t).stage(t))


def _staged_jax_shares_committed(state):
    x = jnp.ones(128)
    return fs.put(state, "a", "o", DenseValue.create(x).stage(x))


def _staged_view_of_committed(state):
    t = torch.ones(256)
    return fs.put(state, "a", "o", DenseValue.create(t).stage(t[8:]))


def _staged_apart(state):
    return fs.stage(_frames(state), "a", "o", torch.full((64,), 2.0))  # staged bytes stay on the device


def _forks(state):
    return fs.fork_session(_jax_ring(state), "a", "b")


def _forks_torch(state):
    return fs.fork_session(_torch_cache(fs.set_attr(state, "a", "note", np.ones(4))), "a", "b")


MAKERS = [
    _torch_cache,
    _jax_ring,
    _numpy_cache,
    _mixed,
    _frames,
    _jax_array_twice,
    _staged_apart,
    _forks,
    _forks_torch,
]


@pytest.mark.parametrize("make", MAKERS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("tracked", [False, True], ids=["untracked", "tracked"])
def test_park_and_restore_report_exactly_the_change_stats_measures(make, tracked):
    # Regression: park and restore reported the object's own bytes, not what moved (a JAX array held twice
    # parked as two host copies); and forks parked together came back as one device copy per session.
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = make(state)
    if tracked:
        fs.stats(state)  # the incremental accounting now follows the table
    sharers = [sid for sid in state.session_ids if fs.lookup(state, sid).get("o", None) is not None]
    snap = snapshot(state)
    parked, moved = fs.park(state, "a", "o", with_sharers=len(sharers) > 1)
    assert_unchanged(state, snap)
    assert moved == _exact_delta(state, parked)
    snap_parked = snapshot(parked)
    restored = parked
    for sid in sharers:
        before = restored
        restored, moved_back = fs.restore(restored, sid, "o")
        assert moved_back == _exact_delta(before, restored), sid
    assert_unchanged(parked, snap_parked)
    assert _exact_delta(state, restored) == {}  # everything back where it was, counted once
    assert fs.stats(restored) == {**fs.stats(restored, exact=True), "parks": parked.parks}
    for sid in sharers:
        back, orig = fs.view(restored, sid, "o"), fs.view(state, sid, "o")
        for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(orig)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "make", [_staged_torch_shares_committed, _staged_jax_shares_committed, _staged_view_of_committed]
)
def test_park_refuses_an_object_whose_staged_payload_shares_the_committed_storage(make):
    # Regression: such a park reported the committed bytes as leaving the device, but the staged payload kept
    # them there (and a restore then held them twice).
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = make(state)
    snap = snapshot(state)
    with pytest.raises(SharedStorageError, match="object 'o' of session 'a'.*staged payload shares storage"):
        fs.park(state, "a", "o")
    assert_unchanged(state, snap)
    assert state.parks == 0 and fs.lookup(state, "a").get("o").resident
    discarded = fs.discard(state, "a", "o")  # what the message says to do
    parked, moved = fs.park(discarded, "a", "o")
    assert moved == _exact_delta(discarded, parked) and moved["cpu"] < 0


@pytest.mark.parametrize("make", [_forks, _forks_torch], ids=["jax", "torch"])
def test_forks_parked_together_restore_to_one_shared_device_buffer(make):
    # Regression: 4,096 B of forks became 8,192 B once both sessions restored their parked object.
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = make(state)
    device = fs.stats(state, exact=True)["nbytes:cpu"]
    parked, _ = fs.park(state, "a", "o", with_sharers=True)
    restored, _ = fs.restore(parked, "a", "o")
    assert fs.lookup(restored, "b").get("o").parked  # "b" keeps the host copy until it restores
    restored, _ = fs.restore(restored, "b", "o")
    a, b = fs.lookup(restored, "a").get("o"), fs.lookup(restored, "b").get("o")
    assert a is b and a.resident  # one object again, as the forks shared before parking
    s = fs.stats(restored, exact=True)
    assert s["nbytes:cpu"] == device and s["parked_nbytes"] == 0 and "nbytes:cpu/pinned_host" not in s


def test_a_restore_whose_earlier_copy_was_donated_builds_a_fresh_one():
    ring = ArrayRing.create(2, (8,)).commit(jnp.ones(8))
    parked = ring.park()
    first = parked.restore()
    assert parked.restore() is first  # the live copy is reused ...
    first.storage.delete()  # ... until its buffer is donated
    again = parked.restore()
    assert again is not first and np.asarray(again.latest(1)).tolist() == [[1.0] * 8]


def test_parking_a_donated_jax_array_raises_a_library_error_and_changes_nothing():
    # Regression: a raw RuntimeError ("Array has been deleted") escaped from jax.device_put.
    gone = jnp.ones(8)
    gone.delete()
    cache = DenseValue.create([jnp.zeros(4), gone])
    with pytest.raises(fs.DeletedArrayError, match=r"`DenseValue.park`: the JAX array at \['value'\]\[1\].*donated"):
        cache.park()
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "cache", cache)
    with pytest.raises(fs.DeletedArrayError, match="object 'cache' of session 'a'.*deleted") as info:
        fs.park(state, "a", "cache")
    assert isinstance(info.value, fs.SessionStateError)
    assert fs.lookup(state, "a").get("cache") is cache and state.parks == 0
    manager = fs.SessionStateManager()
    manager.get_or_create_session("a").put("cache", cache)
    before = manager.state
    with pytest.raises(fs.DeletedArrayError):
        manager.park("a", "cache")
    assert manager.state is before and manager.stats()["parks"] == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(3, 4, requires_grad=True),
        lambda: torch.ones(6, requires_grad=True) * 2,  # not a leaf: restored as a leaf that requires grad
        lambda: torch.arange(12.0, requires_grad=True).reshape(3, 4).t(),
        lambda: torch.ones(4),
    ],
    ids=["leaf", "non-leaf", "view", "no-grad"],
)
def test_park_and_restore_keep_requires_grad(make):
    # Regression: restored tensors came back with requires_grad=False (a checkpoint keeps it).
    t = make()
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "w", DenseValue.create(t))
    snap = snapshot(state)
    parked, _ = fs.park(state, "a", "w")
    back = fs.view(fs.restore(parked, "a", "w")[0], "a", "w")
    assert_unchanged(state, snap)
    assert back.requires_grad == t.requires_grad and torch.equal(back.detach(), t.detach())
    assert back.stride() == t.stride()
    if back.requires_grad:  # a leaf of its own graph, as a checkpoint restores it
        back.sum().backward()
        assert back.is_leaf and torch.equal(back.grad, torch.ones_like(back))


# --- issue 22: restore cuts a shared host buffer into fresh storages, one per parked storage ------------------


def test_restore_gives_each_storage_a_fresh_allocation_of_its_own_bytes(monkeypatch):
    from functional_state.memory import parking

    monkeypatch.setattr(parking, "_NUMPY_MIN", 600)  # storages of 600 bytes and up come back through numpy
    tensors = [torch.arange(n, dtype=torch.float32) for n in (100, 0, 300, 7)] + [torch.ones(3, dtype=torch.int8)]
    tensors.append(tensors[2][1:5])  # a view: parked once with its storage, restored as a view of it again
    parked = park_values(tensors)
    assert len(parked.buffers) == 1 and parked.nbytes == 400 + 0 + 1200 + 28 + 3
    host = parked.buffers[0]
    host_bits = bytes(host.numpy())
    lo, hi = host.data_ptr(), host.data_ptr() + host.numel()
    back = restore_values(parked)
    assert [_bits(t) for t in back] == [_bits(t) for t in tensors]
    assert [t.dtype for t in back] == [t.dtype for t in tensors]
    for t, orig in zip(back, tensors):
        storage = t.untyped_storage()
        assert storage.nbytes() == orig.untyped_storage().nbytes()  # exactly its own bytes, no more
        assert not storage.nbytes() or not lo <= storage.data_ptr() < hi  # not a view of the host buffer
    assert back[5].untyped_storage().data_ptr() == back[2].untyped_storage().data_ptr()
    for t in back[:1] + back[2:5]:
        t.add_(1)  # writing the restored values leaves the parked copy as it was
    assert bytes(host.numpy()) == host_bits
    assert [_bits(t) for t in restore_values(parked)] == [_bits(t) for t in tensors]


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


def _tensors(n: int, numel: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n + numel)
    return [torch.randn(numel, generator=g).to(dtype) for _ in range(n)]


def test_a_uniform_list_parks_as_one_segment_holding_each_storage_back_to_back():
    values = _tensors(600, 1024)  # 2.3 MiB: over the shared buffer's threshold, every storage under a run
    assert sum(t.nbytes for t in values) >= host_buffers.MIN_NBYTES and parking._CHUNK >= 4096
    one = park_values(values)
    assert len(one.buffers) == 1 and len(one.layout.segments) == 1
    assert torch.equal(one.buffers[0], torch.cat(values).view(torch.uint8))
    assert [(s.buffer, s.start, s.nbytes) for s in one.storages] == [(0, 4096 * k, 4096) for k in range(600)]
    assert [leaf.shape for leaf in one.leaves] == [(1024,)] * 600
    back = restore_values(one)
    assert [t.dtype for t in back] == [t.dtype for t in values]
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(back, values))
    assert len({t.untyped_storage().data_ptr() for t in back}) == len(values)  # one allocation per storage
    assert all(t.untyped_storage().nbytes() == t.nbytes and t.stride() == (1,) for t in back)


def test_storages_of_one_dtype_and_trailing_shape_park_as_one_segment_like_a_uniform_list():
    # Issue 38: per-layer K/V of shape (1, heads, n, d) share a buffer back to back; they were one segment per
    # storage (one torch.cat and one split each), only 1-D storages were merged.
    g = torch.Generator().manual_seed(3)
    values = [torch.randn(1, 4, 40, 64, generator=g) for _ in range(60)]  # 40 KiB each, 2.3 MiB in all
    assert sum(t.nbytes for t in values) >= host_buffers.MIN_NBYTES
    parked = park_values(values)
    assert len(parked.buffers) == 1 and len(parked.layout.segments) == 1
    assert torch.equal(parked.buffers[0], torch.cat(values).view(-1).view(torch.uint8))
    back = restore_values(parked)
    assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(back, values))
    assert len({t.untyped_storage().data_ptr() for t in back}) == len(values)


def test_a_plain_tensor_with_a_size_one_dim_and_its_own_strides_restores_as_its_storage():
    # Issue 38: a K/V tensor's batch dim of 1 gave every leaf a rebuild recipe (a size-1 dim may carry any
    # stride), so no park of a transformers cache took the direct path; only odd strides need one.
    kv = [torch.randn(1, 4, 16, 8) for _ in range(4)]
    odd = torch.empty_strided((3, 1), (1, 7)).fill_(2.0)  # contiguous, but not the strides a copy gets
    parked = park_values(kv)
    assert parked.layout.direct and parked.layout.recipe == [None] * 4
    back = restore_values(parked)
    assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(back, kv))
    mixed = park_values([*kv, odd])
    assert not mixed.layout.direct and mixed.layout.recipe[-1] is not None
    again = restore_values(mixed)
    assert again[-1].stride() == (1, 7) and torch.equal(again[-1], odd)


def test_a_parked_copy_reads_its_host_extents_once():
    # Issue 38: the ledger's walk of a parked object and the index of parked copies each re-read every host
    # buffer's storage; they are the copy's own and never change.
    parked = park_values([torch.randn(1, 4, 16, 8) for _ in range(4)])
    first = parked._accounting_extents()
    assert parked._accounting_extents() is first
    assert sum(e.end - e.start for e in first) == parked.nbytes == 4 * 4 * 16 * 8 * 4


def test_a_parked_copy_flattened_and_walked_is_freed_without_the_cycle_collector():
    # Issue 38: a memo of the copy's pytree aux in the copy (the aux holds the copy) made every parked copy a
    # reference cycle: its host buffers stayed held until the cyclic GC ran, and the park/restore loop slowed.
    import gc
    import weakref

    parked = park_values([torch.randn(1, 4, 16, 8) for _ in range(4)])
    jax.tree_util.tree_flatten(parked)
    fs.nbytes_by_device(parked)
    gone = weakref.ref(parked)
    gc.disable()
    try:
        del parked
        assert gone() is None
    finally:
        gc.enable()


def test_a_uniform_list_under_the_shared_threshold_or_with_a_large_storage_keeps_its_runs():
    small = park_values(_tensors(64, 1024, torch.bfloat16))  # 128 KiB: no shared buffer
    assert small.layout.segments and len(small.buffers) == len(small.layout.segments)
    values = [*_tensors(600, 1024), torch.randn(100_000)]  # one storage over a run: it gets a buffer of its own
    parked = park_values(values)
    assert len(parked.buffers) == 2
    back = restore_values(parked)
    assert all(torch.equal(a, b) for a, b in zip(back, values))


def test_a_dense_value_commit_checks_its_payload_once(monkeypatch):
    # Regression (issue 38): `commit` checked the payload, then `_commit_payload` checked it again, per step.
    from functional_state.core import dense_value

    calls = []
    check = dense_value._check_value
    monkeypatch.setattr(dense_value, "_check_value", lambda v, what: calls.append(what) or check(v, what))
    d = DenseValue.create((torch.zeros(2), torch.zeros(3)))
    calls.clear()
    after = d.commit((torch.ones(2), None))
    assert len(calls) == 1 and after.view()[0][0] == 1.0 and after.view()[1] is None
    with pytest.raises(fs.InvalidTypeError, match="list of arrays"):
        d.commit((torch.ones(2), "text"))
    assert d.view()[0][0] == 0.0  # nothing changed


def test_a_list_staged_in_a_dense_value_is_checked_again_at_commit():
    items = [np.zeros(2)]
    staged = DenseValue.create(np.zeros(1)).stage(items)
    items.append("text")  # the staged list changed after its check
    with pytest.raises(fs.InvalidTypeError, match="list of arrays"):
        staged.commit()


def test_a_dense_value_tells_an_array_by_its_class_not_by_one_instance():
    class Loose:  # `shape` and `dtype` set per instance, not defined by the class
        def __init__(self, full: bool):
            if full:
                self.shape, self.dtype = (2,), np.float32

    assert len(DenseValue.create([Loose(True)])) == 1
    with pytest.raises(fs.InvalidTypeError, match="list of arrays"):
        DenseValue.create([Loose(False)])


def test_own_extents_reads_a_parked_copy_as_the_walk_does_and_declines_one_with_children():
    """The ledger reads a parked copy of torch storages without the walk (`accounting.own_extents`): it must
    find what the walk finds, and decline (None) where the walk has children to look into."""

    def walked(x):
        out = []
        accounting.collect_extents(x, out, {}, accounting.WalkReport())
        return sorted(out)

    torch_only = park_values({"a": torch.ones(64), "b": torch.zeros(3, 8)})
    assert sorted(accounting.own_extents(torch_only)) == walked(torch_only) != []
    mixed = park_values({"a": jnp.arange(64.0), "b": torch.ones(64)})
    assert accounting.own_extents(mixed) is None  # its JAX host array is a child the walk reaches
    assert len(walked(mixed)) == 2
    for other in (torch.ones(4), {"a": torch.ones(4)}, np.ones(4)):
        assert accounting.own_extents(other) is None
