"""Model adapters: each model's bespoke session-state surface over the functional core.

The A/B harness (stand-in networks, the synthetic rollout, reference engines) lives in `torch_bridge.harness`.
"""

from .cosmos3 import BranchStateError as BranchStateError
from .cosmos3 import Cosmos3StateAdapter as Cosmos3StateAdapter
from .cosmos3 import request_session as request_session
from .cosmos3_footprint import Cosmos3Footprint as Cosmos3Footprint
from .cosmos3_footprint import cosmos3_footprint as cosmos3_footprint
from .dreamzero import DreamZeroStateAdapter as DreamZeroStateAdapter
from .dreamzero import dreamzero_component_nbytes as dreamzero_component_nbytes
from .dreamzero_bespoke import BespokeDreamZeroCache as BespokeDreamZeroCache
from .dreamzero_bespoke import BespokeDreamZeroState as BespokeDreamZeroState
from .dreamzero_store import DreamZeroSessions as DreamZeroSessions
from .dreamzero_store import begins_session as begins_session

__all__ = [
    "BespokeDreamZeroCache",
    "BespokeDreamZeroState",
    "BranchStateError",
    "Cosmos3Footprint",
    "Cosmos3StateAdapter",
    "DreamZeroSessions",
    "DreamZeroStateAdapter",
    "begins_session",
    "cosmos3_footprint",
    "dreamzero_component_nbytes",
    "request_session",
]
