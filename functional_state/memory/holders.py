"""Private helpers: which buffers a value holds, and what else in a table holds the same ones.

`step` must never donate, and `park` never parks, a buffer that something else still reads. Both compare
buffers by (pool, start address): views, aliases through the bridge and forks all meet there.
"""

from __future__ import annotations

from typing import Any

import jax

from . import accounting


def buffer_keys(tree: Any) -> set[tuple[str, int]]:
    """Every (pool, start address) of the buffers reachable from ``tree``: those the byte accounting counts,
    and every array leaf of its pytrees (ring positions and other small leaves the accounting leaves out
    are buffers a donation could delete too)."""
    extents: accounting.Extents = []
    seen: dict[int, Any] = {}
    report = accounting.WalkReport()
    accounting.collect_extents(tree, extents, seen, report)
    try:
        leaves = jax.tree_util.tree_leaves(tree)
    except Exception:  # an attr JAX cannot flatten: its arrays were found by the walk above
        leaves = []
    for leaf in leaves:
        if id(leaf) not in seen:
            accounting.collect_extents(leaf, extents, seen, report)
    return {(key, start) for key, start, _ in extents}


def holders_except(sessions: dict[str, Any], excluded: dict[str, Any]) -> dict[str, list[Any]]:
    """Per session id, everything the session holds except objects ``excluded[sid]`` (a name or names)."""
    out: dict[str, list[Any]] = {}
    for sid, session in sessions.items():
        names = excluded.get(sid)
        if names is None:
            out[sid] = [session]
        else:
            names = {names} if isinstance(names, str) else set(names)
            out[sid] = [o for n, o in session._objects.items() if n not in names] + list(session._attrs.values())
    return out
