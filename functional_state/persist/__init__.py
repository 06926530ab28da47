"""Persistence: checkpoints of sessions and tables on orbax."""

# What users see of this layer (re-exported by `functional_state`); the rest are its modules' names.
from ..core.codec import register_checkpoint_type
from .checkpoint import load, load_session, read_session, save, save_session
from .directory import has_checkpoint
from .store import SaveHandle

__all__ = [
    "SaveHandle",
    "has_checkpoint",
    "load",
    "load_session",
    "read_session",
    "register_checkpoint_type",
    "save",
    "save_session",
]
