"""`LatentBuffer`: an append buffer or a bounded ring of items (numpy arrays, torch tensors, JAX arrays)."""

from __future__ import annotations

import dataclasses
from typing import Any

import immutables

from .._repr import short
from ..errors import InvalidArgumentError
from ..memory.extents import Extent
from .codec import ObjectCodec, field_error, refused_field, register_checkpoint_type
from .pytree import MISSING, pytree_dataclass
from .state_object import (
    ACCT_SLOT,
    RESIDENT,
    UNALLOCATED,
    LedgerDelta,
    StateObject,
    Status,
    check_source,
    value_extents,
)

__all__ = ["LatentBuffer"]


def _check_maxlen(maxlen: Any, what: str) -> None:
    if maxlen is not None and (isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen <= 0):
        raise InvalidArgumentError(f"`{what}`: maxlen must be a positive int or None, got {maxlen!r}.")


class _BufferCodec(ObjectCodec):
    """The default codec, whose check holds a decoded buffer to what `LatentBuffer.create` and its verbs keep:
    ``maxlen`` a positive int or None, ``items`` a tuple of no more than ``maxlen`` items (none unless
    resident). An item may be any value a checkpoint holds (arrays, numbers, containers of them), as `commit`
    takes any: the decoder has already bounded each leaf."""

    def check(self, obj: Any, where: str) -> None:
        super().check(obj, where)
        with refused_field(where, "maxlen", obj.maxlen):
            _check_maxlen(obj.maxlen, "LatentBuffer")
        items = obj.items
        if not isinstance(items, tuple):
            raise field_error(where, "items", items, "a tuple of items")
        if obj.status != RESIDENT and items:
            raise field_error(where, "items", items, f"() (the buffer is {obj.status})")
        if obj.maxlen is not None and len(items) > obj.maxlen:
            raise field_error(where, "items", items, f"at most maxlen={obj.maxlen} items")


