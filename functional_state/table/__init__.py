"""The table: `ManagerState` (the LRU map of sessions, with named nodes and counters), its kept ledger, the pure
verbs over it, `step`, and which engine blocks a change released.

The package is the table's one import: the layers above (``from .. import table as ms``) reach its verbs and
the reads of its records here. `__all__` lists what users see of this layer (re-exported by
`functional_state`); the other names it imports are for the layers above, not user API.
"""

# Names in `__all__` are user API; the other names imported here (`noqa: F401`) are for the layers above.
from .checks import check_state, find_object, locate, lost_error, resolve_id  # noqa: F401
from .engine_blocks import free_released, released_blocks
from .lru import replace_session  # noqa: F401
from .manager_state import (  # noqa: F401
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_ID,
    ConsumedManagerState,
    Counters,
    ManagerState,
    count_evictions,
    entries,
    entries_lru,
    held_object,
    held_session,
    in_place,
    incarnation_of,
    ledger_of,
    lru_sessions,
    node_session,
    session_map,
    with_counters,
    with_issued,
)
from .object_verbs import (
    commit,
    discard,
    put,
    replace_object,  # noqa: F401
    stage,
    view,
)
from .parked import park, restore
from .session_edits import del_attr, evict, get_attr, reset_session, set_attr, update_session
from .session_verbs import (
    drop_session,
    fork_session,
    get_or_create,
    get_session,
    incarnation,
    lookup,
    raise_max_sessions,
    resolve_session_id,
    sessions,
    with_sessions,
)
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
