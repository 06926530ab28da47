"""What a walk of a state object's buffers found, recorded per structure and buffers, so a step reads it.

A donated `step` asks, per array leaf of the object, which extents it holds (to compare them with every
other holder), and the ledger then asks the same of the object the step returned. Both answers are a
function of the object's type, its treedef (its static fields: a `PytreeValue`'s leaf shapes and dtypes)
and its leaves' buffers, for a type whose storage is its leaves (`StateObject.extents_from_leaves`), while
it is resident with nothing staged or parked and its leaves are plain single-device JAX arrays (no bridge
alias, no engine pool). A donated step writes its output into its input's buffers, so the object a step
returns usually has the buffers of the one it was given: its record is found under the same key.

Only facts about buffers are recorded (their extents, and whether the leaves' bytes are each their own),
never an answer about holders: whether another object, a fork, an attr or a retained value holds a buffer is
asked of the ledger on every step. The object a step returns is remembered with its flattening and record
(weakly: forgotten with it), so the next step over that very object neither flattens it nor reads its key.

Torch leaves (a `DenseValue` of a model's K/V tensors) take no record: the facts a key would be made of
(each storage's device, address and size) are their extents themselves, read from the storages in one pass
(`accounting.torch_extents`, what the walk reads per tensor) without the walk's generic traversal. Nothing is
kept between calls, so a tensor resized, replaced or aliased since is read as it is now.
"""

from __future__ import annotations

import threading
import weakref
from itertools import pairwise
from operator import attrgetter, is_, methodcaller
from typing import Any, NamedTuple

import jax

from ..core.state_object import ACCT_SLOT, StateObject, leaves_walked, value_extents
from ..memory import accounting
from ..memory.aliases import any_aliased
from ..memory.extents import Extent

__all__ = ["BufferRecord", "ObjectRecord", "buffer_key", "leaf_extents", "leaf_record", "object_record", "seed_extents"]

_POINTER = methodcaller("unsafe_buffer_pointer")  # (raises for a deleted or multi-device array, or a non-JAX leaf)
_SHARDING = attrgetter("sharding")
_MAX_RECORDS = 4096  # structures times buffer sets seen; cleared whole when full (a record is rebuilt by one walk)
_RECORDS: dict[Any, BufferRecord] = {}
_LOCK = threading.Lock()
# id(object) -> (weakref to it, its `ObjectRecord`): the record of one object whose key was read (a step's
# result, an object a step donated), found again without flattening it; forgotten with the object.
_BY_OBJECT: dict[int, tuple[weakref.ref, ObjectRecord]] = {}


class BufferRecord(NamedTuple):
    """One object's walk: its ledger figures, each leaf's extents, and the leaves' shardings it read."""

    walked: frozenset[Extent]  # what `StateObject.ledger_extents` returned (its memo, with the leaf extras)
    per_leaf: tuple[tuple[Extent, ...] | None, ...]  # per tree leaf: its extents; None for a leaf not donated
    shardings: tuple[Any, ...]  # per leaf: where it lives (its pool), compared on every read of the record
    every: tuple[Extent, ...] = ()  # every leaf's extents, in leaf order (what the holders are asked about)
    separate: bool = False  # each live JAX leaf holds bytes of its own: none empty, none another leaf's too


class ObjectRecord(NamedTuple):
    """One object's flattening and the `BufferRecord` of its buffers."""

    leaves: list[Any]
    treedef: Any
    record: BufferRecord


def buffer_key(obj: StateObject, leaves: list[Any], treedef: Any) -> Any:
    """The key of ``obj``'s record (``leaves``, ``treedef``: its flattening), or None where its extents may
    depend on more than its type, treedef and leaves' buffers."""
    if (
        not type(obj).extents_from_leaves
        or obj.staged is not None
        or obj.host_copy is not None
        or accounting.POOL_STORAGES
    ):
        return None
    try:
        pointers = tuple(map(_POINTER, leaves))
    except Exception:  # a deleted or multi-device array, a numpy or torch leaf: walked
        return None
    if any_aliased(leaves):
        return None
    return (type(obj), treedef, pointers)


def _walk(obj: StateObject, leaves: list[Any]) -> BufferRecord:
    per_leaf = tuple(
        tuple(value_extents(leaf)) if isinstance(leaf, jax.Array) and not leaf.is_deleted() else None for leaf in leaves
    )
    every = tuple(e for extents in per_leaf if extents for e in extents)
    separate = all(extents != () for extents in per_leaf) and len(set(every)) == len(every) and not _overlapping(every)
    return BufferRecord(obj.ledger_extents(), per_leaf, tuple(map(_SHARDING, leaves)), every, separate)


def _overlapping(extents: tuple[Extent, ...]) -> bool:
    """Whether two of ``extents`` (distinct) share a byte of one pool: a view of another leaf's buffer."""
    by_start = sorted(extents)  # (by pool, then start: one that overlaps another overlaps its successor)
    return any(a.pool == b.pool and b.start < a.end for a, b in pairwise(by_start))


