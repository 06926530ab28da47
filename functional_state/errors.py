"""The error hierarchy of functional-state.

Every error the library raises derives from :class:`SessionStateError`, and also from the builtin it refines
(``KeyError``, ``ValueError``, ``TypeError``, ``RuntimeError``), so code that already catches the builtin keeps
working and code that wants only our errors can catch the base class.
"""

from __future__ import annotations

__all__ = [
    "AttrNotFoundError",
    "BudgetExceededError",
    "CheckpointError",
    "CopyRequiredError",
    "DeletedArrayError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "KVFreeError",
    "NotAllocatedError",
    "NotParkedError",
    "NotResidentError",
    "NothingStagedError",
    "ObjectNotFoundError",
    "ObjectParkedError",
    "PoolChangedError",
    "SessionAdmissionError",
    "SessionExistsError",
    "SessionStateError",
    "SessionStateLostError",
    "SharedStorageError",
    "SharedStorageWrittenError",
    "StaleEpochError",
    "StateConsumedError",
    "StateShapeError",
    "TransferError",
]


class SessionStateError(Exception):
    """Base class of every error raised by functional-state."""


class _KeyMessage(KeyError):
    """A KeyError whose str() is its message (KeyError would show the repr of the message)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(SessionStateError, ValueError):
    """An argument has the right type but a value the call cannot accept (a negative size, an unknown key)."""


class InvalidTypeError(SessionStateError, TypeError):
    """An argument has the wrong type (a session id that is not a str, a value that is not a StateObject)."""


class SessionStateLostError(SessionStateError, _KeyMessage):
    """A continuation asked for a session that is not in the table (never created, evicted or dropped)."""


class SessionExistsError(SessionStateError, ValueError):
    """A call that creates a session under a given id found that id already in the table."""


class SessionAdmissionError(SessionStateError, RuntimeError):
    """The table is full and the manager was built with ``evict_when_full=False``."""


class ObjectNotFoundError(SessionStateError, _KeyMessage):
    """A session holds no state object under the requested name."""


class AttrNotFoundError(SessionStateError, _KeyMessage):
    """A session carries no attr under the requested key."""


class NotAllocatedError(SessionStateError, RuntimeError):
    """A state object was used before ``allocate()`` (or after ``reset()``)."""


class NotResidentError(SessionStateError, RuntimeError):
    """A state object's storage was released by ``evict()`` and has not been rebuilt."""


class ObjectParkedError(SessionStateError, RuntimeError):
    """A state object's storage is parked in host memory; ``restore`` it before reading or writing it."""


class NotParkedError(SessionStateError, RuntimeError):
    """``restore`` was called on an object that is not parked."""


class SharedStorageError(SessionStateError, RuntimeError):
    """Parking an object would free nothing: something else in the table holds the same storage."""


class SharedStorageWrittenError(SessionStateError, RuntimeError):
    """A torch storage that another holder (a fork, an attr, another object) shares was written in place
    outside `writable`: the sessions sharing it no longer hold what they were given."""


class DeletedArrayError(SessionStateError, RuntimeError):
    """A state object holds a JAX array that was deleted (donated to a jitted call): it has no bytes to move."""


class StateShapeError(SessionStateError, ValueError):
    """A payload's shape or dtype differs from what the state object was built for."""


class NothingStagedError(SessionStateError, ValueError):
    """``commit()`` without a payload was called while nothing is staged."""


class StateConsumedError(SessionStateError, RuntimeError):
    """A `ManagerState` was used after ``step(..., donate=True)`` consumed it (its buffers may be deleted)."""


class BudgetExceededError(SessionStateError, RuntimeError):
    """A pool's byte budget cannot be met: even releasing everything the planner may release leaves it over.

    Attributes: ``pool``, ``budget`` (bytes), ``held`` (bytes the pool would hold), ``releasable`` (bytes
    the planner could free), each also in the message.
    """

    def __init__(self, message: str, *, pool: str = "", budget: int = 0, held: int = 0, releasable: int = 0):
        super().__init__(message)
        self.pool, self.budget, self.held, self.releasable = pool, budget, held, releasable


class CopyRequiredError(SessionStateError, ValueError):
    """Zero-copy exchange is impossible for this tensor and the caller asked for ``strict=True``."""


class PoolChangedError(SessionStateError, RuntimeError):
    """An engine KV pool a handle references was freed, resized or moved: its block ids no longer name the
    memory they did."""


class KVFreeError(SessionStateError, RuntimeError):
    """An engine's ``free`` callback raised; the change that released the blocks was not made."""


class CheckpointError(SessionStateError, RuntimeError):
    """A checkpoint cannot be written (a value it cannot hold) or read (absent, damaged, another layout)."""


class TransferError(CheckpointError):
    """A session transfer blob cannot be imported: truncated, tampered with, or exported by another model."""


class StaleEpochError(SessionStateError, RuntimeError):
    """A session's ownership epoch is not the one the call was made under: another owner claimed it since
    (an export, import or save by a replica that no longer owns the session), or a checkpoint already holds
    a newer epoch of it."""
