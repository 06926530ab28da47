from __future__ import annotations

import collections
import dataclasses
import gc
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import (
    LatentBuffer,
    ManagerState,
    SessionState,
    SessionStateManager,
    nbytes_by_device,
    register_alias,
)
from functional_state.memory import accounting, aliases
from functional_state.memory.accounting import _torch_device_key, jax_device_pool, walk
from torch_bridge import to_jax, wrap


def test_torch_slice_reports_its_whole_storage():
    big = torch.zeros(1000, dtype=torch.float32)
    assert nbytes_by_device(big[10:12]) == {"cpu": 4000}
    assert nbytes_by_device(big.narrow(0, 0, 1)) == {"cpu": 4000}


def test_views_of_one_storage_count_once():
    big = torch.zeros(64, 64)
    assert nbytes_by_device(big, big.t(), big[3], big[:, 1:5], big.view(-1)) == {"cpu": 64 * 64 * 4}


def test_numpy_views_and_owner():
    a = np.zeros(1000, np.uint8)
    assert nbytes_by_device(a[::7]) == {"cpu": 1000}
    assert nbytes_by_device([a[:10], a[500:], a.reshape(10, 100).T]) == {"cpu": 1000}


def test_numpy_over_torch_belongs_to_the_torch_storage():
    t = torch.zeros(256, dtype=torch.float64)
    n = t.numpy()[5:9]
    assert nbytes_by_device(n) == {"cpu": 2048}
    assert nbytes_by_device(n, t, t.numpy()) == {"cpu": 2048}


def test_jax_alias_of_torch_counts_once_whole_and_sliced():
    t = torch.zeros(64, 64)  # 16 KiB
    whole = jax.dlpack.from_dlpack(t)
    rows = jax.dlpack.from_dlpack(t[16:32])  # aliases without the bridge: lies inside t's storage
    assert rows.unsafe_buffer_pointer() == t[16:32].data_ptr()
    assert nbytes_by_device(t, whole, rows) == {"cpu": 16384}
    assert nbytes_by_device(rows) == {"cpu": 16 * 64 * 4}  # alone, a raw alias only knows its own bytes


def test_bridge_alias_of_a_slice_reports_the_storage_it_keeps_alive():
    t = torch.zeros(64, 64)
    rows = to_jax(t[16:32])
    del t  # JAX now keeps the whole storage alive; the accounting must say so
    assert nbytes_by_device(rows) == {"cpu": 16384}


def test_wrap_keeps_padded_kv_by_reference_and_counts_the_padded_allocation():
    padded = torch.zeros(2, 128, 64, dtype=torch.bfloat16)  # 32 KiB
    k = wrap(padded[:, :77])
    assert isinstance(k, torch.Tensor)
    assert nbytes_by_device(k) == {"cpu": 32768}


def test_scalars_strings_none_count_zero():
    assert nbytes_by_device(1, 2.5, "text", b"bytes", None, True, np.float32(3)) == {}


def test_nested_containers_and_dataclasses():
    @dataclasses.dataclass
    class Holder:
        x: object
        y: object

    a, b, c = np.zeros(100, np.uint8), torch.zeros(10), jnp.zeros(8, jnp.float32)
    tree = {"l": [a, (b, {"deep": [c]})], "h": Holder(a, frozenset()), "s": {1, 2}}
    assert nbytes_by_device(tree) == {"cpu": 100 + 40 + 32}


def test_cycles_are_walked_once():
    a = np.zeros(64, np.uint8)
    cyclic = [a]
    cyclic.append(cyclic)
    d = {"self": None, "x": a}
    d["self"] = d
    assert nbytes_by_device(cyclic, d) == {"cpu": 64}


def test_plain_objects_deques_views_and_namespaces_are_walked():
    # Regression: a deque of tensors, dict views, namespaces and plain objects in an attr counted 0 bytes.
    class Plain:
        def __init__(self):
            self.hidden = np.zeros(10)  # 80 B

    class Slotted:
        __slots__ = ("a", "b")

        def __init__(self):
            self.a = torch.zeros(5)  # 20 B
            self.b = None

    d = {"k": np.zeros(3, np.uint8)}  # 3 B
    roots = [
        collections.deque([torch.zeros(4)], maxlen=3),  # 16 B
        d.values(),
        d.items(),
        d.keys(),
        types.SimpleNamespace(x=np.zeros(7, np.uint8)),  # 7 B
        Plain(),
        Slotted(),
        print,
        object(),
        np,
    ]
    assert nbytes_by_device(*roots) == {"cpu": 16 + 3 + 7 + 80 + 20}


