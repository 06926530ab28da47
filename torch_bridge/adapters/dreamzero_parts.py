"""The pieces of a DreamZero session the adapter and its readers share: component names, conversions, sizes.

Split out of `dreamzero.py` (the adapter) so that module stays one concept: its object API over a handle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from functional_state import (
    InvalidArgumentError,
    SessionAttr,
    SessionHandle,
    SessionState,
    SessionStateLostError,
    nbytes_by_device,
)

from ..bridge import unwrap, wrap
from .feat_map_view import FEAT_MAP

__all__ = [
    "ENCODER",
    "FRAMES",
    "KV",
    "LATENTS",
    "StrictHandle",
    "as_torch",
    "cat_time",
    "check_window",
    "dreamzero_component_nbytes",
    "tensor_attr",
    "to_state",
]

FRAMES = "stitched_frames"
LATENTS = "video_latents"
ENCODER = "vae_encoder_out"
KV = "self_attn_kv"  # the generator's self-attention KV: blocks of the engine's paged pool


def check_window(window: Any) -> None:
    """Refuse a ``vae_encoder_window`` that is not a positive int."""
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise InvalidArgumentError(
            f"`DreamZeroStateAdapter`: vae_encoder_window must be a positive int, got {window!r}."
        )


def to_state(value: Any) -> Any:
    """A torch tensor as the session keeps it (`torch_bridge.wrap`); anything else as it is."""
    return wrap(value) if isinstance(value, torch.Tensor) else value


def tensor_attr(doc: str) -> SessionAttr:
    """A `SessionAttr` holding a tensor: wrapped on write, a torch tensor again on read."""
    return SessionAttr(default=None, coerce=to_state, load=unwrap, doc=doc)


def as_torch(x: Any) -> Any:
    """``x`` as a torch tensor (a JAX alias unwrapped; a torch tensor itself)."""
    return x if isinstance(x, torch.Tensor) else unwrap(x)


def cat_time(items: tuple[Any, ...]) -> torch.Tensor | None:
    """``items`` concatenated along time (dim 2) as one torch tensor; the one item itself; None for none."""
    if len(items) < 2:
        return as_torch(items[0]) if items else None
    return torch.cat([as_torch(x) for x in items], dim=2)


def dreamzero_component_nbytes(session: SessionState) -> dict[str, int]:
    """Bytes per DreamZero component of a session, read without touching the manager (no LRU hit)."""
    parts = {
        "stitched_frames": session.get(FRAMES, None),
        "video_latents": session.get(LATENTS, None),
        "vae_encoder_out": session.get(ENCODER, None),
        "vae_enc_feat_map": session.get(FEAT_MAP, None),
        "vae_pending_body_frames": session.get_attr("vae_pending_body_frames", None),
        "conditioning": [session.get_attr(k, None) for k in ("clip_feas", "ys", "language", "prompt_embeds")],
    }
    return {name: sum(nbytes_by_device(value).values()) for name, value in parts.items()}


class StrictHandle:
    """What a strict adapter reads and writes through: a table-only `SessionHandle` (`SessionHandle.table_only`)
    whose refusals are raised as ``lost()``, the adapter's own error.

    Nothing is asked before a call (no `in_table` check, which an eviction could overtake): each read and write
    is refused by the handle itself, a write under the lock it installs with, so none reaches a detached copy.
    Methods and properties are the handle's (a chained write returns the handle itself).
    """

    def __init__(self, handle: SessionHandle, lost: Callable[[], SessionStateLostError]):
        self._handle = handle.table_only()
        self._lost = lost

    def __getattr__(self, name: str) -> Any:  # (only for names not found on the instance: see below)
        try:
            attr = getattr(self._handle, name)
        except SessionStateLostError as e:  # (a property: `state`)
            raise self._lost() from e
        if not callable(attr):
            return attr
        lost = self._lost

        def call(*args: Any, **kw: Any) -> Any:
            try:
                return attr(*args, **kw)
            except SessionStateLostError as e:
                raise lost() from e

        setattr(self, name, call)  # a method is bound to the one handle: kept, so the next call finds it at once
        return call

    def __repr__(self) -> str:
        return f"StrictHandle({self._handle!r})"
