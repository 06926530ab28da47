"""Model adapters: each model's bespoke session-state surface over the functional core."""

from .dreamzero import DreamZeroStateAdapter as DreamZeroStateAdapter
from .dreamzero_bespoke import BespokeDreamZeroCache as BespokeDreamZeroCache
from .dreamzero_bespoke import BespokeDreamZeroState as BespokeDreamZeroState

__all__ = ["BespokeDreamZeroCache", "BespokeDreamZeroState", "DreamZeroStateAdapter"]
