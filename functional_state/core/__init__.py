"""Core values: the pytree declaration, `StateObject` and its shipped types, `SessionState` and fork policies."""

# What users see of this layer (re-exported by `functional_state`); the rest are its modules' names.
from . import session_tree  # noqa: F401  (registers SessionState as a pytree on import)
from .array_ring import ArrayRing
from .dense_value import DenseValue
from .latent_buffer import LatentBuffer
from .pytree import pytree_dataclass
from .pytree_value import PytreeValue
from .session import FORK_POLICIES, SessionState
from .session_attr import SessionAttr
from .state_object import StateObject

__all__ = [
    "FORK_POLICIES",
    "ArrayRing",
    "DenseValue",
    "LatentBuffer",
    "PytreeValue",
    "SessionAttr",
    "SessionState",
    "StateObject",
    "pytree_dataclass",
]
