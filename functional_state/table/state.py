"""`ManagerState`: the table type, its encoding, and the named node/counter API the rest of the package reads.

The table is one persistent hash map (``immutables.Map``, a C-backed HAMT) ``session_id -> node`` plus one
tuple of the table's other fields. A node and that tuple are plain tuples, because one is built on every
write (about 5x cheaper than a NamedTuple: 0.07 vs 0.33 us, ~9% of a stage+commit); their positions are
named here, once, and only the table's own modules (this one, `checks`, `lru`, `session_verbs`, `object_verbs`)
index them. Every other module reads a table through the functions below (`node_session`, `held_session`,
`entries`, `entries_lru`, `lru_sessions`, `session_map`, `ledger_of`) and changes counters through
`Counters`, `with_counters` and `count_evictions`.

`ManagerState` is host-side bookkeeping, not a pytree: recency and counters change on every lookup, and a
jitted function over them would retrace each time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Final, NamedTuple

import immutables
import jax

from .._repr import repr_html, treescope_repr
from ..core.pytree import MISSING
from ..core.session import SessionState
from ..errors import InvalidArgumentError, InvalidTypeError
from ..memory.budget import normalize_budget
from .ledger import Acct
from .recency_log import Log, entries_reversed
from .recency_log import entries as log_entries

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_ID",
    "ConsumedManagerState",
    "Counters",
    "ManagerState",
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
]

DEFAULT_SESSION_ID = "default"
DEFAULT_MAX_SESSIONS = 64  # mirrors the bespoke MAX_DREAMZERO_SESSIONS

# A node: (session, tick of its last use, incarnation). Recency is the order of the ticks: every use takes
# the next tick of the table's clock and appends ``(session id, tick)`` to an append-only log, so a hit
# rewrites no other node (a linked list rewrote up to four). An entry is current while its session's node
# still holds its tick; the log is read oldest first, skipping entries a later use superseded, and is
# compacted to its current entries when it grows to COMPACT_AT times the table.
SESSION: Final = 0
USED: Final = 1
UID: Final = 2
Node = tuple[SessionState, int, int]
# The table's other fields, one tuple so that a write to a session copies two references: (clock: the next
# tick, log, start and end of this table's window of the log, pending: the session whose node does not hold
# its tick yet (see `lru.touch`) and that tick, hits, then the fields that only a miss or a rare verb
# changes, one tuple so that a hit copies nine references, not fourteen: (next incarnation, config, misses,
# evictions, parks, restores), and the end at which the window is compacted (start + COMPACT_AT x the
# table's size, kept so that a hit compares one int instead of computing it).
CLOCK: Final = 0
LOG: Final = 1
START: Final = 2
END: Final = 3
PENDING: Final = 4
PENDING_TICK: Final = 5
HITS: Final = 6
COLD: Final = 7
LIMIT: Final = 8
ISSUED: Final = 0
CONFIG: Final = 1
MISSES: Final = 2
EVICTIONS: Final = 3
PARKS: Final = 4
RESTORES: Final = 5
COMPACT_AT: Final = 4
Meta = tuple[Any, ...]
EMPTY_NODES: immutables.Map = immutables.Map()
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

    __slots__ = ("__weakref__", "_acct", "_meta", "_nodes")
    _nodes: immutables.Map  # session_id -> Node
    _meta: Meta
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
        meta = (0, Log([], []), 0, 0, None, 0, 0, (0, config, 0, 0, 0, 0), 0)
        return make_state(EMPTY_NODES, meta, None if budget is None else Acct.build([]))

    # --- reads -------------------------------------------------------------------------------------
    @property
    def max_sessions(self) -> int:
        return self._meta[COLD][CONFIG].max_sessions

    @property
    def byte_budget(self) -> dict[str, int] | None:
        """``{pool: bytes}`` (``"*"``: every device pool), or None."""
        return self._meta[COLD][CONFIG].byte_budget

    @property
    def evict_when_full(self) -> bool:
        return self._meta[COLD][CONFIG].evict_when_full

    @property
    def hits(self) -> int:
        """Lookups (`get_or_create`, `get_session`) that found their session."""
        return self._meta[HITS]

    @property
    def misses(self) -> int:
        """`get_or_create` calls that created their session."""
        return self._meta[COLD][MISSES]

    @property
    def evictions(self) -> int:
        """Sessions dropped to make room under the count cap."""
        return self._meta[COLD][EVICTIONS]

    @property
    def parks(self) -> int:
        """Objects parked (`park`), counting each session of a shared park once."""
        return self._meta[COLD][PARKS]

    @property
    def restores(self) -> int:
        """Objects restored (`restore`), whether asked for or done by a handle on access."""
        return self._meta[COLD][RESTORES]

    @property
    def counters(self) -> Counters:
        """Every counter, by name (what a checkpoint saves)."""
        meta = self._meta
        return Counters(meta[HITS], *meta[COLD][MISSES:])

    @property
    def issued(self) -> int:
        """Incarnation numbers issued so far: a table derived from another gained one per insertion."""
        return self._meta[COLD][ISSUED]

    @property
    def least_recent(self) -> str | None:
        """The id an insertion into a full table would evict next (None when empty)."""
        return next((sid for sid, _, _ in entries_lru(self)), None)

    @property
    def most_recent(self) -> str | None:
        """The most recently used id (None when empty)."""
        nodes, (_, log, start, end, pending, pending_tick, *_) = self._nodes, self._meta
        for sid, tick in entries_reversed(log, start, end):
            node = nodes.get(sid)
            if node is not None and (pending_tick if sid == pending else node[USED]) == tick:
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

    def _accounting_children(self) -> list[SessionState]:
        return [node[SESSION] for node in self._nodes.values()]

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


def make_state(nodes: immutables.Map, meta: Meta, acct: Acct | None) -> ManagerState:
    """A `ManagerState` of these fields (no checks: the table's modules build them)."""
    new = _new(ManagerState)
    new._nodes = nodes
    new._meta = meta
    new._acct = acct
    return new


class Counters(NamedTuple):
    """The table's counters by name (each is also a `ManagerState` property of the same name)."""

    hits: int
    misses: int
    evictions: int
    parks: int
    restores: int


def with_counters(state: ManagerState, counters: Counters | tuple[int, ...] | list[int]) -> ManagerState:
    """``state`` with its counters replaced (a loaded checkpoint's), sessions and configuration kept."""
    hits, *rest = counters
    meta = state._meta
    cold = (*meta[COLD][:MISSES], *rest)
    return make_state(state._nodes, (*meta[:HITS], hits, cold, *meta[COLD + 1 :]), state._acct)


def count_evictions(state: ManagerState, n: int = 1) -> ManagerState:
    """``state`` with ``n`` more evictions counted (a session a release plan dropped is lost like one)."""
    return add_to_counter(state, "evictions", n)


def add_to_counter(state: ManagerState, counter: str, n: int) -> ManagerState:
    """``state`` with ``n`` added to the counter named ``counter`` (a `Counters` field)."""
    return with_counters(state, [c + n if name == counter else c for name, c in state.counters._asdict().items()])


def with_max_sessions(state: ManagerState, n: int) -> ManagerState:
    """``state`` with its count cap set to ``n`` (no checks: `raise_max_sessions` makes them)."""
    meta = state._meta
    cold = list(meta[COLD])
    cold[CONFIG] = dataclasses.replace(cold[CONFIG], max_sessions=n)
    return make_state(state._nodes, (*meta[:COLD], tuple(cold), *meta[COLD + 1 :]), state._acct)


def with_issued(state: ManagerState, n: int) -> ManagerState:
    """``state`` with its incarnation counter at ``n >= state.issued`` (pure; ``state`` itself at its own)."""
    meta, cold = state._meta, state._meta[COLD]
    if type(n) is not int or n < cold[ISSUED]:
        raise InvalidArgumentError(f"`with_issued`: n must be an int >= issued={cold[ISSUED]}, got {n!r}.")
    new = (*meta[:COLD], (n, *cold[CONFIG:]), *meta[LIMIT:])  # (ISSUED is the first cold field)
    return state if n == cold[ISSUED] else make_state(state._nodes, new, state._acct)


def node_session(node: Node) -> SessionState:
    """The session a node (from `locate`) holds."""
    return node[SESSION]


def in_place(before: ManagerState, after: ManagerState, budget: bool = True) -> bool:
    """Whether ``after`` changed ``before``'s sessions in place: the same number of sessions, no incarnation
    issued since, and (with ``budget``) no byte budget to check. O(1); the shell's common-write test."""
    cold, old = after._meta[COLD], before._meta[COLD]
    return (
        (cold is old or cold[ISSUED] == old[ISSUED])
        and len(after._nodes) == len(before._nodes)
        and (not budget or cold[CONFIG].byte_budget is None)
    )


def held_session(state: ManagerState, sid: str, uid: int) -> SessionState | None:
    """The session if ``state`` holds incarnation ``uid`` of ``sid`` (one atomic read), else None."""
    node = state._nodes.get(sid)
    return node[SESSION] if node is not None and node[UID] == uid else None


def held_object(state: ManagerState, sid: str, uid: int, name: str) -> Any:
    """Object ``name`` of the session if ``state`` holds incarnation ``uid`` of ``sid`` (None: it has no such
    object), else `MISSING`: `held_session` and the object lookup in one atomic read (a handle's per-step read)."""
    node = state._nodes.get(sid)
    return node[SESSION]._objects.get(name) if node is not None and node[UID] == uid else MISSING


def incarnation_of(state: ManagerState, sid: str) -> int | None:
    """`incarnation` without its argument checks, for a caller that resolved ``sid`` itself."""
    node = state._nodes.get(sid)
    return None if node is None else node[UID]


def entries(state: ManagerState) -> Iterator[tuple[str, int, SessionState]]:
    """``(session id, incarnation, session)`` for every session, in map order (not recency)."""
    for sid, node in state._nodes.items():
        yield sid, node[UID], node[SESSION]


def entries_lru(state: ManagerState) -> Iterator[tuple[str, int, SessionState]]:
    """``(session id, incarnation, session)`` least recently used first, lazily: a caller looking for what an
    LRU eviction removed stops after the first few."""
    nodes, (_, log, start, end, pending, pending_tick, *_) = state._nodes, state._meta
    for sid, tick in log_entries(log, start, end):
        node = nodes.get(sid)
        if node is not None and (pending_tick if sid == pending else node[USED]) == tick:
            yield sid, node[UID], node[SESSION]


def session_map(state: ManagerState) -> dict[str, SessionState]:
    """``{session id: session}``, in map order (not recency): the cheapest full read."""
    return {sid: node[SESSION] for sid, node in state._nodes.items()}


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
        acct = Acct.build(node[SESSION] for node in state._nodes.values())
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
