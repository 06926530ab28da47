"""The save path's cost (persist/handlers.py `ByteLeaves`, issue 24): a save's byte leaves are one commit of the
OCDBT database, not one per batch of arrays that happened to arrive together (a 607 MiB session was six
commits, each a data file, a new manifest and three fsyncs, written one after another)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorstore as ts
import torch

import functional_state as fs
from functional_state import ManagerState
from functional_state.persist import handlers

pytestmark = pytest.mark.skipif(not handlers.supported(), reason="orbax before 0.12: orbax's own numpy handler")


def _versions(root) -> dict[str, int]:
    """``{database directory name: its number of versions}`` for each OCDBT database of the newest step."""
    out = {}
    for manifest in sorted(root.glob("[0-9]*/arrays/**/manifest.ocdbt")):
        kv = ts.KvStore.open({"driver": "file", "path": f"{manifest.parent}/"}).result()
        out[manifest.parent.name] = len(ts.ocdbt.dump(kv).result()["versions"])
    return out


def test_a_save_writes_all_its_byte_leaves_in_one_commit_and_loads_them_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1 << 15, generator=g) for _ in range(6)]
    array = np.random.default_rng(0).integers(0, 255, 1 << 12, dtype=np.uint8)
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "v", fs.DenseValue.create([*tensors, array]))
    fs.save_session(s, "a", tmp_path / "ck")
    versions = _versions(tmp_path / "ck")
    # The per-process database: the version its creation writes, and one commit of every leaf (it was 4 here).
    assert versions.pop("ocdbt.process_0") <= 2
    assert set(versions.values()) == {1}  # the merged database orbax reads
    loaded = fs.view(fs.load_session(ManagerState.create(), "a", tmp_path / "ck"), "a", "v")
    assert all(torch.equal(x, y) for x, y in zip(loaded[:-1], tensors))
    assert np.array_equal(loaded[-1], array)
    # And a save over it (the previous step deleted once the new one is complete) the same way.
    fs.save_session(s, "a", tmp_path / "ck")
    assert _versions(tmp_path / "ck")["ocdbt.process_0"] <= 2


def test_a_synchronous_save_whose_checksums_fail_fails_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """The checksums of a synchronous save run while orbax writes the arrays, and the manifest waits for them:
    an error there fails the save, and the checkpoint that was there stays the one a load finds."""
    from functional_state import CheckpointError
    from functional_state.persist import encode

    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "v", fs.DenseValue.create([torch.arange(1 << 12, dtype=torch.float32)]))
    fs.save_session(s, "a", tmp_path / "ck")

    def failing(self):
        raise MemoryError("no memory for the checksums")

    monkeypatch.setattr(encode.Writer, "checksums", failing)
    changed = fs.put(s, "a", "v", fs.DenseValue.create([torch.zeros(1 << 12)]))
    with pytest.raises(CheckpointError, match="no memory for the checksums"):
        fs.save_session(changed, "a", tmp_path / "ck")
    monkeypatch.undo()
    loaded = fs.view(fs.load_session(ManagerState.create(), "a", tmp_path / "ck"), "a", "v")
    assert torch.equal(loaded[0], torch.arange(1 << 12, dtype=torch.float32))
    fs.save_session(changed, "a", tmp_path / "ck")  # and the directory takes the next save
    assert torch.equal(
        fs.view(fs.load_session(ManagerState.create(), "a", tmp_path / "ck"), "a", "v")[0], torch.zeros(1 << 12)
    )


def test_a_load_of_a_one_file_checkpoint_reads_its_halves_on_two_streams_bit_exact(tmp_path, monkeypatch):
    """A save is one commit, so its bulk is one data file: the load reads it as two streams (a stream per half,
    on two threads), and every byte lands where it belongs."""
    from functional_state.persist import direct

    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(1 << 16, generator=g) for _ in range(8)]
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "v", fs.DenseValue.create(tensors))
    fs.save_session(s, "a", tmp_path / "ck")
    opened: list[str] = []
    real_open = direct.os.open

    def recording(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(direct.os, "open", recording)  # (each stream opens the file once)
    loaded = fs.view(fs.load_session(ManagerState.create(), "a", tmp_path / "ck"), "a", "v")
    monkeypatch.undo()
    assert all(torch.equal(x, y) for x, y in zip(loaded, tensors))
    data = [p for p in opened if "/d/" in p]  # the OCDBT data files (under the database's ``d/``)
    files = set(data)
    # A lone data file (what one commit writes) is read as two streams; several files, a stream each.
    assert len(data) == (2 if len(files) == 1 else len(files)), (len(files), len(data))
