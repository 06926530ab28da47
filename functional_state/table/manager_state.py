"""`ManagerState`: the table type, made of the records of `records`, and the session/counter API the package reads.

The table is one persistent map (`reroot_map.RerootMap`: the newest version a dict, older ones diffs toward
it) ``session_id -> SessionState``, each session stored carrying the tick of its last use and its
incarnation (`SessionState._tick`, `SessionState._uid`: no node record around it), its `Recency` (clock and
window of the recency log), its hit count, its `Totals` (what a miss or a rare verb changes), its `Config`
and its ledger: a write to a session stores one new session and keeps the other fields by reference. Other modules read a table through the functions below (`node_session`, `held_session`,
`entries`, `entries_lru`, `lru_sessions`, `session_map`, `ledger_of`) and change counters through
`Counters`, `with_counters` and `count_evictions`.

`ManagerState` is host-side bookkeeping, not a pytree: recency and counters change on every lookup, and a
jitted function over them would retrace each time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Final, NamedTuple

import jax

from .._repr import repr_html, treescope_repr
from ..core.pytree import MISSING
from ..core.session import SessionState
from ..errors import InvalidArgumentError, InvalidTypeError
from ..memory.budget import normalize_budget
from .ledger import Acct
from .recency_log import Log, entries_reversed
from .recency_log import entries as log_entries
from .records import Recency, Totals
from .reroot_map import RerootMap

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_ID",
    "ConsumedManagerState",
    "Counters",
    "ManagerState",
    "Recency",
    "Totals",
    "add_to_counter",
    "check_positive",
    "count_evictions",
    "entries",
    "entries_lru",
    "held_object",
    "held_session",
    "in_place",
    "incarnation_of",
    "ledger_of",
    "lru_sessions",
    "make_state",
    "node_session",
    "session_map",
    "with_counters",
    "with_issued",
    "with_max_sessions",
    "with_nodes",
]

DEFAULT_SESSION_ID = "default"
DEFAULT_MAX_SESSIONS = 64  # mirrors the bespoke MAX_DREAMZERO_SESSIONS
# A recency window is compacted to its current entries when it grows to COMPACT_AT times the table.
COMPACT_AT: Final = 4
_new = object.__new__


@dataclasses.dataclass(frozen=True)
class Config:
    """What `ManagerState.create` fixed: the count cap, the byte budget and the eviction mode."""

    max_sessions: int
    byte_budget: dict[str, int] | None  # pool -> bytes ("*": every device pool); see functional_state.memory.budget
    evict_when_full: bool


def check_positive(value: Any, what: str) -> int:
    """``value`` if it is a positive int (not a bool), else an `InvalidArgumentError` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"{what} must be a positive int, got {value!r}.")
    return value


