"""torch_bridge: zero-copy DLPack exchange between PyTorch and JAX, and the model adapters.

Subpackages: `torch_bridge.adapters` (the model adapters and the DreamZero session store) and
`torch_bridge.harness` (the A/B harness: stand-in networks, the synthetic rollout, reference engines).

Needs PyTorch: install ``functional-state[torch]``. The pure core (`functional_state`) never imports torch.
"""

try:
    import torch as _torch  # noqa: F401 - checked here so the error names the extra to install
except ImportError as _e:  # pragma: no cover - exercised in the no-torch CI venv
    raise ImportError(
        "torch_bridge needs PyTorch, which is not installed: `pip install 'functional-state[torch]'` (or install "
        "a torch build of your own; any torch >= 2.3 works)."
    ) from _e

from ._report import BridgeCopyWarning as BridgeCopyWarning
from ._report import BridgeKeptTorchWarning as BridgeKeptTorchWarning
from ._report import BridgeWarning as BridgeWarning
from ._report import report as report
from ._report import reset_report as reset_report
from .bridge import AliasInvalidatedError as AliasInvalidatedError
from .bridge import check_alias as check_alias
from .bridge import copy_reason as copy_reason
from .bridge import to_jax as to_jax
from .bridge import to_torch as to_torch
from .bridge import tree_to_jax as tree_to_jax
from .bridge import tree_to_torch as tree_to_torch
from .bridge import unwrap as unwrap
from .bridge import wrap as wrap

__all__ = [
    "AliasInvalidatedError",
    "BridgeCopyWarning",
    "BridgeKeptTorchWarning",
    "BridgeWarning",
    "check_alias",
    "copy_reason",
    "report",
    "reset_report",
    "to_jax",
    "to_torch",
    "tree_to_jax",
    "tree_to_torch",
    "unwrap",
    "wrap",
]
