"""The argument checks every table function shares: the state, the session id, the session, the object.

Each raises the library error that says what was wrong and what to pass instead; none changes anything.
"""

from __future__ import annotations

import difflib
from typing import Any, Final

from ..core.session import SessionState, no_object_message
from ..core.state_object import StateObject
from ..errors import InvalidTypeError, ObjectNotFoundError, SessionStateLostError, StateConsumedError
from .manager_state import DEFAULT_SESSION_ID, ConsumedManagerState, ManagerState
from .reroot_map import RerootMap

__all__ = ["check_state", "find_object", "locate", "lost_error", "resolve_id"]


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
    """The table key for ``session_id``: None means ``"default"``; anything but a non-empty str raises.

    A str subclass is keyed by its plain str value: the table keeps ids in records the collector does not
    track (`records`), where an id that carried a reference back to the table would make an uncollectable
    cycle."""
    if session_id is None:
        return DEFAULT_SESSION_ID
    if not isinstance(session_id, str) or not session_id:
        raise InvalidTypeError(
            f"`{what}`: session_id must be a non-empty str or None (for {DEFAULT_SESSION_ID!r}), got {session_id!r}."
        )
    return session_id if type(session_id) is str else str.__str__(session_id)


_NEAR_IDS_SCAN: Final = 10_000


def lost_error(state: ManagerState, sid: str, what: str) -> SessionStateLostError:
    """The error for a session ``state`` does not hold, saying why that happens and what to do."""
    # The near ids of a typo; a table too large to scan on an error path is not scanned.
    near = difflib.get_close_matches(sid, list(state._nodes.keys()), n=3) if len(state) <= _NEAR_IDS_SCAN else []
    hint = f" Near ids in the table: {', '.join(map(repr, near))}." if near else ""
    return SessionStateLostError(
        f"`{what}`: session {sid!r} is not in the table: it was never created, or it was evicted "
        f"(LRU cap {state.max_sessions}) or dropped. A continuation cannot resume it; start a new "
        f"session with `get_or_create`.{hint}"
    )


def locate(state: Any, session_id: Any, what: str) -> tuple[str, SessionState]:
    """``(sid, session)`` of an existing session (the very object the table stores, carrying its tick and
    incarnation), with every argument check the public functions need."""
    if type(state) is not ManagerState:
        check_state(state, what)
    sid: str = session_id if type(session_id) is str and session_id else resolve_id(session_id, what)
    nodes: RerootMap = state._nodes
    stored: SessionState | None = nodes.get(sid)
    if stored is None:
        raise lost_error(state, sid, what)
    return sid, stored


def find_object(session: SessionState, name: Any, what: str) -> StateObject:
    """Object ``name`` of ``session``, or an `ObjectNotFoundError` listing the names it has (``name`` is
    `Any`: compiled, a `str` annotation would raise a bare `TypeError` for a name of another type)."""
    obj = session._objects.get(name)
    if obj is None:
        raise ObjectNotFoundError(no_object_message(session, name, what))
    return obj
