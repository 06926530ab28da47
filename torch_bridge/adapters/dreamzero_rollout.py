"""A deterministic synthetic DreamZero rollout: the A/B equivalence harness.

It drives session state exactly as the pipeline does (frames in, a causal VAE encoder stream, an
observation read, latents appended, window and session resets from ``local_attn_size`` and prompt
changes) with stand-in networks built from elementwise ops only, so every result is bitwise reproducible
whatever the tensor sizes. `resolve_session_state_config` picks the path (bespoke state, or the adapter
over a `SessionStateManager`), and every request goes through `DreamZeroSessions` (begin, continue, close). The run prints one digest of every per-step output; the two paths must
print the same one.

``python -m torch_bridge.adapters.dreamzero_rollout --steps 400 --sessions 3``
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

from functional_state import InvalidArgumentError, SessionStateLostError
from functional_state import paged_gather as fs_gather

from .dreamzero_bespoke import BespokeDreamZeroState
from .dreamzero_store import DreamZeroSessions, begins_session, default_resident_bound
from .paged_engine import ReferenceKVEngine

MIB = 2**20
DEPLOY_FEAT_MAP_BYTES = 603 * MIB
VAE_ENCODERS = ("wan", "stand-in")
WAN_BASE_DIM = 8  # the tiny real encoder: Wan 2.1's layout (4 levels, 8x spatial, 4x temporal), few channels


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Shapes and schedule of a rollout. The defaults are the shipped deploy shapes."""

    steps: int = 400
    sessions: int = 3
    camera_hw: tuple[int, int] = (180, 320)  # three cameras, stitched two over one
    latent_channels: int = 16
    encoder_channels: int = 32
    feat_map_bytes: int = DEPLOY_FEAT_MAP_BYTES
    feat_map_entries: int = 30
    local_attn_size: int = 24  # frames per attention window: an inference reset when it fills
    num_frame_per_block: int = 2  # latent frames the observation read uses
    prompt_every: int = 150  # a new prompt (session reset) every this many steps
    vae_encoder_window: int = 2
    enable_session_state_manager: bool | None = None  # the config value; the environment overrides it
    trace_bytes: bool = False  # record session 0's bytes (per component, and deduplicated total) at every step
    park_feat_map: bool = False  # manager path: park each session's feat map after its step (restored on access)
    byte_budget: Any = None  # manager path: the manager's byte budget (see SessionStateManager)
    release_levers: tuple[str, ...] = ("park", "evict", "drop")  # what that budget may use
    resident_bound: int | None = None  # sessions the store admits (None: sized by bytes, at least `sessions`)
    trace_pools: bool = False  # manager path: record stats() pools, parks and restores after every round
    self_attn_kv: bool = True  # the generator attends over a self-attention KV in a reference paged engine
    # The causal VAE encoder: "wan" runs diffusers' real `WanEncoder3d` (tiny, random init, seeded; needs the
    # [diffusers] extra), its feat cache the model's own (``feat_map_bytes`` then unused); "stand-in" runs the
    # elementwise stand-in over a feat map of ``feat_map_bytes``.
    vae_encoder: str = "stand-in"

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "sessions",
            "latent_channels",
            "encoder_channels",
            "feat_map_entries",
            "num_frame_per_block",
            "prompt_every",
            "vae_encoder_window",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"RolloutConfig.{name} must be a positive int, got {value!r}.")
        if self.feat_map_bytes < 0:
            raise InvalidArgumentError(f"RolloutConfig.feat_map_bytes must be >= 0, got {self.feat_map_bytes}.")
        if self.vae_encoder not in VAE_ENCODERS:
            raise InvalidArgumentError(
                f"RolloutConfig.vae_encoder must be one of {VAE_ENCODERS}, got {self.vae_encoder!r}."
            )
        if self.num_frame_per_block > self.vae_encoder_window:
            raise InvalidArgumentError(
                f"RolloutConfig: num_frame_per_block={self.num_frame_per_block} exceeds vae_encoder_window="
                f"{self.vae_encoder_window}; the encoder ring could not serve the observation read."
            )

    @property
    def stitched_hw(self) -> tuple[int, int]:
        h, w = self.camera_hw
        return (2 * h) // 16 * 16, 2 * w  # 180x320 cameras -> 352x640

    @property
    def latent_hw(self) -> tuple[int, int]:
        h, w = self.stitched_hw
        return h // 8, w // 8  # 44x80 at deploy shapes


