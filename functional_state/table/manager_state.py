"""`ManagerState` and the pure functions over it: a count-capped LRU table of sessions.

Every function takes a `ManagerState` and returns a new one (with a result where there is one); the
input is never changed. The table is one persistent hash map (``immutables.Map``, a C-backed HAMT)
``session_id -> (session, previous id, next id, incarnation)``: the recency order is a doubly linked list
threaded through the map, so a hit, a miss, an insertion that evicts, a drop and a fork each rewrite a
handful of entries, O(log n) in the number of sessions whatever the history, from any state, old or new.

`ManagerState` is host-side bookkeeping, not a pytree: recency and counters change on every lookup, and a
jitted function over them would retrace each time. `sessions` gives the ``{session_id: SessionState}``
pytree to map or jit over, and `with_sessions` puts a mapped tree back (Flax NNX's split/merge idea).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, NamedTuple

import immutables
import jax

from .._repr import repr_html, treescope_repr
from ..core.pytree import MISSING
from ..core.session import SessionState, no_object_message
from ..core.state_object import StateObject
from ..errors import (
    InvalidArgumentError,
    InvalidTypeError,
    ObjectNotFoundError,
    SessionAdmissionError,
    SessionExistsError,
    SessionStateLostError,
    StateConsumedError,
)
from ..memory.budget import normalize_budget
from .ledger import Acct, totals_with_attrs

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_ID",
    "ManagerState",
    "commit",
    "discard",
    "drop_session",
    "fork_session",
    "get_or_create",
    "get_session",
    "incarnation",
    "lookup",
    "put",
    "raise_max_sessions",
    "resolve_session_id",
    "sessions",
    "stage",
    "view",
    "with_sessions",
]

DEFAULT_SESSION_ID = "default"
DEFAULT_MAX_SESSIONS = 64  # mirrors the bespoke MAX_DREAMZERO_SESSIONS

# A node of the table: (session, id of the previous (less recent) session, id of the next, incarnation).
# Plain tuples, because one is built on every write: about 5x cheaper than a NamedTuple (0.07 vs 0.33 us,
# which would cost ~9% of a stage+commit). The layout is private to this module: other modules read a
# table through the node API below (`locate`, `node_session`, `held_session`, `entries`, `lru_sessions`,
# `session_map`) and change counters through `Counters`, `with_counters` and `count_evictions`.
_S: Final = 0
_P: Final = 1
_N: Final = 2
_U: Final = 3
Node = tuple[SessionState, "str | None", "str | None", int]
# The table's other fields, one tuple so that a write to a session copies two references, not eight:
# (head: least recent id, tail: most recent id, next incarnation, config, hits, misses, evictions, then
# the counters that change rarely: parks, restores).
_HEAD: Final = 0
_TAIL: Final = 1
_UID: Final = 2
_CFG: Final = 3
_HITS: Final = 4
_MISSES: Final = 5
_EVICTIONS: Final = 6
_PARKS: Final = 7
_RESTORES: Final = 8
Meta = tuple[Any, ...]
_EMPTY: immutables.Map = immutables.Map()
_new = object.__new__
_log = logging.getLogger("functional_state")


@dataclasses.dataclass(frozen=True)
class _Config:
    max_sessions: int
    byte_budget: dict[str, int] | None  # pool -> bytes ("*": every device pool); see functional_state.budget
    evict_when_full: bool


def _check_positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"{what} must be a positive int, got {value!r}.")
    return value


class ManagerState:
    """An immutable LRU table ``session_id -> SessionState`` with a count cap and hit/miss counters.

    Build it with `ManagerState.create`; change it only through the pure functions of this module, which
    return new states. Read it with ``len(state)``, ``sid in state``, ``state.session_ids`` (least recently
    used first), the counter properties, `sessions`, `lookup` and `stats`.
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
          >>> state = ManagerState.create(max_sessions=2)
          >>> state, session = get_or_create(state, "a")
          >>> len(state), state.misses
          (1, 1)
        """
        _check_positive(max_sessions, "`ManagerState.create`: max_sessions")
        budget = normalize_budget(byte_budget, "ManagerState.create: byte_budget")
        config = _Config(max_sessions, budget, bool(evict_when_full))
        return make_state(_EMPTY, (None, None, 0, config, 0, 0, 0, 0, 0), None if budget is None else Acct.build([]))

    # --- reads -------------------------------------------------------------------------------------
    @property
    def _config(self) -> _Config:
        return self._meta[_CFG]

    @property
    def max_sessions(self) -> int:
        return self._meta[_CFG].max_sessions

    @property
    def byte_budget(self) -> dict[str, int] | None:
        """``{pool: bytes}`` (``"*"``: every device pool), or None."""
        return self._meta[_CFG].byte_budget

    @property
    def evict_when_full(self) -> bool:
        return self._meta[_CFG].evict_when_full

    @property
    def hits(self) -> int:
        """Lookups (`get_or_create`, `get_session`) that found their session."""
        return self._meta[_HITS]

    @property
    def misses(self) -> int:
        """`get_or_create` calls that created their session."""
        return self._meta[_MISSES]

    @property
    def evictions(self) -> int:
        """Sessions dropped to make room under the count cap."""
        return self._meta[_EVICTIONS]

    @property
    def parks(self) -> int:
        """Objects parked (`park`), counting each session of a shared park once."""
        return self._meta[_PARKS]

    @property
    def restores(self) -> int:
        """Objects restored (`restore`), whether asked for or done by a handle on access."""
        return self._meta[_RESTORES]

    @property
    def counters(self) -> Counters:
        """Every counter, by name (what a checkpoint saves)."""
        return Counters(*self._meta[_HITS : _RESTORES + 1])

    @property
    def issued(self) -> int:
        """Incarnation numbers issued so far: a table derived from another gained one per insertion."""
        return self._meta[_UID]

    @property
    def least_recent(self) -> str | None:
        """The id an insertion into a full table would evict next (None when empty). O(1)."""
        return self._meta[_HEAD]

    @property
    def most_recent(self) -> str | None:
        """The most recently used id (None when empty). O(1)."""
        return self._meta[_TAIL]

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Session ids, least recently used first."""
        out = []
        nodes, sid = self._nodes, self._meta[_HEAD]
        while sid is not None:
            out.append(sid)
            sid = nodes[sid][_N]
        return tuple(out)

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
        return [node[_S] for node in self._nodes.values()]

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Render as the table a user thinks of (sessions in LRU order, counters), not the internal map."""
        attributes = {
            "sessions": sessions(self),
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


def with_counters(state: ManagerState, counters: Counters | tuple[int, ...]) -> ManagerState:
    """``state`` with its counters replaced (a loaded checkpoint's), sessions and configuration kept."""
    meta = list(state._meta)
    meta[_HITS : _RESTORES + 1] = tuple(counters)
    return make_state(state._nodes, tuple(meta), state._acct)


def count_evictions(state: ManagerState, n: int = 1) -> ManagerState:
    """``state`` with ``n`` more evictions counted (a session a release plan dropped is lost like one)."""
    meta = list(state._meta)
    meta[_EVICTIONS] += n
    return make_state(state._nodes, tuple(meta), state._acct)


def node_session(node: Node) -> SessionState:
    """The session a node (from `locate`) holds."""
    return node[_S]


def held_session(state: ManagerState, sid: str, uid: int) -> SessionState | None:
    """The session if ``state`` holds incarnation ``uid`` of ``sid`` (one atomic read), else None."""
    node = state._nodes.get(sid)
    return node[_S] if node is not None and node[_U] == uid else None


def incarnation_of(state: ManagerState, sid: str) -> int | None:
    """`incarnation` without its argument checks, for a caller that resolved ``sid`` itself."""
    node = state._nodes.get(sid)
    return None if node is None else node[_U]


def entries(state: ManagerState) -> Iterator[tuple[str, int, SessionState]]:
    """``(session id, incarnation, session)`` for every session, in map order (not recency)."""
    for sid, node in state._nodes.items():
        yield sid, node[_U], node[_S]


def entries_lru(state: ManagerState) -> Iterator[tuple[str, int, SessionState]]:
    """``(session id, incarnation, session)`` least recently used first, lazily: a caller looking for what an
    LRU eviction removed stops after the first few."""
    nodes, sid = state._nodes, state._meta[_HEAD]
    while sid is not None:
        node = nodes[sid]
        yield sid, node[_U], node[_S]
        sid = node[_N]


def session_map(state: ManagerState) -> dict[str, SessionState]:
    """``{session id: session}``, in map order (not recency): the cheapest full read."""
    return {sid: node[_S] for sid, node in state._nodes.items()}


def lru_sessions(state: ManagerState) -> tuple[list[str], list[SessionState]]:
    """Session ids and sessions, least recently used first.

    Two flat lists rather than a list of pairs: 100k new tuples would trigger full garbage collections over
    the whole (large) heap, which cost more than the walk itself."""
    sids, objs = [], []
    nodes, sid = state._nodes, state._meta[_HEAD]
    while sid is not None:
        node = nodes[sid]
        sids.append(sid)
        objs.append(node[_S])
        sid = node[_N]
    return sids, objs


def ledger_of(state: ManagerState) -> Acct:
    """The state's incremental accounting, built on first use (one walk) and kept by every later state.

    Built lazily so that a table nobody asks about pays nothing per step; a table with a byte budget tracks
    from its creation. Attaching it to ``state`` is a memo, invisible to every function's result.
    """
    acct = state._acct
    if acct is None:
        acct = Acct.build(node[_S] for node in state._nodes.values())
        state._acct = acct
    return acct


def _not_a_pytree(state: ManagerState) -> Any:
    raise InvalidTypeError(
        "a ManagerState is host-side bookkeeping (recency, counters), not a pytree: jitting or mapping over it "
        "would retrace on every lookup. Map or jit over `fs.sessions(state)` (a {session_id: SessionState} "
        "pytree) and put the result back with `fs.with_sessions(state, tree)`."
    )


jax.tree_util.register_pytree_node(ManagerState, _not_a_pytree, lambda aux, children: _not_a_pytree(None))  # type: ignore[arg-type]
jax.tree_util.register_pytree_node(
    ConsumedManagerState,
    _not_a_pytree,
    lambda aux, children: _not_a_pytree(None),  # type: ignore[arg-type]
)


# --- argument checks -------------------------------------------------------------------------------------


def check_state(state: Any, what: str) -> None:
    """Called when ``type(state) is not ManagerState``: raise the error that says what to pass instead."""
    if isinstance(state, ConsumedManagerState):
        raise StateConsumedError(
            f"`{what}`: this ManagerState was consumed by `step(..., donate=True)`, which may have deleted its "
            f"buffers. Use the state that call returned."
        )
    if isinstance(state, ManagerState):
        return
    if type(state).__name__ == "SessionStateManager" and hasattr(state, "state"):
        raise InvalidTypeError(
            f"`{what}` takes a ManagerState, got a SessionStateManager: pass `manager.state` to the pure "
            f"function, or call the manager's own method."
        )
    raise InvalidTypeError(f"`{what}` takes a ManagerState (from `ManagerState.create`), got {type(state).__name__}.")


def resolve_id(session_id: Any, what: str) -> str:
    """The table key for ``session_id``: None means ``"default"``; anything but a non-empty str raises."""
    if session_id is None:
        return DEFAULT_SESSION_ID
    if not isinstance(session_id, str) or not session_id:
        raise InvalidTypeError(
            f"`{what}`: session_id must be a non-empty str or None (for {DEFAULT_SESSION_ID!r}), got {session_id!r}."
        )
    return session_id


def resolve_session_id(session_id: str | None) -> str:
    """The table key every function uses for ``session_id``: None means ``"default"``.

    Raises:
      InvalidTypeError: ``session_id`` is neither a non-empty str nor None.

    Example:
      >>> resolve_session_id(None), resolve_session_id("robot-0")
      ('default', 'robot-0')
    """
    return resolve_id(session_id, "resolve_session_id")


def _lost(state: ManagerState, sid: str, what: str) -> SessionStateLostError:
    return SessionStateLostError(
        f"`{what}`: session {sid!r} is not in the table: it was never created, or it was evicted "
        f"(LRU cap {state.max_sessions}) or dropped. A continuation cannot resume it; start a new "
        f"session with `get_or_create`."
    )


def locate(state: ManagerState, session_id: Any, what: str) -> tuple[str, Node]:
    """``(sid, node)`` of an existing session, with every argument check the public functions need."""
    if type(state) is not ManagerState:
        check_state(state, what)
    sid = session_id if type(session_id) is str and session_id else resolve_id(session_id, what)
    node = state._nodes.get(sid)
    if node is None:
        raise _lost(state, sid, what)
    return sid, node


def find_object(node: Node, name: str, what: str) -> StateObject:
    obj = node[_S]._objects.get(name)
    if obj is None:
        raise ObjectNotFoundError(no_object_message(node[_S], name, what))
    return obj


# --- the recency list (each helper works on a map mutation, so one write builds one new map) -------------


def _unlink(mm: Any, node: Node, head: str | None, tail: str | None) -> tuple[str | None, str | None]:
    prev, nxt = node[_P], node[_N]
    if prev is None:
        head = nxt
    else:
        p = mm[prev]
        mm[prev] = (p[_S], p[_P], nxt, p[_U])
    if nxt is None:
        tail = prev
    else:
        n = mm[nxt]
        mm[nxt] = (n[_S], prev, n[_N], n[_U])
    return head, tail


def _append(mm: Any, sid: str, session: SessionState, uid: int, head: str | None, tail: str | None) -> str | None:
    """Link ``sid`` in as the most recent session; returns the new head."""
    if tail is None:
        mm[sid] = (session, None, None, uid)
        return sid
    t = mm[tail]
    mm[tail] = (t[_S], t[_P], sid, t[_U])
    mm[sid] = (session, tail, None, uid)
    return head


def _touch(state: ManagerState, sid: str, node: Node, hits: int) -> ManagerState:
    """Make ``sid`` the most recently used session, adding ``hits`` to the hit counter."""
    head, tail, uid, config, n_hits, misses, evictions, *rare = state._meta
    if sid == tail:
        if not hits:
            return state
        return make_state(state._nodes, (head, tail, uid, config, n_hits + hits, misses, evictions, *rare), state._acct)
    # The general unlink + append, written out for a node that is not the tail (so it has a next): the hit
    # path, rewriting at most four entries, each read from the unchanged map.
    nodes = state._nodes
    prev, nxt = node[_P], node[_N]
    mm = nodes.mutate()
    if prev is None:
        head = nxt
    else:
        p = nodes[prev]
        mm[prev] = (p[_S], p[_P], nxt, p[_U])
    n = nodes[nxt]
    if nxt == tail:
        mm[nxt] = (n[_S], prev, sid, n[_U])
    else:
        mm[nxt] = (n[_S], prev, n[_N], n[_U])
        t = nodes[tail]
        mm[tail] = (t[_S], t[_P], sid, t[_U])
    mm[sid] = (node[_S], tail, None, node[_U])
    new = _new(ManagerState)
    new._nodes = mm.finish()
    new._meta = (head, sid, uid, config, n_hits + hits, misses, evictions, *rare)
    new._acct = state._acct
    return new


def _insert(state: ManagerState, sid: str, session: SessionState, what: str, misses: int) -> ManagerState:
    """Add a new session as the most recent, dropping the least recent one when the table is full."""
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
            acct = acct.remove_session(victim[_S])
        head = victim[_N]
        if head is None:
            tail = None
        else:
            h = mm[head]
            mm[head] = (h[_S], None, h[_N], h[_U])
        evictions += 1
    head = _append(mm, sid, session, uid, head, tail)
    if acct is not None:
        acct = acct.add_session(session)
    return make_state(mm.finish(), (head, sid, uid + 1, config, hits, n_misses + misses, evictions, *rare), acct)


def replace_session(state: ManagerState, sid: str, node: Node, session: SessionState) -> ManagerState:
    acct = state._acct
    if acct is not None:
        acct = acct.swap_session(node[_S], session)
    return make_state(state._nodes.set(sid, (session, node[_P], node[_N], node[_U])), state._meta, acct)


# --- public pure functions ---------------------------------------------------------------------------


def get_or_create(state: ManagerState, session_id: str | None) -> tuple[ManagerState, SessionState]:
    """Look a session up, creating it on a miss. Returns ``(state, session)``.

    A hit makes the session most recently used. A miss inserts an empty session; over the cap the least
    recently used session is dropped from the table (``evict_when_full``) or the call is refused.

    Raises:
      SessionAdmissionError: full table with ``evict_when_full=False``.
      InvalidTypeError: ``session_id`` is not a non-empty str or None.

    Example:
      >>> s0 = ManagerState.create(max_sessions=1)
      >>> s1, _ = get_or_create(s0, "a")
      >>> s2, _ = get_or_create(s1, "b")  # drops "a"
      >>> s2.session_ids, s2.evictions, s1.session_ids
      (('b',), 1, ('a',))
    """
    if type(state) is not ManagerState:
        check_state(state, "get_or_create")
    sid = session_id if type(session_id) is str and session_id else resolve_id(session_id, "get_or_create")
    node = state._nodes.get(sid)
    if node is not None:
        meta = state._meta
        if sid == meta[_TAIL]:  # already the most recent: only the hit counter moves
            new = _new(ManagerState)
            new._nodes = state._nodes
            new._acct = state._acct
            new._meta = (
                meta[_HEAD],
                sid,
                meta[_UID],
                meta[_CFG],
                meta[_HITS] + 1,
                meta[_MISSES],
                meta[_EVICTIONS],
                meta[_PARKS],
                meta[_RESTORES],
            )
            return new, node[_S]
        return _touch(state, sid, node, 1), node[_S]
    session = SessionState.empty()
    return _insert(state, sid, session, "get_or_create", 1), session


def get_session(state: ManagerState, session_id: str | None) -> tuple[ManagerState, SessionState]:
    """Look up a session a continuation expects to exist; a hit makes it most recently used.

    Raises:
      SessionStateLostError: unknown, evicted or dropped; nothing is created.
    """
    sid, node = locate(state, session_id, "get_session")
    return _touch(state, sid, node, 1), node[_S]


def lookup(state: ManagerState, session_id: str | None, default: Any = MISSING) -> Any:
    """The `SessionState` of ``session_id`` without using it: recency and counters are unchanged.

    Raises:
      SessionStateLostError: the session is not in the table and no ``default`` was given.
    """
    try:
        return locate(state, session_id, "lookup")[1][_S]
    except SessionStateLostError:
        if default is MISSING:
            raise
        return default


def incarnation(state: ManagerState, session_id: str | None) -> int | None:
    """A number that identifies this life of ``session_id`` in the table, or None when it is absent.

    A session dropped (or evicted) and created again under the same id gets a new number, so a holder of
    the old number can tell that the id now names another session.
    """
    if type(state) is not ManagerState:
        check_state(state, "incarnation")
    node = state._nodes.get(resolve_id(session_id, "incarnation"))
    return None if node is None else node[_U]


def sessions(state: ManagerState) -> dict[str, SessionState]:
    """The sessions as a ``{session_id: SessionState}`` pytree (least recently used first).

    This is what to map or jit over: two tables that differ only in recency or counters give equal tree
    structures. Put a mapped tree back with `with_sessions`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functional_state import ArrayRing
      >>> s, _ = get_or_create(ManagerState.create(), "a")
      >>> s = commit(put(s, "a", "ring", ArrayRing.create(2, (3,))), "a", "ring", jnp.ones(3))
      >>> advance = jax.jit(lambda tree: {k: v.update("ring", lambda r: r.commit(jnp.full(3, 2.0))) for k, v in tree.items()})
      >>> view(with_sessions(s, advance(sessions(s))), "a", "ring")[:, 0].tolist()
      [1.0, 2.0]
    """
    if type(state) is not ManagerState:
        check_state(state, "sessions")
    out = {}
    nodes, sid = state._nodes, state._meta[_HEAD]
    while sid is not None:
        node = nodes[sid]
        out[sid] = node[_S]
        sid = node[_N]
    return out


def with_sessions(state: ManagerState, tree: Mapping[str, SessionState]) -> ManagerState:
    """``state`` with every session replaced by ``tree[session_id]``; recency and counters are unchanged.

    Raises:
      InvalidTypeError: ``tree`` is not a mapping of `SessionState`.
      InvalidArgumentError: ``tree`` does not hold exactly the ids of ``state``.
    """
    if type(state) is not ManagerState:
        check_state(state, "with_sessions")
    if not isinstance(tree, Mapping):
        raise InvalidTypeError(
            f"`with_sessions`: expected a mapping {{session_id: SessionState}}, got {type(tree).__name__}."
        )
    missing = sorted(set(state._nodes.keys()) - set(tree))
    extra = sorted(set(tree) - set(state._nodes.keys()))
    if missing or extra:
        raise InvalidArgumentError(
            f"`with_sessions`: the tree must hold exactly the table's session ids; missing {missing}, unknown {extra}. "
            f"Add or drop sessions with `get_or_create`/`drop_session`, not through the tree."
        )
    bad = sorted(sid for sid, s in tree.items() if not isinstance(s, SessionState))
    if bad:
        raise InvalidTypeError(f"`with_sessions`: values must be SessionState; not so for {bad}.")
    mm = state._nodes.mutate()
    acct = state._acct
    for sid, session in tree.items():
        n = mm[sid]
        mm[sid] = (session, n[_P], n[_N], n[_U])
        if acct is not None:
            acct = acct.swap_session(n[_S], session)
    return make_state(mm.finish(), state._meta, acct)


def put(state: ManagerState, session_id: str | None, name: str, obj: StateObject) -> ManagerState:
    """Store state object ``obj`` under ``name`` in a session (see `SessionState.put`)."""
    sid, node = locate(state, session_id, "put")
    return replace_session(state, sid, node, node[_S].put(name, obj))


def _object_op(
    state: ManagerState, session_id: Any, name: str, what: str, op: Callable[[StateObject], StateObject]
) -> ManagerState:
    sid, node = locate(state, session_id, what)
    session = node[_S]
    return replace_session(state, sid, node, session._with_object(name, op(find_object(node, name, what))))


def stage(state: ManagerState, session_id: str | None, name: str, payload: Any) -> ManagerState:
    """Stage ``payload`` in object ``name`` of a session (see `StateObject.stage`)."""
    return _object_op(state, session_id, name, "stage", lambda o: o.stage(payload))


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
    # Written out, with every helper inlined: this is the per-step path.
    if type(state) is not ManagerState:
        check_state(state, "commit")
    sid = session_id if type(session_id) is str and session_id else resolve_id(session_id, "commit")
    nodes = state._nodes
    node = nodes.get(sid)
    if node is None:
        raise _lost(state, sid, "commit")
    session = node[_S]
    objects = session._objects
    obj = objects.get(name)
    if obj is None:
        raise ObjectNotFoundError(no_object_message(session, name, "commit"))
    new_obj = obj.commit(payload)
    new_session = _new(SessionState)
    new_session._objects = objects.set(name, new_obj)
    new_session._attrs = session._attrs
    new_session._policies = session._policies
    new = _new(ManagerState)
    new._nodes = nodes.set(sid, (new_session, node[_P], node[_N], node[_U]))
    new._meta = state._meta
    acct = state._acct
    new._acct = None if acct is None else acct.swap(obj, new_obj)
    return new


def discard(state: ManagerState, session_id: str | None, name: str) -> ManagerState:
    """Drop the staged payload of object ``name`` in a session."""
    return _object_op(state, session_id, name, "discard", lambda o: o.discard())


def view(state: ManagerState, session_id: str | None, name: str, include_staged: bool = True) -> Any:
    """Read object ``name`` of a session (see `StateObject.view`). Recency is unchanged."""
    _, node = locate(state, session_id, "view")
    return find_object(node, name, "view").view(include_staged=include_staged)


def _pool_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in sorted({*before, *after}) if after.get(k, 0) != before.get(k, 0)
    }


