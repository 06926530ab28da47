"""`ManagerState` and the pure functions over it, in one import: a count-capped LRU table of sessions.

Every function takes a `ManagerState` and returns a new one (with a result where there is one); the input
is never changed. Each concept has its own module, re-exported here for the modules and users that import
the table from one place:

* `state`: the `ManagerState` type, its encoding and the named node/counter API;
* `checks`: the argument checks the functions share;
* `lru`: the recency order (touch, insert with eviction, remove);
* `session_verbs`: `get_or_create`, `get_session`, `lookup`, `fork_session`, `drop_session`, `sessions`,
  `with_sessions` ...;
* `object_verbs`: `put`, `stage`, `commit`, `discard`, `view`, and `replace_object` for park and restore.
"""

from __future__ import annotations

# The names other modules of the package read through this module (`x`: re-exported, not user API)
# sit beside the public ones.
from ..errors import (
    InvalidArgumentError,
    InvalidTypeError,
)
from .checks import (
    check_state,
    find_object,
    locate,
    lost_error,
    resolve_id,
    resolve_session_id,
)
from .lru import (
    replace_session,
)
from .object_verbs import (
    commit,
    discard,
    put,
    replace_object,
    stage,
    view,
)
from .session_verbs import (
    drop_session,
    fork_session,
    get_or_create,
    get_session,
    incarnation,
    lookup,
    raise_max_sessions,
    sessions,
    with_sessions,
)
from .state import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_ID,
    ConsumedManagerState,
    Counters,
    ManagerState,
    Node,
    count_evictions,
    entries,
    entries_lru,
    held_object,
    held_session,
    incarnation_of,
    ledger_of,
    lru_sessions,
    node_session,
    session_map,
    with_counters,
)

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
# The table's own names that other modules of the package read through this module: not user API (the
# package face and `functional_state.table` export only the names above).
__all__ += [
    "ConsumedManagerState",
    "Counters",
    "InvalidArgumentError",
    "InvalidTypeError",
    "Node",
    "check_state",
    "count_evictions",
    "entries",
    "entries_lru",
    "find_object",
    "held_object",
    "held_session",
    "incarnation_of",
    "ledger_of",
    "locate",
    "lost_error",
    "lru_sessions",
    "node_session",
    "replace_object",
    "replace_session",
    "resolve_id",
    "session_map",
    "with_counters",
]
