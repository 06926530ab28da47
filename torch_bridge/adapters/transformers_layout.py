"""The K/V layout of a transformers causal LM, and its `Cache` objects built over a session's tensors.

A session holds its cache as a tuple of tensors (`CacheLayout.flat`). A `DynamicCache`: each layer's keys and
values, the very tensors the model's ``torch.cat`` made. A `StaticCache`: two tensors, every layer's keys and
values stacked (``(2 * layers, 1, heads, max_len, head_dim)``, layer ``i``'s keys at ``2 * i``) and the
layers' filled lengths (``(layers,)``, the counters its ``update`` advances in place), so a write in place,
a fork's copy, a park or a batched step handles two storages, not three per layer. A cache is rebuilt
around views of those tensors for each call (`CacheLayout.cache_over`): nothing is copied, and
``DynamicCache.update``'s ``torch.cat`` onto an empty cache is skipped.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, NamedTuple

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer, get_layer_types_and_kwargs

from functional_state import SessionStateError

__all__ = [
    "CACHE_KWARGS",
    "CacheLayout",
    "CacheLayoutError",
    "CheckedTensors",
    "ModelMismatchError",
    "TokenShapeError",
    "cache_kwarg",
]

# The forward argument that takes the cache: transformers' name for it, then the spellings of its renaming.
CACHE_KWARGS = ("past_key_values", "cache", "past_key_value")
KINDS = ("dynamic", "static")


class CacheLayoutError(SessionStateError, ValueError):
    """A cache (or a session's tensors) of another layout than the model's: layer count, heads, head size,
    dtype, device, or cache kind."""


class ModelMismatchError(SessionStateError, ValueError):
    """A session whose cache another model (or another cache kind) made."""


class TokenShapeError(SessionStateError, ValueError):
    """A token batch of the wrong shape, dtype or length."""


def cache_kwarg(model: Any) -> str:
    """The name ``model.forward`` takes its cache under (``past_key_values`` in transformers 5.23).

    Raises:
      CacheLayoutError: the forward takes none of `CACHE_KWARGS` by name.
    """
    params = inspect.signature(model.forward).parameters
    for name in CACHE_KWARGS:
        if name in params:
            return name
    raise CacheLayoutError(
        f"`{type(model).__name__}.forward` takes no cache argument named any of {list(CACHE_KWARGS)}; pass "
        f"`cache_kwarg=` the name it uses."
    )


def _t(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


class CacheLayout(NamedTuple):
    """What every session of one model holds: per layer, keys and values of shape ``(1, heads, T, head_dim)``."""

    model: str  # the model's class and config name: what a session is stamped with
    kind: str  # "dynamic" or "static"
    layers: int
    heads: int  # key/value heads
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_len: int | None  # a StaticCache's length; None for a DynamicCache

    @classmethod
    def of(cls, model: Any, kind: str, max_len: int | None) -> CacheLayout:
        """The layout of ``model``'s cache of kind ``kind``.

        Raises:
          CacheLayoutError: an unknown kind, a StaticCache without a positive ``max_len``, or a model with
            layers other than full attention (sliding windows, linear attention keep more than K/V).
        """
        if kind not in KINDS:
            raise CacheLayoutError(f"`SessionCaches`: cache must be one of {list(KINDS)}, got {kind!r}.")
        if kind == "static" and (not isinstance(max_len, int) or max_len < 1):
            raise CacheLayoutError(
                f"`SessionCaches`: a static cache needs max_cache_len, a positive int; got {max_len!r}."
            )
        config = model.config.get_text_config(decoder=True)
        types, _ = get_layer_types_and_kwargs(config)
        others = sorted({t for t in types if t != "full_attention"})
        if others:
            raise CacheLayoutError(
                f"`SessionCaches`: {type(model).__name__} has {others} layers; only full-attention layers (whose "
                f"cache is K and V alone) are supported."
            )
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        name = f"{type(model).__name__}({getattr(config, 'name_or_path', '') or config.model_type})"
        return cls(
            name, kind, len(types), heads, head_dim, param.dtype, param.device, max_len if kind == "static" else None
        )

    @property
    def stamp(self) -> str:
        """The session attr value that names this layout (compared before a session is stepped)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.model} {self.kind} cache: {self.layers} layers x {self.heads} heads x {self.head_dim}, {dtype}, max {self.max_len}"

    def empty(self) -> tuple[torch.Tensor, ...]:
        """A new session's tensors: nothing cached yet."""
        if self.kind == "static":
            kv = torch.zeros(self._static_shape(1), dtype=self.dtype, device=self.device)
            return kv, torch.zeros(self.layers, dtype=torch.int64, device=self.device)
        shape = (1, self.heads, 0, self.head_dim)
        return tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * self.layers))

    def _static_shape(self, batch: int) -> tuple[int, ...]:
        return (2 * self.layers, batch, self.heads, self.max_len or 0, self.head_dim)

    def length(self, flat: tuple[torch.Tensor, ...]) -> int:
        """Tokens cached in ``flat``."""
        return int(flat[1][0]) if self.kind == "static" else int(flat[0].shape[-2])

    def check(self, flat: Any, what: str, batch: int = 1) -> None:
        """Raise `CacheLayoutError` unless ``flat`` is a session's tensors of this layout."""
        n = 2 if self.kind == "static" else 2 * self.layers
        if not isinstance(flat, tuple) or len(flat) != n or not all(isinstance(t, torch.Tensor) for t in flat):
            raise CacheLayoutError(
                f"{what}: expected {n} tensors ({self.stamp}), got {type(flat).__name__} of {len(flat) if isinstance(flat, tuple) else '?'}."
            )
        if self.kind == "static":
            kv, lengths = flat
            if kv.shape != self._static_shape(batch) or kv.dtype != self.dtype or kv.device != self.device:
                raise CacheLayoutError(
                    f"{what}: the stacked keys and values are {_t(kv)}; this model's are "
                    f"{str(self.dtype).removeprefix('torch.')}{list(self._static_shape(batch))} on {self.device}. "
                    f"Use the cache of this model ({self.stamp})."
                )
            if lengths.shape != (self.layers,) or lengths.dtype != torch.int64:
                raise CacheLayoutError(f"{what}: the lengths are {_t(lengths)}; expected int64[{self.layers}].")
            return
        for i, t in enumerate(flat):
            shape = t.shape  # (read once: each read builds a new torch.Size)
            shape_ok = len(shape) == 4 and shape[0] == batch and shape[1] == self.heads and shape[3] == self.head_dim
            if not (shape_ok and t.dtype == self.dtype and t.device == self.device):
                raise CacheLayoutError(
                    f"{what}: layer {i // 2}'s {'values' if i % 2 else 'keys'} are {_t(t)}; this model's are "
                    f"{str(self.dtype).removeprefix('torch.')}[{batch}, {self.heads}, T, {self.head_dim}] on "
                    f"{self.device}. Use the cache of this model ({self.stamp})."
                )

    def flat(self, cache: Any, what: str) -> tuple[torch.Tensor, ...]:
        """The tensors of a transformers ``cache`` of this layout: a DynamicCache's very tensors (no copy); a
        StaticCache's stacked into the two a session holds (one copy, once).

        Raises:
          CacheLayoutError: ``cache`` is of another kind or layer count, or its tensors of another shape.
        """
        want = StaticCache if self.kind == "static" else DynamicCache
        if not isinstance(cache, want):
            raise CacheLayoutError(
                f"{what}: expected a transformers {want.__name__} ({self.stamp}), got {type(cache).__name__}."
            )
        if len(cache.layers) != self.layers:
            raise CacheLayoutError(
                f"{what}: the cache has {len(cache.layers)} layers, this model {self.layers} ({self.stamp}); "
                f"use a cache this model filled."
            )
        held: list[Any] = list(cache.layers)
        if not all(layer.is_initialized for layer in held):
            return self.empty()
        kv = tuple(t for layer in held for t in (layer.keys, layer.values))
        batch = kv[0].shape[0] if kv[0].dim() == 4 else 1
        if self.kind == "static":
            for i, t in enumerate(kv):  # checked one by one first: torch.stack would fail on a mismatch
                if t.shape != self._static_shape(batch)[1:] or t.dtype != self.dtype or t.device != self.device:
                    raise CacheLayoutError(
                        f"{what}: layer {i // 2}'s {'values' if i % 2 else 'keys'} are {_t(t)}; this model's are "
                        f"{str(self.dtype).removeprefix('torch.')}{list(self._static_shape(batch)[1:])} on "
                        f"{self.device}. Use the cache of this model ({self.stamp})."
                    )
            lengths = torch.stack([layer.cumulative_length.to(torch.int64) for layer in held])
            return torch.stack(kv), lengths.to(self.device)
        self.check(kv, what, batch=batch)
        return kv

    def cache_over(self, flat: tuple[torch.Tensor, ...]) -> Any:
        """A transformers cache whose layers are ``flat``'s tensors (written in place, for a StaticCache)."""
        layers: list[Any] = []
        static = self.kind == "static"
        kv = flat[0] if static else flat
        for i in range(self.layers):
            k, v = kv[2 * i], kv[2 * i + 1]
            if static:
                layer: Any = StaticLayer(self.max_len or 0)
                layer.batch_size, layer.num_heads = k.shape[:2]
                layer.k_head_dim, layer.v_head_dim = k.shape[-1], v.shape[-1]
                layer.cumulative_length = flat[1][i]  # a view: `update` advances the session's counter
            else:
                layer = DynamicLayer()
            layer.dtype, layer.device = k.dtype, k.device
            layer.keys, layer.values, layer.is_initialized = k, v, True
            layers.append(layer)
        cache: Any = StaticCache.__new__(StaticCache) if self.kind == "static" else DynamicCache()
        if self.kind == "static":
            Cache.__init__(cache, layers=layers)  # StaticCache's own init would allocate every layer anew
        else:
            cache.layers = layers
        return cache

    def after(self, cache: Any, flat: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The session's tensors after a call on ``cache`` (built over ``flat``): a DynamicCache's new ones,
        or ``flat`` itself, written in place."""
        if self.kind == "static":
            return flat
        return tuple(t for layer in cache.layers for t in (layer.keys, layer.values))


def _versions(flat: tuple[torch.Tensor, ...]) -> list[int] | None:
    """The tensors' torch versions (counts of writes in place); None if one is an inference-mode tensor, which
    keeps none (such tensors are checked at every step)."""
    try:
        return [t._version for t in flat]
    except RuntimeError:
        return None


class CheckedTensors:
    """The tensors a layout check passed (or a step of the layout's model made), by identity and weakly, with
    their torch versions: a session stepped again holds the very tensors its last step left, unchanged since
    (a resize or any other write in place raises a version), and need not be checked again.

    A session's entry holds weak references only (it never keeps a session's memory alive, and a live
    referent is never another tensor at a reused address); entries of sessions gone are swept once the
    record has doubled since the last sweep.
    """

    def __init__(self) -> None:
        self._refs: dict[str, tuple[tuple[Any, ...], list[int] | None]] = {}
        self._sweep_at = 64

    def known(self, session_id: str, flat: tuple[torch.Tensor, ...]) -> bool:
        """True if ``flat`` are the very tensors last recorded for ``session_id``, at the versions recorded."""
        entry = self._refs.get(session_id)
        if entry is None:
            return False
        refs, versions = entry
        return (
            versions is not None
            and len(refs) == len(flat)
            and all(r() is t for r, t in zip(refs, flat))
            and versions == _versions(flat)
        )

    def record(self, session_id: str, flat: tuple[torch.Tensor, ...]) -> None:
        """Record ``flat`` as checked for ``session_id``."""
        self._refs[session_id] = (tuple(weakref.ref(t) for t in flat), _versions(flat))
        if len(self._refs) >= self._sweep_at:
            self._refs = {sid: e for sid, e in self._refs.items() if all(r() is not None for r in e[0])}
            self._sweep_at = max(64, 2 * len(self._refs))

    def forget(self, session_id: str) -> None:
        self._refs.pop(session_id, None)


class _Mark(NamedTuple):
    """A row's session and the tensors it was last equal to: weakly held (a row never keeps a session's
    memory alive, and a live referent is never another tensor at a reused address) with their torch
    versions (counts of writes in place)."""

    session_id: str
    refs: tuple[Any, ...]
    versions: tuple[int, ...]

    @classmethod
    def of(cls, session_id: str, flat: tuple[torch.Tensor, ...]) -> _Mark:
        return cls(session_id, tuple(weakref.ref(t) for t in flat), tuple(t._version for t in flat))

    def matches(self, session_id: str, flat: tuple[torch.Tensor, ...]) -> bool:
        return (
            self.session_id == session_id
            and all(r() is t for r, t in zip(self.refs, flat))
            and self.versions == tuple(t._version for t in flat)
        )


class BatchRows:
    """The batch-sized K/V a batched `StaticCache` step runs on, its rows mirroring sessions' caches.

    A row is copied in from its session only when the session's tensors changed since this buffer last
    matched them (another pointer: a fork's copy, a restore, a load; another torch version: a single step):
    between consecutive batched steps of the same sessions only the new positions move. The buffer is the
    adapter's own (``nbytes``), outside the manager's accounting; `SessionCaches.release_batch` frees it.
    """

    def __init__(self, layout: CacheLayout, rows: int):
        self.layout = layout
        self.kv = torch.zeros(layout._static_shape(rows), dtype=layout.dtype, device=layout.device)
        self.marks: list[_Mark | None] = [None] * rows

    @property
    def nbytes(self) -> int:
        return self.kv.untyped_storage().nbytes()

    def gather(self, ids: list[str], flats: list[tuple[torch.Tensor, ...]], start: int) -> Any:
        """A cache over the rows, each row holding its session's first ``start`` positions."""
        for row, (sid, flat) in enumerate(zip(ids, flats)):
            mark = self.marks[row]
            if mark is None or not mark.matches(sid, flat):
                # Positions past `start` may hold another session's K/V: the causal mask never reads them.
                self.kv[:, row : row + 1, :, :start].copy_(flat[0][:, :, :, :start])
        lengths = torch.full((self.layout.layers,), start, dtype=torch.int64, device=self.layout.device)
        return self.layout.cache_over((self.kv, lengths))

    def scatter(self, ids: list[str], flats: list[tuple[torch.Tensor, ...]], start: int, n: int) -> None:
        """Write positions ``start:start+n`` of each row back into its session's tensors (and advance them)."""
        for row, (sid, flat) in enumerate(zip(ids, flats)):
            flat[0][:, :, :, start : start + n].copy_(self.kv[:, row : row + 1, :, start : start + n])
            flat[1].add_(n)
            self.marks[row] = _Mark.of(sid, flat)
