"""Which engine KV blocks a change released, and handing them back to their engines.

Pure functions never call an engine: evicting a `PagedKVHandle` or dropping its session returns a new state
in which fewer handles hold some blocks. `released_blocks(before, after)` names the blocks that handles held
in ``before`` and none holds in ``after`` (reference counts across forks and sessions), and
`free_released(before, after)` calls each pool's ``free`` with them. The `SessionStateManager` does this for
every write it makes, so each block goes back exactly once; a caller of the pure API who keeps only
``after`` does it once per transition. `free_acquired(before, after)` is the mirror image: it hands back
the blocks a change that will not be installed allocated (a refused restore's ``reload``).
"""

from __future__ import annotations

import logging
from typing import Any

from ..engine.kv_handle import PagedKVHandle
from ..engine.paged_kv import PagedKVPool, pool_by_uid
from ..errors import KVFreeError
from .checks import check_state
from .ledger import LOG_CUT, Acct
from .manager_state import ManagerState, ledger_of, session_map

_log = logging.getLogger("functional_state")

__all__ = ["free_acquired", "free_released", "released_blocks"]


def released_between(before: Acct, after: Acct) -> dict[int, tuple[int, ...]]:
    """``{pool uid: block ids}`` that handles held in ``before`` and none holds in ``after``.

    Read from ``after``'s release log back to ``before``'s (O(released)) when ``after`` descends from
    ``before``; otherwise (another lineage, a cut log) by comparing every held block.
    """
    candidates: list[Any] = []  # (pool uid, block id)
    node = after.log
    complete = before.root is after.root
    while complete and node is not before.log:
        if node is None or node is LOG_CUT:
            complete = False
            break
        candidates.extend(node.released)
        node = node.previous
    if not complete:
        candidates = list(before.kv.keys())
    out: dict[int, list[int]] = {}
    for key in candidates:
        if key in before.kv and key not in after.kv:
            uid, block = key
            out.setdefault(uid, []).append(block)
    return {uid: tuple(sorted(set(ids))) for uid, ids in out.items()}


def released_blocks(before: ManagerState, after: ManagerState) -> dict[PagedKVPool, tuple[int, ...]]:
    """``{pool: block ids}`` that some handle held in ``before`` and no handle holds in ``after``, ascending.

    Reads both tables' kept accounting (built by one walk the first time): O(blocks released) when ``after``
    was derived from ``before``.

    Example:
      >>> import numpy as np, functional_state as fs
      >>> layer = np.zeros((4, 2))
      >>> pool = fs.PagedKVPool(layer, free=lambda ids: None, name="kv")
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
      >>> s = fs.put(s, "a", "kv", fs.PagedKVHandle.create(pool, [0, 2]))
      >>> t = fs.fork_session(s, "a", "b")
      >>> {p.name: ids for p, ids in released_blocks(t, fs.drop_session(t, "a")[0]).items()}  # b still holds them
      {}
      >>> {p.name: ids for p, ids in released_blocks(t, fs.drop_session(fs.drop_session(t, "a")[0], "b")[0]).items()}
      {'kv': (0, 2)}
    """
    for state, what in ((before, "before"), (after, "after")):
        if type(state) is not ManagerState:
            check_state(state, f"released_blocks ({what})")
    out = {}
    for uid, ids in released_between(ledger_of(before), ledger_of(after)).items():
        pool = pool_by_uid(uid)
        if pool is not None:  # a pool the engine already dropped has nothing left to free
            out[pool] = ids
    return out


