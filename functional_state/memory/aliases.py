"""Private: memory another object owns. The record of JAX arrays that alias it (filled by the torch bridge),
and the host buffers this package allocated itself (`OWNED`).

An array imported from a torch tensor reports only its own bytes but keeps the whole torch storage alive,
so the accounting counts the owner's allocation wherever it meets the array.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import jax

from .extents import Extent

__all__ = ["OWNED", "alias_owner", "any_aliased", "register_alias"]

# Extents ``("cpu", start, end)`` of host buffers this package allocated for one storage each (`host_buffers`):
# torch reports them as storages it did not allocate (``from_numpy``), yet they are allocations proper, equal
# to or disjoint from every other extent, so the accounting need not treat them as `Loose`.
OWNED: set[Extent] = set()
# id(jax array) -> (weakref to it, owner).
_ALIASES: dict[int, tuple[weakref.ref, Any]] = {}
# Re-entrant: the weakref callback that forgets an alias can run while this thread holds the lock (a
# collection triggered inside `register_alias`).
_ALIASES_LOCK = threading.RLock()


def register_alias(array: jax.Array, owner: Any) -> None:
    """Record that ``array`` lies inside the allocation of ``owner`` (e.g. the torch tensor it aliases).

    The accounting then counts ``owner``'s allocation wherever it meets ``array``. The record disappears
    with ``array``.

    Args:
      array: a JAX array created as a zero-copy view of ``owner``'s memory.
      owner: the object that owns the memory (a torch tensor or numpy array).
    """
    key = id(array)

    def _forget(ref: weakref.ref, key: int = key) -> None:
        with _ALIASES_LOCK:
            entry = _ALIASES.get(key)
            if entry is not None and entry[0] is ref:
                del _ALIASES[key]

    with _ALIASES_LOCK:
        _ALIASES[key] = (weakref.ref(array, _forget), owner)


def alias_owner(array: Any) -> Any:
    """The owner recorded for ``array`` by `register_alias`, or None."""
    entry = _ALIASES.get(id(array))
    if entry is not None and entry[0]() is array:
        return entry[1]
    return None


def any_aliased(arrays: Iterable[Any]) -> bool:
    """Whether any of ``arrays`` has an owner recorded by `register_alias` (one dict read while none has)."""
    return bool(_ALIASES) and any(alias_owner(a) is not None for a in arrays)
