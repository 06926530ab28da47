"""The table's records: `Recency` (the clock and the window of the recency log) and `Totals` (the counters a
miss or a rare verb changes). A session is stored as itself, carrying its recency tick and incarnation
(`SessionState._tick`, `SessionState._uid`; `SessionState._stamped` makes one): no node record around it.

`ManagerState` (in `manager_state`) is made of them; `lru` builds them on every lookup and write. They live
apart from `ManagerState` so that a compiled build compiles them with `lru` (see `_compiled.MODULES`): then
the table's write paths read and build their fields natively. `ManagerState` stays a Python class: the
shell weak-references it and a donating `step` reassigns its class.
"""

from __future__ import annotations

from typing import Final

from mypy_extensions import mypyc_attr

from ..core.session import SessionState
from .recency_log import Log

__all__ = ["Recency", "Totals"]

# Each record says how to pickle (and copy) itself, by its constructor: a class compiled by mypyc has no
# ``__slots__`` for the default protocol to read, so without ``__reduce__`` a table would copy and pickle
# in the pure build and not in the compiled one.
#
# Both are ``acyclic`` for mypyc: the collector never tracks them (one tracked object less per lookup, so
# young collections come less often). That is correct only while no cycle can pass through one: a `Totals`
# holds ints alone; a `Recency` holds ints, its `Log` (which reaches only older segments and lists of ids
# and ticks) and the pending session id, an exact ``str`` (`checks.resolve_id` turns a str subclass, which
# could carry a reference back to the table, into a plain str).


@mypyc_attr(acyclic=True)
class Recency:
    """The table's recency order: its clock, and its window ``[start, end)`` of the shared `recency_log`.

    A hit writes no session: the session it made most recent is *pending* (as stored, it keeps its old tick;
    the table holds the new one here) until the next write of that session stores it (see `lru.touch`).
    """

    __slots__ = ("clock", "end", "limit", "log", "pending", "pending_tick", "start")
    clock: Final[int]  # the next tick
    log: Final[Log]
    start: Final[int]  # the window's first position in ``log``
    end: Final[int]  # one past its last
    pending: Final[str | None]  # the session whose stored copy does not carry its tick yet, if any
    pending_tick: Final[int]  # and that tick
    limit: Final[int]  # the ``end`` at which the window is compacted (start + COMPACT_AT x the table's size)

    def __init__(
        self, clock: int, log: Log, start: int, end: int, pending: str | None, pending_tick: int, limit: int
    ) -> None:
        self.clock = clock
        self.log = log
        self.start = start
        self.end = end
        self.pending = pending
        self.pending_tick = pending_tick
        self.limit = limit

    def tick_of(self, sid: str, session: SessionState) -> int:
        """The tick of ``sid``'s last use (``session``, as the table stores it): the pending tick for the
        pending session."""
        return self.pending_tick if sid == self.pending else session._tick

    def __reduce__(self) -> tuple[type[Recency], tuple[int, Log, int, int, str | None, int, int]]:
        return Recency, (self.clock, self.log, self.start, self.end, self.pending, self.pending_tick, self.limit)

    def __repr__(self) -> str:
        return (
            f"Recency(clock={self.clock}, window=[{self.start}, {self.end}), limit={self.limit}, "
            f"pending={self.pending!r}@{self.pending_tick})"
        )


@mypyc_attr(acyclic=True)
class Totals:
    """The table's totals that only a miss or a rare verb changes (the hits, which every lookup changes, and
    the configuration are kept apart)."""

    __slots__ = ("evictions", "issued", "misses", "parks", "restores")
    issued: Final[int]  # incarnation numbers issued so far
    misses: Final[int]
    evictions: Final[int]
    parks: Final[int]
    restores: Final[int]

    def __init__(self, issued: int, misses: int, evictions: int, parks: int, restores: int) -> None:
        self.issued = issued
        self.misses = misses
        self.evictions = evictions
        self.parks = parks
        self.restores = restores

    def __reduce__(self) -> tuple[type[Totals], tuple[int, int, int, int, int]]:
        return Totals, (self.issued, self.misses, self.evictions, self.parks, self.restores)

    def __repr__(self) -> str:
        return (
            f"Totals(issued={self.issued}, misses={self.misses}, evictions={self.evictions}, "
            f"parks={self.parks}, restores={self.restores})"
        )
