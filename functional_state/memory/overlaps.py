"""Private: the union of one pool's extents, kept incrementally for a pool that holds a `Loose` one.

Allocations are equal or disjoint, so a pool of allocations alone totals the sum of its distinct extents.
A `Loose` extent (memory its holder did not allocate) may overlap another without being it: while a pool
holds one, the ledger keeps that pool's extents in a `PoolIndex`, a persistent sorted list cut into
chunks, and prices each extent that comes or goes by the bytes of it no other extent covers. A change
copies one chunk and the chunk directory: O(log n + chunk + n / chunk), and O(1) for the bytes around it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .extents import Extent, Loose

__all__ = ["PoolIndex", "covered", "overlapped", "pool_changed", "pool_index"]

_CHUNK = 128  # extents per chunk, at most twice this many before a chunk is split


class PoolIndex(NamedTuple):
    """The distinct extents held in one pool while some are `Loose`, sorted, in chunks."""

    chunks: tuple[tuple[Extent, ...], ...]  # consecutive runs of the sorted extents, none empty
    firsts: tuple[Extent, ...]  # each chunk's first extent (what a search bisects)
    loose: int  # how many of them are `Loose`: while one is held the pool stays indexed
    maxlen: int  # at least the length of each (an extent starting ``maxlen`` before a point ends before it)

    def extents(self) -> list[Extent]:
        """Every extent, sorted: O(n)."""
        return [e for chunk in self.chunks for e in chunk]


def covered(index: PoolIndex, e: Extent) -> int:
    """Bytes of ``e`` that the union of the extents of ``index`` covers: O(log n + the extents that start
    within ``maxlen`` before ``e`` or inside it)."""
    return _covered(index.chunks, index.firsts, index.maxlen, e)


def _covered(chunks: Sequence[tuple[Extent, ...]], firsts: Sequence[Extent], maxlen: int, e: Extent) -> int:
    pool, lo, hi = e
    key = (pool, lo - maxlen)
    c = max(bisect.bisect_right(firsts, key) - 1, 0)
    i = bisect.bisect_left(chunks[c], key) if chunks else 0
    cur, total = lo, 0
    while c < len(chunks):
        chunk = chunks[c]
        while i < len(chunk):
            _, start, end = chunk[i]
            if start >= hi:
                return total
            i += 1
            end = min(end, hi)
            if end > cur:
                total += end - max(start, cur)
                cur = end
        c, i = c + 1, 0
    return total


def overlapped(index: PoolIndex, e: Extent) -> bool:
    """Whether an extent of ``index`` other than ``e`` itself shares a byte with ``e``."""
    pool, lo, hi = e
    key = (pool, lo - index.maxlen)
    chunks = index.chunks
    c = max(bisect.bisect_right(index.firsts, key) - 1, 0)
    i = bisect.bisect_left(chunks[c], key) if chunks else 0
    while c < len(chunks):
        for f in chunks[c][i:]:
            if f.start >= hi:
                return False
            if f.end > lo and f != e:
                return True
        c, i = c + 1, 0
    return False


def pool_index(held: Iterable[Extent], pool: str) -> PoolIndex:
    """The `PoolIndex` of the extents of ``pool`` among ``held`` (each key as it is held: its `Loose` mark)."""
    extents = sorted(e for e in held if e.pool == pool)
    chunks = tuple(tuple(extents[i : i + _CHUNK]) for i in range(0, len(extents), _CHUNK))
    loose = sum(type(e) is Loose for e in extents)
    return PoolIndex(chunks, tuple(c[0] for c in chunks), loose, max((e.end - e.start for e in extents), default=0))


def pool_changed(
    index: PoolIndex, total: int, arrived: Iterable[Extent], left: Iterable[Extent]
) -> tuple[PoolIndex | None, int]:
    """The index and union bytes of a pool (``total`` now) once extents ``left`` (held) stopped being held and
    ``arrived`` (not held) started; None for the index when no `Loose` extent remains (the extents add up)."""
    chunks, firsts = list(index.chunks), list(index.firsts)
    loose, maxlen = index.loose, index.maxlen
    for e in left:  # the union loses what no other extent covers
        c = bisect.bisect_right(firsts, e) - 1
        chunk = chunks[c]
        i = bisect.bisect_left(chunk, e)
        loose -= type(chunk[i]) is Loose  # (the key as held: its mark)
        if len(chunk) == 1:
            del chunks[c], firsts[c]
        else:
            chunks[c] = chunk = chunk[:i] + chunk[i + 1 :]
            firsts[c] = chunk[0]
        total -= e.end - e.start - _covered(chunks, firsts, maxlen, e)
    for e in arrived:
        maxlen = max(maxlen, e.end - e.start)
        total += e.end - e.start - _covered(chunks, firsts, maxlen, e)
        loose += type(e) is Loose
        if not chunks:
            chunks, firsts = [(e,)], [e]
            continue
        c = max(bisect.bisect_right(firsts, e) - 1, 0)
        chunk = chunks[c]
        i = bisect.bisect_left(chunk, e)
        chunk = chunk[:i] + (e,) + chunk[i:]
        if len(chunk) > 2 * _CHUNK:
            chunks[c : c + 1] = [chunk[:_CHUNK], chunk[_CHUNK:]]
            firsts[c : c + 1] = [chunk[0], chunk[_CHUNK]]
        else:
            chunks[c], firsts[c] = chunk, chunk[0]
    if not loose:
        return None, total
    return PoolIndex(tuple(chunks), tuple(firsts), loose, maxlen), total
