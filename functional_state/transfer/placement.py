"""`placement`: the figures a router places sessions by, per replica: each pool's bytes against its budget, and
each session's bytes, recency, epoch and last saved step.

Cheap enough to publish every second at 10k sessions: pool totals are the table's kept ledger figures (no
walk), and a session's bytes are the extents its objects cached when they were built (a set union per session,
no array touched).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

from .. import table as ms
from ..memory.accounting import jax_device_pool
from ..memory.budget import ANY_DEVICE, limit_for
from ..memory.pools import Pool
from ..table.manager_state import ManagerState
from ..table.ownership import session_epoch
from ..table.usage import pool_bytes

__all__ = ["Placement", "SessionFigures", "placement"]


class SessionFigures(NamedTuple):
    """One session, as a router sees it."""

    bytes_by_pool: dict[str, int]  # what its objects hold per pool (a buffer shared with a fork counted in each)
    recency: int  # its rank in the table's use order: 0 is the least recently used (the next to go)
    epoch: int  # its ownership epoch
    last_saved_step: Any  # what the caller recorded at its last save (``saved``), or None

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_pool.values())


class Placement(NamedTuple):
    """A replica's figures: ``pools`` maps each pool to ``(bytes held, budget or None)``."""

    pools: dict[str, tuple[int, int | None]]
    sessions: dict[str, SessionFigures]

    def headroom(self, pool: str) -> int | None:
        """Bytes ``pool`` can still take under its budget (None: no budget)."""
        held, budget = self.pools.get(pool, (0, None))
        return None if budget is None else max(budget - held, 0)


def placement(state: ManagerState, *, saved: Mapping[str, Any] | None = None) -> Placement:
    """The placement figures of ``state`` (unchanged; recency too).

    Args:
      saved: ``{session id: step}`` of the last save of each session, as the caller's replica recorded it
        (a save is a read of the table, so the table cannot record it itself).

    Example:
      >>> import numpy as np, functional_state as fs
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(byte_budget="1 MiB"), "a")
      >>> s = fs.put(s, "a", "cache", fs.DenseValue.create([np.zeros(256, np.float32)]))
      >>> p = placement(s, saved={"a": 3})
      >>> p.pools["cpu"], p.sessions["a"].nbytes, p.sessions["a"].last_saved_step
      ((1024, 1048576), 1024, 3)
    """
    ms.check_state(state, "placement")
    saved = saved or {}
    budget = state.byte_budget
    pools = {str(pool): (held, limit_for(budget, pool) if budget else None) for pool, held in pool_bytes(state).items()}
    for name in _budgeted_pools(budget):
        pools.setdefault(name, (0, limit_for(budget, Pool.of(name))))
    sessions = {}
    for rank, (sid, _, session) in enumerate(ms.entries_lru(state)):
        held: set[Any] = set()
        for obj in session.objects.values():
            held |= obj.ledger_extents()
        by_pool: dict[str, int] = {}
        for pool, start, end in held:
            by_pool[pool] = by_pool.get(pool, 0) + end - start
        sessions[sid] = SessionFigures(by_pool, rank, session_epoch(session.attrs), saved.get(sid))
    return Placement(pools, sessions)


def _budgeted_pools(budget: Mapping[str, int] | None) -> list[str]:
    """The pools ``budget`` limits, named as `stats()` names them: each pool it names, and for ``"*"`` each
    local JAX device's pool (``"cpu"`` for the host), so a replica holding nothing still reports its room."""
    if not budget:
        return []
    names = [name for name in budget if name != ANY_DEVICE]
    if ANY_DEVICE in budget:
        names += sorted({jax_device_pool(device) for device in jax.local_devices()})
    return names
