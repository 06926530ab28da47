"""Run in a venv that has the core installed without extras (`make check-core-install`): the pure core
imports and works without torch, and torch_bridge and the command line say which extra to install."""

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp

import functional_state as fs

assert "torch" not in sys.modules, "importing functional_state pulled in torch"
state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
state = fs.put(state, "a", "ring", fs.ArrayRing.create(2, (3,)))
state = fs.step(state, "a", "ring", fs.ArrayRing.commit, jnp.ones(3), donate=True)
assert fs.stats(state)["total_nbytes"] == 24 and "torch" not in sys.modules

try:
    import torch_bridge  # noqa: F401
except ImportError as e:
    assert "functional-state[torch]" in str(e), e
else:
    raise AssertionError("torch_bridge imported without torch")

script = Path(sys.executable).with_name("functional-state")
out = subprocess.run([str(script), "demo"], capture_output=True, text=True)
assert out.returncode == 2 and "functional-state[torch,cli]" in out.stderr, (out.returncode, out.stderr)

# --version and --help need neither torch nor the [cli] extra.
for args, expected in [
    (["--version"], f"functional-state {fs.__version__}"),
    (["--help"], "usage: functional-state"),
    (["demo", "--help"], "usage: functional-state demo"),
]:
    for cmd in ([str(script), *args], [sys.executable, "-m", "functional_state", *args]):
        out = subprocess.run(cmd, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.startswith(expected), (cmd, out.returncode, out.stdout, out.stderr)
print(f"core without torch: ok (functional_state {fs.__version__}, jax only)")
