"""The table: `ManagerState` (the LRU map of sessions, with named nodes and counters), its kept ledger, the pure
verbs over it, `step`, and which engine blocks a change released."""

# What users see of this layer (re-exported by `functional_state`); the rest are its modules' names.
from .engine_blocks import free_released, released_blocks
from .manager_state import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_ID,
    ManagerState,
    commit,
    discard,
    drop_session,
    fork_session,
    get_or_create,
    get_session,
    incarnation,
    lookup,
    put,
    raise_max_sessions,
    resolve_session_id,
    sessions,
    stage,
    view,
    with_sessions,
)
from .parked import park, restore
from .session_edits import del_attr, evict, get_attr, reset_session, set_attr, update_session
from .torch_writes import writable
from .usage import stats

# `step` and `usage` are exported by `functional_state` only: here they would hide the modules `table.step`
# and `table.usage`.

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_ID",
    "ManagerState",
    "commit",
    "del_attr",
    "discard",
    "drop_session",
    "evict",
    "fork_session",
    "free_released",
    "get_attr",
    "get_or_create",
    "get_session",
    "incarnation",
    "lookup",
    "park",
    "put",
    "raise_max_sessions",
    "released_blocks",
    "reset_session",
    "resolve_session_id",
    "restore",
    "sessions",
    "set_attr",
    "stage",
    "stats",
    "update_session",
    "view",
    "with_sessions",
    "writable",
]
