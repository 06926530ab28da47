"""The rollout's deterministic inputs (stitched camera frames, prompt tokens, a fresh feat map) and the digest
of its outputs."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .config import RolloutConfig
from .networks import Networks

__all__ = ["hash_value", "new_feat_map", "prompt_tokens", "stitched_frame"]


def stitched_frame(cfg: RolloutConfig, session: int, step: int) -> torch.Tensor:
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


def prompt_tokens(session: int, prompt_index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * session + prompt_index)
    return torch.randint(0, 32_000, (12,), generator=g)


def new_feat_map(cfg: RolloutConfig, nets: Networks | None = None) -> list:
    if nets is not None and nets.wan is not None:
        return [None] * nets.wan_convs  # the model's own cache, filled by its first chunk
    per = cfg.feat_map_bytes // (2 * cfg.feat_map_entries)
    return [torch.zeros(per, dtype=torch.bfloat16) for _ in range(cfg.feat_map_entries)]


def hash_value(h: hashlib._Hash, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"{tuple(value.shape)}{value.dtype}".encode())
        h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(value).encode())
