"""Moved to `torch_bridge.harness` (issue 20): this old import path keeps the rollout's public names, and
``python -m torch_bridge.adapters.dreamzero_rollout`` still runs it."""

import sys

from ..harness.config import DEPLOY_FEAT_MAP_BYTES as DEPLOY_FEAT_MAP_BYTES
from ..harness.config import MIB as MIB
from ..harness.config import VAE_ENCODERS as VAE_ENCODERS
from ..harness.config import WAN_BASE_DIM as WAN_BASE_DIM
from ..harness.config import RolloutConfig as RolloutConfig
from ..harness.config import small_config as small_config
from ..harness.networks import wan_encoder as wan_encoder
from ..harness.rollout import RolloutResult as RolloutResult
from ..harness.rollout import main as main
from ..harness.rollout import run_rollout as run_rollout

__all__ = [
    "DEPLOY_FEAT_MAP_BYTES",
    "MIB",
    "VAE_ENCODERS",
    "WAN_BASE_DIM",
    "RolloutConfig",
    "RolloutResult",
    "main",
    "run_rollout",
    "small_config",
    "wan_encoder",
]

if __name__ == "__main__":
    sys.exit(main())
