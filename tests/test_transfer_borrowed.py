"""Copy-on-write imports (`import_session` over read-only blob buffers): torch storages borrow the object
store's memory, `writable` copies them before an in-place write, a write outside it is refused, the bytes are
accounted honestly, and the buffers live as long as a tensor uses them."""

from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import ManagerState, SharedStorageWrittenError
from functional_state.memory.outside_readers import immutable, n_read_outside, read_outside
from functional_state.transfer import SessionBlob, export_session, import_session, importing

N = 1 << 14


def _source() -> ManagerState:
    """A session whose K/V cache a model writes in place (transformers' StaticCache: ``index_copy_``)."""
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    g = torch.Generator().manual_seed(0)
    kv = {"k": torch.randn(4, N // 4, generator=g), "v": torch.randn(N, generator=g).to(torch.bfloat16)}
    s = fs.put(s, "a", "kv", fs.PytreeValue.create(kv))
    s = fs.put(s, "a", "ring", fs.LatentBuffer.create(maxlen=2))
    return fs.commit(s, "a", "ring", torch.arange(64, dtype=torch.float32))


def _store_like(blob: SessionBlob, tmp_path) -> tuple[np.ndarray, ...]:
    """The blob's buffers as the object store hands them out: read-only arrays over sealed, aligned memory
    (here a file mapped read-only: a stray write would fault rather than pass unseen)."""
    out = []
    for i, b in enumerate(blob.buffers):
        path = tmp_path / f"buffer{i}"
        path.write_bytes(b.tobytes())
        with open(path, "rb") as f:
            out.append(np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8))
    return tuple(out)


def _step(state: ManagerState, sid: str) -> tuple[ManagerState, torch.Tensor]:
    """One model step: an in-place cache update through `writable`, then an output read from the cache."""
    state, kv = fs.writable(state, sid, "kv")
    kv["k"].index_copy_(0, torch.tensor([1]), torch.full((1, N // 4), 0.5))
    kv["v"].mul_(2)
    state = fs.commit(state, sid, "kv", kv)
    return state, (kv["k"].sum(1) + kv["v"].float().sum()).clone()


def _storage_ptrs(state: ManagerState, sid: str) -> set[int]:
    kv = fs.view(state, sid, "kv")
    return {t.untyped_storage().data_ptr() for t in kv.values()}


def _inside(ptrs: set[int], buffers: tuple[np.ndarray, ...]) -> bool:
    spans = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in buffers]
    return all(any(lo <= p < hi for lo, hi in spans) for p in ptrs)


def test_an_import_borrows_store_buffers_and_writable_copies_them_before_a_write(tmp_path):
    s = _source()
    blob = export_session(s, "a")
    store = _store_like(blob, tmp_path)
    before = [b.copy() for b in store]
    t = import_session(ManagerState.create(), SessionBlob(blob.manifest, store))
    assert _inside(_storage_ptrs(t, "a"), store)  # no copy: the session's storages are the store's bytes
    assert all(read_outside(x) for x in fs.view(t, "a", "kv").values())
    assert fs.stats(t) == fs.stats(t, exact=True)

    s, expected = _step(s, "a")  # the session continued where it was exported
    t, got = _step(t, "a")
    assert torch.equal(got, expected)  # the next step is bit-identical
    assert not _inside(_storage_ptrs(t, "a"), store)  # `writable` gave the session memory of its own
    assert all(np.array_equal(a, b) for a, b in zip(store, before))  # the store's bytes are untouched
    assert fs.stats(t) == fs.stats(t, exact=True)
    again = import_session(ManagerState.create(), SessionBlob(blob.manifest, store))
    assert all(
        torch.equal(x, y) for x, y in zip(fs.view(again, "a", "kv").values(), fs.view(_source(), "a", "kv").values())
    )  # a second import of the same blob reads the original bytes


def test_a_write_outside_writable_into_a_borrowed_storage_is_refused_as_for_a_fork(monkeypatch):
    blob = export_session(_source(), "a")
    # Memory that can be written, taken for the store's (whose pages a write would reach unseen by the store)
    monkeypatch.setattr(importing, "immutable", lambda buf: True)
    store = tuple(torch.empty(b.nbytes, dtype=torch.uint8).numpy() for b in blob.buffers)
    for dst, src in zip(store, blob.buffers):
        dst[:] = src
    t = import_session(ManagerState.create(), SessionBlob(blob.manifest, store))
    assert all(read_outside(x) for x in fs.view(t, "a", "kv").values())
    fs.view(t, "a", "kv")["k"].add_(1)  # what a model writing outside `writable` does
    with pytest.raises(SharedStorageWrittenError, match="which a transfer blob reads"):
        fs.writable(t, "a", "kv")


def test_writable_buffers_attr_storages_and_copy_true_are_copied(tmp_path):
    s = _source()
    s = fs.set_attr(s, "a", "counter", torch.zeros(64))
    blob = export_session(s, "a")
    store = _store_like(blob, tmp_path)
    private = import_session(ManagerState.create(), SessionBlob(blob.manifest, store), copy=True)
    assert not _inside(_storage_ptrs(private, "a"), store)
    assert not any(read_outside(x) for x in fs.view(private, "a", "kv").values())

    t = import_session(ManagerState.create(), SessionBlob(blob.manifest, store))
    counter = fs.lookup(t, "a").attrs["counter"]
    assert not read_outside(counter) and not _inside({counter.untyped_storage().data_ptr()}, store)

    rw = tuple(np.array(b) for b in blob.buffers)  # writable: the caller may change them after the import
    assert not any(immutable(b) for b in rw)
    t = import_session(ManagerState.create(), SessionBlob(blob.manifest, rw))
    for b in rw:
        b[:] = 0
    assert torch.equal(fs.view(t, "a", "kv")["k"], fs.view(s, "a", "kv")["k"])


def test_borrowed_buffers_live_as_long_as_the_session_and_no_longer(tmp_path):
    gc.collect()
    n = n_read_outside()
    blob = export_session(_source(), "a")
    expected = {k: v.clone() for k, v in fs.view(_source(), "a", "kv").items()}
    store = _store_like(blob, tmp_path)
    t = import_session(ManagerState.create(), SessionBlob(blob.manifest, store))
    del store, blob
    gc.collect()
    assert n_read_outside() == n + 3  # kv's two storages and the ring's one
    kv = fs.view(t, "a", "kv")
    assert all(torch.equal(kv[k], expected[k]) for k in expected)  # the tensors keep the buffers alive
    del kv
    t, _ = fs.drop_session(t, "a")
    del t
    gc.collect()
    assert n_read_outside() == n  # forgotten with the session


@pytest.mark.parametrize(
    ("buf", "expected"),
    [
        (np.frombuffer(b"abcdefgh", np.uint8), True),
        (np.frombuffer(memoryview(b"abcdefgh"), np.uint8), True),
        (np.frombuffer(bytearray(8), np.uint8), False),
        (np.frombuffer(memoryview(bytearray(8)).toreadonly(), np.uint8), False),
        (np.zeros(8, np.uint8), False),
    ],
)
def test_only_memory_nobody_can_write_is_immutable(buf, expected):
    assert immutable(buf) is expected
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False  # (its owner may flag it writable again)
    assert not immutable(ro) and not immutable(ro[2:])


def test_an_exported_blob_stays_a_snapshot_while_the_session_is_written_in_place():
    s = _source()
    exported = {k: v.clone() for k, v in fs.view(s, "a", "kv").items()}
    blob = export_session(s, "a")  # (views of the session's storages: no copy)
    assert _inside(_storage_ptrs(s, "a"), blob.buffers)
    s, _ = _step(s, "a")  # the session stepped before the blob was sent: `writable` copied what it wrote
    t = import_session(ManagerState.create(), blob)  # (its checksums hold: the blob still has what it exported)
    assert all(torch.equal(fs.view(t, "a", "kv")[k], exported[k]) for k in exported)
    assert not torch.equal(fs.view(s, "a", "kv")["v"], exported["v"])
    assert fs.stats(s) == fs.stats(s, exact=True)

    blob = export_session(s, "a")
    fs.view(s, "a", "kv")["v"].add_(1)  # outside `writable`, while the blob is alive: it would change the blob
    with pytest.raises(SharedStorageWrittenError, match="which a transfer blob reads"):
        fs.writable(s, "a", "kv")

    s = _source()
    blob = export_session(s, "a")
    del blob  # (sent, say): nothing reads the storages outside the table any more
    gc.collect()
    before = _storage_ptrs(s, "a")
    s, _ = _step(s, "a")
    assert _storage_ptrs(s, "a") == before  # written in place, nothing copied


def test_a_storage_a_jax_alias_views_is_copied_never_borrowed(tmp_path):
    from torch_bridge import to_jax

    s = _source()
    aliased = torch.arange(1 << 14, dtype=torch.float32)
    s = fs.put(s, "a", "alias", fs.DenseValue.create([to_jax(aliased)]))
    blob = export_session(s, "a")
    store = _store_like(blob, tmp_path)
    t = import_session(ManagerState.create(), SessionBlob(blob.manifest, store))
    alias = fs.view(t, "a", "alias")[0]
    assert np.array_equal(np.asarray(alias), aliased.numpy())
    # (a step may donate the alias: XLA must never be handed the store's memory as a buffer to write)
    assert not _inside({np.asarray(alias).ctypes.data}, store)
    assert all(read_outside(x) for x in fs.view(t, "a", "kv").values())  # the rest is still borrowed
    assert fs.stats(t) == fs.stats(t, exact=True)


def test_a_storage_stays_read_outside_while_any_of_its_blobs_lives():
    s = _source()
    k = fs.view(s, "a", "kv")["k"]
    first, second = export_session(s, "a"), export_session(s, "a")
    assert read_outside(k)
    del first
    gc.collect()
    assert read_outside(k)  # (the second blob still reads it)
    del second
    gc.collect()
    assert not read_outside(k)
