"""A stand-in for Cosmos3's transformer cache: the bespoke reference the adapter replaces.

Cosmos3 encodes the text ("UND") conditioning once per generation into per-layer ``(K, V)`` pairs and
builds the GEN M-RoPE ``(cos, sin)`` tables, then rereads them at every denoising step. The bespoke code
keeps them on the transformer instance (``cached_kv``, ``freqs_gen``, and a cond/uncond branch cache), so
every request that uses the instance shares them, and ``reset_cache()`` at the start of the next
generation is the only cleanup. Two interleaved requests on one instance therefore clobber each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["Cosmos3Shapes", "Cosmos3TransformerCache", "build_freqs_gen", "encode_und_kv"]


@dataclasses.dataclass(frozen=True)
class Cosmos3Shapes:
    """UND K/V and RoPE shapes of one branch."""

    num_layers: int = 8
    num_heads: int = 8
    head_dim: int = 64
    text_len: int = 77  # the trimmed length the model reads
    padded_text_len: int = 128  # the allocation the K/V slices keep alive
    media_tokens: int = 256  # sizes freqs_gen
    text_batch: int = 1
    dtype: torch.dtype = torch.bfloat16
    freqs_dtype: torch.dtype = torch.float32


def encode_und_kv(shapes: Cosmos3Shapes, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)``: each a ``[:, :, :text_len]`` slice of its own padded allocation (as the model's
    fused projections produce), so storage follows ``padded_text_len``."""
    g = torch.Generator().manual_seed(seed)
    shape = (shapes.text_batch, shapes.num_heads, shapes.padded_text_len, shapes.head_dim)
    kv = []
    for _ in range(shapes.num_layers):
        k = torch.randn(shape, generator=g).to(shapes.dtype)
        v = torch.randn(shape, generator=g).to(shapes.dtype)
        kv.append((k[:, :, : shapes.text_len], v[:, :, : shapes.text_len]))
    return kv


def build_freqs_gen(shapes: Cosmos3Shapes, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEN M-RoPE tables, ``(media_tokens, head_dim)`` each."""
    pos = torch.arange(shapes.media_tokens, dtype=torch.float32).unsqueeze(1) + offset
    inv = 1.0 / (10_000 ** (torch.arange(shapes.head_dim, dtype=torch.float32) / shapes.head_dim))
    angles = pos * inv
    return torch.cos(angles).to(shapes.freqs_dtype), torch.sin(angles).to(shapes.freqs_dtype)


class Cosmos3TransformerCache:
    """The transformer fields Cosmos3 keeps its encode-once conditioning in (shared by every request)."""

    def __init__(self) -> None:
        self.cached_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.freqs_gen: tuple[torch.Tensor, torch.Tensor] | None = None
        self.branch_cache: dict[bool, tuple[Any, Any]] = {}  # is_negative -> (cached_kv, freqs_gen)

    def reset_cache(self) -> None:
        """Called at the start of each generation: drops whatever the last request left behind."""
        self.cached_kv = None
        self.freqs_gen = None
        self.branch_cache.clear()

    def encode_branch(self, shapes: Cosmos3Shapes, is_negative: bool, seed: int) -> None:
        """Encode a branch into the transformer fields and the cond/uncond cache (the bespoke path)."""
        self.cached_kv = encode_und_kv(shapes, seed)
        self.freqs_gen = build_freqs_gen(shapes, offset=float(is_negative))
        self.branch_cache[is_negative] = (self.cached_kv, self.freqs_gen)

    def use_branch(self, is_negative: bool) -> None:
        """Point the transformer fields at a cached branch (sequential CFG alternates branches)."""
        self.cached_kv, self.freqs_gen = self.branch_cache[is_negative]

    def attend(self, query: torch.Tensor) -> torch.Tensor:
        """A denoising step's read of the conditioning: attention of ``query`` over every layer's K/V."""
        if self.cached_kv is None or self.freqs_gen is None:
            raise RuntimeError("attend: the transformer holds no conditioning K/V; encode or load a branch first.")
        out = torch.zeros_like(query, dtype=torch.float32)
        for k, v in self.cached_kv:
            scores = torch.einsum("bhqd,bhkd->bhqk", query.float(), k.float()) / k.shape[-1] ** 0.5
            out = out + torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v.float())
        cos, sin = self.freqs_gen
        return out * cos[: query.shape[2]].mean() + sin[: query.shape[2]].mean()
