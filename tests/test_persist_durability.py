"""A save reported complete is on the disk before the previous checkpoint is deleted (persist/directory.py
`make_durable`): tensorstore syncs the array data it writes, but orbax wrote the step's manifest, its metadata
files and the rename that puts the step in place without a sync, so a power loss right after a save could
leave a step without its manifest while the previous step was already gone (issue 24, found by strace)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import functional_state as fs
from functional_state import ManagerState
from functional_state.persist import store as store_module

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_syncs_its_manifest_and_the_rename_before_dropping_the_previous_step(
    tmp_path, monkeypatch, asynchronous
):
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "v", fs.DenseValue.create(np.arange(1000, dtype=np.float32)))
    root = tmp_path / "ck"
    fs.save_session(s, "a", root)
    events: list[str] = []
    fsync, drop = os.fsync, store_module.drop_steps_before

    def recording_fsync(fd):
        events.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    def recording_drop(path, step):
        events.append(f"drop {step}")
        return drop(path, step)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(store_module, "drop_steps_before", recording_drop)
    fs.save_session(s, "a", root, asynchronous=asynchronous).wait()
    assert "drop 1" in events
    synced = set(events[: events.index("drop 1")])
    step = os.path.realpath(root / "1")
    assert {f"{step}/manifest/metadata", f"{step}/manifest", step, os.path.realpath(root)} <= synced
    assert all(os.path.join(d, f) in synced for d, _, files in os.walk(step) for f in files)
    assert not (root / "0").exists()
    assert np.array_equal(fs.view(fs.load_session(ManagerState.create(), "a", root), "a", "v"), np.arange(1000))