def test_what_cannot_be_read_is_reported_never_raised():
    class Hostile:
        @property
        def __class__(self):
            raise RuntimeError("boom")

    class BadMapping(collections.abc.Mapping):
        def __getitem__(self, k):
            raise RuntimeError("boom")

        def __iter__(self):
            raise RuntimeError("boom")

        def __len__(self):
            return 1

    totals, report = walk([Hostile(), BadMapping(), np.zeros(4, np.uint8)])
    assert totals == {"cpu": 4}
    assert report.unaccounted_objects == 2
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.set_attr(fs.set_attr(state, "a", "bad", BadMapping()), "a", "ok", np.zeros(8, np.uint8))
    s = fs.stats(state)  # never crashes
    assert s["unaccounted_objects"] == 1 and s["total_nbytes"] == 8


def test_deep_object_chains_are_bounded_and_reported():
    class Link:
        def __init__(self, nxt):
            self.nxt = nxt
            self.payload = np.zeros(1, np.uint8)

    chain = None
    for _ in range(100):
        chain = Link(chain)
    totals, report = walk(chain)
    assert 0 < totals["cpu"] < 100 and report.unaccounted_objects == 1


def test_deleted_jax_array_counts_zero_and_is_reported():
    a = jnp.ones(1024)
    a.delete()
    totals, report = walk(a)
    assert totals == {} and report.deleted_arrays == 1


def test_alias_registry_lock_is_reentrant():
    # The weakref callback that forgets an alias takes the registry lock; a collection triggered while the
    # lock is held (inside register_alias) runs that callback on the same thread.
    assert isinstance(aliases._ALIASES_LOCK, type(threading.RLock()))
    with aliases._ALIASES_LOCK:
        a = jnp.ones(4)
        register_alias(a, np.zeros(4))
        del a
        gc.collect()


def test_roots_share_one_dedup_scope():
    t = torch.zeros(100)
    assert nbytes_by_device([t], {"again": t[5:]}) == {"cpu": 400}


def test_shared_tensor_across_sessions_counts_once():
    shared = torch.zeros(1024)  # 4 KiB
    state = ManagerState.create()
    for sid in ("a", "b", "c"):
        state, _ = fs.get_or_create(state, sid)
        state = fs.set_attr(state, sid, "prompt", shared[: 10 * (ord(sid) - 96)])
    s = fs.stats(state)
    assert s["nbytes:cpu"] == 4096 and s["total_nbytes"] == 4096


def test_attr_object_alias_counts_once_in_a_session():
    t = torch.zeros(256)
    session = SessionState.empty().put("buf", LatentBuffer.create().commit(t)).set_attr("alias", t[1:])
    assert session.nbytes_by_device() == {"cpu": 1024}


def test_session_counts_staged_and_committed_and_attrs():
    session = (
        SessionState.empty()
        .put("buf", LatentBuffer.create().commit(np.zeros(10, np.uint8)).stage(np.zeros(20, np.uint8)))
        .set_attr("feat_map", [np.zeros(30, np.uint8), None, [np.zeros(40, np.uint8)]])
    )
    assert session.nbytes_by_device() == {"cpu": 100}


def test_evict_returns_exactly_what_leaves_the_accounting():
    m = SessionStateManager()
    h = m.get_or_create_session("s")
    t = torch.zeros(1000, dtype=torch.uint8)
    h.put("a", LatentBuffer.create().commit(t).commit(np.zeros(24, np.uint8)))
    h.put("b", LatentBuffer.create().commit(t[100:]))  # the same storage, held by another object
    before = m.stats()["total_nbytes"]
    freed = h.evict("a")
    assert freed == 24  # t stays alive through "b"
    assert m.stats()["total_nbytes"] == before - freed
    freed = h.evict("b")
    assert freed == 1000 and m.stats()["total_nbytes"] == 0


def test_stats_splits_devices_with_sorted_keys():
    fake = types.SimpleNamespace
    assert jax_device_pool(fake(platform="cpu", id=5)) == "cpu"
    assert jax_device_pool(fake(platform="gpu", id=7, local_hardware_id=1)) == "cuda:1"
    assert jax_device_pool(fake(platform="gpu", id=0, local_hardware_id=0)) == "cuda:0"
    assert jax_device_pool(fake(platform="tpu", id=3)) == "tpu:3"
    assert _torch_device_key(torch.device("cuda", 2)) == "cuda:2"
    assert _torch_device_key(torch.device("cpu")) == "cpu"
    assert _torch_device_key(torch.device("meta")) is None
    assert nbytes_by_device(torch.zeros(10, device="meta")) == {}


class _Bag:
    """A user pytree whose flatten builds a fresh list every time (a temporary the walk must keep alive)."""

    def __init__(self, arrays):
        self.arrays = arrays


jax.tree_util.register_pytree_node(_Bag, lambda b: ([list(b.arrays)], None), lambda _, c: _Bag(c[0]))


def test_temporaries_built_by_flatten_never_hide_later_buffers():
    # Regression: the walk deduplicated by id() alone, so a temporary list freed mid-walk could hand its id
    # to the next bag's temporary list, which was then skipped and its arrays went uncounted.
    bags = [_Bag([np.zeros(100 + i, np.uint8)]) for i in range(200)]
    assert nbytes_by_device(bags) == {"cpu": sum(100 + i for i in range(200))}


