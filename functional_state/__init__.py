"""functional-state: immutable, pytree-based per-session state for autoregressive world models.

The pure core (`ManagerState` and the functions over it) never mutates its input; `SessionStateManager`
is a thread-safe imperative shell that swaps one immutable value under a lock.
"""

from ._compiled import COMPILED
from ._version import __version__
from .core.array_ring import ArrayRing
from .core.dense_value import DenseValue
from .core.latent_buffer import LatentBuffer
from .core.pytree import pytree_dataclass
from .core.pytree_value import PytreeValue
from .core.session import FORK_POLICIES, SessionState
from .core.session_attr import SessionAttr
from .core.state_object import StateObject
from .engine.kv_handle import PagedKVHandle, paged_gather
from .engine.paged_kv import PagedKVPool
from .errors import (
    AttrNotFoundError,
    BudgetExceededError,
    CheckpointError,
    CopyRequiredError,
    DeletedArrayError,
    InvalidArgumentError,
    InvalidTypeError,
    KVFreeError,
    NotAllocatedError,
    NothingStagedError,
    NotParkedError,
    NotResidentError,
    ObjectNotFoundError,
    ObjectParkedError,
    PoolChangedError,
    SessionAdmissionError,
    SessionExistsError,
    SessionStateError,
    SessionStateLostError,
    SharedStorageError,
    SharedStorageWrittenError,
    StaleEpochError,
    StateConsumedError,
    StateShapeError,
    TransferError,
)
from .memory.accounting import nbytes_by_device, register_alias, total_nbytes
from .memory.budget import capacity_for, format_bytes, parse_bytes
from .memory.pools import Pool
from .memory.usage import Usage
from .persist.checkpoint import (
    SaveHandle,
    has_checkpoint,
    load,
    load_session,
    read_session,
    register_checkpoint_type,
    save,
    save_session,
)
from .policy.enforce import apply_plan, enforce_budget
from .policy.planner import LEVERS, ReleaseAction, ReleasePlan, plan_release
from .shell.config import resolve_session_state_config
from .shell.manager import ReentrantWriteError, SessionHandle, SessionStateManager
from .table.engine_blocks import free_released, released_blocks
from .table.manager_state import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_ID, ManagerState
from .table.object_verbs import commit, discard, put, stage, view
from .table.parked import park, restore
from .table.session_edits import del_attr, evict, get_attr, reset_session, set_attr, update_session
from .table.session_verbs import (
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
from .table.step import step
from .table.torch_writes import writable
from .table.usage import stats, usage

register_checkpoint_type(PytreeValue)  # its structure is plain static data: no hooks needed

__all__ = [
    "COMPILED",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_ID",
    "FORK_POLICIES",
    "LEVERS",
    "ArrayRing",
    "AttrNotFoundError",
    "BudgetExceededError",
    "CheckpointError",
    "CopyRequiredError",
    "DeletedArrayError",
    "DenseValue",
    "InvalidArgumentError",
    "InvalidTypeError",
    "KVFreeError",
    "LatentBuffer",
    "ManagerState",
    "NotAllocatedError",
    "NotParkedError",
    "NotResidentError",
    "NothingStagedError",
    "ObjectNotFoundError",
    "ObjectParkedError",
    "PagedKVHandle",
    "PagedKVPool",
    "Pool",
    "PoolChangedError",
    "PytreeValue",
    "ReentrantWriteError",
    "ReleaseAction",
    "ReleasePlan",
    "SaveHandle",
    "SessionAdmissionError",
    "SessionAttr",
    "SessionExistsError",
    "SessionHandle",
    "SessionState",
    "SessionStateError",
    "SessionStateLostError",
    "SessionStateManager",
    "SharedStorageError",
    "SharedStorageWrittenError",
    "StaleEpochError",
    "StateConsumedError",
    "StateObject",
    "StateShapeError",
    "TransferError",
    "Usage",
    "__version__",
    "apply_plan",
    "capacity_for",
    "commit",
    "del_attr",
    "discard",
    "drop_session",
    "enforce_budget",
    "evict",
    "fork_session",
    "format_bytes",
    "free_released",
    "get_attr",
    "get_or_create",
    "get_session",
    "has_checkpoint",
    "incarnation",
    "load",
    "load_session",
    "lookup",
    "nbytes_by_device",
    "paged_gather",
    "park",
    "parse_bytes",
    "plan_release",
    "put",
    "pytree_dataclass",
    "raise_max_sessions",
    "read_session",
    "register_alias",
    "register_checkpoint_type",
    "released_blocks",
    "reset_session",
    "resolve_session_id",
    "resolve_session_state_config",
    "restore",
    "save",
    "save_session",
    "sessions",
    "set_attr",
    "stage",
    "stats",
    "step",
    "total_nbytes",
    "update_session",
    "usage",
    "view",
    "with_sessions",
    "writable",
]
