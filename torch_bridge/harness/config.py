"""The shapes and schedule of a synthetic DreamZero rollout (`RolloutConfig`), deploy-shaped by default."""

from __future__ import annotations

import dataclasses
from typing import Any

from functional_state import InvalidArgumentError

__all__ = ["DEPLOY_FEAT_MAP_BYTES", "MIB", "VAE_ENCODERS", "WAN_BASE_DIM", "RolloutConfig", "small_config"]

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


def small_config(**overrides: Any) -> RolloutConfig:
    """Test-sized shapes (same logic, tiny tensors): 24x40 cameras, a 64 KiB feat map."""
    base: dict[str, Any] = dict(camera_hw=(24, 40), feat_map_bytes=64 * 1024, feat_map_entries=8)
    base.update(overrides)
    return RolloutConfig(**base)