@register_checkpoint_type(codec=_BufferCodec())
@pytree_dataclass(static=("maxlen", "status", "recompute_source", "recompute_cost"))
class LatentBuffer(StateObject):
    """Items in commit order; unbounded, or a ring of ``maxlen`` that drops the oldest.

    Items are carried by reference (never copied) and may be of any array type. ``view()`` returns them
    oldest first as a tuple; ``len()`` is the number committed.

    Example:
      >>> import numpy as np
      >>> ring = LatentBuffer.create(maxlen=2)
      >>> for i in range(3):
      ...     ring = ring.commit(np.full((2,), i))
      >>> [int(x[0]) for x in ring.view()]
      [1, 2]
      >>> ring
      LatentBuffer(items=(i64[2], i64[2]), maxlen=2, status='resident')
    """

    items: tuple[Any, ...]  # committed items, oldest first
    staged: Any  # the staged item, or None
    host_copy: Any  # ParkedStorage of the items while parked, else None
    maxlen: int | None  # ring capacity; None for an unbounded append buffer
    status: Status
    recompute_source: str | None  # name of an object of the same session this buffer can be rebuilt from
    recompute_cost: float  # relative cost of rebuilding it: the budget planner evicts the cheapest first

    @classmethod
    def create(
        cls,
        maxlen: int | None = None,
        *,
        allocate: bool = True,
        recompute_source: str | None = None,
        recompute_cost: float = 1.0,
    ) -> LatentBuffer:
        """Build an empty buffer.

        Args:
          maxlen: ring capacity (a positive int), or None for an unbounded append buffer.
          allocate: start resident (True) or unallocated (False).
          recompute_source: the name of another object of the same session this buffer can be rebuilt
            from (checked when the buffer is put into a session).
          recompute_cost: what rebuilding it costs, relative to other objects (the planner evicts
            recomputable objects cheapest first).

        Raises:
          InvalidArgumentError: ``maxlen`` is not a positive int or None, or ``recompute_source`` is not a
            non-empty str or None.
        """
        _check_maxlen(maxlen, "LatentBuffer.create")
        check_source(recompute_source, "LatentBuffer.create", recompute_cost)
        return cls(
            items=(),
            staged=None,
            host_copy=None,
            maxlen=maxlen,
            status=RESIDENT if allocate else UNALLOCATED,
            recompute_source=recompute_source,
            recompute_cost=float(recompute_cost),
        )

    def __len__(self) -> int:
        self._require_resident("__len__")
        return len(self.items)

    def commit(self, payload: Any = MISSING) -> LatentBuffer:
        """`StateObject.commit`; a payload committed into a resident buffer (the per-step path) builds the new
        buffer directly (no generic copy: ~2x faster), everything else takes the base class's path."""
        if payload is MISSING or self.status != RESIDENT or type(self) is not LatentBuffer:
            return StateObject.commit(self, payload)
        items, maxlen = self.items, self.maxlen
        n = len(items)
        if maxlen is None or n < maxlen:
            items = items + (payload,)
        else:  # a full ring, the steady state: a constant slice is a third cheaper than a computed one
            items = (items[1:] if n == maxlen else items[n + 1 - maxlen :]) + (payload,)
        # `_with_items`, written out: each slot set through its descriptor (the frozen __setattr__ refuses).
        new = _new(LatentBuffer)
        _SET_ITEMS(new, items)
        _SET_STAGED(new, self.staged)
        _SET_HOST(new, self.host_copy)
        _SET_MAXLEN(new, maxlen)
        _SET_STATUS(new, RESIDENT)
        _SET_SOURCE(new, self.recompute_source)
        _SET_COST(new, self.recompute_cost)
        _SET_ACCT(new, None)
        return new

    def _commit_payload(self, payload: Any) -> LatentBuffer:
        items = _appended(self.items, payload, self.maxlen)
        return _with_items(self, items) if type(self) is LatentBuffer else self._replace(items=items)

    def _committed_view(self) -> tuple[Any, ...]:
        return self.items

    def _view_with(self, payload: Any) -> tuple[Any, ...]:
        items = self.items + (payload,)
        if self.maxlen is not None and len(items) > self.maxlen:
            items = items[len(items) - self.maxlen :]
        return items

    def _allocated_storage(self) -> dict[str, Any]:
        return {"items": ()}

    def _released_storage(self) -> dict[str, Any]:
        return {"items": ()}

    def _committed_roots(self) -> Any:
        return self.items

    def _parkable_fields(self) -> dict[str, Any]:
        return {"items": self.items}

    def _parked_fields(self) -> dict[str, Any]:
        return {"items": ()}

    # --- ledger protocol: the ring's figures come from its items, kept as a multiset cached per buffer ----
    def ledger_extents(self) -> frozenset[Extent]:
        counts, per_item = _counted(self)
        return frozenset(counts.keys()) if counts is not None else frozenset(per_item)

    def ledger_leaf_extents(self) -> frozenset[Extent]:
        return _NO_EXTRA  # the items are the leaves: the accounting reaches every one

    def ledger_step(self, new: Any) -> LedgerDelta | None:
        """A commit (items appended, the oldest dropped), priced by the items that changed: ``self``'s
        cached extent multiset gives ``new``'s by difference, and only an extent whose count in the ring
        reaches zero (or leaves zero) moves the ledger. The hot path of every step: kept to one pass."""
        if type(new) is not type(self):
            return None
        try:  # (a slot never set raises: a commit sets ``new``'s to None, a step sets ``self``'s)
            cached = self._acct_cache
            if new._acct_cache is not None:
                return None
        except AttributeError:
            return None
        if type(cached) is not tuple or self.staged is not new.staged or self.host_copy is not None:
            return None
        oi, ni = self.items, new.items
        kept = len(ni) - 1
        drop = len(oi) - kept
        if kept < 0 or drop < 0 or new.host_copy is not None:
            return None
        i = drop  # ``ni[:kept]`` must be ``oi[drop:]`` item by item (identity: items are arrays), written out
        for x in ni[:kept]:
            if oi[i] is not x:
                return None
            i += 1
        counts, per_item = cached
        found = value_extents(ni[-1])
        gone: Any
        if counts is None:  # every item holds one extent of its own: ``per_item`` is the multiset, flat
            if drop <= 1 and len(found) == 1:  # (the steady state, and a ring still filling)
                e = found[0]
                kept_items = per_item[1:] if drop else per_item
                if e not in kept_items:  # (else the new item shares an item's storage: counted below)
                    now = kept_items + (e,)
                    _SET_ACCT(new, (None, now) if len(now) <= _PLAIN else (_plain_counts(now), _nested(now)))
                    return LedgerDelta(found, (per_item[0],) if drop else ())
            counts, per_item = _plain_counts(per_item), _nested(per_item)
        elif drop == 1 and len(found) == 1 and type(counts) is dict and len(per_item[0]) == 1 and len(counts) < _SMALL:
            # A full ring whose items share storage, one extent out and one in (written out for it).
            gone, came = per_item[0], (found[0],)
            counts = counts.copy()
            e = gone[0]
            n = counts[e] - 1
            if n:  # another item holds the storage too
                counts[e] = n
                gone = ()
            else:
                del counts[e]
            e = came[0]
            n = counts.get(e, 0)
            counts[e] = n + 1
            _SET_ACCT(new, (counts, (*per_item[1:], came)))
            return LedgerDelta(() if n else came, gone)
        m = counts.copy() if type(counts) is dict else counts.mutate()
        for extents in per_item[:drop]:
            for e in extents:
                n = m[e] - 1
                if n:
                    m[e] = n
                else:
                    del m[e]
        gone = {e for extents in per_item[:drop] for e in extents if e not in m} if drop else ()
        added = _distinct(found)
        for e in added:
            m[e] = m.get(e, 0) + 1
        fresh = [e for e in added if m[e] == 1]
        _SET_ACCT(new, (_finished(m), (*per_item[drop:], added)))
        return LedgerDelta(fresh, gone)

    def __repr__(self) -> str:
        parts = [f"items={short(self.items)}", f"maxlen={self.maxlen}", f"status={self.status!r}"]
        if self.staged is not None:
            parts.insert(1, f"staged={short(self.staged)}")
        if self.recompute_source is not None:
            parts.append(f"recompute_source={self.recompute_source!r}")
        return f"LatentBuffer({', '.join(parts)})"


