"""A deterministic synthetic DreamZero rollout: the A/B equivalence harness.

It drives session state exactly as the pipeline does (frames in, a causal VAE encoder stream, an
observation read, latents appended, window and session resets from ``local_attn_size`` and prompt
changes) with stand-in networks built from elementwise ops only, so every result is bitwise reproducible
whatever the tensor sizes. `resolve_session_state_config` picks the path (bespoke state, or the adapter
over a `SessionStateManager`), and every request goes through `DreamZeroSessions` (begin, continue, close). The run prints one digest of every per-step output; the two paths must
print the same one.

``python -m torch_bridge.harness --steps 400 --sessions 3``
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from functional_state import SessionStateLostError

from ..adapters.dreamzero_bespoke import BespokeDreamZeroState
from ..adapters.dreamzero_store import DreamZeroSessions, begins_session, default_resident_bound
from .config import MIB, VAE_ENCODERS, RolloutConfig, small_config
from .inputs import hash_value, new_feat_map, prompt_tokens, stitched_frame
from .networks import Networks
from .self_attn_kv import SelfAttnKV

__all__ = ["RolloutResult", "main", "pipeline_step", "run_rollout"]


def pipeline_step(
    state: Any,
    nets: Networks,
    cfg: RolloutConfig,
    session: int,
    step: int,
    frame_stream: int | None = None,
    kv: SelfAttnKV | None = None,
) -> list[Any]:
    """One pipeline call on one session's state; returns the per-step outputs that the digest covers.

    ``frame_stream`` picks the camera input (default: ``session``'s), so a fork can be fed other frames
    under the same prompt. With ``kv``, the generator also attends over the session's self-attention KV
    in the paged engine and appends this step's.
    """
    sid = f"session-{session}"
    tokens = prompt_tokens(session, step // cfg.prompt_every)
    reason = state.reset_reason(tokens, 1, cfg.local_attn_size)
    if reason == "session":
        state.reset(clear_video_latents=True)
        state.language = tokens
        state.prompt_embeds = nets.text(tokens)
    elif reason == "inference":
        state.reset_inference_state()
    if reason is not None and kv is not None:
        kv.reset(state, sid)
    frame = stitched_frame(cfg, session if frame_stream is None else frame_stream, step)
    if state.clip_feas is None:
        state.clip_feas = frame.float().mean(dim=(0, 1)).to(torch.bfloat16)
        state.ys = frame[::8, ::8].float().mean(-1).to(torch.bfloat16)
    window = state.accumulate_frames(frame)

    new_latent = False
    if not state.vae_stream_initialized:
        state.vae_enc_feat_map = new_feat_map(cfg, nets)
        state.vae_stream_initialized = True
        state.vae_pending_body_frames = []
        state.append_vae_encoder_chunk(nets.encode([frame], state.vae_enc_feat_map))
        new_latent = True
    else:
        pending = state.vae_pending_body_frames
        pending.append(frame)  # mutated in place: the list is carried by identity
        if len(pending) == state.FRAMES_PER_CHUNK:
            state.append_vae_encoder_chunk(nets.encode(pending, state.vae_enc_feat_map))
            state.vae_pending_body_frames = []
            new_latent = True

    if isinstance(state, BespokeDreamZeroState):
        # The bespoke reader quantises the whole history, then keeps the last frames.
        history = state.vae_encoder_out
        assert history is not None  # the first step encodes a chunk
        obs = nets.quant(history)[:, :, -cfg.num_frame_per_block :]
    else:
        latest = state.observation_latents(cfg.num_frame_per_block)
        assert latest is not None
        obs = nets.quant(latest)
    video_out = nets.generate(obs, window, state.prompt_embeds, state.call_count)
    if kv is not None:
        past = kv.read(state, sid)
        if past is not None:  # attention over the window's earlier steps, reduced to one term
            video_out = (video_out.float() + past.float().mean() * 0.01).to(torch.bfloat16)
        kv.append(state, sid, obs)
    if new_latent:
        state.append_video_latents(video_out)
    state.call_count += 1
    state.current_start_frame += 1
    return [reason, window, obs, video_out, state.call_count, state.current_start_frame]


@dataclasses.dataclass
class RolloutResult:
    path: str  # "bespoke" or "manager"
    digest: str
    components: dict[str, dict[str, int]]  # session id -> component -> bytes, after the last step
    totals: dict[str, int]  # session id -> every byte the session holds, each allocation once
    bytes_trace: list[dict[str, int]]  # session 0's components and "total" per step (when traced)
    latents_shape: tuple[int, ...] | None
    stats: dict[str, Any] | None  # manager stats (manager path)
    lost: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (session, step) continuations refused
    pool_trace: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # per round, when traced
    kv_blocks_leaked: int = 0  # self-attention KV blocks still allocated in the engine after every close


def run_rollout(cfg: RolloutConfig, progress: Callable[[int], None] | None = None) -> RolloutResult:
    """Run ``cfg.steps`` steps on each of ``cfg.sessions`` interleaved sessions, on the configured path.

    Every request goes through the serving lifecycle (`DreamZeroSessions`): a session's first request is a
    begin (``reset`` set in its extra args), the others continuations; at the end the latents are exported and
    the sessions closed.
    """
    store = DreamZeroSessions(
        cfg.enable_session_state_manager,
        resident_bound=cfg.resident_bound or max(cfg.sessions, default_resident_bound()),
        vae_encoder_window=cfg.vae_encoder_window,
        byte_budget=cfg.byte_budget,
        release_levers=cfg.release_levers,
    )
    nets = Networks(cfg)
    kv = SelfAttnKV(cfg) if cfg.self_attn_kv else None
    digest = hashlib.sha256()
    trace: list[dict[str, int]] = []
    pool_trace: list[dict[str, Any]] = []
    lost: list[tuple[str, int]] = []
    gone: set[str] = set()
    for step in range(cfg.steps):
        for session in range(cfg.sessions):
            sid = f"session-{session}"
            if sid in gone:
                continue
            extra_args = {"reset": step == 0}  # as a runner sends it
            try:
                state = store.begin(sid) if begins_session(extra_args) else store.resume(sid)
            except SessionStateLostError:  # the budget dropped it: a loud loss, never a silent restart
                lost.append((sid, step))
                gone.add(sid)
                continue
            for value in pipeline_step(state, nets, cfg, session, step, kv=kv):
                hash_value(digest, value)
            if cfg.park_feat_map and store.enabled:
                state.park_feat_map()
            if cfg.trace_bytes and session == 0:
                trace.append({**state.component_nbytes(), "total": state.total_nbytes()})
        if cfg.trace_pools and store.enabled:
            s = store.manager.stats()
            pool_trace.append(
                {
                    k: v
                    for k, v in s.items()
                    if k.startswith(("nbytes:", "kv_pool:")) or k in ("parks", "restores", "evictions")
                }
            )
        if progress is not None:
            progress(step)
    final_states = {
        f"session-{s}": store.resume(f"session-{s}") for s in range(cfg.sessions) if f"session-{s}" not in gone
    }
    for sid in final_states:
        hash_value(digest, sid)
        hash_value(digest, store.decode_accumulated_video_latents(sid))
    latents = store.decode_accumulated_video_latents("session-0") if "session-0" in final_states else None
    result = RolloutResult(
        path="manager" if store.enabled else "bespoke",
        digest=digest.hexdigest(),
        components={sid: s.component_nbytes() for sid, s in final_states.items()},
        totals={sid: s.total_nbytes() for sid, s in final_states.items()},
        bytes_trace=trace,
        latents_shape=None if latents is None else tuple(latents.shape),
        stats=store.manager.stats() if store.enabled else None,
        lost=lost,
        pool_trace=pool_trace,
    )
    for sid in final_states:
        store.close(sid)
        if kv is not None:
            kv.close(sid)
    if kv is not None:  # every block went back to the engine, on either path
        result.kv_blocks_leaked = len(kv.engine.allocated)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Deterministic synthetic DreamZero rollout; prints one digest.")
    parser.add_argument("--steps", type=int, default=400, help="steps per session (default 400)")
    parser.add_argument("--sessions", type=int, default=3, help="interleaved sessions (default 3)")
    parser.add_argument("--deploy-shapes", action="store_true", help="use the shipped 180x320 camera shapes")
    parser.add_argument("--feat-map-mib", type=float, default=None, help="VAE feat map size (deploy: 603)")
    parser.add_argument("--enable", action="store_true", help="config value of enable_session_state_manager")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--park-feat-map", action="store_true", help="manager path: park feat maps after each step")
    parser.add_argument("--vae-encoder", choices=VAE_ENCODERS, default="stand-in", help="the causal VAE encoder")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = dict(
        steps=args.steps,
        sessions=args.sessions,
        enable_session_state_manager=args.enable,
        park_feat_map=args.park_feat_map,
        vae_encoder=args.vae_encoder,
    )
    if args.feat_map_mib is not None:
        overrides["feat_map_bytes"] = int(args.feat_map_mib * MIB)
    cfg = RolloutConfig(**overrides) if args.deploy_shapes else small_config(**overrides)
    result = run_rollout(cfg)
    if args.json:
        print(
            json.dumps(
                {
                    "path": result.path,
                    "digest": result.digest,
                    "components": result.components,
                    "latents_shape": result.latents_shape,
                }
            )
        )
    else:
        print(f"path={result.path} digest={result.digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
