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
    AttrNotFoundError as AttrNotFoundError,
    CopyRequiredError as CopyRequiredError,
    InvalidArgumentError as InvalidArgumentError,
    InvalidTypeError as InvalidTypeError,
    NotAllocatedError as NotAllocatedError,
    NothingStagedError as NothingStagedError,
    NotResidentError as NotResidentError,
    ObjectNotFoundError as ObjectNotFoundError,
    SessionAdmissionError as SessionAdmissionError,
    SessionExistsError as SessionExistsError,
    SessionStateError as SessionStateError,
    SessionStateLostError as SessionStateLostError,
    StateConsumedError as StateConsumedError,
    StateShapeError as StateShapeError,
)
from .latent_buffer import LatentBuffer as LatentBuffer
from .manager import ReentrantWriteError as ReentrantWriteError
from .manager import SessionHandle as SessionHandle
from .manager import SessionStateManager as SessionStateManager
from .manager_state import (
    DEFAULT_MAX_SESSIONS as DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_ID as DEFAULT_SESSION_ID,
    ManagerState as ManagerState,
    commit as commit,
    del_attr as del_attr,
    discard as discard,
    drop_session as drop_session,
    evict as evict,
    fork_session as fork_session,
    get_attr as get_attr,
    get_or_create as get_or_create,
    get_session as get_session,
    incarnation as incarnation,
    lookup as lookup,
    put as put,
    raise_max_sessions as raise_max_sessions,
    reset_session as reset_session,
    resolve_session_id as resolve_session_id,
    sessions as sessions,
    set_attr as set_attr,
    stage as stage,
    stats as stats,
    update_session as update_session,
    view as view,
    with_sessions as with_sessions,
)
from .session import FORK_POLICIES as FORK_POLICIES
from .session import SessionState as SessionState
from .session_attr import SessionAttr as SessionAttr
from .state_object import StateObject as StateObject
from .step import step as step

__all__ = [
    "ArrayRing",
    "AttrNotFoundError",
    "CopyRequiredError",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_ID",
    "FORK_POLICIES",
    "InvalidArgumentError",
    "InvalidTypeError",
    "LatentBuffer",
    "ManagerState",
    "NotAllocatedError",
    "NotResidentError",
    "NothingStagedError",
    "ObjectNotFoundError",
    "ReentrantWriteError",
    "SessionAdmissionError",
    "SessionAttr",
    "SessionExistsError",
    "SessionHandle",
    "SessionState",
    "SessionStateError",
    "SessionStateLostError",
    "SessionStateManager",
    "StateConsumedError",
    "StateObject",
    "StateShapeError",
    "commit",
    "del_attr",
    "discard",
    "drop_session",
    "evict",
    "fork_session",
    "get_attr",
    "get_or_create",
    "get_session",
    "incarnation",
    "lookup",
    "nbytes_by_device",
    "put",
    "raise_max_sessions",
    "register_alias",
    "reset_session",
    "resolve_session_id",
    "resolve_session_state_config",
    "sessions",
    "set_attr",
    "stage",
    "stats",
    "step",
    "total_nbytes",
    "update_session",
    "view",
    "with_sessions",
]
