"""Verbs that edit one session of the table in place of it: its attrs, a reset, an evicted object, any function of it. Recency and counters are unchanged."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..core.pytree import MISSING
from ..core.session import SessionState
from ..errors import (
    InvalidTypeError,
)
from .checks import find_object, locate
from .lru import recorded_anew, replace_session
from .manager_state import ManagerState, node_session

_log = logging.getLogger("functional_state")


def update_session(
    state: ManagerState, session_id: str | None, fn: Callable[[SessionState], SessionState]
) -> ManagerState:
    """Replace session ``session_id`` by ``fn(session)``; recency and counters are unchanged.

    Raises:
      SessionStateLostError: the session is not in the table.
      InvalidTypeError: ``fn`` did not return a `SessionState`.
    """
    sid, node = locate(state, session_id, "update_session")
    new = fn(node_session(node))
    if not isinstance(new, SessionState):
        raise InvalidTypeError(f"`update_session`: fn must return a SessionState, got {type(new).__name__}.")
    return replace_session(state, sid, node, new)


def set_attr(state: ManagerState, session_id: str | None, key: str, value: Any, *, on_fork: Any = None) -> ManagerState:
    """Carry ``value`` (by reference) under ``key`` in a session (see `SessionState.set_attr`)."""
    sid, node = locate(state, session_id, "set_attr")
    session = node_session(node)
    out = replace_session(state, sid, node, session.set_attr(key, value, on_fork=on_fork))
    if session.attrs.get(key, _ABSENT) is value:
        # The same value set again: the ledger records it anew (a torch tensor resized in place since it was
        # set is counted at its recorded size until then; see `functional_state.memory.values`).
        out = recorded_anew(out, value)
    return out


_ABSENT = object()


def get_attr(state: ManagerState, session_id: str | None, key: str, default: Any = MISSING) -> Any:
    """The carried value ``key`` of a session: the very object stored. Recency is unchanged.

    Raises:
      AttrNotFoundError: absent and no default given.
    """
    _, node = locate(state, session_id, "get_attr")
    return node_session(node).get_attr(key, default)


def del_attr(state: ManagerState, session_id: str | None, key: str) -> ManagerState:
    """Remove attr ``key`` from a session (a no-op if absent)."""
    sid, node = locate(state, session_id, "del_attr")
    return replace_session(state, sid, node, node_session(node).del_attr(key))


def reset_session(state: ManagerState, session_id: str | None) -> ManagerState:
    """Reset every object of a session and clear its attrs; the session stays in the table."""
    sid, node = locate(state, session_id, "reset_session")
    return replace_session(state, sid, node, node_session(node).reset())


def evict(state: ManagerState, session_id: str | None, name: str) -> tuple[ManagerState, int]:
    """Release the committed storage of object ``name`` in a session.

    Returns:
      ``(state, freed_bytes)``, where ``freed_bytes`` is exactly what leaves the session's accounting:
      a buffer still reachable from another object or an attr of the session is not freed, and neither
      are staged bytes.
    """
    sid, node = locate(state, session_id, "evict")
    find_object(node, name, "evict")
    new_session, freed = node_session(node).evict(name)
    _log.debug("evict: object %r of session %r, %d bytes freed", name, sid, freed)
    return replace_session(state, sid, node, new_session), freed