def _with_counter(state: ManagerState, nodes: immutables.Map, index: int, add: int, acct: Acct | None) -> ManagerState:
    meta = list(state._meta)
    meta[index] += add
    return make_state(nodes, tuple(meta), acct)


def replace_object(
    state: ManagerState, old: StateObject, new: StateObject, targets: dict[str, list[str]], counter: str
) -> tuple[ManagerState, dict[str, int]]:
    """``state`` with object ``old`` replaced by ``new`` under ``targets`` (session -> names), the named
    counter (``"parks"`` or ``"restores"``) raised by the names replaced, and the change in bytes per pool
    that makes, measured: the table's accounting (objects, and attrs re-read) before and after, each buffer
    counted once, exactly as `stats` counts it."""
    sessions_now = [node[_S] for node in state._nodes.values()]
    before = state._acct if state._acct is not None else Acct.build(sessions_now)
    after = before
    mm = state._nodes.mutate()
    for target, names in targets.items():
        n = mm[target]
        session = n[_S]
        for name in names:
            session = session._with_object(name, new)
            after = after.swap(old, new)
        mm[target] = (session, n[_P], n[_N], n[_U])
    moved = _pool_delta(totals_with_attrs(before, sessions_now)[0], totals_with_attrs(after, sessions_now)[0])
    count = sum(len(names) for names in targets.values())
    index = _PARKS if counter == "parks" else _RESTORES
    return _with_counter(state, mm.finish(), index, count, None if state._acct is None else after), moved


