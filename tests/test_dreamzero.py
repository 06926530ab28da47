"""DreamZero: the adapter against the bespoke reference, method by method, plus sessions and accounting."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager, nbytes_by_device
from functional_state.shell.config import enable_override
from helpers import HookLock
from torch_bridge import harness as rollout
from torch_bridge import report, reset_report, unwrap
from torch_bridge.adapters import (
    BespokeDreamZeroCache,
    BespokeDreamZeroState,
    DreamZeroStateAdapter,
    request_session,
)
from torch_bridge.adapters.dreamzero import FeatMapView
from torch_bridge.harness import Cosmos3Shapes, build_freqs_gen, encode_und_kv


def _same(a, b):
    if isinstance(b, FeatMapView):  # the adapter's list view of its DenseValue reads like the bespoke list
        b = list(b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (type(a), type(b))
        assert a.dtype == b.dtype and a.shape == b.shape
        assert (
            a.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            == b.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    else:
        assert a == b


def _pair(window=2, manager=None):
    manager = manager or SessionStateManager()
    return BespokeDreamZeroState(), DreamZeroStateAdapter("s", manager, vae_encoder_window=window), manager


def _both(pair, fn):
    out_a, out_b = fn(pair[0]), fn(pair[1])
    _same(out_a, out_b)
    return out_b


def _frame(i, hw=(8, 16), dtype=torch.uint8):
    return (torch.arange(hw[0] * hw[1] * 3).reshape(*hw, 3) + i).to(dtype)


ATTRS = [
    "call_count",
    "current_start_frame",
    "clip_feas",
    "ys",
    "language",
    "prompt_embeds",
    "vae_stream_initialized",
    "vae_enc_feat_map",
    "vae_pending_body_frames",
]


def _same_attrs(pair):
    for name in ATTRS:
        _same(getattr(pair[0], name), getattr(pair[1], name))
    _same(pair[0].vae_encoder_out, pair[1].vae_encoder_out)
    _same(pair[0].get_concatenated_video_latents(), pair[1].get_concatenated_video_latents())


def test_defaults_match():
    _same_attrs(_pair())


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_frames_and_rollover(kind):
    pair = _pair()
    shapes = []
    for i in range(7):
        f = _frame(i)
        f = f.numpy() if kind == "numpy" else f
        out = _both(pair, lambda s: s.accumulate_frames(f))
        shapes.append(out.shape[0])
    assert shapes == [1, 4, 4, 4, 4, 4, 4]
    # Padding repeats the oldest frame while fewer than 4 are held.
    pair = _pair()
    _both(pair, lambda s: s.accumulate_frames(_frame(0)))
    out = _both(pair, lambda s: s.accumulate_frames(_frame(1)))
    assert torch.equal(out[0], _frame(0)) and torch.equal(out[1], _frame(0)) and torch.equal(out[3], _frame(1))


@pytest.mark.parametrize("t", [1, 2, 6])
def test_four_d_clips(t):
    pair = _pair()
    clip = torch.stack([_frame(i) for i in range(t)])
    first = _both(pair, lambda s: s.accumulate_frames(clip))
    assert first.shape[0] == 1
    second = _both(pair, lambda s: s.accumulate_frames(clip[:1] + 100))
    assert second.shape[0] == 4


@pytest.mark.parametrize("bad", [torch.zeros(4, 4), torch.zeros(1, 2, 3, 4, 5), torch.zeros(3)])
def test_frames_bad_ndim_raises_on_both(bad):
    for state in _pair()[:2]:
        with pytest.raises(ValueError, match=r"\(H, W, C\) or a clip \(T, H, W, C\)"):
            state.accumulate_frames(bad)


def test_video_latents_bf16_round_trip():
    pair = _pair()
    _both(pair, lambda s: s.get_concatenated_video_latents())
    outs = [
        torch.randn(1, 2, 16, 4, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) for i in range(3)
    ]
    _both(pair, lambda s: s.append_video_latents(outs[0]))
    single = _both(pair, lambda s: s.get_concatenated_video_latents())
    assert single.shape == (1, 16, 2, 4, 8) and single.dtype == torch.bfloat16
    for o in outs[1:]:
        _both(pair, lambda s: s.append_video_latents(o))
    cat = _both(pair, lambda s: s.get_concatenated_video_latents())
    assert cat.shape == (1, 16, 6, 4, 8)
    _both(pair, lambda s: s.clear_video_latents())
    assert pair[1].get_concatenated_video_latents() is None
    for state in pair[:2]:
        with pytest.raises(ValueError, match=r"\(B, T, C, H, W\)"):
            state.append_video_latents(torch.zeros(2, 3))


def _chunk(i, t=1):
    return torch.full((1, 32, t, 4, 8), float(i), dtype=torch.bfloat16) + torch.arange(t, dtype=torch.bfloat16).reshape(
        1, 1, t, 1, 1
    )


def test_encoder_ring_matches_bespoke_reads_within_the_window():
    pair = _pair(window=3)
    for i in range(10):
        _both(pair, lambda s: s.append_vae_encoder_chunk(_chunk(i, t=1 + i % 3)))
        for n in (1, 2, 3):
            _both(pair, lambda s: s.observation_latents(n))
    assert pair[0].vae_encoder_out.shape[2] == sum(1 + i % 3 for i in range(10))
    assert pair[1].vae_encoder_out.shape[2] == 3
    _same(pair[0].vae_encoder_out[:, :, -3:], pair[1].vae_encoder_out)


def test_observation_beyond_the_window_raises():
    _, adapter, _ = _pair(window=2)
    adapter.append_vae_encoder_chunk(_chunk(0, t=4))
    with pytest.raises(ValueError, match="retains 2"):
        adapter.observation_latents(3)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="positive int"):
            adapter.observation_latents(bad)


def test_encoder_out_assignment_seeds_and_clears():
    pair = _pair(window=2)
    assert pair[1].observation_latents(2) is None and pair[0].observation_latents(2) is None
    seed = _chunk(5, t=5)
    for s in pair[:2]:
        s.vae_encoder_out = seed
    _both(pair, lambda s: s.observation_latents(2))
    _both(pair, lambda s: s.append_vae_encoder_chunk(_chunk(9)))
    _both(pair, lambda s: s.observation_latents(2))
    for s in pair[:2]:
        s.vae_encoder_out = None
    assert pair[1].vae_encoder_out is None and pair[0].vae_encoder_out is None


def test_vae_stream_fields_and_the_feat_map_read_and_write_as_before():
    pair = _pair()
    feat_map, pending = [torch.zeros(4), None], []
    for s in pair[:2]:
        s.vae_stream_initialized = True
        s.vae_enc_feat_map = list(feat_map)
        s.vae_pending_body_frames = pending
    assert pair[1].vae_pending_body_frames is pending  # an attr: carried by identity
    view = pair[1].vae_enc_feat_map
    assert len(view) == 2 and view[0] is feat_map[0] and view[1] is None  # items by reference
    new = torch.ones(2)
    for s in pair[:2]:
        cache = s.vae_enc_feat_map
        cache[1] = new  # the encoder replaces cached items through the list it reads from the state
    assert pair[1].vae_enc_feat_map[1] is new and pair[0].vae_enc_feat_map[1] is new
    assert isinstance(pair[1]._session.get("vae_enc_feat_map"), fs.DenseValue)  # a parkable state object
    with pytest.raises(fs.InvalidArgumentError, match="fixed length"):
        pair[1].vae_enc_feat_map.append(torch.zeros(1))
    _both(pair, lambda s: s.append_vae_encoder_chunk(_chunk(1)))
    _both(pair, lambda s: s.reset_vae_encoder_stream())
    _same_attrs(pair)
    assert pair[1].vae_stream_initialized is False and pair[1].vae_enc_feat_map is None


def test_the_feat_map_parks_between_steps_and_restores_on_access():
    manager = SessionStateManager()
    state = DreamZeroStateAdapter("s", manager)
    tensors = [torch.randn(256) for _ in range(3)]
    state.vae_enc_feat_map = tensors
    before = manager.stats()
    moved = state.park_feat_map()
    after = manager.stats()
    assert moved == {"cpu": -3 * 1024, "cpu/unpinned_host": 3 * 1024}
    assert (
        after.get("nbytes:cpu", 0) == before["nbytes:cpu"] - 3 * 1024 and after["nbytes:cpu/unpinned_host"] == 3 * 1024
    )
    assert after["parks"] == 1 and after["parked_nbytes"] == 3 * 1024
    again = DreamZeroStateAdapter("s", manager)  # a new adapter, as the next request builds one
    restored = list(again.vae_enc_feat_map)  # first access restores
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(restored, tensors))
    s = manager.stats()
    assert s["restores"] == 1 and s["parked_nbytes"] == 0 and "nbytes:cpu/unpinned_host" not in s


def _populate(s):
    s.accumulate_frames(_frame(0))
    s.accumulate_frames(_frame(1))
    s.append_video_latents(torch.ones(1, 1, 16, 4, 8, dtype=torch.bfloat16))
    s.append_vae_encoder_chunk(_chunk(3))
    s.vae_stream_initialized = True
    s.vae_enc_feat_map = [torch.zeros(3)]
    s.vae_pending_body_frames = [_frame(2)]
    s.call_count = 5
    s.current_start_frame = 9
    s.clip_feas = torch.ones(4, dtype=torch.bfloat16)
    s.ys = torch.ones(2, 2)
    s.language = torch.arange(6)
    s.prompt_embeds = torch.ones(6, 8, dtype=torch.bfloat16)


@pytest.mark.parametrize("method", ["window", "inference", "session"])
def test_resets_match(method):
    pair = _pair()
    feat = None
    for s in pair[:2]:
        _populate(s)
        if feat is None:
            feat = s.vae_enc_feat_map
        s.vae_enc_feat_map = feat
    for s in pair[:2]:
        {
            "window": lambda: s.reset(clear_video_latents=False),
            "inference": s.reset_inference_state,
            "session": s.reset,
        }[method]()
    _same_attrs(pair)
    out = _both(pair, lambda s: s.accumulate_frames(_frame(7)))
    assert out.shape[0] == 1  # the frame ring was cleared by both kinds of reset
    if method != "session":
        assert pair[1].language is not None and pair[1].get_concatenated_video_latents() is not None
        assert pair[1].vae_stream_initialized and pair[1].vae_encoder_out is not None
    else:
        assert pair[1].language is None and pair[1].call_count == 0 and pair[1].vae_encoder_out is None


@pytest.mark.parametrize(
    "language, start, tokens, frames, attn, expected",
    [
        (None, 0, torch.arange(3), 1, 24, "session"),  # 1: nothing conditioned yet
        (torch.arange(3), 0, torch.arange(3) + 1, 1, 24, "session"),  # 2: prompt changed (values)
        (torch.arange(3), 0, torch.arange(4), 1, 24, "session"),  # 2: prompt changed (shape)
        (torch.arange(3), 23, torch.arange(3), 2, 24, "inference"),  # 3: window overflows
        (torch.arange(3), 22, torch.arange(3), 2, 24, None),  # 4: exactly fills
        (torch.arange(3), 10_000, torch.arange(3), 2, -1, None),  # 4: unlimited attention
        (torch.arange(3), 5, torch.arange(3), 1, 24, None),  # 4
    ],
)
def test_reset_reason_and_should_reset(language, start, tokens, frames, attn, expected):
    pair = _pair()
    for s in pair[:2]:
        s.language = language
        s.current_start_frame = start
    _both(pair, lambda s: s.reset_reason(tokens, frames, attn))
    assert pair[1].reset_reason(tokens, frames, attn) == expected
    assert pair[1].should_reset(tokens, frames, attn) is (expected is not None)


def test_fresh_adapter_sees_the_same_session():
    manager = SessionStateManager()
    a = DreamZeroStateAdapter("s", manager)
    _populate(a)
    b = DreamZeroStateAdapter("s", manager)
    assert b.call_count == 5 and b.vae_enc_feat_map[0] is a.vae_enc_feat_map[0]
    _same(b.get_concatenated_video_latents(), a.get_concatenated_video_latents())
    b.call_count += 1
    assert a.call_count == 6


def test_lru_cap_and_pinned_eviction():
    manager = SessionStateManager(max_sessions=2)
    first = DreamZeroStateAdapter("a", manager)
    _populate(first)
    DreamZeroStateAdapter("b", manager)
    DreamZeroStateAdapter("c", manager)  # evicts "a" from the table
    assert "a" not in manager and len(manager) == 2
    assert first.call_count == 5 and first.get_concatenated_video_latents() is not None  # pinned: kept
    first.append_video_latents(torch.ones(1, 1, 16, 4, 8, dtype=torch.bfloat16))
    assert "a" not in manager  # writes never resurrect it
    assert DreamZeroStateAdapter("a", manager).call_count == 0  # a new session starts empty
    # The bespoke cache evicts the same way.
    cache = BespokeDreamZeroCache(max_sessions=2)
    for sid in "abc":
        cache.get_or_create(sid)
    assert "a" not in cache and len(cache) == 2


def test_a_strict_adapter_refuses_use_once_its_session_left_the_table():
    # Regression (issue 19): an adapter whose session was evicted or dropped kept accepting writes into a copy no
    # request would read again. Strict (what `DreamZeroSessions` hands out), every use raises instead.
    manager = SessionStateManager(max_sessions=2)
    strict = DreamZeroStateAdapter("a", manager, strict=True)
    strict.call_count = 5
    DreamZeroStateAdapter("b", manager)
    DreamZeroStateAdapter("c", manager)  # the count cap evicts "a" (least recently used)
    assert not strict.in_table and "a" not in manager
    for use in (
        lambda: strict.call_count,
        lambda: setattr(strict, "call_count", 6),
        lambda: strict.append_video_latents(torch.ones(1, 1, 16, 4, 8, dtype=torch.bfloat16)),
        lambda: strict.accumulate_frames(_frame(0)),
        strict.get_concatenated_video_latents,
    ):
        with pytest.raises(fs.SessionStateLostError, match="'a': this state object refers to a session that is no"):
            use()
    assert "a" not in manager and strict.session_id == "a" and "detached" in repr(strict)  # nothing re-created
    fresh = DreamZeroStateAdapter("a", manager, strict=True)  # a new incarnation: the old adapter stays dead
    assert fresh.in_table and fresh.call_count == 0 and not strict.in_table
    with pytest.raises(fs.SessionStateLostError):
        strict.call_count  # noqa: B018


def test_from_handle_creates_nothing_and_building_an_adapter_restores_nothing():
    manager = SessionStateManager()
    with pytest.raises(fs.SessionStateLostError):
        DreamZeroStateAdapter.from_handle(manager.get_session("ghost"))
    assert "ghost" not in manager
    state = DreamZeroStateAdapter("s", manager)
    state.append_video_latents(torch.ones(1, 1, 16, 4, 8, dtype=torch.bfloat16))
    state.vae_enc_feat_map = [torch.zeros(8)]
    state._session.park("video_latents")
    state.park_feat_map()
    # Regression (issue 19): a store now builds an adapter per request when the caller keeps none; building one
    # restored every parked buffer at once (undoing the budget's parking). Parked objects wait for their use.
    again = DreamZeroStateAdapter.from_handle(manager.get_session("s"))
    also = DreamZeroStateAdapter("s", manager)
    assert manager.stats()["restores"] == 0 and manager.stats()["parks"] == 2
    assert again.get_concatenated_video_latents().shape == (1, 16, 1, 4, 8) and also.vae_enc_feat_map is not None
    assert manager.stats()["restores"] == 2
    with pytest.raises(ValueError, match="window of 2 frames; this adapter asks for 3"):
        DreamZeroStateAdapter.from_handle(manager.get_session("s"), vae_encoder_window=3)


def test_session_reset_leaves_a_fresh_adapter_with_defaults():
    manager = SessionStateManager()
    a = DreamZeroStateAdapter("s", manager)
    _populate(a)
    a.reset()
    fresh = DreamZeroStateAdapter("s", manager)
    _same_attrs((BespokeDreamZeroState(), fresh))


def test_window_validation():
    manager = SessionStateManager()
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            DreamZeroStateAdapter("s", manager, vae_encoder_window=bad)
    DreamZeroStateAdapter("s", manager, vae_encoder_window=2)
    with pytest.raises(ValueError, match="window of 2 frames; this adapter asks for 3"):
        DreamZeroStateAdapter("s", manager, vae_encoder_window=3)


def test_tensors_enter_by_reference_and_are_counted_once():
    reset_report()
    manager = SessionStateManager()
    a = DreamZeroStateAdapter("s", manager)
    video_out = torch.ones(1, 2, 16, 4, 8, dtype=torch.bfloat16)
    a.append_video_latents(video_out)
    frame = _frame(0)
    a.accumulate_frames(frame)
    chunk = _chunk(0)
    a.append_vae_encoder_chunk(chunk)
    a.prompt_embeds = torch.ones(64, dtype=torch.bfloat16)
    session = fs.sessions(manager.state)["s"]
    stored = session.get("video_latents").view()[0]
    assert isinstance(stored, jax.Array) and stored.dtype == jax.numpy.bfloat16
    assert stored.unsafe_buffer_pointer() == video_out.data_ptr()  # a permuted view, aliased
    assert session.get("stitched_frames").view()[0].unsafe_buffer_pointer() == frame.data_ptr()
    kept = session.get("vae_encoder_out").view()[0]  # the ring keeps a torch tensor: its own copy (issue 34)
    assert type(kept) is torch.Tensor and torch.equal(kept, chunk) and kept.data_ptr() != chunk.data_ptr()
    assert report()["copied_count"] == 0
    back = a.get_concatenated_video_latents()
    assert back.untyped_storage().data_ptr() == video_out.untyped_storage().data_ptr()
    expected = sum(nbytes_by_device(video_out, frame, chunk, torch.ones(64, dtype=torch.bfloat16)).values())
    assert manager.stats()["total_nbytes"] == expected


def test_deploy_shapes_encoder_growth_vs_constant_ring():
    frame_bytes = 32 * 44 * 80 * 2  # one latent frame of encoder output, bf16: 0.215 MiB
    assert abs(frame_bytes / 2**20 - 0.215) < 0.001
    results = {}
    # The stand-in encoder: the real one costs seconds a chunk at deploy shapes on a CPU; the byte counts are
    # the same (its output is the same 32 x 44 x 80 latent frame).
    cfg = rollout.RolloutConfig(
        steps=21, sessions=1, feat_map_bytes=2**20, trace_bytes=True, prompt_every=10**6, vae_encoder="stand-in"
    )
    for flag in ("0", "1"):
        with enable_override(flag == "1"):
            results[flag] = rollout.run_rollout(cfg)
    bespoke, managed = results["0"], results["1"]
    assert (bespoke.path, managed.path) == ("bespoke", "manager") and bespoke.digest == managed.digest
    enc_b = [t["vae_encoder_out"] for t in bespoke.bytes_trace]
    enc_m = [t["vae_encoder_out"] for t in managed.bytes_trace]
    assert enc_b[-1] == 6 * frame_bytes and enc_b[0] == frame_bytes  # 1 + 20 // 4 latent frames
    assert enc_m[-1] == 2 * frame_bytes and max(enc_m) == 2 * frame_bytes  # the ring: constant 0.43 MiB
    stitched = 352 * 640 * 3
    assert (
        bespoke.components["session-0"]["stitched_frames"]
        == managed.components["session-0"]["stitched_frames"]
        == 4 * stitched
    )


def test_harness_detects_a_broken_adapter(monkeypatch):
    """The A/B digest must be able to fail: an adapter that silently returns a shorter window is caught."""
    monkeypatch.setenv("OMNI_DIFFUSION_SESSION_STATE_MANAGER", "0")
    good = rollout.run_rollout(rollout.small_config(steps=12, sessions=1))
    monkeypatch.setenv("OMNI_DIFFUSION_SESSION_STATE_MANAGER", "1")
    same = rollout.run_rollout(rollout.small_config(steps=12, sessions=1))

    monkeypatch.setattr(
        DreamZeroStateAdapter,
        "observation_latents",
        lambda self, n: unwrap(self._buffer("vae_encoder_out").view()[-1]),
    )
    broken = rollout.run_rollout(rollout.small_config(steps=12, sessions=1))
    assert good.digest == same.digest != broken.digest


def _rollouts_in_fresh_processes(*flags):
    """One rollout per flag value, each in its own fresh process (started together: most of each is imports)."""
    cmd = [sys.executable, "-m", "torch_bridge.harness", "--steps", "30", "--sessions", "2", "--prompt-every", "26"]
    procs = [
        subprocess.Popen(
            [*cmd, "--json"],
            env=dict(os.environ, OMNI_DIFFUSION_SESSION_STATE_MANAGER=flag),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for flag in flags
    ]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def test_flag_flip_ab_in_fresh_processes_on_the_real_wan_encoder():
    # 30 steps: a window reset (local_attn_size 24) and a prompt change (step 26) on both sessions.
    bespoke, managed = _rollouts_in_fresh_processes("0", "1")
    assert (bespoke["path"], managed["path"]) == ("bespoke", "manager")
    assert bespoke["digest"] == managed["digest"]
    assert bespoke["latents_shape"] == managed["latents_shape"]


def _replay_digest(cfg, nets, streams, adapter_steps=None):
    """Digest of the outputs of the steps whose index is in ``adapter_steps``, on a fresh, unforked session fed
    frame stream ``streams[step]`` at each step; the bespoke and the manager-backed path must agree."""
    digests = []
    for state in (
        BespokeDreamZeroState(),
        DreamZeroStateAdapter("replay", SessionStateManager(), vae_encoder_window=cfg.vae_encoder_window),
    ):
        h = hashlib.sha256()
        for step, stream in enumerate(streams):
            out = rollout.pipeline_step(state, nets, cfg, 0, step, frame_stream=stream)
            if step in adapter_steps:
                for v in out:
                    rollout.hash_value(h, v)
        digests.append(h.hexdigest())
    assert digests[0] == digests[1]
    return digests[0]


@pytest.mark.parametrize("policy", ["declared", "share"])
def test_a_fork_is_a_real_snapshot_of_a_dreamzero_session(policy, monkeypatch):
    """Fork at step 30, feed the forks different frames for 12 steps: each equals an unforked replay.

    With the pending-frame list shared between forks (policy "share", the old behaviour), one fork's appends
    leak into the other and the digests differ: the control shows the check can fail.
    """
    if policy == "share":
        # The feat map is a DenseValue (immutable: forks cannot share writes); the pending-frames list is an
        # attr whose declared policy copies it.
        monkeypatch.setattr(DreamZeroStateAdapter.__dict__["vae_pending_body_frames"], "on_fork", "share")
    cfg = rollout.small_config(prompt_every=10**6)
    nets = rollout.Networks(cfg)
    manager = SessionStateManager()

    def adapter(sid):
        return DreamZeroStateAdapter(sid, manager, vae_encoder_window=cfg.vae_encoder_window)

    for step in range(30):
        rollout.pipeline_step(adapter("s"), nets, cfg, 0, step)
    manager.fork_session("s", "s/fork")
    streams = {"s": 0, "s/fork": 7}
    digests = {sid: hashlib.sha256() for sid in streams}
    for step in range(30, 42):
        for sid, stream in streams.items():
            for v in rollout.pipeline_step(adapter(sid), nets, cfg, 0, step, frame_stream=stream):
                rollout.hash_value(digests[sid], v)
    later = set(range(30, 42))
    replays = {sid: _replay_digest(cfg, nets, [0] * 30 + [stream] * 12, later) for sid, stream in streams.items()}
    assert replays["s"] != replays["s/fork"]  # the inputs matter
    matches = {sid: digests[sid].hexdigest() == replays[sid] for sid in streams}
    if policy == "declared":
        assert matches == {"s": True, "s/fork": True}
    else:
        assert not all(matches.values())


def test_commit_all_is_one_transaction():
    # Regression: the adapter rebuilt a missing buffer under one lock and committed under another, so a reset
    # from another adapter of the session in between made the append raise NotAllocatedError.
    manager = SessionStateManager()
    a, b = DreamZeroStateAdapter("s", manager), DreamZeroStateAdapter("s", manager)
    calls = []
    original = a._session.transact

    def transact(fn):
        calls.append(fn)
        b.reset()  # another adapter of the session resets just before the transaction runs
        return original(fn)

    a._session = type(
        "H", (), {"transact": staticmethod(transact), "__getattr__": lambda self, n: getattr(b._session, n)}
    )()
    b._session.remove("vae_encoder_out")  # a lost ring: the append rebuilds it (the transaction's path)
    a.append_vae_encoder_chunk(_chunk(1))
    assert len(calls) == 1 and len(b._buffer("vae_encoder_out").view()) == 1


def test_the_encoder_step_is_one_commit_of_the_torch_tensor_and_no_bridge_crossing(monkeypatch):
    """The per-step encoder write and read (issue 24): the chunk goes into the ring as itself, by one commit
    (no read-modify-write transaction), and the observation comes back without a DLPack import either way
    (which cost ~5x the step's own torch.cat when the ring held JAX aliases)."""
    manager = SessionStateManager()
    state = DreamZeroStateAdapter("s", manager, vae_encoder_window=2)
    state.append_vae_encoder_chunk(_chunk(0))
    transactions = []
    original = fs.SessionHandle.transact
    monkeypatch.setattr(fs.SessionHandle, "transact", lambda h, fn: transactions.append(fn) or original(h, fn))
    reset_report()
    chunk = _chunk(1)
    state.append_vae_encoder_chunk(chunk)
    obs = state.observation_latents(2)
    kept = fs.sessions(manager.state)["s"].get("vae_encoder_out").view()[-1]
    assert type(kept) is torch.Tensor and torch.equal(kept, chunk)  # a torch copy, never a JAX alias
    assert report()["wrapped_count"] == 0 and report()["copied_count"] == 0 and transactions == []
    assert torch.equal(obs[:, :, :1], _chunk(0)) and torch.equal(obs[:, :, 1:], chunk)


def test_a_thousand_begin_close_cycles_reclaim_every_slot_and_byte():
    manager = SessionStateManager(max_sessions=4, evict_when_full=False)  # a leaked slot would refuse
    shapes = Cosmos3Shapes(num_layers=2, num_heads=2, head_dim=8, text_len=5, padded_text_len=8, media_tokens=4)
    for i in range(1000):
        sid = f"robot-{i % 8}"
        state = DreamZeroStateAdapter(sid, manager)
        state.accumulate_frames(_frame(i))
        state.append_vae_encoder_chunk(_chunk(i))
        state.vae_enc_feat_map = [torch.zeros(16)]
        with request_session(manager, f"req-{i}") as kv:
            kv.set_branch(False, encode_und_kv(shapes, i), build_freqs_gen(shapes))
            assert len(manager) == 2
        assert manager.stats()["total_nbytes"] > 0
        assert manager.drop_session(sid) and not manager.drop_session(sid)  # release is idempotent
        assert len(manager) == 0 and manager.stats()["total_nbytes"] == 0
    s = manager.stats()
    assert s["misses"] == 2000 and s["evictions"] == 0


def test_parking_every_feat_map_after_every_step_changes_no_output():
    cfg = rollout.small_config(steps=40, sessions=2, prompt_every=30)
    digests, stats = {}, {}
    for label, enabled, park in (("bespoke", False, False), ("manager", True, False), ("manager+park", True, True)):
        with enable_override(enabled):
            result = rollout.run_rollout(dataclasses.replace(cfg, park_feat_map=park))
        digests[label], stats[label] = result.digest, result.stats
    assert digests["bespoke"] == digests["manager"] == digests["manager+park"]
    parked = stats["manager+park"]
    # Every step parks; the next step restores on access, except after a session's last step and when the
    # next step starts with a prompt change (a session reset drops the parked cache instead).
    resets = cfg.sessions * ((cfg.steps - 1) // cfg.prompt_every)
    assert resets > 0 and parked["parks"] == cfg.sessions * cfg.steps
    assert parked["restores"] == parked["parks"] - cfg.sessions - resets
    assert stats["manager"]["parks"] == 0


def test_self_attention_kv_lives_in_the_paged_engine_through_a_handle_and_stays_bit_identical():
    cfg = rollout.small_config(steps=40, sessions=2, prompt_every=25, trace_pools=True)
    with enable_override(False):
        bespoke = rollout.run_rollout(cfg)
    with enable_override(True):
        managed = rollout.run_rollout(cfg)
        without_kv = rollout.run_rollout(dataclasses.replace(cfg, self_attn_kv=False))
    assert bespoke.digest == managed.digest  # the flag flip stays bit-identical with the KV in the engine
    assert without_kv.digest != managed.digest  # and the generator really reads the KV
    assert bespoke.kv_blocks_leaked == managed.kv_blocks_leaked == 0  # every block went back, on both paths
    held = [p["kv_pool:self-attn-kv:held_nbytes"] for p in managed.pool_trace]
    block = 2 * 4 * 2 * 8 * 2  # K and V, 4 tokens x 2 heads x 8 dims, bf16
    assert all(n % block == 0 for n in held) and max(held) <= cfg.sessions * (cfg.local_attn_size + 1) * block
    assert min(held) < max(held)  # window and prompt resets let blocks go
    assert managed.stats is not None and managed.stats["kv_pool:self-attn-kv:held_nbytes"] == held[-1]


def test_the_session_surface_reports_and_resets_its_kv_blocks():
    from torch_bridge.harness.paged_engine import ReferenceKVEngine

    engine = ReferenceKVEngine(num_blocks=8, block_size=4, heads=2, head_dim=8)
    manager = SessionStateManager()
    state = DreamZeroStateAdapter("robot", manager)
    state.append_self_attn_kv(engine.pool, engine.allocate(2))
    state.append_self_attn_kv(engine.pool, engine.allocate(1))
    assert state.self_attn_kv_blocks == (0, 1, 2) and state.self_attn_kv()[0].shape == (12, 2, 8)
    assert manager.stats()["kv_pool:engine-kv:held_nbytes"] == 3 * 2 * 4 * 2 * 8 * 2
    state.reset_inference_state()  # a window reset starts attention afresh: the blocks go back
    assert state.self_attn_kv_blocks == () and engine.freed_log == [(0, 1, 2)]


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