def _recorded(key: Any, leaves: list[Any]) -> BufferRecord | None:
    """The record under ``key`` if its leaves live where the recorded ones did (a pointer names a buffer only
    with its device and memory kind); a step's outputs usually carry the very sharding objects it read."""
    record = _RECORDS.get(key)
    if record is None:
        return None
    shardings = tuple(map(_SHARDING, leaves))
    if all(map(is_, shardings, record.shardings)):
        return record
    if shardings != record.shardings:
        return None
    record = record._replace(shardings=shardings)  # (equal placements: kept as these objects, read by identity)
    _RECORDS[key] = record
    return record


def leaf_extents(obj: StateObject, leaves: list[Any], treedef: Any) -> tuple[tuple[Extent, ...] | None, ...]:
    """Per leaf of ``obj`` (flattened as ``leaves``, ``treedef``), the extents its buffer holds (None: not a
    live JAX array): from the record of its structure and buffers, else by a walk, then recorded."""
    return leaf_record(obj, leaves, treedef).per_leaf


def leaf_record(obj: StateObject, leaves: list[Any], treedef: Any) -> BufferRecord:
    """The `BufferRecord` of ``obj`` (flattened as ``leaves``, ``treedef``): the one made for its structure and
    buffers, else a walk of it, recorded where its key says the walk's answer follows from them."""
    key = buffer_key(obj, leaves, treedef)
    if key is None:
        return _walk(obj, leaves)
    record = _recorded(key, leaves)
    if record is None:
        record = _walk(obj, leaves)
        with _LOCK:
            if len(_RECORDS) >= _MAX_RECORDS:
                _RECORDS.clear()
            _RECORDS[key] = record
    _remember(obj, ObjectRecord(leaves, treedef, record))
    return record


def object_record(obj: StateObject) -> ObjectRecord:
    """``obj``'s flattening and `BufferRecord`: remembered for this very object when its key was read before
    (a step returned it), else as `leaf_record` finds it.

    An object is immutable, so its leaves, and the buffers they hold while alive, are those its key was read
    from; what may have changed since is asked again: whether an engine pool or a bridge alias now makes a
    walk answer otherwise (then the key is read anew)."""
    entry = _BY_OBJECT.get(id(obj))
    if entry is not None and entry[0]() is obj:
        known = entry[1]
        if not accounting.POOL_STORAGES and not any_aliased(known.leaves):
            return known
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    return ObjectRecord(leaves, treedef, leaf_record(obj, leaves, treedef))


def _remember(obj: StateObject, known: ObjectRecord) -> None:
    key = id(obj)

    def forget(ref: weakref.ref, key: int = key) -> None:
        entry = _BY_OBJECT.get(key)
        if entry is not None and entry[0] is ref:
            _BY_OBJECT.pop(key, None)

    _BY_OBJECT[key] = (weakref.ref(obj, forget), known)


def _torch_walked(obj: StateObject, leaves: list[Any]) -> frozenset[Extent] | None:
    """``obj``'s ledger figures read from its torch leaves' storages, when its leaves are plain tensors and its
    storage is its leaves (else None: walked)."""
    torch = accounting.torch_module()
    if torch is None or obj.staged is not None or obj.host_copy is not None:
        return None
    tensor, out = torch.Tensor, list[Extent]()
    for leaf in leaves:
        if type(leaf) is not tensor:  # (a subclass, or a mix with other arrays: the walk decides)
            return None
        accounting.torch_extents(leaf, out)  # (the walk's own read of a tensor: engine pools and `Loose` included)
    return leaves_walked(out)


def seed_extents(obj: StateObject) -> bool:
    """Give ``obj`` (just returned by a step, a commit, a park or a restore) its ledger figures from the record
    of its structure and buffers, if one was made, from its torch leaves' storages, or (parked) from its host
    copy alone, so the ledger does not walk it; whether it did.

    Example:
      >>> import torch
      >>> from functional_state import DenseValue
      >>> cache = DenseValue.create([torch.zeros(4), torch.zeros(8)])
      >>> seed_extents(cache), sorted(e.end - e.start for e in cache.ledger_extents())
      (True, [16, 32])
    """
    if getattr(obj, "_acct_cache", None) is not None or not type(obj).extents_from_leaves:
        return False
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    if not leaves and obj.host_copy is not None and obj.staged is None and obj._committed_roots() is None:
        # Parked, with torch storages only (JAX host arrays would be leaves): its storage is its host copy.
        ACCT_SLOT.__set__(obj, leaves_walked(value_extents(obj.host_copy)))
        return True
    if leaves and not isinstance(leaves[0], jax.Array):
        walked = _torch_walked(obj, leaves)
        if walked is None:
            return False
        ACCT_SLOT.__set__(obj, walked)  # a memo, not state: what the walk of these storages gives
        return True
    key = buffer_key(obj, leaves, treedef)
    record = _recorded(key, leaves) if key is not None else None
    if record is None:
        return False
    ACCT_SLOT.__set__(obj, record.walked)  # a memo, not state: what the walk of these buffers gives
    _remember(obj, ObjectRecord(leaves, treedef, record))  # (the next step over it reads it from here)
    return True
