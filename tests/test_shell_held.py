"""`SessionHandle.held` and `commit_held` (issue 24): a read and a commit of the manager's table only, refused
once the handle's incarnation left it; what a strict DreamZero adapter uses on its per-step path instead of
asking `in_table` before each read and write."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager
from helpers import HookLock, leave_table
from torch_bridge.adapters import DreamZeroStateAdapter


@pytest.mark.parametrize("how", ["evicted", "dropped", "replaced"])
def test_held_reads_the_table_and_refuses_once_the_incarnation_left(how: str) -> None:
    manager = SessionStateManager(max_sessions=1)
    h = manager.get_or_create_session("a").put("x", LatentBuffer.create(maxlen=2)).commit("x", 1.0)
    assert h.held("x") is h.state.get("x") and h.held("x").view() == (1.0,)
    assert h.held("nothing") is None  # absent: None, not an error
    leave_table(manager, how)
    with pytest.raises(fs.SessionStateLostError, match=r"`SessionHandle.held`: session 'a' was"):
        h.held("x")
    assert h.state.get("x").view() == (1.0,)  # the handle's copy is still readable


def test_held_returns_a_parked_object_parked() -> None:
    manager = SessionStateManager()
    h = manager.get_or_create_session("a").put("x", LatentBuffer.create(maxlen=2)).commit("x", np.ones(4))
    h.park("x")
    assert h.held("x").parked and fs.lookup(manager.state, "a").get("x").parked  # nothing restored


@pytest.mark.parametrize("how", ["evicted", "dropped", "replaced"])
def test_commit_held_commits_into_the_table_and_refuses_once_the_incarnation_left(how: str) -> None:
    manager = SessionStateManager(max_sessions=1)
    h = manager.get_or_create_session("a").put("x", LatentBuffer.create(maxlen=2))
    assert h.commit_held("x", 1.0) is h and manager.get_or_create_session("a").view("x") == (1.0,)
    leave_table(manager, how)
    table = manager.state
    with pytest.raises(fs.SessionStateLostError, match=r"commit_held`: session 'a' was"):
        h.commit_held("x", 2.0)
    assert h.view("x") == (1.0,)  # nothing written: not the copy ...
    assert manager.state is table  # ... nor the table (a new incarnation is never touched)


def test_commit_held_refuses_an_eviction_that_lands_just_before_its_lock() -> None:
    # The eviction lands after any lock-free check the caller could make and before the commit's lock: the
    # one-step commit decides under that lock, so nothing reaches the detached copy.
    lock = HookLock()
    manager = SessionStateManager(max_sessions=1, lock_factory=lambda: lock)
    h = manager.get_or_create_session("a").put("x", LatentBuffer.create(maxlen=2)).commit("x", 1.0)
    assert h.in_table
    lock.hooks = [lambda: manager.get_or_create_session("b")]
    with pytest.raises(fs.SessionStateLostError):
        h.commit_held("x", 2.0)
    assert not h.in_table and h.view("x") == (1.0,) and "a" not in manager


def test_a_strict_adapter_writes_no_frame_into_a_copy_when_its_session_is_evicted_mid_step() -> None:
    # Regression: the strict encoder step asked `in_table` (lock-free) and then committed; an eviction landing
    # in between sent the frame into the detached copy and the step "succeeded" on a session that was gone.
    lock = HookLock()
    manager = SessionStateManager(max_sessions=1, lock_factory=lambda: lock)
    strict = DreamZeroStateAdapter("a", manager, vae_encoder_window=2, strict=True)
    first = torch.zeros(1, 8, 1, 4, 6, dtype=torch.bfloat16)
    strict.append_vae_encoder_chunk(first)
    handle = manager.get_or_create_session("a")
    lock.hooks = [lambda: manager.get_or_create_session("b")]  # the count cap evicts "a"
    with pytest.raises(fs.SessionStateLostError, match="'a': this state object refers to a session"):
        strict.append_vae_encoder_chunk(torch.ones(1, 8, 1, 4, 6, dtype=torch.bfloat16))
    assert len(handle.state.get("vae_encoder_out").view()) == 1  # the copy kept only the first frame
    with pytest.raises(fs.SessionStateLostError, match="'a': this state object refers to a session"):
        strict.observation_latents(1)


def test_a_strict_adapter_reads_and_writes_through_the_table_while_its_session_is_there() -> None:
    manager = SessionStateManager()
    strict = DreamZeroStateAdapter("a", manager, vae_encoder_window=2, strict=True)
    for i in range(3):
        strict.append_vae_encoder_chunk(torch.full((1, 8, 1, 4, 6), float(i), dtype=torch.bfloat16))
    assert strict.observation_latents(2)[0, 0, :, 0, 0].tolist() == [1.0, 2.0]
    ring = fs.lookup(manager.state, "a").get("vae_encoder_out")
    assert [float(t[0, 0, 0, 0, 0]) for t in ring.view()] == [1.0, 2.0]


def test_commit_held_restores_a_parked_object_and_commits_into_the_table() -> None:
    # The one-step commit hands a parked object to the retry loop, which restores it and commits, table only.
    manager = SessionStateManager()
    h = manager.get_or_create_session("a").put("x", LatentBuffer.create(maxlen=2)).commit("x", np.ones(2))
    h.park("x")
    h.commit_held("x", np.zeros(2))
    ring = fs.lookup(manager.state, "a").get("x")
    assert ring.resident and [v.tolist() for v in ring.view()] == [[1.0, 1.0], [0.0, 0.0]]


def test_commit_held_through_the_retry_loop_refuses_a_session_evicted_meanwhile() -> None:
    # A parked object sends the commit to the retry loop; the eviction lands before its install: the loop
    # computes it again on the new table and refuses, writing nothing into the copy.
    lock = HookLock()
    manager = SessionStateManager(max_sessions=1, lock_factory=lambda: lock)
    h = manager.get_or_create_session("a").put("x", LatentBuffer.create(maxlen=2)).commit("x", np.ones(2))
    h.park("x")
    lock.hooks = [None, lambda: manager.get_or_create_session("b")]  # the one-step commit's lock, the loop's
    with pytest.raises(fs.SessionStateLostError, match="commit_held"):
        h.commit_held("x", np.zeros(2))
    assert not h.in_table and h.state.get("x").parked and "a" not in manager  # nothing committed anywhere
