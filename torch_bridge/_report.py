"""Counters for what the bridge wrapped, copied, and left as torch tensors, with once-per-reason logging."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

logger = logging.getLogger("torch_bridge")

_lock = threading.Lock()
_counts: Counter = Counter()
_logged: set[tuple[str, str]] = set()


def record(kind: str, nbytes: int, reason: str | None = None) -> None:
    """Count one tensor of ``nbytes`` under ``kind`` ('wrapped', 'copied', 'kept_torch'), and log the first
    occurrence of each (kind, reason)."""
    with _lock:
        _counts[f"{kind}_count"] += 1
        _counts[f"{kind}_bytes"] += nbytes
        if reason is not None:
            _counts[f"{kind}[{reason}]"] += 1
            first = (kind, reason) not in _logged
            _logged.add((kind, reason))
        else:
            first = False
    if first:
        if kind == "copied":
            logger.warning("torch_bridge: copying a tensor because %s (logged once per reason).", reason)
        else:
            logger.warning("torch_bridge: leaving a tensor in torch because %s (logged once per reason).", reason)


def report() -> dict[str, Any]:
    """Totals since the last `reset_report`: ``wrapped_count``/``_bytes`` (zero-copy), ``copied_count``/
    ``_bytes`` (explicit copies), ``kept_torch_count``/``_bytes`` (left as torch tensors), and one
    ``<kind>[<reason>]`` count per reason.

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
    """Zero the counters and forget which reasons were logged."""
    with _lock:
        _counts.clear()
        _logged.clear()