def wan_encoder(cfg: RolloutConfig) -> Any:
    """diffusers' real Wan 2.1 causal VAE encoder, tiny (``WAN_BASE_DIM`` channels, one res block per level),
    random init from a fixed seed: ``encoder_channels`` output channels (the latent distribution's mean and
    log-variance)."""
    from .wan import require_diffusers

    wan = require_diffusers()
    if cfg.encoder_channels % 2:
        raise InvalidArgumentError(
            f"RolloutConfig.encoder_channels must be even with vae_encoder='wan', got {cfg.encoder_channels}."
        )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(1234)
        vae = wan.AutoencoderKLWan(base_dim=WAN_BASE_DIM, z_dim=cfg.encoder_channels // 2, num_res_blocks=1)
    finally:
        torch.random.set_rng_state(state)
    return vae.encoder.eval()


class _Networks:
    """The encoder (diffusers' real `WanEncoder3d`, or a stand-in), and stand-in quant_conv, text encoder and
    generator: elementwise ops only (bitwise stable)."""

    def __init__(self, cfg: RolloutConfig):
        g = torch.Generator().manual_seed(1234)
        self.cfg = cfg
        self.enc_w = torch.randn(cfg.encoder_channels, 3, generator=g)
        self.quant_w = torch.randn(cfg.latent_channels, cfg.encoder_channels, generator=g) / cfg.encoder_channels
        self.wan = wan_encoder(cfg) if cfg.vae_encoder == "wan" else None
        self.wan_convs = (
            0 if self.wan is None else sum(type(m).__name__ == "WanCausalConv3d" for m in self.wan.modules())
        )

    def _mix(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A 1x1(x1) conv over dim 1 as a sum of scaled channels (pointwise in time and space)."""
        out = w[:, 0].reshape(1, -1, *([1] * (x.ndim - 2))) * x[:, 0:1]
        for c in range(1, w.shape[1]):
            out = out + w[:, c].reshape(1, -1, *([1] * (x.ndim - 2))) * x[:, c : c + 1]
        return out

    def encode(self, frames: list[torch.Tensor], feat_map: list) -> torch.Tensor:
        """Frames (H, W, 3) uint8 -> one latent frame (1, C_enc, 1, h, w) bf16.

        Like the causal VAE encoder, it reads its feature cache and replaces one cached tensor with a new one
        (``feat_map[i] = ...``: the list is mutated item by item, never reassigned), so the output depends on
        every chunk encoded before. The real Wan encoder reads and writes the cache as diffusers does.
        """
        if self.wan is not None:
            video = torch.stack(frames).permute(3, 0, 1, 2).unsqueeze(0).float() / 127.5 - 1.0  # (1, 3, T, H, W)
            with torch.no_grad():
                out = self.wan(video, feat_cache=feat_map, feat_idx=[0])  # (1, C_enc, 1, h, w)
            return out.to(torch.bfloat16)
        x = torch.stack(frames).float().mean(0)  # (H, W, 3)
        x = torch.nn.functional.avg_pool2d(x.permute(2, 0, 1).unsqueeze(0), 8)  # (1, 3, h, w)
        out = self._mix(x / 255.0, self.enc_w).unsqueeze(2)
        if feat_map:
            slot = int(frames[-1][0, 0, 0]) % len(feat_map)
            cached = feat_map[slot]
            out = out + cached[:1].float()  # the causal context
            fresh = cached.clone()
            fresh[:1] = (x.mean() / 255.0).to(fresh.dtype)
            feat_map[slot] = fresh
        return out.to(torch.bfloat16)

    def quant(self, latents: torch.Tensor) -> torch.Tensor:
        """quant_conv: kernel size 1, pointwise in time."""
        return self._mix(latents.float(), self.quant_w).to(torch.bfloat16)

    def text(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens.float().unsqueeze(-1) * torch.linspace(-1, 1, 8)).to(torch.bfloat16)

    def generate(self, obs: torch.Tensor, window: torch.Tensor, prompt: torch.Tensor, call: int) -> torch.Tensor:
        """(1, C_lat, T, h, w) observation -> video_out (1, T, C_lat, h, w) bf16."""
        bias = window.float().mean() / 255.0 + prompt.float().mean() + call * 1e-3
        return (obs.float() * 0.5 + bias).to(torch.bfloat16).transpose(1, 2).contiguous()


class _SelfAttnKV:
    """The generator's self-attention KV in a reference paged engine (one block of 4 tokens per step).

    The engine owns the blocks. On the bespoke path it also keeps each request's block table (here:
    ``tables``) and frees it on a reset or at the end; on the manager path the table is the session's
    `PagedKVHandle` (`DreamZeroStateAdapter.append_self_attn_kv`), and the manager frees the blocks when the
    session resets, is dropped or is closed.
    """

    HEADS, HEAD_DIM, BLOCK = 2, 8, 4

    def __init__(self, cfg: RolloutConfig):
        per_session = cfg.local_attn_size + 2  # a window reset lets go of the blocks
        self.engine = ReferenceKVEngine(
            num_blocks=max(1, cfg.sessions) * per_session * 2,
            block_size=self.BLOCK,
            heads=self.HEADS,
            head_dim=self.HEAD_DIM,
            name="self-attn-kv",
        )
        self.tables: dict[str, list[int]] = {}

    def read(self, state: Any, sid: str) -> torch.Tensor | None:
        """K and V of every earlier step of the window, concatenated, or None."""
        if isinstance(state, BespokeDreamZeroState):
            ids = self.tables.get(sid)
            if not ids:
                return None
            layers = [fs_gather(layer, ids) for layer in (self.engine.k[0], self.engine.v[0])]
        else:
            got = state.self_attn_kv()
            if got is None:
                return None
            layers = list(got)
        return torch.cat(layers)

    def append(self, state: Any, sid: str, obs: torch.Tensor) -> None:
        """Write this step's K/V (a function of the observation) into a fresh block and record it."""
        (block,) = self.engine.allocate(1)
        base = obs.float().mean()
        grid = torch.arange(self.HEADS * self.HEAD_DIM, dtype=torch.float32).reshape(self.HEADS, self.HEAD_DIM)
        for slot in range(self.BLOCK):
            k = (base + slot * 0.125 + grid * 0.01).to(torch.bfloat16)
            self.engine.write(block, slot, k, (k.float() * 0.5).to(torch.bfloat16))
        if isinstance(state, BespokeDreamZeroState):
            self.tables.setdefault(sid, []).append(block)
        else:
            state.append_self_attn_kv(self.engine.pool, [block])

    def reset(self, state: Any, sid: str) -> None:
        """A session or window reset: the bespoke table frees its blocks (the adapter's reset already did)."""
        if isinstance(state, BespokeDreamZeroState):
            self.close(sid)

    def close(self, sid: str) -> None:
        ids = self.tables.pop(sid, None)
        if ids:
            self.engine.free(tuple(ids))


def _frame(cfg: RolloutConfig, session: int, step: int) -> torch.Tensor:
    h, w = cfg.camera_hw
    cams = [
        (
            (
                torch.arange(h * w, dtype=torch.int64).reshape(h, w, 1) * (3 + c)
                + step * 7
                + session * 31
                + torch.arange(3)
            )
            % 251
        ).to(torch.uint8)
        for c in range(3)
    ]
    top = torch.cat(cams[:2], dim=1)
    bottom = torch.zeros_like(top)
    bottom[:, w // 2 : w // 2 + w] = cams[2]
    return torch.cat([top, bottom], dim=0)[: cfg.stitched_hw[0]].clone()  # its own allocation, cropped


def _tokens(session: int, prompt_index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * session + prompt_index)
    return torch.randint(0, 32_000, (12,), generator=g)


def _feat_map(cfg: RolloutConfig, nets: _Networks | None = None) -> list:
    if nets is not None and nets.wan is not None:
        return [None] * nets.wan_convs  # the model's own cache, filled by its first chunk
    per = cfg.feat_map_bytes // (2 * cfg.feat_map_entries)
    return [torch.zeros(per, dtype=torch.bfloat16) for _ in range(cfg.feat_map_entries)]


def _hash(h: hashlib._Hash, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"{tuple(value.shape)}{value.dtype}".encode())
        h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(value).encode())


def _step(
    state: Any,
    nets: _Networks,
    cfg: RolloutConfig,
    session: int,
    step: int,
    frame_stream: int | None = None,
    kv: _SelfAttnKV | None = None,
) -> list[Any]:
    """One pipeline call on one session's state; returns the per-step outputs that the digest covers.

    ``frame_stream`` picks the camera input (default: ``session``'s), so a fork can be fed other frames
    under the same prompt. With ``kv``, the generator also attends over the session's self-attention KV
    in the paged engine and appends this step's.
    """
    sid = f"session-{session}"
    tokens = _tokens(session, step // cfg.prompt_every)
    reason = state.reset_reason(tokens, 1, cfg.local_attn_size)
    if reason == "session":
        state.reset(clear_video_latents=True)
        state.language = tokens
        state.prompt_embeds = nets.text(tokens)
    elif reason == "inference":
        state.reset_inference_state()
    if reason is not None and kv is not None:
        kv.reset(state, sid)
    frame = _frame(cfg, session if frame_stream is None else frame_stream, step)
    if state.clip_feas is None:
        state.clip_feas = frame.float().mean(dim=(0, 1)).to(torch.bfloat16)
        state.ys = frame[::8, ::8].float().mean(-1).to(torch.bfloat16)
    window = state.accumulate_frames(frame)

    new_latent = False
    if not state.vae_stream_initialized:
        state.vae_enc_feat_map = _feat_map(cfg, nets)
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
    nets = _Networks(cfg)
    kv = _SelfAttnKV(cfg) if cfg.self_attn_kv else None
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
            for value in _step(state, nets, cfg, session, step, kv=kv):
                _hash(digest, value)
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
        _hash(digest, sid)
        _hash(digest, store.decode_accumulated_video_latents(sid))
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


def small_config(**overrides: Any) -> RolloutConfig:
    """Test-sized shapes (same logic, tiny tensors): 24x40 cameras, a 64 KiB feat map."""
    base: dict[str, Any] = dict(camera_hw=(24, 40), feat_map_bytes=64 * 1024, feat_map_entries=8)
    base.update(overrides)
    return RolloutConfig(**base)


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