_NO_EXTRA: frozenset[Extent] = frozenset()
_SET_ACCT = ACCT_SLOT.__set__
# A ring's extent multiset: a plain dict (copied per commit: cheaper than a persistent map's updates) up to
# this many extents, an immutables.Map (O(log n) per update) beyond.
_SMALL = 64
# Up to this many items, a ring whose items each hold one extent of their own keeps no multiset (None):
# ``per_item`` is one, flat (one extent per item), and a commit compares the new extent with the few kept
# (no dict copied, no hashing).
_PLAIN = 8
_FIELDS = ["items", "staged", "host_copy", "maxlen", "status", "recompute_source", "recompute_cost"]
if [f.name for f in dataclasses.fields(LatentBuffer)] != _FIELDS:
    raise TypeError("LatentBuffer's fields changed: `LatentBuffer.commit` must set every one of them")


def _appended(items: tuple[Any, ...], payload: Any, maxlen: int | None) -> tuple[Any, ...]:
    """``items`` with ``payload`` committed: the oldest dropped once ``maxlen`` are held."""
    if maxlen is not None and len(items) >= maxlen:
        return items[len(items) + 1 - maxlen :] + (payload,)
    return items + (payload,)


def _with_items(buf: LatentBuffer, items: tuple[Any, ...]) -> LatentBuffer:
    """``buf._replace(items=items)`` with the ledger's commit mark (its ``_acct_cache`` set to None)."""
    new = buf._replace(items=items)
    _SET_ACCT(new, None)
    return new


_new = object.__new__
_SET_ITEMS, _SET_STAGED, _SET_HOST, _SET_MAXLEN, _SET_STATUS, _SET_SOURCE, _SET_COST = (
    LatentBuffer.__dict__[n].__set__ for n in _FIELDS
)


def _distinct(extents: list[Extent]) -> tuple[Extent, ...]:
    return tuple(extents) if len(extents) < 2 else tuple(set(extents))


def _finished(m: Any) -> Any:
    """A multiset being updated, as kept: a dict while small, else a Map (and a Map that shrank stays one)."""
    if type(m) is dict:
        return m if len(m) <= _SMALL else immutables.Map(m)
    return m.finish()


def _plain_counts(flat: tuple[Extent, ...]) -> dict[Extent, int]:
    return dict.fromkeys(flat, 1)


def _nested(flat: tuple[Extent, ...]) -> tuple[tuple[Extent, ...], ...]:
    """A plain ring's flat extents as the per-item tuples a counted ring keeps."""
    return tuple((e,) for e in flat)


def _counted(buf: LatentBuffer) -> tuple[Any, tuple[Any, ...]]:
    """A buffer's extents with how many of its values (items, staged, parked copy) hold each, and each item's
    own extents (so a commit that drops an item need not look at it again), computed once and cached; a
    plain ring (see `_PLAIN`) keeps no counts (None) and one extent per item."""
    cached = getattr(buf, "_acct_cache", None)
    if type(cached) is tuple:
        return cached
    counts: dict[Extent, int] = {}
    per_item = tuple(_distinct(value_extents(value)) for value in buf.items)
    for extents in per_item:
        for e in extents:
            counts[e] = counts.get(e, 0) + 1
    for value in (buf.staged, buf.host_copy):
        if value is not None:
            for e in _distinct(value_extents(value)):
                counts[e] = counts.get(e, 0) + 1
    plain = len(per_item) <= _PLAIN and all(len(p) == 1 for p in per_item) and len(counts) == len(per_item)
    if plain and buf.staged is None and buf.host_copy is None:
        cached = (None, tuple(e for (e,) in per_item))
    else:
        cached = (_finished(counts), per_item)
    _SET_ACCT(buf, cached)
    return cached