def test_a_user_donation_outside_the_library_shows_in_exact_stats():
    # A user's own `jax.jit(donate_argnums=...)` deleted arrays a session holds (an object's, a closed
    # attr's). The default reads kept totals and checks no array (issue 24: that check made stats() O(arrays
    # held), 263 ms at 100k sessions): it keeps the bytes they were counted with. The exact walk finds them.
    import jax
    import jax.numpy as jnp

    state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    state = fs.put(state, "a", "ring", fs.ArrayRing.create(2, (8,)))
    state = fs.step(state, "a", "ring", fs.ArrayRing.commit, jnp.ones(8))
    state = fs.set_attr(state, "a", "cond", jnp.zeros(4))
    assert fs.stats(state) == fs.stats(state, exact=True) and fs.stats(state)["deleted_arrays"] == 0
    before = fs.stats(state)["total_nbytes"]
    ring_bytes = fs.lookup(state, "a").get("ring").storage.nbytes
    jax.jit(lambda x: x * 2, donate_argnums=0)(fs.lookup(state, "a").get("ring").storage)
    jax.jit(lambda x: x * 2, donate_argnums=0)(fs.get_attr(state, "a", "cond"))
    fast, exact = fs.stats(state), fs.stats(state, exact=True)
    assert exact["deleted_arrays"] == 2 and exact["total_nbytes"] == before - 4 * 4 - ring_bytes
    assert fast["deleted_arrays"] == 0 and fast["total_nbytes"] == before  # what the table saw


def test_a_numpy_items_address_is_read_the_same_way_for_every_layout():
    # The fast address read (a ctypes view over the buffer) must agree with the array interface, and the
    # arrays it cannot export (read-only, Fortran order) must still be counted by their allocation.
    plain = np.zeros(64, np.float32)
    readonly = np.zeros(64, np.float32)
    readonly.flags.writeable = False
    fortran = np.zeros((8, 8), np.float32, order="F")
    for a in (plain, readonly, fortran):
        out: list = []
        accounting.numpy_extents(a, out)
        start = a.__array_interface__["data"][0]
        assert out == [("cpu", start, start + a.nbytes)]
    shared = fs.LatentBuffer.create(maxlen=4).commit(readonly).commit(readonly[2:])
    assert fs.SessionState.empty().put("buf", shared).nbytes_by_device() == {"cpu": 256}


KIB = 1024


def _cpu(stats: dict) -> int:
    return stats.get("nbytes:cpu", 0)


@pytest.mark.parametrize("wrap", [lambda a: memoryview(a), lambda a: [memoryview(a)], lambda a: memoryview(a)[16:]])
def test_a_memoryview_of_an_array_counts_the_array_and_is_refused_over_the_budget(wrap) -> None:
    # A memoryview was one of the buffer-free types: a 1 MiB numpy array behind one counted zero in `stats`
    # (kept and exact alike), so an attr holding it was admitted under a 4 KiB budget.
    array = np.ones(1 << 20, np.uint8)
    assert fs.nbytes_by_device(wrap(array)) == {"cpu": 1 << 20}
    assert fs.nbytes_by_device(memoryview(b"\0" * 4096), memoryview(bytearray(64))) == {}  # (Python's own: zero)
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    s = fs.set_attr(s, "a", "m", wrap(array))
    assert _cpu(fs.stats(s)) == _cpu(fs.stats(s, exact=True)) == 1 << 20
    m = fs.SessionStateManager(byte_budget={"cpu": 4 * KIB})
    h = m.get_or_create_session("a")
    with pytest.raises(fs.BudgetExceededError):
        h.set_attr("m", wrap(array))
    assert _cpu(m.stats(exact=True)) == 0


def test_a_released_memoryview_holds_nothing() -> None:
    view = memoryview(np.ones(64, np.uint8))
    view.release()
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    s = fs.set_attr(s, "a", "m", view)
    assert fs.stats(s) == fs.stats(s, exact=True) and _cpu(fs.stats(s)) == 0


def test_an_object_array_counts_the_arrays_it_holds() -> None:
    # Its pointer buffer alone was counted (16 B for two slots): a 1 MiB array inside counted nothing.
    holder = np.empty(2, dtype=object)
    holder[0], holder[1] = np.ones(1 << 20, np.uint8), "text"
    assert fs.nbytes_by_device(holder) == {"cpu": (1 << 20) + holder.nbytes}
    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    s = fs.set_attr(s, "a", "o", holder)
    assert _cpu(fs.stats(s)) == _cpu(fs.stats(s, exact=True)) == (1 << 20) + holder.nbytes
    m = fs.SessionStateManager(byte_budget={"cpu": 4 * KIB})
    with pytest.raises(fs.BudgetExceededError):
        m.get_or_create_session("a").set_attr("o", holder)
