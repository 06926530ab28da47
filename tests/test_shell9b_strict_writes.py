"""A strict DreamZero adapter's writes refuse a detached handle under the write's own lock (issue 24).

Regression: the strict adapter's writes other than the frame commit (``put``, ``remove``, ``transact``,
``set_attr`` through its ``_session``) asked `in_table` (lock-free) and wrote afterwards; an eviction landing
in between sent the write into the detached copy and the call "succeeded" on a session that was gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager
from helpers import HookLock
from torch_bridge.adapters import DreamZeroStateAdapter


def _latents(value: float) -> torch.Tensor:
    return torch.full((1, 1, 16, 4, 8), value, dtype=torch.bfloat16)


_WRITES: dict[str, Callable[[DreamZeroStateAdapter], Any]] = {
    "put (clear_video_latents)": lambda s: s.clear_video_latents(),
    "remove (feat map = None)": lambda s: setattr(s, "vae_enc_feat_map", None),
    "put (feat map = [...])": lambda s: setattr(s, "vae_enc_feat_map", [torch.ones(2)]),
    "transact (append_video_latents)": lambda s: s.append_video_latents(_latents(2.0)),
    "transact (feat map item)": lambda s: s.vae_enc_feat_map.__setitem__(0, torch.full((2,), 7.0)),
    "set_attr (call_count)": lambda s: setattr(s, "call_count", 6),
    "del_attr + put (reset_vae_encoder_stream)": lambda s: s.reset_vae_encoder_stream(),
    "reset": lambda s: s.reset(),
}


def _fingerprint(session: fs.SessionState) -> Any:
    feat = session.get("vae_enc_feat_map", None)
    latents = session.get("video_latents", None)
    return (
        session.get_attr("call_count", None),
        None if feat is None or feat.value is None else [t.tolist() for t in map(torch.as_tensor, feat.value)],
        None if latents is None else len(latents.view()),
        len(session.get("vae_encoder_out").view()),
    )


@pytest.mark.parametrize("write", list(_WRITES), ids=list(_WRITES))
def test_a_strict_write_evicted_between_check_and_write_is_refused_and_lands_nowhere(write: str) -> None:
    lock = HookLock()
    manager = SessionStateManager(max_sessions=1, lock_factory=lambda: lock)
    strict = DreamZeroStateAdapter("a", manager, vae_encoder_window=2, strict=True)
    strict.call_count = 5
    strict.append_video_latents(_latents(1.0))
    strict.vae_enc_feat_map = [torch.zeros(2)]
    strict.append_vae_encoder_chunk(torch.zeros(1, 8, 1, 4, 6, dtype=torch.bfloat16))
    assert strict.vae_enc_feat_map is not None  # (the view, read while the session is in the table)
    handle = manager.get_or_create_session("a")
    before = _fingerprint(handle.state)
    view = strict.vae_enc_feat_map
    run = _WRITES[write]
    target: Any = strict
    if write == "transact (feat map item)":
        target = type("Feat", (), {"vae_enc_feat_map": view})()  # the view the model holds across the eviction
    lock.hooks = [lambda: manager.get_or_create_session("b")]  # the count cap evicts "a" before the write's lock
    with pytest.raises(fs.SessionStateLostError, match="'a': this state object refers to a session"):
        run(target)  # refused by the write itself, under its lock, with the adapter's error
    assert not strict.in_table and "a" not in manager
    assert _fingerprint(handle.state) == before  # nothing reached the detached copy either
    with pytest.raises(fs.SessionStateLostError, match="no longer in the manager"):
        run(strict)  # once it has left, the adapter's own error


def test_a_strict_get_or_create_never_builds_an_object_into_a_detached_copy() -> None:
    lock = HookLock()
    manager = SessionStateManager(max_sessions=1, lock_factory=lambda: lock)
    strict = DreamZeroStateAdapter("a", manager, vae_encoder_window=2, strict=True)
    handle = manager.get_or_create_session("a").remove("stitched_frames")  # lost: rebuilt where it is used
    lock.hooks = [lambda: manager.get_or_create_session("b")]
    with pytest.raises(fs.SessionStateLostError, match="no longer in the manager"):
        strict._buffer("stitched_frames")
    assert "stitched_frames" not in handle.state.objects


def test_a_strict_adapter_still_writes_through_the_table_while_its_session_is_there() -> None:
    manager = SessionStateManager(max_sessions=2)
    strict = DreamZeroStateAdapter("a", manager, strict=True)
    for name, run in _WRITES.items():
        if name == "transact (feat map item)":
            strict.vae_enc_feat_map = [torch.zeros(2)]
        run(strict)
    strict.call_count = 3
    strict.append_video_latents(_latents(1.0))
    session = fs.lookup(manager.state, "a")
    assert session.get_attr("call_count") == 3 and len(session.get("video_latents").view()) == 1
    assert isinstance(session.get("stitched_frames"), LatentBuffer)
