"""The compiled floor of the manager op: bench_manager's persistent floor written for mypyc and compiled by it.

The same algorithm as `bench_manager.floor_*` on the table's own map (`RerootMap`): every old state valid
and unchanged, exact LRU by a tick per session and the shared `recency_log`, a hit that writes no session
(left pending, its tick in the table), a commit that writes one. What mypyc is given to work with: the
table and each session are native classes (`FloorTable`, `FloorSession`: a session carries its tick, so
there is no separate node), a session's objects a dict copied on write, a ring a tuple of at most
`RING` items; no argument checks, counters or accounting. It bounds what a compiled persistent table can
reach for this op: bench_manager's ``floor compiled`` row, checked against ours and the OrderedDict in
tests/test_table_floor.py.

Built in place by bench_manager (``mypyc manager_floor.py`` in this directory, a git-ignored ``.so``
beside this file) when mypyc is installed; imported as Python otherwise, which bench_manager reports.
`RerootMap` and `Log` are compiled in the package's own extension, so from here they are called through
Python's C API (a few tens of ns per call) rather than natively: the floor is that much pessimistic.
"""

from __future__ import annotations

from typing import Any, Final

from functional_state.table.recency_log import Log, append, entries
from functional_state.table.reroot_map import RerootMap

__all__ = ["FloorSession", "FloorTable", "commit", "create", "get_or_create", "lru", "put", "ring_of"]

RING: Final = 4  # the ring's capacity
COMPACT_AT: Final = 4  # a window is compacted at this many times the table's size


class FloorSession:
    """One session: its objects (a dict never changed once built) and the tick of its last use."""

    __slots__ = ("objects", "used")

    def __init__(self, objects: dict[str, Any], used: int) -> None:
        self.objects: Final = objects
        self.used: Final = used


class FloorTable:
    """The table: sessions by id, the clock, the window of the recency log, the pending hit and the cap."""

    __slots__ = ("cap", "clock", "end", "log", "nodes", "pending", "pending_tick", "start")

    def __init__(
        self, nodes: Any, clock: int, log: Any, start: int, end: int, pending: str | None, pending_tick: int, cap: int
    ) -> None:
        self.nodes: Final = nodes
        self.clock: Final = clock
        self.log: Final = log
        self.start: Final = start
        self.end: Final = end
        self.pending: Final = pending
        self.pending_tick: Final = pending_tick
        self.cap: Final = cap


_EMPTY: Final[dict[str, Any]] = {}


def create(cap: int) -> FloorTable:
    """An empty table of at most ``cap`` sessions."""
    return FloorTable(RerootMap(), 0, Log([], []), 0, 0, None, 0, cap)


def _tick(t: FloorTable, sid: str, s: FloorSession) -> int:
    return t.pending_tick if sid == t.pending else s.used


def _compacted(nodes: Any, log: Any, start: int, end: int, pending: str | None, tick: int) -> Any:
    sids: list[str] = []
    ticks: list[int] = []
    for sid, t in entries(log, start, end):
        s = nodes.get(sid)
        if s is not None and (tick if sid == pending else s.used) == t:
            sids.append(sid)
            ticks.append(t)
    return Log(sids, ticks)


def get_or_create(t: FloorTable, sid: str) -> tuple[FloorTable, dict[str, Any]]:
    """``(table, session objects)``: a hit made most recent, a miss inserted (evicting the least recent)."""
    nodes = t.nodes
    s = nodes.get(sid)
    clock = t.clock
    if s is not None:
        found: FloorSession = s
        pending = t.pending
        if pending is not None and pending != sid:  # settle the previous hit unless its commit did
            p: FloorSession = nodes[pending]
            if p.used != t.pending_tick:
                nodes = nodes.set(pending, FloorSession(p.objects, t.pending_tick))
        log = append(t.log, t.end, sid, clock)
        start, end = t.start, t.end + 1
        if end - start >= COMPACT_AT * len(nodes):
            log = _compacted(nodes, log, start, end, sid, clock)
            start, end = 0, len(log.sids)
        return FloorTable(nodes, clock + 1, log, start, end, sid, clock, t.cap), found.objects
    pending = t.pending
    start, end, log = t.start, t.end, t.log
    if len(nodes) >= t.cap:  # evict the oldest entry still current
        for victim, tick in entries(log, start, end):
            start += 1
            v = nodes.get(victim)
            if v is not None and (t.pending_tick if victim == pending else v.used) == tick:
                nodes = nodes.delete(victim)
                if victim == pending:
                    pending = None
                break
    nodes = nodes.set(sid, FloorSession(_EMPTY, clock))
    log = append(log, end, sid, clock)
    end += 1
    if end - start >= COMPACT_AT * len(nodes):
        log = _compacted(nodes, log, start, end, pending, t.pending_tick)
        start, end = 0, len(log.sids)
    return FloorTable(nodes, clock + 1, log, start, end, pending, t.pending_tick, t.cap), _EMPTY


def _written(t: FloorTable, sid: str, s: FloorSession, objects: dict[str, Any]) -> FloorTable:
    """``t`` with session ``sid`` (now ``s``) holding ``objects``; a pending hit's tick lands here."""
    if sid == t.pending:
        new = FloorSession(objects, t.pending_tick)
        return FloorTable(t.nodes.set(sid, new), t.clock, t.log, t.start, t.end, None, 0, t.cap)
    new = FloorSession(objects, s.used)
    return FloorTable(t.nodes.set(sid, new), t.clock, t.log, t.start, t.end, t.pending, t.pending_tick, t.cap)


def put(t: FloorTable, sid: str, name: str, ring: tuple[Any, ...]) -> FloorTable:
    """``ring`` stored under ``name`` in session ``sid``."""
    s: FloorSession = t.nodes[sid]
    objects = s.objects.copy()
    objects[name] = ring
    return _written(t, sid, s, objects)


def commit(t: FloorTable, sid: str, name: str, item: Any) -> FloorTable:
    """``item`` appended to ring ``name`` of session ``sid`` (the oldest dropped when full)."""
    s: FloorSession = t.nodes[sid]
    r: tuple[Any, ...] = s.objects[name]
    r = (r[1], r[2], r[3], item) if len(r) == RING else (*r, item)
    objects = s.objects.copy()
    objects[name] = r
    return _written(t, sid, s, objects)


def ring_of(t: FloorTable, sid: str, name: str) -> tuple[Any, ...]:
    """The items of ring ``name`` of session ``sid``, oldest first."""
    s: FloorSession = t.nodes[sid]
    ring: tuple[Any, ...] = s.objects[name]
    return ring


def lru(t: FloorTable) -> list[str]:
    """The session ids, least recently used first."""
    sids: list[str] = _compacted(t.nodes, t.log, t.start, t.end, t.pending, t.pending_tick).sids
    return sids
