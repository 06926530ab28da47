"""Tests of `persist/direct.py`.

A damaged checkpoint's load leaves no read behind (issue 24): orbax's JAX array handler gathers its leaves'
reads and raises at the first failure, and the reads still running then called back into the event loop orbax
had closed ("Event loop is closed", an unraisable exception, intermittently in the full suite)."""

from __future__ import annotations

import gc
import shutil
import sys
import time

import jax.numpy as jnp
import pytest

import functional_state as fs
from functional_state import CheckpointError, ManagerState
from helpers import assert_unchanged, snapshot
from helpers import damage as damage_file


def _many_jax_leaves() -> ManagerState:
    """A session of many small JAX arrays, so that when the first read fails, others are still in flight."""
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    leaves = [jnp.arange(8, dtype=jnp.float32) + i for i in range(12)]
    return fs.put(s, "a", "dense", fs.DenseValue.create(leaves))


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_failed_load_leaves_no_read_calling_into_a_closed_loop(tmp_path, monkeypatch):
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    fs.save_session(_many_jax_leaves(), "a", tmp_path / "saved")
    refused = 0
    for i in range(20):  # the original code lost the race in most loads: 20 loads lose it almost surely
        path = tmp_path / f"ck{i}"
        shutil.copytree(tmp_path / "saved", path)
        data = max((p for p in path.glob("[0-9]*/arrays/d/*") if p.is_file()), key=lambda p: p.stat().st_size)
        damage_file(data, "flip")
        empty = ManagerState.create()
        snap = snapshot(empty)
        try:
            fs.load_session(empty, "a", path)
        except CheckpointError:
            refused += 1
        assert_unchanged(empty, snap)
    time.sleep(0.1)  # the last load's leftover reads, if any, finish
    gc.collect()
    assert refused == 20
    assert unraisable == []
