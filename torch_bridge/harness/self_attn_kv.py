"""The generator's self-attention KV, kept in a reference paged engine (`SelfAttnKV`)."""

from __future__ import annotations

from typing import Any

import torch

from functional_state import paged_gather as fs_gather

from ..adapters.dreamzero_bespoke import BespokeDreamZeroState
from .config import RolloutConfig
from .paged_engine import ReferenceKVEngine

__all__ = ["SelfAttnKV"]


class SelfAttnKV:
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
