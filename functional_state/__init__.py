"""functional-state: immutable, pytree-based per-session state for autoregressive world models.

The pure core (`ManagerState` and the functions over it) never mutates its input; `SessionStateManager`
is a thread-safe imperative shell that swaps one immutable value under a lock.
"""

from ._version import __version__ as __version__
from .accounting import nbytes_by_device as nbytes_by_device
from .accounting import register_alias as register_alias
from .accounting import total_nbytes as total_nbytes
from .array_ring import ArrayRing as ArrayRing
from .config import resolve_session_state_config as resolve_session_state_config
from .errors import (
    AttrNotFoundError as AttrNotFoundError,
)
from .errors import (
    CopyRequiredError as CopyRequiredError,
)
from .errors import (
    InvalidArgumentError as InvalidArgumentError,
)
from .errors import (
    InvalidTypeError as InvalidTypeError,
)
from .errors import (
    NotAllocatedError as NotAllocatedError,
)
from .errors import (
    NothingStagedError as NothingStagedError,
)
from .errors import (
    NotResidentError as NotResidentError,
)
from .errors import (
    ObjectNotFoundError as ObjectNotFoundError,
)
from .errors import (
    SessionAdmissionError as SessionAdmissionError,
)
from .errors import (
    SessionExistsError as SessionExistsError,
)
from .errors import (
    SessionStateError as SessionStateError,
)
from .errors import (
    SessionStateLostError as SessionStateLostError,
)
from .errors import (
    StateConsumedError as StateConsumedError,
)
from .errors import (
    StateShapeError as StateShapeError,
)
from .latent_buffer import LatentBuffer as LatentBuffer
from .manager import ReentrantWriteError as ReentrantWriteError
from .manager import SessionHandle as SessionHandle
from .manager import SessionStateManager as SessionStateManager
from .manager_state import (
    DEFAULT_MAX_SESSIONS as DEFAULT_MAX_SESSIONS,
)
from .manager_state import (
    DEFAULT_SESSION_ID as DEFAULT_SESSION_ID,
)
from .manager_state import (
    ManagerState as ManagerState,
)
from .manager_state import (
    commit as commit,
)
from .manager_state import (
    del_attr as del_attr,
)
from .manager_state import (
    discard as discard,
)
from .manager_state import (
    drop_session as drop_session,
)
from .manager_state import (
    evict as evict,
)
from .manager_state import (
    fork_session as fork_session,
)
from .manager_state import (
    get_attr as get_attr,
)
from .manager_state import (
    get_or_create as get_or_create,
)
from .manager_state import (
    get_session as get_session,
)
from .manager_state import (
    incarnation as incarnation,
)
from .manager_state import (
    lookup as lookup,
)
from .manager_state import (
    put as put,
)
from .manager_state import (
    raise_max_sessions as raise_max_sessions,
)
from .manager_state import (
    reset_session as reset_session,
)
from .manager_state import (
    resolve_session_id as resolve_session_id,
)
from .manager_state import (
    sessions as sessions,
)
from .manager_state import (
    set_attr as set_attr,
)
from .manager_state import (
    stage as stage,
)
from .manager_state import (
    stats as stats,
)
from .manager_state import (
    update_session as update_session,
)
from .manager_state import (
    view as view,
)
from .manager_state import (
    with_sessions as with_sessions,
)
from .session import FORK_POLICIES as FORK_POLICIES
from .session import SessionState as SessionState
from .session_attr import SessionAttr as SessionAttr
from .state_object import StateObject as StateObject
from .step import step as step

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_ID",
    "FORK_POLICIES",
    "ArrayRing",
    "AttrNotFoundError",
    "CopyRequiredError",
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
    "__version__",
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
