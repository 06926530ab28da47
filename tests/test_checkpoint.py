"""Checkpoints on orbax: bit-exact round trips, atomic and verified files, resume and migration across
processes, a session sharded across two JAX controllers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import CheckpointError, ManagerState, SessionExistsError, SessionStateManager
from helpers import assert_unchanged, snapshot
from helpers import damage as damage_file

ROOT = Path(__file__).resolve().parents[1]


def _rich_state() -> ManagerState:
    """One session with every leaf kind the issue names."""
    s, _ = fs.get_or_create(ManagerState.create(max_sessions=7), "a")
    storage = torch.arange(40, dtype=torch.bfloat16)
    ring = fs.LatentBuffer.create(maxlen=3)
    for i in range(5):  # a ring that wrapped: order matters
        ring = ring.commit(storage[i * 4 : (i + 1) * 4].reshape(2, 2))
    s = fs.put(s, "a", "ring", ring.stage(storage[30:34]))  # a staged payload
    jring = fs.ArrayRing.create(3, (2,), jnp.float32)
    for v in range(4):
        jring = jring.commit(jnp.full(2, float(v)))  # head and size mid-ring
    s = fs.put(s, "a", "jax_ring", jring)
    dense = [torch.arange(6, dtype=torch.int64), np.arange(3, dtype=np.float64), jnp.arange(3, dtype=jnp.bfloat16)]
    s = fs.put(s, "a", "dense", fs.DenseValue.create(dense))
    s = fs.put(s, "a", "parked_one", fs.DenseValue.create([torch.full((4,), 7.0), jnp.ones(2, jnp.int32)]))
    s, _ = fs.park(s, "a", "parked_one")
    s = fs.set_attr(s, "a", "views", [storage[:2], storage[10:12]])  # views of the ring's storage
    s = fs.set_attr(
        s, "a", "misc", {"n": 3, "f": float("inf"), "s": "x", "b": b"\x00\x01", "none": None, "t": (1, 2.5)}
    )
    s = fs.set_attr(s, "a", "pending", [], on_fork="copy_container")
    s = fs.set_attr(s, "a", "i64", torch.tensor([2**40], dtype=torch.int64))  # int64 with x64 off
    return s


def _fingerprints(state: ManagerState, sid: str) -> list:
    """Every leaf's bytes (parked objects restored first), dtype and shape, in tree order."""
    session = fs.lookup(state, sid)
    for name, obj in session.objects.items():
        if obj.parked:
            state, _ = fs.restore(state, sid, name)
    return snapshot(fs.lookup(state, sid))[1]


def _same_leaves(a: list, b: list) -> None:
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
        if x[0] == "torch":  # storage pointers differ; kind, dtype, shape and bytes must not
            assert (x[0], x[1], x[2], x[4]) == (y[0], y[1], y[2], y[4]), path
        else:
            assert x == y, path


def test_every_leaf_kind_round_trips_bit_exact_and_stats_agree(tmp_path):
    s = _rich_state()
    snap = snapshot(s)
    fs.save_session(s, "a", tmp_path / "ck")
    assert_unchanged(s, snap)  # saving is pure
    t = fs.load_session(ManagerState.create(max_sessions=7), "a", tmp_path / "ck")
    _same_leaves(_fingerprints(s, "a"), _fingerprints(t, "a"))
    a, b = fs.lookup(s, "a"), fs.lookup(t, "a")
    assert b.objects["parked_one"].parked and b.objects["ring"].staged is not None
    assert [x.tolist() for x in b.objects["ring"].items] == [x.tolist() for x in a.objects["ring"].items]
    assert int(b.objects["jax_ring"].head) == int(a.objects["jax_ring"].head)
    assert b.attrs["i64"].dtype == torch.int64 and int(b.attrs["i64"]) == 2**40
    assert b.attrs["views"][0].untyped_storage().data_ptr() == b.objects["ring"].items[0].untyped_storage().data_ptr()
    assert isinstance(b.objects["dense"].value[2], jax.Array) and b.objects["dense"].value[2].dtype == jnp.bfloat16
    assert isinstance(b.objects["dense"].value[1], np.ndarray)
    assert b._policies == a._policies  # fork policies come back
    keys = [k for k in fs.stats(s) if k.startswith("nbytes") or k in ("total_nbytes", "parked_nbytes")]
    assert {k: fs.stats(s)[k] for k in keys} == {k: fs.stats(t)[k] for k in keys}


