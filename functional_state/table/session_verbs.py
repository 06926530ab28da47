"""The session verbs of the table: look up, create, fork and drop sessions, and map over all of them.

Every function takes a `ManagerState` and returns a new one (with a result where there is one); the input
is never changed. `sessions` gives the ``{session_id: SessionState}`` pytree to map or jit over, and
`with_sessions` puts a mapped tree back (Flax NNX's split/merge idea).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..core.pytree import MISSING
from ..core.session import SessionState
from ..errors import (
    InvalidArgumentError,
    InvalidTypeError,
    SessionAdmissionError,
    SessionExistsError,
    SessionStateLostError,
)
from .checks import check_state, locate, resolve_id
from .lru import insert, remove, replace_sessions, touch
from .manager_state import ManagerState, check_positive, entries_lru, incarnation_of, with_max_sessions, with_nodes
from .torch_writes import record_fork
from .verb_core import hit_or_insert

__all__ = [
    "drop_session",
    "fork_session",
    "get_or_create",
    "get_session",
    "incarnation",
    "lookup",
    "raise_max_sessions",
    "resolve_session_id",
    "sessions",
    "with_sessions",
]

_log = logging.getLogger("functional_state")
_new = object.__new__


def resolve_session_id(session_id: str | None) -> str:
    """The table key every function uses for ``session_id``: None means ``"default"``.

    Raises:
      InvalidTypeError: ``session_id`` is neither a non-empty str nor None.

    Example:
      >>> resolve_session_id(None), resolve_session_id("robot-0")
      ('default', 'robot-0')
    """
    # (here, not in the compiled `checks`: compiled, its `str | None` annotation would refuse an int with a
    # bare TypeError before the check below says what was wrong)
    return resolve_id(session_id, "resolve_session_id")


def get_or_create(state: ManagerState, session_id: str | None) -> tuple[ManagerState, SessionState]:
    """Look a session up, creating it on a miss. Returns ``(state, session)``.

    A hit makes the session most recently used. A miss inserts an empty session; over the cap the least
    recently used session is dropped from the table (``evict_when_full``) or the call is refused.

    Raises:
      SessionAdmissionError: full table with ``evict_when_full=False``.
      InvalidTypeError: ``session_id`` is not a non-empty str or None.

    Example:
      >>> from functional_state import ManagerState
      >>> s0 = ManagerState.create(max_sessions=1)
      >>> s1, _ = get_or_create(s0, "a")
      >>> s2, _ = get_or_create(s1, "b")  # drops "a"
      >>> s2.session_ids, s2.evictions, s1.session_ids
      (('b',), 1, ('a',))
    """
    return hit_or_insert(state, session_id)


def get_session(state: ManagerState, session_id: str | None) -> tuple[ManagerState, SessionState]:
    """Look up a session a continuation expects to exist; a hit makes it most recently used.

    Raises:
      SessionStateLostError: unknown, evicted or dropped; nothing is created.
    """
    sid, session = locate(state, session_id, "get_session")
    return touch(state, sid, session, 1), session


def lookup(state: ManagerState, session_id: str | None, default: Any = MISSING) -> Any:
    """The `SessionState` of ``session_id`` without using it: recency and counters are unchanged.

    Raises:
      SessionStateLostError: the session is not in the table and no ``default`` was given.
    """
    try:
        _, session = locate(state, session_id, "lookup")
        return session
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
    return incarnation_of(state, resolve_id(session_id, "incarnation"))


def sessions(state: ManagerState) -> dict[str, SessionState]:
    """The sessions as a ``{session_id: SessionState}`` pytree (least recently used first).

    This is what to map or jit over: two tables that differ only in recency or counters give equal tree
    structures. Put a mapped tree back with `with_sessions`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functional_state import ArrayRing, ManagerState, commit, put, view
      >>> s, _ = get_or_create(ManagerState.create(), "a")
      >>> s = commit(put(s, "a", "ring", ArrayRing.create(2, (3,))), "a", "ring", jnp.ones(3))
      >>> advance = jax.jit(lambda tree: {k: v.update("ring", lambda r: r.commit(jnp.full(3, 2.0))) for k, v in tree.items()})
      >>> view(with_sessions(s, advance(sessions(s))), "a", "ring")[:, 0].tolist()
      [1.0, 2.0]
    """
    if type(state) is not ManagerState:
        check_state(state, "sessions")
    return {sid: session for sid, _, session in entries_lru(state)}


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
    nodes = state._nodes
    missing = sorted(set(nodes.keys()) - set(tree))
    extra = sorted(set(tree) - set(nodes.keys()))
    if missing or extra:
        raise InvalidArgumentError(
            f"`with_sessions`: the tree must hold exactly the table's session ids; missing {missing}, unknown {extra}. "
            f"Add or drop sessions with `get_or_create`/`drop_session`, not through the tree."
        )
    bad = sorted(sid for sid, s in tree.items() if not isinstance(s, SessionState))
    if bad:
        raise InvalidTypeError(f"`with_sessions`: values must be SessionState; not so for {bad}.")
    acct = state._acct
    if acct is not None:
        for sid, session in tree.items():
            acct = acct.swap_session(nodes[sid], session)
    return with_nodes(state, replace_sessions(state, tree), acct)


def drop_session(state: ManagerState, session_id: str | None) -> tuple[ManagerState, bool]:
    """Remove a session from the table. Returns ``(state, existed)``; not counted as an eviction."""
    if type(state) is not ManagerState:
        check_state(state, "drop_session")
    sid = resolve_id(session_id, "drop_session")
    stored = state._nodes.get(sid)
    if stored is None:
        return state, False
    _log.info("drop_session: session %r left the table (%d objects)", sid, len(stored._objects))
    return remove(state, sid, stored), True


def fork_session(state: ManagerState, source_id: str | None, new_id: str | None) -> ManagerState:
    """Fork: ``new_id`` starts as a snapshot of ``source_id``.

    Objects are immutable, so both sessions share every buffer (O(1) in what the session holds) and a
    later commit to either builds a new state that the other never sees. Attrs follow their fork policy
    (`SessionState.forked`): a list the model assigns into should be declared ``"copy_container"``, or one
    fork's writes would show in the other. The one copy it makes: a torch inference-mode tensor keeps no
    version counter, so an in-place write to it could not be caught (see `torch_writes`); the fork holds its
    own copy of each such storage, counted as its own bytes.

    A fork is a use of the source: the source becomes most recently used first, then the fork is
    inserted as the most recent, so inserting into a full table drops the least recently used *other*
    session (or is refused without ``evict_when_full``), never the source.

    Raises:
      SessionStateLostError: ``source_id`` is not in the table.
      SessionExistsError: ``new_id`` is already in the table.
      SessionAdmissionError: the table is full and cannot evict, or holds only the source (cap 1).
      SharedStorageWrittenError: a torch storage the source shares was written in place outside `writable`.
    """
    sid, source = locate(state, source_id, "fork_session")
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
    copies = record_fork(state, sid, source)  # (torch tensors: a fork makes them shared; see `torch_writes`)
    fork = source.forked()
    for name, copy in (copies or {}).items():  # (inference-mode tensors: the fork holds copies)
        fork = fork._with_object(name, copy)
    touched = touch(state, sid, source, 0)
    return insert(touched, nid, fork, "fork_session", 0)


def raise_max_sessions(state: ManagerState, n: int) -> ManagerState:
    """Raise the count cap to ``n``.

    Raises:
      InvalidArgumentError: ``n`` is not a positive int, or is below the current cap (lowering is refused:
        it would have to drop sessions without a request asking for it).
    """
    if type(state) is not ManagerState:
        check_state(state, "raise_max_sessions")
    check_positive(n, "`raise_max_sessions`: n")
    if n < state.max_sessions:
        raise InvalidArgumentError(
            f"`raise_max_sessions`: n={n} is below the current cap {state.max_sessions}; the cap can only be raised."
        )
    if n == state.max_sessions:
        return state
    return with_max_sessions(state, n)
