"""Run against an installed wheel or sdist, outside the source tree (`make test-newest`): the package imports
from site-packages with its version and type marker, the pure core works, a checkpoint saves, loads and is
inspected by the installed `functional-state` command, and `bench` says the benchmarks ship with the repository."""

import importlib.metadata
import subprocess
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import functional_state as fs

here = Path(fs.__file__).resolve().parent
assert "site-packages" in here.parts, f"imported from {here}, not from the install"
assert importlib.metadata.version("functional-state") == fs.__version__
assert (here / "py.typed").is_file(), "py.typed is missing from the install"
assert "torch" not in sys.modules, "importing functional_state pulled in torch"

state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
state = fs.put(state, "a", "ring", fs.ArrayRing.create(2, (3,)))
state = fs.step(state, "a", "ring", fs.ArrayRing.commit, jnp.ones(3), donate=True)
state, _ = fs.park(state, "a", "ring")
state, _ = fs.restore(state, "a", "ring")
assert fs.stats(state)["total_nbytes"] == 24 and fs.stats(state)["restores"] == 1, fs.stats(state)

script = Path(sys.executable).with_name("functional-state")
with tempfile.TemporaryDirectory() as tmp:
    fs.save(state, Path(tmp) / "ck")
    loaded = fs.load(Path(tmp) / "ck")
    assert np.array_equal(fs.view(loaded, "a", "ring"), fs.view(state, "a", "ring"))
    out = subprocess.run([str(script), "inspect", str(Path(tmp) / "ck"), "--verify"], capture_output=True, text=True)
    assert out.returncode == 0 and "session 'a'" in out.stdout and "verified" in out.stdout, (out.stdout, out.stderr)

out = subprocess.run([str(script), "bench"], capture_output=True, text=True, cwd=tempfile.gettempdir())
assert out.returncode == 2 and "ship with the repository" in out.stderr, (out.returncode, out.stderr)
print(f"installed package: ok (functional_state {fs.__version__} from {here})")
