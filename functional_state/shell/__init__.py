"""The imperative shell: the thread-safe `SessionStateManager`, its session handles, and environment config."""

# What users see of this layer (re-exported by `functional_state`); the rest are its modules' names.
from .config import resolve_session_state_config
from .manager import ReentrantWriteError, SessionHandle, SessionStateManager

__all__ = ["ReentrantWriteError", "SessionHandle", "SessionStateManager", "resolve_session_state_config"]
