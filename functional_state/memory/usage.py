"""A typed snapshot of what a table holds: bytes per `Pool`, engine KV pools, and the table's counters.

`Usage` is what `functional_state.usage` returns and what the planner and the budget checks read;
`Usage.as_stats` formats it as the flat ``{key: value}`` mapping `stats()` has always returned (``nbytes:<pool>``
and ``kv_pool:<name>:<figure>`` keys), so the text keys are written in one place and read back nowhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .pools import Pool

__all__ = ["KVPoolUsage", "Usage"]


@dataclasses.dataclass(frozen=True)
class KVPoolUsage:
    """An engine KV pool sessions hold blocks of: ``held_nbytes`` (those blocks, each once; part of its
    device's bytes) and the pool's own figures (``total_nbytes``, and ``free_nbytes`` when the engine
    exposes its free count)."""

    name: str
    held_nbytes: int
    capacity: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Usage:
    """What a table holds: bytes per pool (each allocation once across all sessions, attrs included) and its
    counters. Build it with `functional_state.usage`; ``as_stats()`` is `stats()`.

    Example:
      >>> import numpy as np, functional_state as fs
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
      >>> u = fs.usage(fs.put(s, "a", "cache", fs.DenseValue.create([np.zeros(256, np.float32)])))
      >>> u.by_pool, u.nbytes("cpu"), u.sessions
      ({Pool(device='cpu', memory_kind=None): 1024}, 1024, 1)
    """

    by_pool: Mapping[Pool, int]  # pool -> bytes held there (pools holding nothing are left out), by name
    sessions: int = 0
    max_sessions: int = 0
    byte_budget: Mapping[str, int] | None = None
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    parks: int = 0
    restores: int = 0
    parked_nbytes: int = 0  # bytes of parked host copies
    deleted_arrays: int = 0  # JAX arrays found deleted (donated elsewhere): they hold no bytes
    unaccounted_objects: int = 0  # objects the walk could not read
    kv_pools: tuple[KVPoolUsage, ...] = ()

    @property
    def total_nbytes(self) -> int:
        """Bytes over every pool."""
        return sum(self.by_pool.values())

    def nbytes(self, pool: Pool | str) -> int:
        """Bytes held in ``pool`` (a `Pool`, or its name as `stats()` writes it); 0 for a pool holding none."""
        return self.by_pool.get(pool if isinstance(pool, Pool) else Pool.parse(pool, "Usage.nbytes"), 0)

    def nbytes_by_pool(self) -> dict[str, int]:
        """``{pool name: bytes}``, as `functional_state.nbytes_by_device` writes it."""
        return {str(p): n for p, n in self.by_pool.items()}

    def as_stats(self) -> dict[str, Any]:
        """The `stats()` mapping: counters, then ``nbytes:<pool>`` by pool name, then ``kv_pool:`` figures."""
        out: dict[str, Any] = {
            "sessions": self.sessions,
            "max_sessions": self.max_sessions,
            "byte_budget": self.byte_budget,
            "total_nbytes": self.total_nbytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "parks": self.parks,
            "restores": self.restores,
            "parked_nbytes": self.parked_nbytes,
            "deleted_arrays": self.deleted_arrays,
            "unaccounted_objects": self.unaccounted_objects,
        }
        out.update({f"nbytes:{p}": n for p, n in self.by_pool.items()})
        for kv in self.kv_pools:
            out[f"kv_pool:{kv.name}:held_nbytes"] = kv.held_nbytes
            out.update({f"kv_pool:{kv.name}:{key}": n for key, n in kv.capacity.items()})
        return out


def pools_by_name(nbytes: Mapping[str, int]) -> dict[Pool, int]:
    """``{Pool: bytes}`` from the accounting's ``{pool text: bytes}``, in name order (the one place the
    accounting's text keys become typed)."""
    return {Pool.of(k): n for k, n in sorted(nbytes.items())}
