"""Checkpoint paths through orbax's path layer (`etils.epath`; `persist.paths`, `persist.remote`): a local
``epath.Path`` or a ``file://`` URL works where a directory does, still confined (no link followed); a bucket
URL (here an in-memory fake bucket registered for ``gs://`` with fsspec, which epath's backend uses) saves,
loads, fences and reports its metadata, counting only committed steps and downloading only plain names."""

from __future__ import annotations

import os
import shutil
from typing import ClassVar

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")
fsspec = pytest.importorskip("fsspec")
epath = pytest.importorskip("etils.epath")

from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

import functional_state as fs  # noqa: E402
from functional_state import CheckpointError, StaleEpochError  # noqa: E402
from functional_state.persist.remote import COMMITTED  # noqa: E402
from functional_state.table.ownership import claim  # noqa: E402
from functional_state.transfer import checkpoint_info  # noqa: E402


class FakeBucket(MemoryFileSystem):
    """An in-memory object store answering ``gs://`` (no network)."""

    protocol = ("gs", "gcs")
    root_marker = ""
    store: ClassVar[dict] = {}
    pseudo_dirs: ClassVar[list] = [""]


@pytest.fixture
def bucket():
    for name in ("gs", "gcs"):
        fsspec.register_implementation(name, FakeBucket, clobber=True)
    FakeBucket.store.clear()
    FakeBucket.pseudo_dirs[:] = [""]
    yield FakeBucket.store
    FakeBucket.store.clear()


def _table(values, epoch: int = 0):
    s, _ = fs.get_or_create(fs.ManagerState.create(), "robot")
    s = fs.put(s, "robot", "feat", fs.DenseValue.create([np.asarray(values, np.float32)]))
    s = fs.set_attr(s, "robot", "step", int(values[0]))
    for _ in range(epoch):
        s = claim(s, "robot", model="wm@1")
    return s


def _loaded(path) -> np.ndarray:
    return np.asarray(fs.view(fs.load_session(fs.ManagerState.create(), "robot", path), "robot", "feat")[0])


@pytest.mark.parametrize("kind", ["epath", "file-url"])
def test_a_local_epath_or_file_url_is_a_directory(tmp_path, kind):
    path = epath.Path(tmp_path / "ck") if kind == "epath" else f"file://{tmp_path}/ck"
    fs.save_session(_table(np.arange(8)), "robot", path)
    assert fs.has_checkpoint(path) and (tmp_path / "ck").is_dir()
    assert np.array_equal(_loaded(path), np.arange(8, dtype=np.float32))
    assert checkpoint_info(path).sessions["robot"].attrs == {"step": 0}


def test_a_local_epath_is_still_confined(tmp_path):
    root = tmp_path / "ck"
    fs.save_session(_table(np.arange(8)), "robot", epath.Path(root))
    step = next(p for p in root.iterdir() if p.name.isdigit())
    shutil.move(step / "manifest", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", step / "manifest")  # the same bytes, through a link
    with pytest.raises(CheckpointError):
        _loaded(epath.Path(root))


@pytest.mark.parametrize("as_epath", [False, True])
def test_a_bucket_url_saves_loads_and_reports_like_a_directory(bucket, tmp_path, monkeypatch, as_epath):
    # Regression: a URL string was taken for a local relative path ("gs:/bucket/..." under the working
    # directory), and orbax failed on it.
    monkeypatch.chdir(tmp_path)
    url = "gs://bucket/sessions/robot"
    path = epath.Path(url) if as_epath else url
    assert not fs.has_checkpoint(path)
    fs.save_session(_table(np.arange(8)), "robot", path)
    fs.save_session(_table(np.arange(8) + 1), "robot", path)  # replaces the first, committed
    assert not (tmp_path / "gs:").exists()
    assert fs.has_checkpoint(path) and np.array_equal(_loaded(path), np.arange(8, dtype=np.float32) + 1)
    info = checkpoint_info(path).sessions["robot"]
    assert (info.attrs, info.bytes_by_pool) == ({"step": 1}, {"cpu": 32})
    steps = {k.split("/")[5] for k in bucket}
    assert steps == {"1"}, sorted(bucket)  # the older step dropped once the newer was committed


def test_a_bucket_checkpoint_never_goes_back_to_an_older_epoch(bucket):
    url = "gs://bucket/robot"
    fs.save_session(_table(np.arange(4) + 5, epoch=2), "robot", url)
    with pytest.raises(StaleEpochError, match="at epoch 2, and this save is of epoch 1"):
        fs.save_session(_table(np.arange(4), epoch=1), "robot", url)
    assert checkpoint_info(url).sessions["robot"].epoch == 2
    assert np.array_equal(_loaded(url), np.arange(4, dtype=np.float32) + 5)


def test_a_step_not_committed_is_not_read_and_odd_names_are_refused(bucket):
    url = "gs://bucket/robot"
    fs.save_session(_table(np.arange(4)), "robot", url)
    root = epath.Path(url)
    half = root / "7"  # a newer step whose upload never finished
    (half / "manifest").mkdir(parents=True)
    (half / "manifest" / "metadata").write_text("{}")
    assert np.array_equal(_loaded(url), np.arange(4, dtype=np.float32))
    (root / "0" / "arrays" / "..evil name").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a plain name"):
        _loaded(url)
    (root / "0" / "arrays" / "..evil name").unlink()
    (root / "0" / COMMITTED).unlink()
    assert not fs.has_checkpoint(url)
    with pytest.raises(CheckpointError, match="no committed step"):
        _loaded(url)
