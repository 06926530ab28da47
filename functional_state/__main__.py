"""``python -m functional_state {demo,ab,bench}``: the command line lives in `torch_bridge.cli`, since the
demo drives the model adapters; importing it here, lazily, keeps the pure core free of the bridge."""

import sys

if __name__ == "__main__":
    from torch_bridge.cli import main

    sys.exit(main())
