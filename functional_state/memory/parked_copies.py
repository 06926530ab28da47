"""The parked host copies a table holds, with their bytes kept as copies come and go (what `stats` reports
as ``parked_nbytes`` without reading every copy)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import immutables

from . import accounting
from .extents import Loose

_EMPTY: immutables.Map = immutables.Map()


class ParkedCopies:
    """Holder counts of host copies (``copies``: id(copy) -> (copy, objects holding it, its extents)) and of
    their extents (``refs``), with the bytes of the distinct extents held (``nbytes``). Immutable.

    A copy's extents are read once, when its first holder arrives: a host copy is the table's own and is
    never written. Copies that share a host buffer (one park packs several storages into one) share its
    extent, which counts once. Extents are allocations (equal or disjoint) unless one is `Loose` (memory the
    copy did not allocate, e.g. a numpy array parked where it was): while one is held, `total` is their
    union, O(extents held).
    """

    __slots__ = ("copies", "loose", "nbytes", "refs")

    def __init__(self, copies: immutables.Map, refs: immutables.Map, nbytes: int, loose: int):
        self.copies = copies
        self.refs = refs
        self.nbytes = nbytes  # the sum of the distinct extents' sizes
        self.loose = loose  # how many distinct `Loose` extents are held

    def __len__(self) -> int:
        return len(self.copies)

    def total(self) -> int:
        """Bytes of the copies held, each allocation once: O(1), or O(extents) while a `Loose` one is held."""
        if not self.loose:
            return self.nbytes
        return sum(accounting.union_by_device(list(self.refs.keys())).values())

    def change(self, add: Iterable[Iterable[Any]], remove: Iterable[Iterable[Any]]) -> ParkedCopies:
        """The index after holders of the copies ``remove`` left and of ``add`` arrived (each an iterable of
        copies, one per holder)."""
        add, remove = [a for a in add if a], [r for r in remove if r]
        if not add and not remove:
            return self
        copies, refs = self.copies.mutate(), self.refs.mutate()
        nbytes, loose = self.nbytes, self.loose
        for values in remove:
            for v in values:
                copy, n, extents = copies[id(v)]
                if n > 1:
                    copies[id(v)] = (copy, n - 1, extents)
                    continue
                del copies[id(v)]
                for e in extents:
                    k = refs[e] - 1
                    if k:
                        refs[e] = k
                    else:
                        del refs[e]
                        nbytes -= e.end - e.start
                        loose -= type(e) is Loose
        for values in add:
            for v in values:
                entry = copies.get(id(v))
                if entry is not None:
                    copies[id(v)] = (v, entry[1] + 1, entry[2])
                    continue
                out = accounting.own_extents(v)
                if out is None:
                    out = []
                    accounting.collect_extents(v, out, {}, accounting.WalkReport())
                extents = frozenset(out)
                copies[id(v)] = (v, 1, extents)
                for e in extents:
                    k = refs.get(e, 0)
                    refs[e] = k + 1
                    if not k:
                        nbytes += e.end - e.start
                        loose += type(e) is Loose
        return ParkedCopies(copies.finish(), refs.finish(), nbytes, loose)


NO_COPIES = ParkedCopies(_EMPTY, _EMPTY, 0, 0)
