"""A per-rank model of the bytes Cosmos3's retained UND K/V and GEN M-RoPE tables hold.

Per retained branch: ``sum over layers of storage(K) + storage(V)``, plus ``storage(cos) + storage(sin)``,
where storage is the *allocation* a tensor keeps alive: K/V trimmed to the text length are slices of
allocations sized by the padded text length, so the padded length is what counts.

This is retained memory, **not a peak bound**: while the next branch is built, its UND activations, the new
full K/V result, its RoPE tables and the generator's activations exist beside the branch already retained,
so the peak is higher. The count-based session cap does not bound it either.
"""

from __future__ import annotations

import dataclasses

import torch

from functional_state import InvalidArgumentError

__all__ = ["CFG_MODES", "Cosmos3Footprint", "cosmos3_footprint"]

CFG_MODES = ("none", "sequential", "parallel")


@dataclasses.dataclass(frozen=True)
class Cosmos3Footprint:
    """Retained bytes on one rank, and how they break down."""

    per_rank_bytes: int
    branches_per_rank: int
    kv_bytes_per_branch: int
    freqs_bytes_per_branch: int
    ranks: int  # CFG ranks x sequence-parallel ranks

    @property
    def per_rank_mib(self) -> float:
        return self.per_rank_bytes / 2**20


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cosmos3_footprint(
    *,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    padded_text_len: int,
    media_tokens: int,
    dtype: torch.dtype = torch.bfloat16,
    freqs_dtype: torch.dtype = torch.float32,
    text_batch: int = 1,
    cfg: str = "sequential",
    sp_degree: int = 1,
) -> Cosmos3Footprint:
    """Predict the retained UND K/V + RoPE bytes per rank.

    Args:
      num_layers, num_heads, head_dim: transformer geometry.
      padded_text_len: the text length K/V allocations are sized by (not the trimmed length).
      media_tokens: GEN tokens; sizes each of cos and sin as ``(media_tokens, head_dim)``.
      dtype: K/V dtype; freqs_dtype: cos/sin dtype.
      text_batch: prompts per request.
      cfg: ``"none"`` (one conditional branch), ``"sequential"`` (both branches on every GPU) or
        ``"parallel"`` (one branch per CFG rank).
      sp_degree: sequence-parallel degree. UND K/V is replicated across SP ranks, not divided, so it
        does not change the per-rank figure; it multiplies the rank count.

    Raises:
      ValueError: an unknown ``cfg``, or a non-positive size.

    Example:
      >>> f = cosmos3_footprint(num_layers=28, num_heads=16, head_dim=128, padded_text_len=512,
      ...                       media_tokens=4096, cfg="sequential")
      >>> f.branches_per_rank, round(f.per_rank_mib, 1)
      (2, 232.0)
    """
    if cfg not in CFG_MODES:
        raise InvalidArgumentError(f"`cosmos3_footprint`: cfg must be one of {CFG_MODES}, got {cfg!r}.")
    sizes = dict(
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        padded_text_len=padded_text_len,
        media_tokens=media_tokens,
        text_batch=text_batch,
        sp_degree=sp_degree,
    )
    bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0}
    if bad:
        raise InvalidArgumentError(f"`cosmos3_footprint`: sizes must be positive ints, got {bad}.")
    kv_one = text_batch * num_heads * padded_text_len * head_dim * _itemsize(dtype)
    kv_branch = num_layers * 2 * kv_one
    freqs_branch = 2 * media_tokens * head_dim * _itemsize(freqs_dtype)
    branches = 2 if cfg == "sequential" else 1
    cfg_ranks = 2 if cfg == "parallel" else 1
    return Cosmos3Footprint(
        per_rank_bytes=branches * (kv_branch + freqs_branch),
        branches_per_rank=branches,
        kv_bytes_per_branch=kv_branch,
        freqs_bytes_per_branch=freqs_branch,
        ranks=cfg_ranks * sp_degree,
    )
