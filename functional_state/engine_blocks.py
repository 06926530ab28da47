"""Which engine KV blocks a change released, and handing them back to their engines.

Pure functions never call an engine: evicting a `PagedKVHandle` or dropping its session returns a new state
in which fewer handles hold some blocks. `released_blocks(before, after)` names the blocks that handles held
in ``before`` and none holds in ``after`` (reference counts across forks and sessions), and
`free_released(before, after)` calls each pool's ``free`` with them. The `SessionStateManager` does this for
every write it makes, so each block goes back exactly once; a caller of the pure API who keeps only
``after`` does it once per transition.
"""

from __future__ import annotations

from typing import Any

from ._acct import released_between
from .errors import KVFreeError
from .manager_state import ManagerState, _check_state, _track
from .paged_kv import PagedKVPool, pool_by_uid

__all__ = ["free_released", "released_blocks"]


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
            _check_state(state, f"released_blocks ({what})")
    out = {}
    for uid, ids in released_between(_track(before), _track(after)).items():
        pool = pool_by_uid(uid)
        if pool is not None:  # a pool the engine already dropped has nothing left to free
            out[pool] = ids
    return out


def free_released(before: ManagerState, after: ManagerState) -> dict[PagedKVPool, tuple[int, ...]]:
    """Call each engine's ``free`` with the blocks the change from ``before`` to ``after`` released.

    Returns what was freed.

    Raises:
      KVFreeError: a ``free`` callback raised (chained). Pools are freed one by one; the error lists those
        already freed before the failing one.
    """
    released = released_blocks(before, after)
    done: list[str] = []
    for pool, ids in released.items():
        try:
            pool.free_fn(ids)
        except Exception as e:
            raise KVFreeError(_free_failed(pool, ids, done, e)) from e
        done.append(pool.name)
    return released


def _free_failed(pool: PagedKVPool, ids: tuple[int, ...], done: list[str], e: Any) -> str:
    already = f"; pools already freed: {done}" if done else ""
    return f"KV pool {pool.name!r}: the engine's free({list(ids)[:8]}...) raised {type(e).__name__}: {e}{already}"