def drop_session(state: ManagerState, session_id: str | None) -> tuple[ManagerState, bool]:
    """Remove a session from the table. Returns ``(state, existed)``; not counted as an eviction."""
    if type(state) is not ManagerState:
        check_state(state, "drop_session")
    sid = resolve_id(session_id, "drop_session")
    node = state._nodes.get(sid)
    if node is None:
        return state, False
    head, tail, *rest = state._meta
    mm = state._nodes.mutate()
    head, tail = _unlink(mm, node, head, tail)
    del mm[sid]
    acct = None if state._acct is None else state._acct.remove_session(node[_S])
    _log.info("drop_session: session %r left the table (%d objects)", sid, len(node[_S]._objects))
    return make_state(mm.finish(), (head, tail, *rest), acct), True


def fork_session(state: ManagerState, source_id: str | None, new_id: str | None) -> ManagerState:
    """Fork: ``new_id`` starts as a snapshot of ``source_id``.

    Objects are immutable, so both sessions share every buffer (O(1) in what the session holds) and a
    later commit to either builds a new state that the other never sees. Attrs follow their fork policy
    (`SessionState.forked`): a list the model assigns into should be declared ``"copy_container"``, or one
    fork's writes would show in the other.

    A fork is a use of the source: the source becomes most recently used first, then the fork is
    inserted as the most recent, so inserting into a full table drops the least recently used *other*
    session (or is refused without ``evict_when_full``), never the source.

    Raises:
      SessionStateLostError: ``source_id`` is not in the table.
      SessionExistsError: ``new_id`` is already in the table.
      SessionAdmissionError: the table is full and cannot evict, or holds only the source (cap 1).
    """
    sid, node = locate(state, source_id, "fork_session")
    nid = resolve_id(new_id, "fork_session")
    if nid in state._nodes:
        raise SessionExistsError(
            f"`fork_session`: target session {nid!r} already exists; drop it first or pick another id."
        )
    if state.max_sessions == 1:
        raise SessionAdmissionError(
            f"`fork_session`: the table holds at most 1 session, so a fork of {sid!r} could only replace it. "
            f"Raise the cap (`raise_max_sessions`) to keep both."
        )
    touched = _touch(state, sid, node, 0)
    return _insert(touched, nid, node[_S].forked(), "fork_session", 0)


def raise_max_sessions(state: ManagerState, n: int) -> ManagerState:
    """Raise the count cap to ``n``.

    Raises:
      InvalidArgumentError: ``n`` is not a positive int, or is below the current cap (lowering is refused:
        it would have to drop sessions without a request asking for it).
    """
    if type(state) is not ManagerState:
        check_state(state, "raise_max_sessions")
    _check_positive(n, "`raise_max_sessions`: n")
    if n < state.max_sessions:
        raise InvalidArgumentError(
            f"`raise_max_sessions`: n={n} is below the current cap {state.max_sessions}; the cap can only be raised."
        )
    if n == state.max_sessions:
        return state
    meta = list(state._meta)
    meta[_CFG] = dataclasses.replace(state._config, max_sessions=n)
    return make_state(state._nodes, tuple(meta), state._acct)
