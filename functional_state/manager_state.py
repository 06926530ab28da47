"""`ManagerState` and the pure functions over it: a count-capped LRU table of sessions.

Every function takes a `ManagerState` and returns a new one (with a result where there is one); the
input is never changed. The table is a persistent hash map, so a step costs O(log n) in the number of
sessions and a fork shares everything it does not change.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple

import jax
from pyrsistent import PMap, pmap

from . import accounting
from ._pytree import MISSING, replace
from .errors import ObjectNotFoundError, SessionAdmissionError, SessionStateLostError
from .session import SessionState

__all__ = [
    "DEFAULT_SESSION_ID",
    "DEFAULT_MAX_SESSIONS",
    "ManagerState",
    "get_or_create",
    "get_session",
    "update_session",
    "put",
    "stage",
    "commit",
    "discard",
    "view",
    "set_attr",
    "get_attr",
    "reset_session",
    "evict",
    "drop_session",
    "fork_session",
    "raise_max_sessions",
    "stats",
]

DEFAULT_SESSION_ID = "default"
DEFAULT_MAX_SESSIONS = 64  # mirrors the bespoke MAX_DREAMZERO_SESSIONS


class _Entry(NamedTuple):
    uid: int  # incarnation: a session re-created under the same id gets a new uid
    tick: int  # LRU recency: larger is more recent
    session: SessionState


def _check_positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ManagerState:
    """An immutable LRU table ``session_id -> SessionState`` with a count cap and hit/miss counters.

    Build it with `ManagerState.create`. JAX sees the sessions as children (keyed by id, least recently
    used first); ids, recency, counters and config are aux data.
    """

    _entries: PMap  # session_id -> _Entry
    _order: PMap  # tick -> session_id
    _next_tick: int
    _low: int  # no live tick is below this
    max_sessions: int
    byte_budget: int | None  # recorded, not enforced
    evict_when_full: bool
    hits: int
    misses: int
    evictions: int

    @classmethod
    def create(
        cls, max_sessions: int = DEFAULT_MAX_SESSIONS, byte_budget: int | None = None, evict_when_full: bool = True
    ) -> "ManagerState":
        """An empty table.

        Args:
          max_sessions: the count cap (positive). Over it, the least recently used session is dropped
            from the table (``evict_when_full=True``) or a new session is refused.
          byte_budget: recorded and reported; not enforced in this phase.
          evict_when_full: LRU eviction (True) or admission control (False).

        Raises:
          ValueError: ``max_sessions`` is not a positive int, or ``byte_budget`` is negative.

        Example:
          >>> state = ManagerState.create(max_sessions=2)
          >>> state, session = get_or_create(state, "a")
          >>> stats(state)["sessions"], stats(state)["misses"]
          (1, 1)
        """
        _check_positive(max_sessions, "`ManagerState.create`: max_sessions")
        if byte_budget is not None and (
            isinstance(byte_budget, bool) or not isinstance(byte_budget, int) or byte_budget < 0
        ):
            raise ValueError(f"`ManagerState.create`: byte_budget must be None or an int >= 0, got {byte_budget!r}.")
        return cls(pmap(), pmap(), 0, 0, max_sessions, byte_budget, bool(evict_when_full), 0, 0, 0)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: Any) -> bool:
        return session_id in self._entries

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Session ids, least recently used first."""
        return tuple(self._order[t] for t in sorted(self._order))

    @property
    def sessions(self) -> Mapping[str, SessionState]:
        """A read-only ``{session_id: SessionState}``, least recently used first. Does not touch recency."""
        return MappingProxyType({sid: self._entries[sid].session for sid in self.session_ids})

    def _replace(self, **changes: Any) -> "ManagerState":
        return replace(self, **changes)

    def _accounting_children(self) -> list[SessionState]:
        return [e.session for e in self._entries.values()]

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Render as the table a user thinks of (sessions, LRU order, counters), not the internal maps."""
        from treescope import repr_lib

        attributes = {
            "sessions": dict(self.sessions),
            "max_sessions": self.max_sessions,
            "byte_budget": self.byte_budget,
            "evict_when_full": self.evict_when_full,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
        return repr_lib.render_object_constructor(type(self), attributes, path, subtree_renderer)

    def __repr__(self) -> str:
        return (
            f"ManagerState(sessions={len(self)}/{self.max_sessions}, hits={self.hits}, misses={self.misses}, "
            f"evictions={self.evictions}, ids={list(self.session_ids)})"
        )


def _flatten_with_keys(state: ManagerState):
    ids = state.session_ids
    children = [(jax.tree_util.DictKey(sid), state._entries[sid].session) for sid in ids]
    meta = tuple((sid, state._entries[sid].uid, state._entries[sid].tick) for sid in ids)
    aux = (meta, state._next_tick, state._low, state.max_sessions, state.byte_budget, state.evict_when_full,
           state.hits, state.misses, state.evictions)
    return children, aux


def _unflatten(aux, children) -> ManagerState:
    meta, next_tick, low, *rest = aux
    entries = pmap({sid: _Entry(uid, tick, s) for (sid, uid, tick), s in zip(meta, children)})
    order = pmap({tick: sid for sid, _, tick in meta})
    return ManagerState(entries, order, next_tick, low, *rest)


jax.tree_util.register_pytree_with_keys(ManagerState, _flatten_with_keys, _unflatten)


# --- internals -------------------------------------------------------------------------------------


def _resolve_id(session_id: Any) -> str:
    if session_id is None:
        return DEFAULT_SESSION_ID
    if not isinstance(session_id, str) or not session_id:
        raise TypeError(f"session_id must be a non-empty str or None (for {DEFAULT_SESSION_ID!r}), got {session_id!r}.")
    return session_id


def _lookup(state: ManagerState, session_id: Any, what: str) -> tuple[str, _Entry]:
    sid = _resolve_id(session_id)
    entry = state._entries.get(sid)
    if entry is None:
        raise SessionStateLostError(
            f"`{what}`: session {sid!r} is not in the table: it was never created, or it was evicted "
            f"(LRU cap {state.max_sessions}) or dropped. A continuation cannot resume it; start a new "
            f"session with `get_or_create`."
        )
    return sid, entry


def _touch(state: ManagerState, sid: str, entry: _Entry) -> ManagerState:
    """Make ``sid`` most recently used and count the hit."""
    tick = state._next_tick
    return state._replace(
        _entries=state._entries.set(sid, _Entry(entry.uid, tick, entry.session)),
        _order=state._order.remove(entry.tick).set(tick, sid),
        _next_tick=tick + 1,
        hits=state.hits + 1,
    )


def _drop_lru(state: ManagerState) -> ManagerState:
    tick = state._low
    while tick not in state._order:
        tick += 1
    sid = state._order[tick]
    return state._replace(
        _entries=state._entries.remove(sid), _order=state._order.remove(tick), _low=tick + 1,
        evictions=state.evictions + 1,
    )


def _insert(state: ManagerState, sid: str, session: SessionState, what: str, misses: int = 0) -> ManagerState:
    if len(state._entries) >= state.max_sessions:
        if not state.evict_when_full:
            raise SessionAdmissionError(
                f"`{what}`: the table is full ({len(state._entries)}/{state.max_sessions} sessions) and "
                f"evict_when_full=False, so session {sid!r} is refused. Drop a finished session "
                f"(`drop_session`) or raise the cap (`raise_max_sessions`)."
            )
        state = _drop_lru(state)
    tick = state._next_tick
    return state._replace(
        _entries=state._entries.set(sid, _Entry(tick, tick, session)),
        _order=state._order.set(tick, sid),
        _next_tick=tick + 1,
        misses=state.misses + misses,
    )


def _evict_object(session: SessionState, name: str) -> tuple[SessionState, int]:
    new_session = session.put(name, session.get(name).evict()[0])
    return new_session, accounting.total_nbytes(session) - accounting.total_nbytes(new_session)


def _entry_uid(state: ManagerState, session_id: Any) -> int | None:
    entry = state._entries.get(_resolve_id(session_id))
    return None if entry is None else entry.uid


# --- public pure functions ---------------------------------------------------------------------------


def get_or_create(state: ManagerState, session_id: str | None) -> tuple[ManagerState, SessionState]:
    """Look a session up, creating it on a miss. Returns ``(state, session)``.

    A hit makes the session most recently used. A miss inserts an empty session; over the cap the least
    recently used session is dropped from the table (``evict_when_full``) or the call is refused.

    Raises:
      SessionAdmissionError: full table with ``evict_when_full=False``.
      TypeError: ``session_id`` is not a str or None.

    Example:
      >>> s0 = ManagerState.create(max_sessions=1)
      >>> s1, _ = get_or_create(s0, "a")
      >>> s2, _ = get_or_create(s1, "b")  # drops "a"
      >>> s2.session_ids, s2.evictions, s1.session_ids
      (('b',), 1, ('a',))
    """
    sid = _resolve_id(session_id)
    entry = state._entries.get(sid)
    if entry is not None:
        return _touch(state, sid, entry), entry.session
    session = SessionState.empty()
    return _insert(state, sid, session, "get_or_create", misses=1), session


def get_session(state: ManagerState, session_id: str | None) -> tuple[ManagerState, SessionState]:
    """Look up a session a continuation expects to exist; a hit makes it most recently used.

    Raises:
      SessionStateLostError: unknown, evicted or dropped; nothing is created.
    """
    sid, entry = _lookup(state, session_id, "get_session")
    return _touch(state, sid, entry), entry.session


def update_session(
    state: ManagerState, session_id: str | None, fn: Callable[[SessionState], SessionState]
) -> ManagerState:
    """Replace session ``session_id`` by ``fn(session)``; recency and counters are unchanged.

    Raises:
      SessionStateLostError: the session is not in the table.
    """
    sid, entry = _lookup(state, session_id, "update_session")
    new = fn(entry.session)
    if not isinstance(new, SessionState):
        raise TypeError(f"`update_session`: fn must return a SessionState, got {type(new).__name__}.")
    return state._replace(_entries=state._entries.set(sid, _Entry(entry.uid, entry.tick, new)))


def _object_update(state, session_id, name, what, fn):
    def apply(session: SessionState) -> SessionState:
        return session.put(name, fn(session.get(name)))

    try:
        return update_session(state, session_id, apply)
    except ObjectNotFoundError as e:
        raise ObjectNotFoundError(f"`{what}`: {e}") from None


def put(state: ManagerState, session_id: str | None, name: str, obj: Any) -> ManagerState:
    """Store state object ``obj`` under ``name`` in a session."""
    return update_session(state, session_id, lambda s: s.put(name, obj))


def stage(state: ManagerState, session_id: str | None, name: str, payload: Any) -> ManagerState:
    """Stage ``payload`` in object ``name`` of a session (see `StateObject.stage`)."""
    return _object_update(state, session_id, name, "stage", lambda o: o.stage(payload))


def commit(state: ManagerState, session_id: str | None, name: str, payload: Any = MISSING) -> ManagerState:
    """Commit ``payload`` (or the staged payload) into object ``name`` of a session.

    Example:
      >>> from functional_state import LatentBuffer
      >>> s, _ = get_or_create(ManagerState.create(), "a")
      >>> s = put(s, "a", "frames", LatentBuffer.create(maxlen=2))
      >>> s = commit(commit(commit(s, "a", "frames", 1), "a", "frames", 2), "a", "frames", 3)
      >>> view(s, "a", "frames")
      (2, 3)
    """
    return _object_update(state, session_id, name, "commit", lambda o: o.commit(payload))


def discard(state: ManagerState, session_id: str | None, name: str) -> ManagerState:
    """Drop the staged payload of object ``name`` in a session."""
    return _object_update(state, session_id, name, "discard", lambda o: o.discard())


def view(state: ManagerState, session_id: str | None, name: str, include_staged: bool = True) -> Any:
    """Read object ``name`` of a session (see `StateObject.view`). Recency is unchanged."""
    _, entry = _lookup(state, session_id, "view")
    return entry.session.get(name).view(include_staged=include_staged)


def set_attr(state: ManagerState, session_id: str | None, key: str, value: Any) -> ManagerState:
    """Carry ``value`` (by reference) under ``key`` in a session."""
    return update_session(state, session_id, lambda s: s.set_attr(key, value))


def get_attr(state: ManagerState, session_id: str | None, key: str, default: Any = MISSING) -> Any:
    """The carried value ``key`` of a session: the very object stored."""
    _, entry = _lookup(state, session_id, "get_attr")
    return entry.session.get_attr(key, default)


def reset_session(state: ManagerState, session_id: str | None) -> ManagerState:
    """Reset every object of a session and clear its attrs; the session stays in the table."""
    return update_session(state, session_id, SessionState.reset)


def evict(state: ManagerState, session_id: str | None, name: str) -> tuple[ManagerState, int]:
    """Release the committed storage of object ``name`` in a session.

    Returns:
      ``(state, freed_bytes)``, where ``freed_bytes`` is exactly what leaves the session's accounting:
      a buffer still reachable from another object or an attr of the session is not freed, and neither
      are staged bytes.
    """
    sid, entry = _lookup(state, session_id, "evict")
    new_session, freed = _evict_object(entry.session, name)
    return state._replace(_entries=state._entries.set(sid, entry._replace(session=new_session))), freed


def drop_session(state: ManagerState, session_id: str | None) -> tuple[ManagerState, bool]:
    """Remove a session from the table. Returns ``(state, existed)``; not counted as an eviction."""
    sid = _resolve_id(session_id)
    entry = state._entries.get(sid)
    if entry is None:
        return state, False
    return state._replace(_entries=state._entries.remove(sid), _order=state._order.remove(entry.tick)), True


def fork_session(state: ManagerState, source_id: str | None, new_id: str) -> ManagerState:
    """Copy-on-write fork: ``new_id`` starts as the very same immutable `SessionState` as ``source_id``.

    O(1) in what the session holds: no array is copied, both ids share every leaf, and since states are
    immutable a later commit to either builds a new state that the other never sees. Carried attrs are
    shared *by reference*: the manager never copies what it only carries, so an attr value mutated in
    place (a list, a tensor written in place) is seen by both forks. The new session is most recently
    used; inserting it may drop the least recently used one (or be refused, without ``evict_when_full``).

    Raises:
      SessionStateLostError: ``source_id`` is not in the table.
      ValueError: ``new_id`` is already in the table.
    """
    _, entry = _lookup(state, source_id, "fork_session")
    nid = _resolve_id(new_id)
    if nid in state._entries:
        raise ValueError(f"`fork_session`: target session {nid!r} already exists; drop it first or pick another id.")
    return _insert(state, nid, entry.session, "fork_session")


def raise_max_sessions(state: ManagerState, n: int) -> ManagerState:
    """Raise the count cap to ``n``.

    Raises:
      ValueError: ``n`` is not a positive int, or is below the current cap (lowering is refused: it would
        have to drop sessions without a request asking for it).
    """
    _check_positive(n, "`raise_max_sessions`: n")
    if n < state.max_sessions:
        raise ValueError(
            f"`raise_max_sessions`: n={n} is below the current cap {state.max_sessions}; the cap can only be raised."
        )
    return state._replace(max_sessions=n)


def stats(state: ManagerState) -> dict[str, Any]:
    """Counters and bytes: ``sessions``, ``max_sessions``, ``byte_budget``, ``total_nbytes``, ``hits``,
    ``misses``, ``evictions``, then one ``nbytes:<device>`` key per device, sorted. Each allocation is
    counted once across all sessions."""
    per_device = accounting.nbytes_by_device(state)
    out: dict[str, Any] = {
        "sessions": len(state),
        "max_sessions": state.max_sessions,
        "byte_budget": state.byte_budget,
        "total_nbytes": sum(per_device.values()),
        "hits": state.hits,
        "misses": state.misses,
        "evictions": state.evictions,
    }
    out.update({f"nbytes:{device}": n for device, n in per_device.items()})
    return out
