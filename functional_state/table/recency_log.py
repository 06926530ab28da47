"""The recency log: the append-only sequence of ``(session id, tick)`` uses that orders the table's sessions.

A table reads its window ``[start, end)`` of absolute positions. Tables derived from one another share the
log: a table appends in place while its window ends the log, and a table derived from an older one (whose
window ends before the log does) starts a new `Log` segment at its end whose earlier positions are read
from the parent segment, so branching costs O(1) whatever the table's size. Compaction
(`lru`) rebuilds a window into one new segment holding only the entries still current.

Entries are two parallel lists (session ids, ticks), not a list of pairs: a pair per use would be one more
object the garbage collector tracks for every hit (str and int are untracked); with pairs its generations
filled and it ran full collections over a 100k-session heap (~1 s each).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

__all__ = ["MAX_DEPTH", "Log", "append", "entries", "entries_reversed"]

MAX_DEPTH: Final = 16  # segments a window may span before the next append compacts it


class Log:
    """One segment: the entries at positions ``base, base + 1, ...``; positions before ``base`` are
    ``parent``'s. Only `append` extends a segment, and only at the end of its lists."""

    __slots__ = ("base", "depth", "parent", "sids", "ticks")

    def __init__(self, sids: list[str], ticks: list[int], base: int = 0, parent: Log | None = None) -> None:
        self.sids = sids
        self.ticks = ticks
        self.base = base
        self.parent = parent
        self.depth: int = 1 if parent is None else parent.depth + 1

    def __reduce__(self) -> tuple[type[Log], tuple[list[str], list[int], int, Log | None]]:
        # By its constructor, as `records` does, so that the compiled class pickles and copies too.
        return Log, (self.sids, self.ticks, self.base, self.parent)


def append(log: Log, end: int, sid: str, tick: int) -> Log:
    """The log of a window ``[..., end)`` of ``log`` with ``(sid, tick)`` appended at position ``end``."""
    sids = log.sids
    if log.base + len(sids) == end:
        sids.append(sid)
        # Checked after the append: of two tables appending at once, the second finds the first's id and
        # branches. Tables whose windows end at the same position of one segment share their clock, so
        # the ticks they append are equal and one list of ticks serves both.
        if sids[end - log.base] is sid:
            log.ticks.append(tick)
            return log
    return Log([sid], [tick], end, log)


def _segments(log: Log, start: int) -> list[Log]:
    """The segments a window starting at ``start`` spans, oldest first."""
    out = [log]
    while log.base > start and log.parent is not None:
        log = log.parent
        out.append(log)
    out.reverse()
    return out


def entries(log: Log, start: int, end: int) -> Iterator[tuple[str, int]]:
    """``(session id, tick)`` at positions ``start`` to ``end - 1``, oldest first."""
    segments = _segments(log, start)
    for k, seg in enumerate(segments):
        top = segments[k + 1].base if k + 1 < len(segments) else end
        sids, ticks, base = seg.sids, seg.ticks, seg.base
        for i in range(max(start, base) - base, top - base):
            yield sids[i], ticks[i]


def entries_reversed(log: Log, start: int, end: int) -> Iterator[tuple[str, int]]:
    """``(session id, tick)`` at positions ``end - 1`` down to ``start``, newest first."""
    top = end
    seg: Log | None = log
    while seg is not None and top > start:
        sids, ticks, base = seg.sids, seg.ticks, seg.base
        for i in range(top - base - 1, max(start, base) - base - 1, -1):
            yield sids[i], ticks[i]
        top = base
        seg = seg.parent