class ManagerState:
    """An immutable LRU table ``session_id -> SessionState`` with a count cap and hit/miss counters.

    Build it with `ManagerState.create`; change it only through the pure functions of `functional_state`,
    which return new states. Read it with ``len(state)``, ``sid in state``, ``state.session_ids`` (least
    recently used first), the counter properties, `sessions`, `lookup` and `stats`.
    """

    __slots__ = ("__weakref__", "_acct", "_config", "_hits", "_nodes", "_recency", "_totals")
    _nodes: RerootMap  # session_id -> SessionState, as stored (carrying its tick and incarnation)
    _recency: Recency
    _hits: int
    _totals: Totals
    _config: Config
    _acct: Acct | None  # object bytes, maintained incrementally once tracked (see `ledger_of`)

    def __init__(self) -> None:
        raise InvalidTypeError("build a ManagerState with `ManagerState.create(...)`.")

    @classmethod
    def create(
        cls, max_sessions: int = DEFAULT_MAX_SESSIONS, byte_budget: Any = None, evict_when_full: bool = True
    ) -> ManagerState:
        """An empty table.

        Args:
          max_sessions: the count cap (positive). Over it, the least recently used session is dropped
            from the table (``evict_when_full=True``) or a new session is refused.
          byte_budget: bytes each memory pool may hold: ``{"cuda:0": "40GiB", "cpu/pinned_host": "64GiB"}``
            (pools as `stats` names them), or one size for every device pool. `enforce_budget` and the
            shell keep pools within it, releasing what `plan_release` chooses; a table with a budget keeps
            its byte totals from its creation.
          evict_when_full: LRU eviction (True) or admission control (False).

        Raises:
          InvalidArgumentError: ``max_sessions`` is not a positive int, or ``byte_budget`` is not a budget
            (a negative size, an unknown pool name).

        Example:
          >>> from functional_state import get_or_create
          >>> state = ManagerState.create(max_sessions=2)
          >>> state, session = get_or_create(state, "a")
          >>> len(state), state.misses
          (1, 1)
        """
        check_positive(max_sessions, "`ManagerState.create`: max_sessions")
        budget = normalize_budget(byte_budget, "ManagerState.create: byte_budget")
        config = Config(max_sessions, budget, bool(evict_when_full))
        recency = Recency(0, Log([], []), 0, 0, None, 0, 0)
        acct = None if budget is None else Acct.build([])
        return make_state(RerootMap(), recency, 0, Totals(0, 0, 0, 0, 0), config, acct)

    # --- reads -------------------------------------------------------------------------------------
    @property
    def max_sessions(self) -> int:
        return self._config.max_sessions

    @property
    def byte_budget(self) -> dict[str, int] | None:
        """``{pool: bytes}`` (``"*"``: every device pool), or None."""
        return self._config.byte_budget

    @property
    def evict_when_full(self) -> bool:
        return self._config.evict_when_full

    @property
    def hits(self) -> int:
        """Lookups (`get_or_create`, `get_session`) that found their session."""
        return self._hits

    @property
    def misses(self) -> int:
        """`get_or_create` calls that created their session."""
        return self._totals.misses

    @property
    def evictions(self) -> int:
        """Sessions dropped to make room under the count cap."""
        return self._totals.evictions

    @property
    def parks(self) -> int:
        """Objects parked (`park`), counting each session of a shared park once."""
        return self._totals.parks

    @property
    def restores(self) -> int:
        """Objects restored (`restore`), whether asked for or done by a handle on access."""
        return self._totals.restores

    @property
    def counters(self) -> Counters:
        """Every counter, by name (what a checkpoint saves)."""
        t = self._totals
        return Counters(self._hits, t.misses, t.evictions, t.parks, t.restores)

    @property
    def issued(self) -> int:
        """Incarnation numbers issued so far: a table derived from another gained one per insertion."""
        return self._totals.issued

    @property
    def least_recent(self) -> str | None:
        """The id an insertion into a full table would evict next (None when empty)."""
        return next((sid for sid, _, _ in entries_lru(self)), None)

    @property
    def most_recent(self) -> str | None:
        """The most recently used id (None when empty)."""
        nodes, recency = self._nodes, self._recency
        for sid, tick in entries_reversed(recency.log, recency.start, recency.end):
            session = nodes.get(sid)
            if session is not None and recency.tick_of(sid, session) == tick:
                return sid
        return None

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Session ids, least recently used first."""
        return tuple(sid for sid, _, _ in entries_lru(self))

    def __len__(self) -> int:
        return len(self._nodes)

    def __bool__(self) -> bool:
        return True  # an empty table is still a table: `if state:` must not mean "has sessions"

    def _repr_html_(self) -> str | None:
        return repr_html(self)

    def __contains__(self, session_id: object) -> bool:
        if session_id is None:
            session_id = DEFAULT_SESSION_ID
        return isinstance(session_id, str) and session_id in self._nodes

    def __reduce__(self) -> tuple[Any, ...]:
        # Without the ledger: it is keyed by the buffers' addresses, and a clone (pickled, deep-copied) holds
        # buffers of its own; the original's would count a buffer later allocated at a freed address as held
        # already. The clone builds its own on first use (`ledger_of`).
        return make_state, (self._nodes, self._recency, self._hits, self._totals, self._config, None)

    def _accounting_children(self) -> list[SessionState]:
        return self._nodes.values()

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Render as the table a user thinks of (sessions in LRU order, counters), not the internal map."""
        attributes = {
            "sessions": dict(zip(*lru_sessions(self), strict=True)),
            "max_sessions": self.max_sessions,
            "byte_budget": self.byte_budget,
            "evict_when_full": self.evict_when_full,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
        return treescope_repr(self, path, subtree_renderer, attributes)

    def __repr__(self) -> str:
        ids = list(self.session_ids[-8:])
        more = f"... {len(self) - 8} more, " if len(self) > 8 else ""
        return (
            f"ManagerState(sessions={len(self)}/{self.max_sessions}, hits={self.hits}, misses={self.misses}, "
            f"evictions={self.evictions}, ids=[{more}{', '.join(map(repr, ids))}])"
        )


class ConsumedManagerState(ManagerState):
    """The class a state takes once a donating `step` consumed it: every function then refuses it."""

    __slots__ = ()


def make_state(
    nodes: RerootMap, recency: Recency, hits: int, totals: Totals, config: Config, acct: Acct | None
) -> ManagerState:
    """A `ManagerState` of these fields (no checks: the table's modules build them)."""
    new = _new(ManagerState)
    new._nodes = nodes
    new._recency = recency
    new._hits = hits
    new._totals = totals
    new._config = config
    new._acct = acct
    return new


def with_nodes(state: ManagerState, nodes: RerootMap, acct: Acct | None) -> ManagerState:
    """``state`` with its nodes and ledger replaced; recency, counters and configuration kept."""
    return make_state(nodes, state._recency, state._hits, state._totals, state._config, acct)


class Counters(NamedTuple):
    """The table's counters by name (each is also a `ManagerState` property of the same name)."""

    hits: int
    misses: int
    evictions: int
    parks: int
    restores: int


def with_counters(state: ManagerState, counters: Counters | tuple[int, ...] | list[int]) -> ManagerState:
    """``state`` with its counters replaced (a loaded checkpoint's), sessions and configuration kept."""
    hits, misses, evictions, parks, restores = counters
    totals = Totals(state._totals.issued, misses, evictions, parks, restores)
    return make_state(state._nodes, state._recency, hits, totals, state._config, state._acct)


def count_evictions(state: ManagerState, n: int = 1) -> ManagerState:
    """``state`` with ``n`` more evictions counted (a session a release plan dropped is lost like one)."""
    return add_to_counter(state, "evictions", n)


def add_to_counter(state: ManagerState, counter: str, n: int) -> ManagerState:
    """``state`` with ``n`` added to the counter named ``counter`` (a `Counters` field)."""
    counters = state.counters  # (a name that is no counter raises here, rather than changing nothing)
    return with_counters(state, counters._replace(**{counter: getattr(counters, counter) + n}))


def with_max_sessions(state: ManagerState, n: int) -> ManagerState:
    """``state`` with its count cap set to ``n`` (no checks: `raise_max_sessions` makes them)."""
    config = dataclasses.replace(state._config, max_sessions=n)
    return make_state(state._nodes, state._recency, state._hits, state._totals, config, state._acct)


def with_issued(state: ManagerState, n: int) -> ManagerState:
    """``state`` with its incarnation counter at ``n >= state.issued`` (pure; ``state`` itself at its own)."""
    t = state._totals
    if type(n) is not int or n < t.issued:
        raise InvalidArgumentError(f"`with_issued`: n must be an int >= issued={t.issued}, got {n!r}.")
    if n == t.issued:
        return state
    totals = Totals(n, t.misses, t.evictions, t.parks, t.restores)
    return make_state(state._nodes, state._recency, state._hits, totals, state._config, state._acct)


def node_session(node: SessionState) -> SessionState:
    """The session `locate` found (the very object the table stores: `locate` returns it as its node)."""
    return node


def in_place(before: ManagerState, after: ManagerState, budget: bool = True) -> bool:
    """Whether ``after`` changed ``before``'s sessions in place: the same number of sessions, no incarnation
    issued since, and (with ``budget``) no byte budget to check. O(1); the shell's common-write test."""
    return (
        after._totals.issued == before._totals.issued
        and len(after._nodes) == len(before._nodes)
        and (not budget or after._config.byte_budget is None)
    )


def held_session(state: ManagerState, sid: str, uid: int) -> SessionState | None:
    """The session if ``state`` holds incarnation ``uid`` of ``sid`` (one atomic read), else None."""
    session = state._nodes.get(sid)
    return session if session is not None and session._uid == uid else None


def held_object(state: ManagerState, sid: str, uid: int, name: str) -> Any:
    """Object ``name`` of the session if ``state`` holds incarnation ``uid`` of ``sid`` (None: it has no such
    object), else `MISSING`: `held_session` and the object lookup in one atomic read (a handle's per-step read)."""
    session = state._nodes.get(sid)
    return session._objects.get(name) if session is not None and session._uid == uid else MISSING


def incarnation_of(state: ManagerState, sid: str) -> int | None:
    """`incarnation` without its argument checks, for a caller that resolved ``sid`` itself."""
    session = state._nodes.get(sid)
    return None if session is None else session._uid


def entries(state: ManagerState) -> Iterator[tuple[str, int, SessionState]]:
    """``(session id, incarnation, session)`` for every session, in map order (not recency)."""
    for sid, session in state._nodes.items():
        yield sid, session._uid, session


def entries_lru(state: ManagerState) -> Iterator[tuple[str, int, SessionState]]:
    """``(session id, incarnation, session)`` least recently used first, lazily: a caller looking for what an
    LRU eviction removed stops after the first few."""
    nodes, recency = state._nodes, state._recency
    for sid, tick in log_entries(recency.log, recency.start, recency.end):
        session = nodes.get(sid)
        if session is not None and recency.tick_of(sid, session) == tick:
            yield sid, session._uid, session


def session_map(state: ManagerState) -> dict[str, SessionState]:
    """``{session id: session}``, in map order (not recency): the cheapest full read."""
    return dict(state._nodes.items())


def lru_sessions(state: ManagerState) -> tuple[list[str], list[SessionState]]:
    """Session ids and sessions, least recently used first.

    Two flat lists rather than a list of pairs: 100k new tuples would trigger full garbage collections over
    the whole (large) heap, which cost more than the walk itself."""
    sids, objs = [], []
    for sid, _, session in entries_lru(state):
        sids.append(sid)
        objs.append(session)
    return sids, objs


def ledger_of(state: ManagerState) -> Acct:
    """The state's incremental accounting, built on first use (one walk) and kept by every later state.

    Built lazily so that a table nobody asks about pays nothing per step; a table with a byte budget tracks
    from its creation. Attaching it to ``state`` is a memo, invisible to every function's result.
    """
    acct = state._acct
    if acct is None:
        acct = Acct.build(state._nodes.values())
        state._acct = acct
    return acct


def _not_a_pytree(state: ManagerState) -> Any:
    raise InvalidTypeError(
        "a ManagerState is host-side bookkeeping (recency, counters), not a pytree: jitting or mapping over it "
        "would retrace on every lookup. Map or jit over `fs.sessions(state)` (a {session_id: SessionState} "
        "pytree) and put the result back with `fs.with_sessions(state, tree)`."
    )


for _cls in (ManagerState, ConsumedManagerState):
    jax.tree_util.register_pytree_node(_cls, _not_a_pytree, lambda aux, children: _not_a_pytree(None))  # type: ignore[arg-type]