def test_the_whole_table_keeps_its_order_counters_and_config(tmp_path):
    manager = SessionStateManager(max_sessions=5, byte_budget="1GiB")
    for sid in ("x", "y", "z"):
        manager.get_or_create_session(sid).put("buf", fs.LatentBuffer.create().commit(torch.ones(3)))
    manager.get_session("x")  # x becomes the most recent
    manager.save(tmp_path / "table")
    other = SessionStateManager()
    other.load(tmp_path / "table")
    a, b = manager.state, other.state
    assert b.session_ids == a.session_ids == ("y", "z", "x")
    assert (b.hits, b.misses, b.evictions, b.max_sessions, b.byte_budget) == (
        a.hits,
        a.misses,
        a.evictions,
        a.max_sessions,
        a.byte_budget,
    )


def test_adapters_round_trip_with_their_bespoke_surface(tmp_path):
    from torch_bridge.adapters import Cosmos3StateAdapter, DreamZeroStateAdapter
    from torch_bridge.harness.cosmos3_bespoke import (
        Cosmos3Shapes,
        Cosmos3TransformerCache,
        build_freqs_gen,
        encode_und_kv,
    )

    manager = SessionStateManager()
    dz = DreamZeroStateAdapter("robot", manager, vae_encoder_window=2)
    for i in range(3):
        dz.accumulate_frames(torch.full((8, 8, 3), i, dtype=torch.uint8))
        dz.append_vae_encoder_chunk(torch.full((1, 4, 1, 2, 2), float(i), dtype=torch.bfloat16))
    dz.vae_enc_feat_map = [torch.zeros(4), torch.ones(4)]
    dz.call_count, dz.language = 5, torch.arange(3)
    shapes = Cosmos3Shapes(num_layers=2)
    transformer = Cosmos3TransformerCache()
    transformer.cached_kv, transformer.freqs_gen = encode_und_kv(shapes, seed=1), build_freqs_gen(shapes)
    cosmos = Cosmos3StateAdapter("req", manager)
    cosmos.capture_from_transformer(transformer, is_negative=False)
    for sid in ("robot", "req"):
        manager.save_session(sid, tmp_path / sid)
    fresh = SessionStateManager()
    for sid in ("robot", "req"):
        fresh.load_session(sid, tmp_path / sid)
    dz2 = DreamZeroStateAdapter("robot", fresh, vae_encoder_window=2)
    assert torch.equal(dz2.observation_latents(2), dz.observation_latents(2))
    assert dz2.call_count == 5 and torch.equal(dz2.language, dz.language)
    assert [t.tolist() for t in dz2.vae_enc_feat_map] == [[0.0] * 4, [1.0] * 4]
    assert dz2.component_nbytes() == dz.component_nbytes()
    restored = Cosmos3TransformerCache()
    Cosmos3StateAdapter("req", fresh).load_into_transformer(restored, is_negative=False)
    for (k1, v1), (k2, v2) in zip(transformer.cached_kv, restored.cached_kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


# --- atomic, verified, and every bad input named --------------------------------------------------------


def test_an_asynchronous_save_captures_the_values_when_called(tmp_path):
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    t = torch.zeros(1 << 20)
    s = fs.put(s, "a", "big", fs.DenseValue.create(t))
    handle = fs.save_session(s, "a", tmp_path / "ck", asynchronous=True)
    t.fill_(1.0)  # a model writing in place after the call: the checkpoint holds what was there
    assert handle.wait_until_finished() == handle.path  # orbax's name for `wait`
    assert handle.done()
    loaded = fs.load_session(ManagerState.create(), "a", tmp_path / "ck")
    assert float(fs.lookup(loaded, "a").objects["big"].value.sum()) == 0.0


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ck"
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    fs.save_session(fs.put(s, "a", "v", fs.DenseValue.create(torch.full((4,), 1.0))), "a", path)
    script = textwrap.dedent(
        f"""
        import torch, functional_state as fs
        s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
        s = fs.put(s, "a", "v", fs.DenseValue.create(torch.full((64 << 20,), 2.0)))
        print("saving", flush=True)
        fs.save_session(s, "a", {str(path)!r})
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "saving"
    time.sleep(0.3)
    proc.kill()  # mid-write (or just after it: either checkpoint is whole)
    proc.wait()
    (path / "7.orbax-checkpoint-tmp-1").mkdir(exist_ok=True)  # and a leftover partial step
    loaded = fs.lookup(fs.load_session(ManagerState.create(), "a", path), "a").objects["v"].value
    assert loaded.shape in ((4,), (64 << 20,)) and float(loaded[0]) in (1.0, 2.0)


def _saved(tmp_path) -> tuple[ManagerState, Path]:
    s = _rich_state()
    path = tmp_path / "ck"
    fs.save_session(s, "a", path)
    return s, path


def _manifest_file(path: Path) -> Path:
    return next(path.glob("[0-9]*")) / "manifest" / "metadata"


def _rewrite_manifest(path: Path, manifest: dict, *, seal: bool) -> None:
    """Write ``manifest`` over the checkpoint's: resealed with its checksum (to reach the checks past it), or
    without one, as versions before the manifest checksum wrote it."""
    manifest = dict(manifest)
    manifest.pop(fs.persist.manifest._SEAL, None)
    if seal:
        fs.persist.manifest.seal(manifest)
    _manifest_file(path).write_text(json.dumps(manifest))


def _largest_data_file(path: Path) -> Path:
    """The file holding the array data orbax reads (its merged OCDBT store: ``<step>/arrays/d/*``)."""
    files = [p for p in path.glob("[0-9]*/arrays/d/*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_checkpoint_is_refused_and_nothing_changes(tmp_path, damage, threads, monkeypatch):
    if threads:  # checksums verified on threads, as for a large checkpoint
        monkeypatch.setattr(fs.persist.manifest, "_PARALLEL_MIN", 0)
    _, path = _saved(tmp_path)
    target = _largest_data_file(path)
    damage_file(target, damage)
    state = ManagerState.create()
    snap = snapshot(state)
    with pytest.raises(CheckpointError, match="damaged|checksum|corrupted"):
        fs.load_session(state, "a", path)
    assert_unchanged(state, snap)


def test_bad_paths_layouts_attrs_and_ids_each_get_a_specific_error(tmp_path):
    s, path = _saved(tmp_path)
    empty = ManagerState.create()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        fs.load_session(empty, "a", tmp_path / "plain")
    with pytest.raises(CheckpointError, match="does not exist"):
        fs.load_session(empty, "a", tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="non-empty directory that holds no checkpoint"):
        fs.save_session(s, "a", tmp_path / "plain")
    with pytest.raises(CheckpointError, match=r"holds sessions \['a'\], not 'b'"):
        fs.load_session(empty, "b", path)
    taken, _ = fs.get_or_create(empty, "a")
    snap = snapshot(taken)
    with pytest.raises(SessionExistsError, match="already in the table"):
        fs.load_session(taken, "a", path)
    assert_unchanged(taken, snap)
    replaced = fs.load_session(taken, "a", path, replace=True)
    assert "ring" in fs.lookup(replaced, "a").objects
    odd = fs.set_attr(s, "a", "handle", object())
    with pytest.raises(CheckpointError, match=r"attr 'handle' is a builtins.object"):
        fs.save_session(odd, "a", tmp_path / "never")
    assert not (tmp_path / "never").exists()  # refused before anything was written
    hooked = fs.save_session(odd, "a", tmp_path / "hooked", attr_hooks={"handle": (lambda o: "exported", lambda v: v)})
    assert hooked.done()
    with pytest.raises(CheckpointError, match="export hook"):
        fs.load_session(empty, "a", tmp_path / "hooked")
    meta = _manifest_file(path)
    manifest = json.loads(meta.read_text())
    good = meta.read_text()
    manifest["leaves"]["leaf2"]["xxh3_128"] = "0" * 32  # the bytes no longer match what the manifest promises
    _rewrite_manifest(path, manifest, seal=True)
    with pytest.raises(CheckpointError, match=r"leaf 'leaf2' \(.*\) fails its checksum"):
        fs.load_session(empty, "a", path)
    manifest = json.loads(good)
    manifest["layout"] = 99
    meta.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="layout 99"):
        fs.load_session(empty, "a", path)


def test_a_checkpoint_with_sha256_checksums_as_earlier_versions_wrote_still_verifies(tmp_path):
    import hashlib

    t = torch.arange(64, dtype=torch.float32)
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    fs.save_session(fs.put(s, "a", "v", fs.DenseValue.create(t)), "a", tmp_path / "ck")
    manifest = json.loads(_manifest_file(tmp_path / "ck").read_text())
    ((_, info),) = manifest["leaves"].items()  # the tensor's storage, the one leaf
    del info["xxh3_128"]
    info["sha256"] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    _rewrite_manifest(tmp_path / "ck", manifest, seal=False)  # those versions wrote no manifest checksum
    assert torch.equal(fs.view(fs.load_session(ManagerState.create(), "a", tmp_path / "ck"), "a", "v"), t)
    info["sha256"] = hashlib.sha256(b"other bytes").hexdigest()
    _rewrite_manifest(tmp_path / "ck", manifest, seal=False)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        fs.load_session(ManagerState.create(), "a", tmp_path / "ck")


def test_engine_kv_is_refused_without_hooks_and_travels_with_them(tmp_path):
    from torch_bridge.harness.paged_engine import ReferenceKVEngine

    engine = ReferenceKVEngine(num_blocks=8, block_size=2, heads=1, head_dim=4)
    ids = engine.allocate(2)
    engine.write(ids[1], 0, torch.ones(1, 4), torch.full((1, 4), 3.0))
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "kv", fs.PagedKVHandle.create(engine.pool, ids))
    with pytest.raises(CheckpointError, match="PagedKVHandle"):
        fs.save_session(s, "a", tmp_path / "no")
    hooks = {"object_hooks": {"kv": engine.checkpoint_hooks()}}
    fs.save_session(s, "a", tmp_path / "kv", **hooks)
    other = ReferenceKVEngine(num_blocks=8, block_size=2, heads=1, head_dim=4)
    other.allocate(3)  # another worker's engine, partly in use: the session gets other block ids
    t = fs.load_session(ManagerState.create(), "a", tmp_path / "kv", object_hooks={"kv": other.checkpoint_hooks()})
    h = fs.lookup(t, "a").objects["kv"]
    assert h.block_ids == (3, 4) and h.pool is other.pool
    for x, y in zip(fs.lookup(s, "a").objects["kv"].view(), h.view()):
        assert torch.equal(x, y)


def _kv_session(engine, sid: str, state: ManagerState | None = None) -> ManagerState:
    """A session holding engine KV and an attr that only a hook can save."""
    s, _ = fs.get_or_create(state if state is not None else ManagerState.create(), sid)
    s = fs.put(s, sid, "kv", fs.PagedKVHandle.create(engine.pool, engine.allocate(2)))
    return fs.set_attr(s, sid, "opaque", object())


def test_a_load_that_fails_hands_the_kv_blocks_it_took_back_to_the_engine(tmp_path):
    from functional_state import BudgetExceededError
    from torch_bridge.harness.paged_engine import ReferenceKVEngine

    source = ReferenceKVEngine(num_blocks=8, block_size=2, heads=1, head_dim=4)
    s = _kv_session(source, "b", _kv_session(source, "a"))
    save_hooks = {"object_hooks": {"kv": source.checkpoint_hooks()}, "attr_hooks": {"opaque": (str, lambda v: v)}}
    fs.save_session(s, "a", tmp_path / "one", **save_hooks)
    fs.save(s, tmp_path / "table", **save_hooks)
    engine = ReferenceKVEngine(num_blocks=8, block_size=2, heads=1, head_dim=4)
    free = engine.free_block_count()
    only_kv = {"object_hooks": {"kv": engine.checkpoint_hooks()}}  # the attr hook is missing: the load fails
    with pytest.raises(CheckpointError, match="attr 'opaque'"):
        fs.load_session(ManagerState.create(), "a", tmp_path / "one", **only_kv)
    assert engine.free_block_count() == free  # the blocks the KV import took came back
    with pytest.raises(CheckpointError, match="attr 'opaque'"):
        fs.load(tmp_path / "table", **only_kv)
    assert engine.free_block_count() == free
    manager = SessionStateManager(byte_budget={"*": 8})  # smaller than the session: refused at install
    with pytest.raises(BudgetExceededError):
        manager.load_session("a", tmp_path / "one", **only_kv, attr_hooks={"opaque": (str, lambda v: v)})
    assert engine.free_block_count() == free and "a" not in manager
    loaded = fs.load(tmp_path / "table", **only_kv, attr_hooks={"opaque": (str, lambda v: v)})
    assert engine.free_block_count() == free - 4 and loaded.session_ids == ("a", "b")


# --- resume and migrate across processes -------------------------------------------------------------------


def _worker(actions: list, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch_bridge.adapters.dreamzero_worker", "--actions", json.dumps(actions)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])  # (gloo logs a line of its own to stdout)


def test_a_rollout_resumed_in_a_fresh_process_matches_the_uninterrupted_one(tmp_path):
    ck = str(tmp_path / "session-0")
    reference = _worker([["serve", [0], 0, 400]])
    first = _result(_worker([["serve", [0], 0, 200], ["save", 0, ck]]))  # then the process ends
    second = _result(_worker([["load", 0, ck], ["serve", [0], 200, 400]]))
    ref = _result(reference)
    assert first["steps"]["session-0"] + second["steps"]["session-0"] == ref["steps"]["session-0"]
    assert second["latents"]["session-0"] == ref["latents"]["session-0"]
    assert second["kv_blocks_allocated"] > 0  # the self-attention KV came back into the new engine


def test_a_session_migrates_between_two_concurrent_workers(tmp_path):
    ck = str(tmp_path / "shared" / "session-0")
    reference = _worker([["serve", [0, 2], 0, 400]])
    worker_a = _worker([["serve", [0, 1], 0, 200], ["save", 0, ck], ["close", 0], ["serve", [1], 200, 260]])
    worker_b = _worker([["serve", [2], 0, 200], ["load", 0, ck], ["serve", [0, 2], 200, 400]])
    a, b, ref = _result(worker_a), _result(worker_b), _result(reference)
    assert a["steps"]["session-0"] + b["steps"]["session-0"] == ref["steps"]["session-0"]
    assert b["steps"]["session-2"] == ref["steps"]["session-2"]  # the other session in flight on B
    assert b["latents"]["session-0"] == ref["latents"]["session-0"]


def test_a_bridge_alias_comes_back_as_an_alias_of_the_restored_storage(tmp_path):
    from torch_bridge import to_jax, to_torch

    t = torch.arange(1 << 16, dtype=torch.float32)
    p = torch.full((1 << 14,), 3.0)
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.set_attr(s, "a", "t", t)
    s = fs.put(s, "a", "alias", fs.DenseValue.create([to_jax(t)]))
    s = fs.put(s, "a", "parked", fs.DenseValue.create([to_jax(p), p]))
    s, _ = fs.park(s, "a", "parked")
    before = {k: v for k, v in fs.stats(s).items() if k.startswith("nbytes")}
    fs.save_session(s, "a", tmp_path / "ck")
    loaded = fs.load_session(ManagerState.create(), "a", tmp_path / "ck")
    after = {k: v for k, v in fs.stats(loaded).items() if k.startswith("nbytes")}
    assert after == before and before["nbytes:cpu"] == t.nbytes  # the alias and its tensor count once
    back_t = fs.get_attr(loaded, "a", "t")
    back_j = fs.view(loaded, "a", "alias")[0]
    assert isinstance(back_j, jax.Array) and back_j.unsafe_buffer_pointer() == back_t.data_ptr()
    assert to_torch(back_j).data_ptr() == back_t.data_ptr()
    np.testing.assert_array_equal(np.asarray(back_j), t.numpy())
    restored, _ = fs.restore(loaded, "a", "parked")
    value = fs.view(restored, "a", "parked")
    assert isinstance(value[0], jax.Array)  # a parked alias stays a JAX array, over the tensor's storage
    assert value[0].unsafe_buffer_pointer() == value[1].data_ptr()
    np.testing.assert_array_equal(np.asarray(value[0]), p.numpy())


def test_host_bound_storages_come_back_aligned_and_gpu_bound_ones_skip_the_host_copy(tmp_path):
    from functional_state.persist.read import _storages_on_cpu

    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "v", fs.DenseValue.create([torch.arange(1000.0), torch.ones(7, dtype=torch.int16)]))
    fs.save_session(s, "a", tmp_path / "ck")
    loaded = fs.view(fs.load_session(ManagerState.create(), "a", tmp_path / "ck"), "a", "v")
    assert all(t.data_ptr() % 64 == 0 for t in loaded)  # what JAX needs to alias them without a copy
    manifest = json.loads((next((tmp_path / "ck").glob("[0-9]*")) / "manifest" / "metadata").read_text())
    first, second = sorted(manifest["leaves"])
    assert _storages_on_cpu(manifest, None) == {first, second}
    node = manifest["sessions"][0]["objects"]["v"]["fields"]["value"]["items"][0]
    node["device"] = "cuda:0"  # as if saved from a GPU: it loads onto the GPU, straight from the read buffer
    assert _storages_on_cpu(manifest, None) == {first, second} - {node["storage"]}
    assert _storages_on_cpu(manifest, "cpu") == {first, second}
    assert _storages_on_cpu(manifest, torch.device("cuda", 1)) == set()


def test_arrays_are_written_uncompressed_and_a_compressed_checkpoint_still_loads(tmp_path):
    import orbax.checkpoint as ocp

    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "v", fs.DenseValue.create(torch.zeros(1 << 20)))  # 4 MiB that zstd shrinks to nothing
    fs.save_session(s, "a", tmp_path / "ck")
    on_disk = sum(p.stat().st_size for p in (tmp_path / "ck").rglob("*") if p.is_file())
    assert on_disk >= 4 << 20  # the CPU is the step's, not a compressor's
    # A checkpoint written compressed (orbax's default, and what earlier versions wrote) reads the same.
    old = tmp_path / "old"
    fs.save_session(s, "a", old)
    (old / "0").rename(tmp_path / "ours")
    manifest = json.loads((tmp_path / "ours" / "manifest" / "metadata").read_text())
    arrays = ocp.PyTreeCheckpointer().restore(tmp_path / "ours" / "arrays")
    with ocp.CheckpointManager(old, item_names=("arrays", "manifest")) as m:
        m.save(0, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), manifest=ocp.args.JsonSave(manifest)))
    assert sum(p.stat().st_size for p in old.rglob("*") if p.is_file()) < 1 << 20  # it did compress
    back = fs.view(fs.load_session(ManagerState.create(), "a", old), "a", "v")
    assert torch.equal(back, torch.zeros(1 << 20))


def test_a_loader_waits_out_a_half_written_checkpoint_and_not_a_complete_one(tmp_path):
    import threading

    from torch_bridge.adapters.dreamzero_worker import run_actions

    src, dst = tmp_path / "src", tmp_path / "dst"
    first = run_actions([["serve", [0], 0, 3], ["save", 0, str(src)]], sessions=1)
    partial = dst / "0.orbax-checkpoint-tmp-9"
    (partial / "manifest").mkdir(parents=True)  # what a save in flight looks like on disk
    assert fs.has_checkpoint(src) and not fs.has_checkpoint(dst)

    def finish_the_save() -> None:
        time.sleep(0.5)
        (src / "0").rename(dst / "0")  # orbax's final rename: the step appears whole (the stale tmp stays)

    mover = threading.Thread(target=finish_the_save)
    mover.start()
    second = run_actions([["load", 0, str(dst)], ["serve", [0], 3, 5]], sessions=1, wait_s=30)
    mover.join()
    reference = run_actions([["serve", [0], 0, 5]], sessions=1)
    assert first["steps"]["session-0"] + second["steps"]["session-0"] == reference["steps"]["session-0"]
    # A complete checkpoint that fails to load is damaged: the loader gives up at once instead of waiting.
    _largest_data_file(dst).write_bytes(b"")
    started = time.monotonic()
    with pytest.raises(CheckpointError):
        run_actions([["load", 0, str(dst)]], sessions=1, wait_s=30)
    assert time.monotonic() - started < 10


# --- a session sharded across two JAX controllers -----------------------------------------------------------

_CONTROLLER = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import functional_state as fs
mesh = Mesh(np.array(jax.devices()), ("x",))
values = np.arange(64, dtype=np.float32).reshape(8, 8)
rows = jax.make_array_from_callback((8, 8), NamedSharding(mesh, P("x", None)), lambda i: values[i])
s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
s = fs.put(s, "a", "kv", fs.DenseValue.create(rows))
fs.save_session(s, "a", sys.argv[3])
multihost_utils.sync_global_devices("saved")
cols = NamedSharding(mesh, P(None, "x"))
t = fs.load_session(fs.ManagerState.create(), "a", sys.argv[3], placement=cols)
got = fs.lookup(t, "a").objects["kv"].value
ok = got.sharding == cols and all(np.array_equal(np.asarray(sh.data), values[sh.index]) for sh in got.addressable_shards)
print(json.dumps({"ok": bool(ok), "processes": jax.process_count(), "shards": len(got.addressable_shards)}))
"""


def test_a_session_sharded_across_two_controllers_saves_and_loads_into_another_sharding(tmp_path):
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "controller.py"
    script.write_text(_CONTROLLER)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), f"localhost:{port}", str(i), str(tmp_path / "ck")],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [_result(p) for p in procs]
    assert all(r == {"ok": True, "processes": 2, "shards": 1} for r in results)
