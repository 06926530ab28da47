"""Counters for what the bridge wrapped, copied and left as torch tensors, and the warnings it issues.

Counts are keyed by a bounded set of reason *categories* (``strides``, ``alignment``, ``x64`` ...), never by
the detail of one tensor (its shape or offset), so a long run of distinct slices adds no new keys. A copy,
or a `to_jax` call that has to return the torch tensor itself, is something the caller can act on: it is
announced once per category with a `BridgeWarning` subclass, which ``warnings.filterwarnings`` can silence.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from typing import Any

__all__ = ["CATEGORIES", "BridgeCopyWarning", "BridgeKeptTorchWarning", "BridgeWarning", "report", "reset_report"]

# Why a tensor cannot be aliased, as the bounded set of keys `report()` uses.
CATEGORIES = ("layout", "device", "dtype", "x64", "conj", "neg", "strides", "alignment")


class BridgeWarning(UserWarning):
    """Base class of the bridge's warnings: filter this one to silence them all."""


class BridgeCopyWarning(BridgeWarning):
    """`to_jax` made an explicit copy because JAX cannot alias the tensor (once per reason category)."""


class BridgeKeptTorchWarning(BridgeWarning):
    """`to_jax` returned the torch tensor itself: JAX has no form for it (once per reason category)."""


_lock = threading.Lock()
_counts: Counter = Counter()
_warned: set[tuple[str, str]] = set()


def record(kind: str, nbytes: int, category: str | None = None, detail: str = "", warn: bool = False) -> None:
    """Count one tensor of ``nbytes`` under ``kind`` (``wrapped``, ``copied``, ``kept_torch``) and its reason
    ``category``; with ``warn``, issue the first occurrence of each (kind, category) as a warning whose
    text carries ``detail`` (that first tensor's particulars)."""
    with _lock:
        _counts[f"{kind}_count"] += 1
        _counts[f"{kind}_bytes"] += nbytes
        first = False
        if category is not None:
            _counts[f"{kind}[{category}]"] += 1
            if warn:
                first = (kind, category) not in _warned
                _warned.add((kind, category))
    if first:
        if kind == "copied":
            warnings.warn(
                f"torch_bridge.to_jax copied a tensor: {detail} (warned once per reason; category {category!r}). "
                f"Pass strict=True to raise instead, or use `wrap` to keep it a torch tensor.",
                BridgeCopyWarning,
                stacklevel=3,
            )
        else:
            warnings.warn(
                f"torch_bridge.to_jax returned the torch tensor itself: {detail} (warned once per reason; "
                f"category {category!r}).",
                BridgeKeptTorchWarning,
                stacklevel=3,
            )


def report() -> dict[str, Any]:
    """Totals since the last `reset_report`: ``wrapped_count``/``_bytes`` (zero-copy), ``copied_count``/
    ``_bytes`` (explicit copies), ``kept_torch_count``/``_bytes`` (left as torch tensors), and one
    ``<kind>[<category>]`` count per reason category (see `CATEGORIES`).

    Example:
      >>> import torch
      >>> from torch_bridge import to_jax, reset_report
      >>> reset_report()
      >>> _ = to_jax(torch.zeros(256))
      >>> report()["wrapped_bytes"], report()["copied_bytes"]
      (1024, 0)
    """
    with _lock:
        out = {f"{k}_{unit}": 0 for k in ("wrapped", "copied", "kept_torch") for unit in ("count", "bytes")}
        out.update(_counts)
        return dict(sorted(out.items()))


def reset_report() -> None:
    """Zero the counters and forget which categories were warned about."""
    with _lock:
        _counts.clear()
        _warned.clear()
