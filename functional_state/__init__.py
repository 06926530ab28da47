"""functional-state: immutable, pytree-based per-session state for autoregressive world models.

The pure core (`ManagerState` and the functions over it) never mutates its input; `SessionStateManager`
is a thread-safe imperative shell that swaps one immutable value under a lock.
"""

from .accounting import nbytes_by_device as nbytes_by_device
from .accounting import register_alias as register_alias
from .accounting import total_nbytes as total_nbytes
from .array_ring import ArrayRing as ArrayRing
from .config import resolve_session_state_config as resolve_session_state_config
from .errors import (
    CopyRequiredError as CopyRequiredError,
    NotAllocatedError as NotAllocatedError,
    NothingStagedError as NothingStagedError,
    NotResidentError as NotResidentError,
    ObjectNotFoundError as ObjectNotFoundError,
    SessionAdmissionError as SessionAdmissionError,
    SessionStateError as SessionStateError,
    SessionStateLostError as SessionStateLostError,
    StateShapeError as StateShapeError,
)
from .latent_buffer import LatentBuffer as LatentBuffer
from .manager import SessionHandle as SessionHandle
from .manager import SessionStateManager as SessionStateManager
from .manager_state import (
    DEFAULT_MAX_SESSIONS as DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_ID as DEFAULT_SESSION_ID,
    ManagerState as ManagerState,
    commit as commit,
    discard as discard,
    drop_session as drop_session,
    evict as evict,
    fork_session as fork_session,
    get_attr as get_attr,
    get_or_create as get_or_create,
    get_session as get_session,
    put as put,
    raise_max_sessions as raise_max_sessions,
    reset_session as reset_session,
    set_attr as set_attr,
    stage as stage,
    stats as stats,
    update_session as update_session,
    view as view,
)
from .session import SessionState as SessionState
from .session_attr import SessionAttr as SessionAttr
from .state_object import StateObject as StateObject
from .state_object import SupportsResidency as SupportsResidency

__all__ = [
    "ArrayRing",
    "CopyRequiredError",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_ID",
    "LatentBuffer",
    "ManagerState",
    "NotAllocatedError",
    "NotResidentError",
    "NothingStagedError",
    "ObjectNotFoundError",
    "SessionAdmissionError",
    "SessionAttr",
    "SessionHandle",
    "SessionState",
    "SessionStateError",
    "SessionStateLostError",
    "SessionStateManager",
    "StateObject",
    "StateShapeError",
    "SupportsResidency",
    "commit",
    "discard",
    "drop_session",
    "evict",
    "fork_session",
    "get_attr",
    "get_or_create",
    "get_session",
    "nbytes_by_device",
    "put",
    "raise_max_sessions",
    "register_alias",
    "reset_session",
    "resolve_session_state_config",
    "set_attr",
    "stage",
    "stats",
    "total_nbytes",
    "update_session",
    "view",
]
