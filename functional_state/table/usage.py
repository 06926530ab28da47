"""What the table holds: a typed `Usage` snapshot (usage), its bytes per pool alone (pool_bytes), and the
`stats()` mapping that formats the snapshot."""

from __future__ import annotations

from typing import Any

from ..engine.paged_kv import pool_by_uid
from ..memory import accounting
from ..memory.holders import parked_nbytes as kept_parked_nbytes
from ..memory.holders import pool_totals, totals_with_attrs
from ..memory.pools import Pool
from ..memory.usage import KVPoolUsage, Usage, pools_by_name
from .checks import check_state
from .manager_state import ManagerState, ledger_of, session_map

__all__ = ["pool_bytes", "stats", "usage"]


def pool_bytes(state: ManagerState) -> dict[Pool, int]:
    """Bytes per pool the table holds, attrs included (`Usage.by_pool` without the rest of the snapshot)."""
    return pools_by_name(pool_totals(ledger_of(state)))


def usage(state: ManagerState, *, exact: bool = False) -> Usage:
    """What the table holds, typed: bytes per `Pool`, engine KV pools, counters (see `stats` for each figure).

    ``exact=True`` walks every object too, as a check; the default reads kept totals (see `stats`).

    Example:
      >>> import numpy as np, functional_state as fs
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
      >>> s = fs.put(s, "a", "cache", fs.DenseValue.create([np.zeros(256, np.float32)]))
      >>> u = usage(s)
      >>> u.nbytes(fs.Pool("cpu")), u.as_stats() == fs.stats(s)
      (1024, True)
    """
    return _usage(state, exact, "usage")


def _usage(state: ManagerState, exact: bool, what: str) -> Usage:
    if type(state) is not ManagerState:
        check_state(state, what)
    if exact:
        sessions_now = list(session_map(state).values())
        per_device, report = accounting.walk(*sessions_now)
        # Read from the host copies themselves: a parked copy need not sit in a host pool (numpy stays where
        # it was, an engine's offload token is the engine's), so host-pool totals undercount it.
        parked = [o.host_copy for s in sessions_now for o in s._objects.values() if o.host_copy is not None]
        parked_nbytes = accounting.total_nbytes(*parked)
    else:  # kept by the ledger: O(pools + parked copies + attr containers), whatever the number of sessions
        acct = ledger_of(state)
        per_device, report = totals_with_attrs(acct)  # (the report is that of the walk of attr containers)
        parked_nbytes = kept_parked_nbytes(acct)
    kv_pools = []
    for uid, blocks in ledger_of(state).kv_held().items():
        pool = pool_by_uid(uid)
        if pool is not None:  # engine pools sessions hold blocks of: what they hold, and the pool's size
            kv_pools.append(KVPoolUsage(pool.name, blocks * pool.block_nbytes, pool.capacity()))
    return Usage(
        by_pool=pools_by_name(per_device),
        sessions=len(state),
        max_sessions=state.max_sessions,
        byte_budget=state.byte_budget,
        hits=state.hits,
        misses=state.misses,
        evictions=state.evictions,
        parks=state.parks,
        restores=state.restores,
        parked_nbytes=parked_nbytes,
        deleted_arrays=report.deleted_arrays,
        unaccounted_objects=report.unaccounted_objects,
        kv_pools=tuple(kv_pools),
    )


def stats(state: ManagerState, *, exact: bool = False) -> dict[str, Any]:
    """Counters and bytes of the table: `usage` formatted as one flat mapping (`Usage.as_stats`).

    Keys: ``sessions``, ``max_sessions``, ``byte_budget``, ``total_nbytes``, ``hits``, ``misses``,
    ``evictions``, ``parks``, ``restores``, ``parked_nbytes`` (bytes of parked host copies: what objects
    hold in the host pools), ``deleted_arrays`` (JAX arrays found deleted, e.g. donated elsewhere: they
    hold no bytes, and a non-zero count means some state reads freed memory; see below for what finds
    them), ``unaccounted_objects`` (objects the walk could not read), then one ``nbytes:<pool>`` key per pool, sorted: devices
    (``nbytes:cpu``, ``nbytes:cuda:0``) and the host memory kinds parked storage lives in
    (``nbytes:cpu/pinned_host``, ``nbytes:cpu/unpinned_host``). Each allocation is counted once across
    all sessions. For each engine KV pool that handles hold blocks of: ``kv_pool:<name>:held_nbytes`` (the
    blocks sessions hold, each once; part of ``nbytes:<device>``), ``kv_pool:<name>:total_nbytes`` and,
    when the engine exposes its free count, ``kv_pool:<name>:free_nbytes``.

    State objects are immutable, so their bytes are kept incrementally as the table changes (built by one
    walk the first time): the default costs O(pools + parked copies + attr containers), not O(sessions). Only attr
    containers (lists, dicts, objects a model may change in place) are walked on each call, and
    ``deleted_arrays`` and ``unaccounted_objects`` describe that walk: the deletions the table sees.
    No other JAX array is checked for deletion (that alone would cost O(arrays held)): the table's own
    donations never delete what it still holds, so only an array deleted behind its back (a user's own
    ``jax.jit(donate_argnums=...)`` on an array the table holds) is missed, and keeps the bytes it was
    counted with. ``exact=True`` walks everything instead (objects too), as a check: it finds those
    deleted arrays, and the figures are the same unless a buffer was deleted or resized behind the
    manager's back. Free host buffers parking keeps for reuse are not state and not counted here
    (`functional_state.memory.host_buffers.cached_nbytes`).
    """
    return _usage(state, exact, "stats").as_stats()
