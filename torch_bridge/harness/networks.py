"""The rollout's networks: diffusers' real Wan causal VAE encoder (or an elementwise stand-in), and stand-in
quant_conv, text encoder and generator, where no real package provides the part."""

from __future__ import annotations

from typing import Any

import torch

from functional_state import InvalidArgumentError

from ..adapters.wan import require_diffusers
from .config import WAN_BASE_DIM, RolloutConfig

__all__ = ["Networks", "wan_encoder"]


def wan_encoder(cfg: RolloutConfig) -> Any:
    """diffusers' real Wan 2.1 causal VAE encoder, tiny (``WAN_BASE_DIM`` channels, one res block per level),
    random init from a fixed seed: ``encoder_channels`` output channels (the latent distribution's mean and
    log-variance)."""
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


class Networks:
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
