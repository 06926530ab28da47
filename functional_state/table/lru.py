"""The table's recency order: make a session most recent, insert one (evicting the least recent when the
table is full), remove one, and replace a session without touching its recency.

The order is a doubly linked list threaded through the nodes of the persistent map (see `state`), so each
change rewrites a handful of entries, O(log n) in the number of sessions whatever the history, from any
state, old or new. Each helper works on one map mutation, so one change builds one new map.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import immutables

from ..core.session import SessionState
from ..errors import SessionAdmissionError
from .state import (
    NEXT,
    PREV,
    SESSION,
    UID,
    ManagerState,
    Node,
    make_state,
)

__all__ = ["insert", "remove", "replace_session", "replace_sessions", "touch"]

_new = object.__new__
_log = logging.getLogger("functional_state")


def _unlink(mm: Any, node: Node, head: str | None, tail: str | None) -> tuple[str | None, str | None]:
    prev, nxt = node[PREV], node[NEXT]
    if prev is None:
        head = nxt
    else:
        p = mm[prev]
        mm[prev] = (p[SESSION], p[PREV], nxt, p[UID])
    if nxt is None:
        tail = prev
    else:
        n = mm[nxt]
        mm[nxt] = (n[SESSION], prev, n[NEXT], n[UID])
    return head, tail


def _append(mm: Any, sid: str, session: SessionState, uid: int, head: str | None, tail: str | None) -> str | None:
    """Link ``sid`` in as the most recent session; returns the new head."""
    if tail is None:
        mm[sid] = (session, None, None, uid)
        return sid
    t = mm[tail]
    mm[tail] = (t[SESSION], t[PREV], sid, t[UID])
    mm[sid] = (session, tail, None, uid)
    return head


def touch(state: ManagerState, sid: str, node: Node, hits: int) -> ManagerState:
    """Make ``sid`` the most recently used session, adding ``hits`` to the hit counter."""
    head, tail, uid, config, n_hits, misses, evictions, *rare = state._meta
    if sid == tail:
        if not hits:
            return state
        return make_state(state._nodes, (head, tail, uid, config, n_hits + hits, misses, evictions, *rare), state._acct)
    # The general unlink + append, written out for a node that is not the tail (so it has a next): the hit
    # path, rewriting at most four entries, each read from the unchanged map.
    nodes = state._nodes
    prev, nxt = node[PREV], node[NEXT]
    mm = nodes.mutate()
    if prev is None:
        head = nxt
    else:
        p = nodes[prev]
        mm[prev] = (p[SESSION], p[PREV], nxt, p[UID])
    n = nodes[nxt]
    if nxt == tail:
        mm[nxt] = (n[SESSION], prev, sid, n[UID])
    else:
        mm[nxt] = (n[SESSION], prev, n[NEXT], n[UID])
        t = nodes[tail]
        mm[tail] = (t[SESSION], t[PREV], sid, t[UID])
    mm[sid] = (node[SESSION], tail, None, node[UID])
    new = _new(ManagerState)
    new._nodes = mm.finish()
    new._meta = (head, sid, uid, config, n_hits + hits, misses, evictions, *rare)
    new._acct = state._acct
    return new


def insert(state: ManagerState, sid: str, session: SessionState, what: str, misses: int) -> ManagerState:
    """Add a new session as the most recent, dropping the least recent one when the table is full.

    Raises:
      SessionAdmissionError: the table is full and ``evict_when_full`` is off.
    """
    head, tail, uid, config, hits, n_misses, evictions, *rare = state._meta
    acct = state._acct
    mm = state._nodes.mutate()
    if len(state._nodes) >= config.max_sessions:
        if not config.evict_when_full:
            raise SessionAdmissionError(
                f"`{what}`: the table is full ({len(state._nodes)}/{config.max_sessions} sessions) and "
                f"evict_when_full=False, so session {sid!r} is refused. Drop a finished session "
                f"(`drop_session`) or raise the cap (`raise_max_sessions`)."
            )
        victim = mm[head]
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("LRU eviction: session %r leaves the full table (%d sessions) for %r", head, len(mm), sid)
        del mm[head]
        if acct is not None:
            acct = acct.remove_session(victim[SESSION])
        head = victim[NEXT]
        if head is None:
            tail = None
        else:
            h = mm[head]
            mm[head] = (h[SESSION], None, h[NEXT], h[UID])
        evictions += 1
    head = _append(mm, sid, session, uid, head, tail)
    if acct is not None:
        acct = acct.add_session(session)
    return make_state(mm.finish(), (head, sid, uid + 1, config, hits, n_misses + misses, evictions, *rare), acct)


def remove(state: ManagerState, sid: str, node: Node) -> ManagerState:
    """``state`` without session ``sid`` (its node ``node``); counters unchanged."""
    head, tail, *rest = state._meta
    mm = state._nodes.mutate()
    head, tail = _unlink(mm, node, head, tail)
    del mm[sid]
    acct = None if state._acct is None else state._acct.remove_session(node[SESSION])
    return make_state(mm.finish(), (head, tail, *rest), acct)


def replace_session(state: ManagerState, sid: str, node: Node, session: SessionState) -> ManagerState:
    """``state`` with the session of ``sid`` (its node ``node``) replaced; recency and counters unchanged."""
    acct = state._acct
    if acct is not None:
        acct = acct.swap_session(node[SESSION], session)
    return make_state(state._nodes.set(sid, (session, node[PREV], node[NEXT], node[UID])), state._meta, acct)


def replace_sessions(state: ManagerState, new: Mapping[str, SessionState]) -> immutables.Map:
    """The nodes of ``state`` with the session of each id in ``new`` replaced; recency kept."""
    mm = state._nodes.mutate()
    for sid, session in new.items():
        n = mm[sid]
        mm[sid] = (session, n[PREV], n[NEXT], n[UID])
    return mm.finish()
