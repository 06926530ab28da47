"""The table's recency order: make a session most recent, insert one (evicting the least recent when the
table is full), remove one, and replace sessions without touching their recency.

Recency is a tick per stored session (`SessionState._tick`) and the append-only `recency_log` of
``(session id, tick)`` uses (see `records.Recency`): a use takes the next tick and appends one entry;
eviction takes the oldest entry that is still current. A hit writes no session at all: the session it made
most recent is *pending* (as stored it keeps its old tick; the table holds its new one), and the next write
of that session (the commit that follows a hit) stores the tick with the new session, so a hit and its
commit write one entry of the map. The next hit on another session settles the pending one first; an
insertion or a fork leaves it pending. When a window reaches `COMPACT_AT` times the
table's size (or spans `MAX_DEPTH` segments) it is rebuilt from its current entries, so it never holds more
than a few entries per session and a lookup, a hit and a miss cost the same after any history.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..core.session import SessionState
from ..errors import SessionAdmissionError
from ..memory.accounting import total_nbytes
from ..memory.budget import format_bytes
from .manager_state import COMPACT_AT, ManagerState, make_state, with_nodes
from .recency_log import MAX_DEPTH, Log, append, entries
from .records import Recency, Totals
from .reroot_map import RerootMap
from .torch_versions import RECORDS, release

__all__ = [
    "compacted",
    "get_or_insert",
    "insert",
    "recorded_anew",
    "remove",
    "replace_session",
    "replace_sessions",
    "touch",
]

_log = logging.getLogger("functional_state")


def compacted(nodes: Any, log: Log, start: int, end: int, pending: str | None, tick: int) -> Log:
    """The current entries of a window (``pending``'s tick is ``tick``), in order, in one new segment."""
    sids, ticks = [], []
    for sid, t in entries(log, start, end):
        session: SessionState | None = nodes.get(sid)
        if session is not None and (tick if sid == pending else session._tick) == t:
            sids.append(sid)
            ticks.append(t)
    return Log(sids, ticks)


def touch(state: ManagerState, sid: str, session: SessionState, hits: int) -> ManagerState:
    """Make ``sid`` (stored as ``session``) the most recently used session, adding ``hits`` to the hit counter."""
    r: Recency = state._recency
    clock = r.clock
    if r.tick_of(sid, session) == clock - 1:  # already the most recent
        if not hits:
            return state
        return make_state(state._nodes, r, state._hits + hits, state._totals, state._config, state._acct)
    nodes = state._nodes
    pending = r.pending
    if pending is not None:  # settle the previous hit's session unless its commit already did
        p: SessionState = nodes[pending]
        if p._tick != r.pending_tick:
            nodes = nodes.set(pending, p._stamped(r.pending_tick, p._uid))
    log = append(r.log, r.end, sid, clock)
    start, end, limit = r.start, r.end + 1, r.limit
    if end >= limit or log.depth > MAX_DEPTH:
        log = compacted(nodes, log, start, end, sid, clock)
        start, end, limit = 0, len(log.sids), COMPACT_AT * len(nodes)
    recency = Recency(clock + 1, log, start, end, sid, clock, limit)
    return make_state(nodes, recency, state._hits + hits, state._totals, state._config, state._acct)


def insert(
    state: ManagerState, sid: str, session: SessionState, what: str, misses: int, evicted: list[Any] | None = None
) -> ManagerState:
    """Add a new session as the most recent, dropping the least recent one when the table is full.

    ``evicted``: if given, the dropped session is appended to it as ``(session id, incarnation, session)``.

    Raises:
      SessionAdmissionError: the table is full and ``evict_when_full`` is off.
    """
    r: Recency = state._recency
    totals: Totals = state._totals
    config = state._config
    clock, log, start, end, pending = r.clock, r.log, r.start, r.end, r.pending
    evictions = totals.evictions
    acct = state._acct
    size = len(state._nodes)
    if size >= config.max_sessions and not config.evict_when_full:
        raise SessionAdmissionError(
            f"`{what}`: the table is full ({size}/{config.max_sessions} sessions) and "
            f"evict_when_full=False, so session {sid!r} is refused. Drop a finished session "
            f"(`drop_session`) or raise the cap (`raise_max_sessions`)."
        )
    # A pending session stays pending (its tick is older than the new one's).
    nodes: RerootMap = state._nodes
    if size >= config.max_sessions:
        # The oldest current entry; those before it were superseded (about ten entries per miss here).
        for victim_id, tick in entries(log, start, end):
            start += 1
            victim: SessionState | None = nodes.get(victim_id)
            if victim is not None and r.tick_of(victim_id, victim) == tick:
                break
        assert victim is not None  # (a full table's window holds a current entry for each of its sessions)
        if _log.isEnabledFor(logging.INFO):  # (the bytes are counted only for a reader of the log)
            _log.info(
                "LRU eviction: session %r (%d objects, %s) left the table, full at max_sessions=%d, for %r",
                victim_id,
                len(victim.objects),
                format_bytes(total_nbytes(victim)),
                config.max_sessions,
                sid,
            )
        if RECORDS:
            release(state, victim, None)
        nodes = nodes.delete(victim_id)
        if evicted is not None:
            evicted.append((victim_id, victim._uid, victim))
        if victim_id == pending:
            pending = None
        if acct is not None:
            acct = acct.remove_session(victim)
        evictions += 1
    nodes = nodes.set(sid, session._stamped(clock, totals.issued))
    log = append(log, end, sid, clock)
    end += 1
    limit = start + COMPACT_AT * len(nodes)
    if end >= limit or log.depth > MAX_DEPTH:
        log = compacted(nodes, log, start, end, pending, r.pending_tick)
        start, end, limit = 0, len(log.sids), COMPACT_AT * len(nodes)
    if acct is not None:
        acct = acct.add_session(session)
    recency = Recency(clock + 1, log, start, end, pending, r.pending_tick, limit)
    totals = Totals(totals.issued + 1, totals.misses + misses, evictions, totals.parks, totals.restores)
    return make_state(nodes, recency, state._hits, totals, config, acct)


def get_or_insert(state: ManagerState, sid: str) -> tuple[ManagerState, int, list[Any] | None]:
    """`get_or_create` for a caller that resolved ``sid`` and holds a `ManagerState`: the new table, the
    incarnation of ``sid`` in it, and None for a hit, or for an insertion the sessions it evicted (see
    `insert`), so the caller learns what left without looking for it.

    Raises:
      SessionAdmissionError: the table is full and ``evict_when_full`` is off.
    """
    stored: SessionState | None = state._nodes.get(sid)
    if stored is not None:
        return touch(state, sid, stored, 1), stored._uid, None
    evicted: list[Any] = []
    after = insert(state, sid, SessionState.empty(), "get_or_create", 1, evicted)
    return after, state._totals.issued, evicted


def remove(state: ManagerState, sid: str, session: SessionState) -> ManagerState:
    """``state`` without session ``sid`` (stored as ``session``); counters unchanged."""
    if RECORDS:
        release(state, session, None)
    r: Recency = state._recency
    log, start, end, pending = r.log, r.start, r.end, r.pending
    nodes = state._nodes.delete(sid)
    if sid == pending:
        pending = None
    if end - start >= COMPACT_AT * len(nodes) + COMPACT_AT:  # after many drops: keep the window short
        log = compacted(nodes, log, start, end, pending, r.pending_tick)
        start, end = 0, len(log.sids)
    acct = None if state._acct is None else state._acct.remove_session(session)
    recency = Recency(r.clock, log, start, end, pending, r.pending_tick, start + COMPACT_AT * len(nodes))
    return make_state(nodes, recency, state._hits, state._totals, state._config, acct)


def replace_session(state: ManagerState, sid: str, old: SessionState, session: SessionState) -> ManagerState:
    """``state`` with the session of ``sid`` (stored as ``old``) replaced by ``session``; recency and
    counters unchanged.

    A pending session (the one a hit just made most recent) takes its tick in this same write."""
    if RECORDS:
        release(state, old, session)
    acct = state._acct
    if acct is not None:
        acct = acct.swap_session(old, session)
    r: Recency = state._recency
    new = session._stamped(r.tick_of(sid, old), old._uid)
    return with_nodes(state, state._nodes.set(sid, new), acct)


def recorded_anew(state: ManagerState, value: Any) -> ManagerState:
    """``state`` with attr value ``value`` (held by its sessions) recorded anew in its ledger, if it keeps one."""
    acct = state._acct
    return state if acct is None else with_nodes(state, state._nodes, acct.change_objects((), (), (value,), (value,)))


def replace_sessions(state: ManagerState, new: Mapping[str, SessionState]) -> RerootMap:
    """The session map of ``state`` with the session of each id in ``new`` replaced; recency kept."""
    nodes: RerootMap = state._nodes
    for sid, session in new.items():
        old: SessionState = nodes[sid]
        if RECORDS:
            release(state, old, session)
        nodes = nodes.set(sid, session._stamped(old._tick, old._uid))
    return nodes
