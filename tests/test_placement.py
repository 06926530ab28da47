"""Placement figures (`transfer.placement`) and checkpoint metadata without loading (`persist.info`)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import ManagerState
from functional_state.transfer import checkpoint_info, claim, placement


def test_figures_per_pool_and_per_session_agree_with_stats():
    s = ManagerState.create(byte_budget={"cpu": "1 MiB"})
    for i, sid in enumerate(("a", "b", "c")):
        s, _ = fs.get_or_create(s, sid)
        s = fs.put(s, sid, "x", fs.DenseValue.create([np.zeros(256 * (i + 1), np.float32)]))
    s = fs.fork_session(claim(s, "b"), "b", "b2")  # a fork shares b's buffer: counted in each session
    s, _ = fs.get_session(s, "a")  # a is the most recent now
    p = placement(s, saved={"a": 7})
    assert p.pools == {"cpu": (fs.stats(s)["nbytes:cpu"], 1 << 20)}
    assert {sid: f.nbytes for sid, f in p.sessions.items()} == {"a": 1024, "b": 2048, "b2": 2048, "c": 3072}
    assert [sid for sid, f in sorted(p.sessions.items(), key=lambda kv: kv[1].recency)] == list(s.session_ids)
    assert (p.sessions["b"].epoch, p.sessions["a"].epoch, p.sessions["a"].last_saved_step) == (1, 0, 7)
    assert p.headroom("cpu") == (1 << 20) - fs.stats(s)["nbytes:cpu"] and p.headroom("cuda:0") is None


@pytest.mark.parametrize(
    ("budget", "pools"),
    [
        ("64 MiB", {"cpu": (0, 64 << 20)}),
        ({"cpu": "1 MiB", "cpu/pinned_host": "2 MiB"}, {"cpu": (0, 1 << 20), "cpu/pinned_host": (0, 2 << 20)}),
        (None, {}),
    ],
)
def test_an_empty_budgeted_replica_reports_its_room(budget, pools):
    # A replica that holds nothing yet must still show its budget: read as "no budget", it would fit any
    # session and win every placement and drain, however small its budget.
    from functional_state.serving.moves import roomiest

    p = placement(ManagerState.create(byte_budget=budget))
    assert p.pools == pools and p.sessions == {}
    big = fs.transfer.SessionFigures({"cpu": 128 << 20}, 0, 1, None)
    other = fs.transfer.Placement({"cpu": (0, 256 << 20)}, {})
    assert roomiest({"empty": p, "other": other}, big) == ("other" if budget else "empty")


def test_figures_at_10k_sessions_cost_milliseconds():
    s = ManagerState.create(max_sessions=10_000, byte_budget="1 GiB")
    for i in range(10_000):
        s, _ = fs.get_or_create(s, f"s{i}")
        s = fs.put(s, f"s{i}", "x", fs.DenseValue.create([np.zeros(16, np.float32)]))
    placement(s)
    start = time.perf_counter()
    p = placement(s)
    took = time.perf_counter() - start
    assert len(p.sessions) == 10_000 and p.pools["cpu"][0] == 10_000 * 64
    assert took < 0.5, took  # (about 30 ms here; a publish every second must not be a walk of the buffers)


def test_checkpoint_info_reads_the_manifest_alone(tmp_path, monkeypatch):
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "t", fs.DenseValue.create([torch.zeros(8, dtype=torch.float32), np.zeros(4)]))
    s = fs.set_attr(claim(s, "a", model="wm@1"), "a", "step", 12)
    s = fs.set_attr(s, "a", "seed_hex", "ab12")
    fs.save_session(claim(s, "a"), "a", tmp_path / "a")
    from functional_state.persist import read

    monkeypatch.setattr(read, "read_checkpoint", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    info = checkpoint_info(tmp_path / "a")
    got = info.sessions["a"]
    assert (info.kind, got.epoch, got.model) == ("session", 2, "wm@1")
    assert got.attrs == {"step": 12, "seed_hex": "ab12", "functional_state.epoch": 2}
    assert got.bytes_by_pool == {"cpu": 8 * 4 + 4 * 8}
    with pytest.raises(fs.CheckpointError, match="holds no readable checkpoint"):
        checkpoint_info(tmp_path / "nothing")
