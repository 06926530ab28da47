"""``python -m functional_state`` and the ``functional-state`` command.

The command line drives the model adapters, so it lives in `torch_bridge.cli`; importing it here, lazily,
keeps the pure core free of torch, and a missing extra is reported as one line that says what to install.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``functional-state`` console script."""
    if importlib.util.find_spec("torch") is None:
        print(
            "functional-state: the command line drives the torch adapters and needs PyTorch: "
            "pip install 'functional-state[torch,cli]'",
            file=sys.stderr,
        )
        return 2
    from torch_bridge.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
