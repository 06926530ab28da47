"""Tests of `persist/directory.py`.

A save whose step cannot be made durable (`make_durable`, its syncs issued together on threads since issue 24)
fails, and the previous checkpoint is the one a load finds, bit for bit: the new step, already renamed into
place by orbax, was left in front of it while the error said the previous one was still there."""

from __future__ import annotations

import errno
import os
import sys

import numpy as np
import pytest

import functional_state as fs
from functional_state import CheckpointError, ManagerState

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")


@pytest.mark.parametrize("failing", ["manifest/metadata", "manifest"])  # a file's sync, a directory's
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_sync_that_fails_on_a_thread_fails_the_save_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, failing, code
):
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "v", fs.DenseValue.create(np.arange(1000, dtype=np.float32)))
    root = tmp_path / "ck"
    fs.save_session(s, "a", root)
    fsync, target = os.fsync, os.path.realpath(root / "1" / failing)

    def failing_fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == target:
            raise OSError(code, os.strerror(code))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    newer = fs.put(s, "a", "v", fs.DenseValue.create(np.arange(1000, dtype=np.float32) + 1))
    with pytest.raises(CheckpointError, match="still the one there"):
        fs.save_session(newer, "a", root)
    monkeypatch.setattr(os, "fsync", fsync)
    # The error says the previous checkpoint is still the one there: a load finds it, not the step that never
    # became durable (it was left in place, in front of the previous one, before).
    assert sorted(p.name for p in root.iterdir() if p.name.isdigit()) == ["0"]
    back = fs.load_session(ManagerState.create(), "a", root)
    assert np.array_equal(fs.view(back, "a", "v"), np.arange(1000, dtype=np.float32))
    fs.save_session(newer, "a", root)  # and the next save goes through
    assert np.array_equal(fs.view(fs.load_session(ManagerState.create(), "a", root), "a", "v"), np.arange(1000) + 1)