def free_released(before: ManagerState, after: ManagerState) -> dict[PagedKVPool, tuple[int, ...]]:
    """Call each engine's ``free`` with the blocks the change from ``before`` to ``after`` released.

    Each block goes back once even when a ``free`` fails: pools are freed one by one, and each pool records
    the blocks its engine took back as its ``free`` returns. A caller that keeps ``before`` after the error
    (the manager does) and retries the change frees only what the engines are still owed. The engine's
    ``free`` must be all or nothing per call (raise having freed nothing), as the reference engine's is.

    Returns:
      Every block the change released, by pool (those an earlier, failed attempt already handed back too).

    Raises:
      KVFreeError: a ``free`` callback raised (chained). The error lists the pools already freed.
    """
    released = released_blocks(before, after)
    done: list[str] = []
    for pool, ids in released.items():
        owed = pool._still_owed(ids)
        if owed:
            try:
                pool.free_fn(owed)
            except Exception as e:
                raise KVFreeError(_free_failed(pool, owed, done, e)) from e
            pool._note_handed_back(owed, settled=False)
        done.append(pool.name)
    for pool, ids in released.items():  # the change is complete: its blocks are owed nothing any more
        pool._note_handed_back(ids, settled=True)
    return released


def free_acquired(before: ManagerState, after: ManagerState) -> dict[PagedKVPool, tuple[int, ...]]:
    """Undo the engine allocations of a change that will not be installed: free the blocks handles hold in
    ``after`` and none held in ``before``.

    For a `restore` (or a handle's restore on access) that is then refused, by the byte budget or a failing
    ``free``: the engine's ``reload`` allocated blocks for ``after`` that no state will hold. Each handle
    ``before`` holds parked and ``after`` restored first puts those blocks back through the engine's
    ``offload`` and keeps the new token in the parked handle's `OffloadToken` (an engine's ``reload`` may
    consume its token), so a later restore reloads the same K/V. Blocks a caller allocated and
    committed in a refused write are the caller's: call this only for changes whose new blocks the library
    allocated. Each block is freed once, as in `free_released` (whose mirror image this is).

    Returns:
      The blocks freed, by pool.

    Raises:
      KVFreeError: a ``free`` callback raised (chained); a retry frees only what is still owed.

    Example:
      >>> import numpy as np, functional_state as fs
      >>> freed = []
      >>> pool = fs.PagedKVPool(np.zeros((4, 2)), free=freed.extend, offload=lambda ids: ids, reload=lambda t: (3,), name="kv")
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
      >>> parked, _ = fs.park(fs.put(s, "a", "kv", fs.PagedKVHandle.create(pool, [0])), "a", "kv")
      >>> restored, _ = fs.restore(parked, "a", "kv")  # reload allocated block 3; say the budget refuses it
      >>> {p.name: ids for p, ids in free_acquired(parked, restored).items()}, freed
      ({'kv': (3,)}, [3])
    """
    if released_between(ledger_of(after), ledger_of(before)):
        _offload_again(before, after)
    return free_released(after, before)


def _offload_again(before: ManagerState, after: ManagerState) -> None:
    """Each handle parked in ``before`` and restored in ``after`` (its reload is being undone) puts its
    reloaded K/V back through the engine's ``offload`` into the parked handle's token: an engine whose
    ``reload`` consumed the token would otherwise have lost it. Read only on this refused path."""
    old_sessions = session_map(before)
    for sid, session in session_map(after).items():
        old = old_sessions.get(sid)
        if old is None or old is session:
            continue
        for name, obj in session._objects.items():
            parked = old._objects.get(name)
            if not (isinstance(obj, PagedKVHandle) and isinstance(parked, PagedKVHandle) and obj is not parked):
                continue
            box, offload = parked.host_copy, obj.pool.offload_fn
            if parked.parked and not obj.parked and obj.block_ids and box is not None and offload is not None:
                try:
                    box.token = offload(obj.block_ids)
                except Exception:  # the blocks still go back; a later restore reloads the old token
                    _log.warning("a refused KV restore could not offload its blocks again", exc_info=True)


def _free_failed(pool: PagedKVPool, ids: tuple[int, ...], done: list[str], e: Any) -> str:
    already = (
        f"; pools already freed: {done} (their blocks are the engine's again: retry the change, which frees only "
        f"what is still owed)"
        if done
        else ""
    )
    return f"KV pool {pool.name!r}: the engine's free({list(ids)[:8]}...) raised {type(e).__name__}: {e}{already}"
