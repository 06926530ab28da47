"""The error hierarchy of functional-state.

Every error derives from :class:`SessionStateError` and also from the builtin it refines (``KeyError``,
``ValueError``, ...), so code that already catches the builtin keeps working.
"""

from __future__ import annotations

__all__ = [
    "SessionStateError",
    "SessionStateLostError",
    "SessionAdmissionError",
    "ObjectNotFoundError",
    "NotAllocatedError",
    "NotResidentError",
    "StateShapeError",
    "NothingStagedError",
    "CopyRequiredError",
]


class SessionStateError(Exception):
    """Base class of every error raised by functional-state."""


class SessionStateLostError(SessionStateError, KeyError):
    """A continuation asked for a session that is not in the table (never created, evicted or dropped)."""

    def __str__(self) -> str:  # KeyError would repr() the message.
        return str(self.args[0]) if self.args else ""


class SessionAdmissionError(SessionStateError, RuntimeError):
    """The table is full and the manager was built with ``evict_when_full=False``."""


class ObjectNotFoundError(SessionStateError, KeyError):
    """A session holds no state object under the requested name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class NotAllocatedError(SessionStateError, RuntimeError):
    """A state object was used before ``allocate()`` (or after ``reset()``)."""


class NotResidentError(SessionStateError, RuntimeError):
    """A state object's storage was released by ``evict()`` and has not been rebuilt."""


class StateShapeError(SessionStateError, ValueError):
    """A payload's shape or dtype differs from what the state object was built for."""


class NothingStagedError(SessionStateError, ValueError):
    """``commit()`` without a payload was called while nothing is staged."""


class CopyRequiredError(SessionStateError, ValueError):
    """Zero-copy exchange is impossible for this tensor and the caller asked for ``strict=True``."""
