"""``python -m torch_bridge.harness``: run the synthetic DreamZero rollout and print its digest."""

import sys

from .rollout import main

if __name__ == "__main__":
    sys.exit(main())
