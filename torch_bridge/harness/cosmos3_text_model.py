"""Cosmos3's encode-once UND pass computed by a real transformers text model (a tiny random-init Qwen2).

The prompt is run once, padded to ``padded_text_len``, with a `DynamicCache`; each layer's (K, V) handed to
`Cosmos3StateAdapter` is a ``[:, :, :text_len]`` view of that cache's own tensors, so the padded allocation is
what a branch retains (as the footprint formula counts). The GEN rotary tables are the model's own rotary
embedding over the media positions. Needs the ``[transformers]`` extra; weights are never downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import transformers

from functional_state import SessionStateManager

from ..adapters.cosmos3 import request_session
from ..adapters.cosmos3_footprint import CFG_MODES, cosmos3_footprint

__all__ = ["PLACEMENTS", "build_freqs_gen", "encode_und_kv", "placement_figures"]

# CFG placement -> the branches (is_negative) each rank holds: one rank, both branches on one rank, or one
# branch on each of two CFG ranks.
PLACEMENTS: dict[str, list[list[bool]]] = {
    "none": [[False]],
    "sequential": [[False, True]],
    "parallel": [[False], [True]],
}


def text_ids(text_len: int, padded_text_len: int, *, seed: int, pad_id: int = 0) -> torch.Tensor:
    """A prompt of ``text_len`` tokens padded to ``padded_text_len``, shape ``(1, padded_text_len)``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((1, padded_text_len), pad_id, dtype=torch.long)
    ids[0, :text_len] = torch.randint(1, 128, (text_len,), generator=g)
    return ids


@torch.no_grad()
def encode_und_kv(model: Any, ids: torch.Tensor, text_len: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Any]:
    """The UND pass: ``model`` run once over the padded ``ids``; returns per-layer ``(K, V)`` trimmed to
    ``text_len`` (views of the cache's tensors: causal attention leaves the text positions' K/V unaffected
    by the padding after them) and the cache itself."""
    cache = transformers.DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    layers: list[Any] = list(cache.layers)
    return [(layer.keys[:, :, :text_len], layer.values[:, :, :text_len]) for layer in layers], cache


@torch.no_grad()
def build_freqs_gen(model: Any, media_tokens: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEN rotary ``(cos, sin)`` tables from the model's own rotary embedding, float32, each
    ``(1, media_tokens, head_dim)``."""
    positions = torch.arange(offset, offset + media_tokens).unsqueeze(0)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = model.model.rotary_emb(x, positions)
    return cos, sin


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def placement_figures(
    model: Any, cfg: str, *, text_len: int, padded_text_len: int, media_tokens: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Run one request per rank of placement ``cfg``: the real UND pass per branch, its K/V and tables
    handed to `Cosmos3StateAdapter` by reference. Returns per rank: ``stored`` (the distinct storages'
    bytes), ``formula`` (`cosmos3_footprint`), ``stats`` (``total_nbytes`` while live), ``copies`` (tensors
    whose stored pointer differs from the model's), ``after`` (``total_nbytes`` once the request ended)."""
    if cfg not in CFG_MODES:
        raise ValueError(f"cfg must be one of {CFG_MODES}, got {cfg!r}")
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    formula = cosmos3_footprint(
        num_layers=config.num_hidden_layers,
        num_heads=config.num_key_value_heads,
        head_dim=head_dim,
        padded_text_len=padded_text_len,
        media_tokens=media_tokens,
        dtype=next(model.parameters()).dtype,
        freqs_dtype=torch.float32,
        cfg=cfg,
    ).per_rank_bytes
    ranks = []
    for r, branches in enumerate(PLACEMENTS[cfg]):
        manager = SessionStateManager()
        with request_session(manager, f"req-{cfg}-{r}") as state:
            given: list[torch.Tensor] = []
            for is_negative in branches:
                ids = text_ids(text_len, padded_text_len, seed=seed + int(is_negative))
                kv, _ = encode_und_kv(model, ids, text_len)
                freqs = build_freqs_gen(model, media_tokens, offset=int(is_negative))
                state.set_branch(is_negative, kv, freqs)
                given += [t for pair in kv for t in pair] + list(freqs)
            held: list[torch.Tensor] = []
            for is_negative in branches:
                got = state.get_branch(is_negative)
                assert got is not None
                held += [t for pair in got[0] for t in pair] + list(got[1])
            copies = sum(a.data_ptr() != b.data_ptr() for a, b in zip(given, held, strict=True))
            storages = {_storage_key(t): t.untyped_storage().nbytes() for t in held}
            stats = manager.stats()["total_nbytes"]
        ranks.append(
            {
                "branches": _names(branches),
                "stored": sum(storages.values()),
                "formula": formula,
                "stats": stats,
                "copies": copies,
                "after": manager.stats()["total_nbytes"],
                "sessions_after": len(manager),
            }
        )
    return ranks


def _names(branches: Sequence[bool]) -> str:
    return "+".join("uncond" if b else "cond" for b in branches)
