"""Session transfer blobs (`functional_state.transfer`): bit-exact round trips without a filesystem, zero-copy
export, and every bad blob refused with a specific error and the target table unchanged."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from test_checkpoint import _fingerprints, _rich_state, _same_leaves

import functional_state as fs
from functional_state import (
    CheckpointError,
    ManagerState,
    SessionExistsError,
    StaleEpochError,
    TransferError,
)
from functional_state.persist import manifest as manifest_module
from functional_state.transfer import SessionBlob, claim, epoch_of, export_session, import_session
from functional_state.transfer.blob import TRANSFER
from helpers import assert_unchanged, snapshot


def test_every_leaf_kind_moves_bit_exact_and_the_next_step_agrees():
    s = _rich_state()
    snap = snapshot(s)
    blob = export_session(s, "a")
    assert_unchanged(s, snap)  # exporting is pure
    t = import_session(ManagerState.create(max_sessions=7), blob)
    _same_leaves(_fingerprints(s, "a"), _fingerprints(t, "a"))
    a, b = fs.lookup(s, "a"), fs.lookup(t, "a")
    assert b.objects["parked_one"].parked and b.objects["ring"].staged is not None
    assert int(a.objects["jax_ring"].head) == int(b.objects["jax_ring"].head)
    assert b._policies == a._policies
    keys = [k for k in fs.stats(s) if k.startswith("nbytes") or k in ("total_nbytes", "parked_nbytes")]
    assert {k: fs.stats(s)[k] for k in keys} == {k: fs.stats(t)[k] for k in keys}
    # views of one storage share one storage again (not one copy per view)
    ring_storage = b.objects["ring"].items[0].untyped_storage().data_ptr()
    assert {v.untyped_storage().data_ptr() for v in b.attrs["views"]} == {ring_storage}
    # the next step: the same commit on both sides gives the same ring
    payload = torch.arange(4, dtype=torch.bfloat16).reshape(2, 2)
    s2, t2 = fs.commit(s, "a", "ring", payload), fs.commit(t, "a", "ring", payload)
    assert [x.tolist() for x in fs.view(s2, "a", "ring")] == [x.tolist() for x in fs.view(t2, "a", "ring")]


def test_export_reads_host_storages_in_place_and_import_owns_its_memory():
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    big = torch.arange(1 << 16, dtype=torch.float32)
    s = fs.put(s, "a", "dense", fs.DenseValue.create([big]))
    blob = export_session(s, "a")
    (buf,) = blob.buffers
    assert buf.ctypes.data == big.untyped_storage().data_ptr()  # a view: no copy on export
    ro = tuple(np.frombuffer(b.tobytes(), np.uint8) for b in blob.buffers)  # read-only, as the object store gives
    assert not ro[0].flags.writeable
    t = import_session(ManagerState.create(), SessionBlob(blob.manifest, ro))
    got = fs.lookup(t, "a").objects["dense"].value[0]
    assert got.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    got.add_(1)  # its own writable memory: neither the exporter's nor the blob's
    assert float(big[0]) == 0.0 and torch.equal(got, big + 1)


def _blob() -> tuple[ManagerState, SessionBlob]:
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "dense", fs.DenseValue.create([torch.arange(64, dtype=torch.float32), np.ones(8)]))
    s = claim(s, "a", model="wm@1")
    return s, export_session(s, "a")


def _resealed(manifest: dict, edit) -> dict:
    """A copy of ``manifest`` changed by ``edit`` and sealed again, as a crafted blob would be."""
    from functional_state.persist.manifest import seal

    manifest = json.loads(json.dumps(manifest))
    edit(manifest)
    manifest.pop("manifest_xxh3_128")
    seal(manifest)
    return manifest


def _bad_blobs(blob: SessionBlob) -> dict[str, tuple[SessionBlob, type, str]]:
    flipped = [b.copy() for b in blob.buffers]
    flipped[0][5] ^= 1
    tampered = {**blob.manifest, "library_version": blob.manifest["library_version"] + "x"}

    def reach_past(m: dict) -> None:  # a tensor view reaching past its storage
        m["sessions"][0]["objects"]["dense"]["fields"]["value"]["items"][0]["shape"] = [1 << 20]

    def other_id(m: dict) -> None:  # the transfer record disagreeing with the session it carries
        m["transfer"]["session_id"] = "b"

    shape = _resealed(blob.manifest, reach_past)
    return {
        "one buffer missing": (SessionBlob(blob.manifest, blob.buffers[:-1]), TransferError, "truncated"),
        "a buffer cut short": (
            SessionBlob(blob.manifest, (blob.buffers[0][:-8], *blob.buffers[1:])),
            TransferError,
            "declared as",
        ),
        "a flipped bit": (SessionBlob(blob.manifest, tuple(flipped)), TransferError, "checksum"),
        "a field edited": (SessionBlob(tampered, blob.buffers), TransferError, "checksum"),
        "a crafted view": (SessionBlob(shape, blob.buffers), TransferError, "within its storage"),
        "a record that disagrees": (
            SessionBlob(_resealed(blob.manifest, other_id), blob.buffers),
            TransferError,
            "disagrees with its manifest",
        ),
        "not a blob": (blob.manifest, fs.InvalidTypeError, "SessionBlob"),  # type: ignore[dict-item]
    }


@pytest.mark.parametrize("case", list(_bad_blobs(_blob()[1])))
def test_a_bad_blob_is_refused_with_a_specific_error_and_the_table_unchanged(case):
    _, blob = _blob()
    bad, error, match = _bad_blobs(blob)[case]
    target, _ = fs.get_or_create(ManagerState.create(), "other")
    snap = snapshot(target)
    with pytest.raises(error, match=match):
        import_session(target, bad)  # type: ignore[arg-type]
    assert_unchanged(target, snap)
    assert issubclass(TransferError, CheckpointError)


def test_another_model_a_live_id_and_a_stale_epoch_are_refused():
    _, blob = _blob()
    target, _ = fs.get_or_create(ManagerState.create(), "a")
    snap = snapshot(target)
    with pytest.raises(SessionExistsError, match="already in the table"):
        import_session(target, blob)
    with pytest.raises(TransferError, match="belongs to model 'wm@1'.*serves 'wm@2'"):
        import_session(target, blob, model="wm@2", as_id="b")
    with pytest.raises(StaleEpochError, match="epoch 1, not 2"):
        import_session(target, blob, epoch=2, as_id="b")
    assert_unchanged(target, snap)
    t = import_session(target, blob, model="wm@1", epoch=1, as_id="b")
    assert epoch_of(t, "b") == 1 and fs.get_attr(t, "b", "functional_state.model") == "wm@1"


def test_a_superseded_owner_cannot_export():
    s, _ = _blob()
    assert epoch_of(s, "a") == 1
    newer = claim(s, "a", above=4)
    assert epoch_of(newer, "a") == 5
    with pytest.raises(StaleEpochError, match="at epoch 1, not 5: this replica's copy is stale"):
        export_session(s, "a", epoch=5)
    assert export_session(newer, "a", epoch=5).epoch == 5
    with pytest.raises(fs.InvalidArgumentError, match="belongs to model 'wm@1'"):
        claim(s, "a", model="wm@2")


def test_engine_kv_travels_through_the_engine_hooks_and_is_refused_without():
    from torch_bridge.harness.paged_engine import ReferenceKVEngine

    engine = ReferenceKVEngine(num_blocks=8, block_size=2, heads=1, head_dim=4)
    ids = engine.allocate(2)
    engine.write(ids[1], 0, torch.ones(1, 4), torch.full((1, 4), 3.0))
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "kv", fs.PagedKVHandle.create(engine.pool, ids))
    with pytest.raises(CheckpointError, match="PagedKVHandle"):
        export_session(s, "a")
    blob = export_session(s, "a", object_hooks={"kv": engine.checkpoint_hooks()})
    other = ReferenceKVEngine(num_blocks=8, block_size=2, heads=1, head_dim=4)
    other.allocate(3)
    t = import_session(ManagerState.create(), blob, object_hooks={"kv": other.checkpoint_hooks()})
    h = fs.lookup(t, "a").objects["kv"]
    assert h.block_ids == (3, 4) and h.pool is other.pool
    for x, y in zip(fs.lookup(s, "a").objects["kv"].view(), h.view()):
        assert torch.equal(x, y)


def test_blob_fields_are_what_the_manifest_says():
    _, blob = _blob()
    assert (blob.session_id, blob.epoch, blob.model) == ("a", 1, "wm@1")
    assert blob.nbytes == 64 * 4 + 8 * 8
    assert "SessionBlob(session_id='a'" in repr(blob)
    assert dataclasses.is_dataclass(blob)


def test_a_blob_sent_as_json_text_and_buffers_comes_back_and_bad_text_is_refused():
    s, blob = _blob()
    wire = SessionBlob.from_parts(blob.manifest_bytes(), list(blob.buffers))
    t = import_session(ManagerState.create(), wire)
    assert fs.view(t, "a", "dense")[0].tolist() == fs.view(s, "a", "dense")[0].tolist()
    for text, match in [
        (b'{"a": 1, "a": 2}', "appears twice"),
        (b"[1, 2]", "not an object"),
        (b"{" * 5000 + b"}" * 5000, "JSON"),
        (b"\xff", "not valid JSON"),
    ]:
        with pytest.raises(TransferError, match=match):
            SessionBlob.from_parts(text, [])
    deep: dict = {}
    node = deep
    for _ in range(2000):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(TransferError, match="nests more than"):
        import_session(ManagerState.create(), SessionBlob({"transfer": deep}, ()))


def test_a_jax_leaf_is_imported_into_memory_of_its_own_and_checked():
    import jax.numpy as jnp

    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "ring", fs.ArrayRing.create(2, (1 << 12,), jnp.float32))
    s = fs.commit(s, "a", "ring", jnp.arange(1 << 12, dtype=jnp.float32))
    blob = export_session(s, "a")
    expected = np.arange(1 << 12, dtype=np.float32)
    # Read-only, as the object store gives.
    ro = tuple(np.frombuffer(b.tobytes(), np.uint8) for b in blob.buffers)
    t = import_session(ManagerState.create(), SessionBlob(blob.manifest, ro))
    assert np.array_equal(np.asarray(fs.view(t, "a", "ring")[0]), expected)
    # Regression: a JAX leaf handed to `jax.device_put` straight from the blob's buffer was adopted by JAX
    # (no copy, where aligned), so writing the buffer after the import changed the imported session.
    rw = tuple(np.array(b) for b in blob.buffers)
    t = import_session(ManagerState.create(), SessionBlob(blob.manifest, rw))
    for b in rw:
        b[:] = 0
    assert np.array_equal(np.asarray(fs.view(t, "a", "ring")[0]), expected)
    for i in range(len(ro)):  # a flipped bit in any JAX leaf is caught, the target unchanged
        flipped = [x.copy() for x in ro]
        flipped[i][-1] ^= 1
        target = ManagerState.create()
        with pytest.raises(TransferError, match="checksum"):
            import_session(target, SessionBlob(blob.manifest, tuple(flipped)))
        assert target.session_ids == ()


def _dense_blob() -> SessionBlob:
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    return export_session(fs.put(s, "a", "d", fs.DenseValue.create(np.zeros(4))), "a")


def _table_kind_without_sessions(m: dict) -> None:
    m.update(kind="table", sessions=[], leaves={})
    m[TRANSFER]["buffers"] = []
    m["table"] = {"max_sessions": 1, "byte_budget": None, "evict_when_full": True, "counters": [0] * 5}


def _table_kind_with_two_sessions(m: dict) -> None:
    m.update(kind="table", sessions=[m["sessions"][0], dict(m["sessions"][0], id="other")])
    m["table"] = {"max_sessions": 4, "byte_budget": None, "evict_when_full": True, "counters": [0] * 5}


def _buffer_keys_of_mixed_types(m: dict) -> None:
    m[TRANSFER]["buffers"] = [1, "leaf0"]


def _transfer_record_not_a_mapping(m: dict) -> None:
    m[TRANSFER] = [1]


@pytest.mark.parametrize(
    "edit",
    [
        _table_kind_without_sessions,
        _table_kind_with_two_sessions,
        _buffer_keys_of_mixed_types,
        _transfer_record_not_a_mapping,
    ],
)
def test_a_resealed_transfer_blob_is_refused_with_a_transfer_error_never_a_raw_one(edit):
    # Found: IndexError (a "table" blob of no sessions), TypeError (buffer keys sorted across types),
    # AssertionError (a transfer record that is not a mapping), and a "table" blob of two sessions imported
    # as its first (ambiguity accepted).
    blob = _dense_blob()
    m = json.loads(blob.manifest_bytes())
    edit(m)
    manifest_module.seal(m)
    state = ManagerState.create()
    with pytest.raises(fs.TransferError):
        import_session(state, SessionBlob.from_parts(json.dumps(m).encode(), blob.buffers))
    assert len(state) == 0


@pytest.mark.parametrize(
    "buf",
    [np.array([object()] * 32, dtype=object), memoryview(np.zeros(64, np.uint8))[::2]],
    ids=["object-array", "non-contiguous-memoryview"],
)
def test_a_blob_buffer_that_is_not_plain_bytes_is_refused_with_a_transfer_error(buf):
    # Found: `_as_bytes` raised a raw TypeError (an object array) or BufferError (a strided memoryview).
    blob = _dense_blob()
    state = ManagerState.create()
    with pytest.raises(fs.TransferError):
        import_session(state, SessionBlob.from_parts(blob.manifest_bytes(), (buf,)))
    assert len(state) == 0
