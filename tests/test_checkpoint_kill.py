"""A process saving checkpoints in a loop, SIGKILLed at any moment, never loses the previous one (issue 19)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch

import functional_state as fs
from functional_state import ManagerState

ROOT = Path(__file__).resolve().parents[1]
DELAYS = (0.05, 0.2, 0.4, 0.7, 1.0, 3.0)  # (the last long enough for whole saves on a busy disk)


def generation_values(gen: int) -> dict:
    """What generation ``gen`` holds, a function of ``gen`` alone: a feature map of several storages with views
    at offsets and mixed dtypes (about 6 MiB, so a kill lands mid-write), and a mixed torch + JAX object."""
    base = torch.arange(1 << 20, dtype=torch.float32) + gen
    fm = [base[3:], (torch.arange(1 << 19, dtype=torch.int64) * gen)[1:], torch.full((777,), gen % 2 == 0)]
    fm += [torch.full((5 + i,), float(gen + i), dtype=torch.bfloat16)[i % 3 :] for i in range(8)]
    mixed = [jnp.full((64,), gen, jnp.int32), torch.arange(33, dtype=torch.uint8) + gen % 200]
    return {"fm": fm, "mixed": mixed}


def generation(gen: int) -> ManagerState:
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    for name, value in generation_values(gen).items():
        s = fs.put(s, "a", name, fs.DenseValue.create(value))
        s, _ = fs.park(s, "a", name)
    return fs.set_attr(s, "a", "gen", gen)


def _bits(x) -> tuple:
    if isinstance(x, torch.Tensor):
        return ("torch", str(x.dtype), tuple(x.shape), x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    a = np.asarray(x)
    return ("jax", a.dtype.name, a.shape, a.tobytes())


def loaded_generation(path: Path) -> int:
    """The generation the checkpoint at ``path`` says it is, checked bit for bit against that generation."""
    state = fs.load_session(ManagerState.create(), "a", path)
    gen = fs.get_attr(state, "a", "gen")
    for name, expected in generation_values(gen).items():
        state, _ = fs.restore(state, "a", name)
        assert [_bits(v) for v in fs.view(state, "a", name)] == [_bits(v) for v in expected], (path, gen, name)
    return gen


# A zygote imports once and forks one saver per delay (importing torch and JAX in each of six processes would
# take most of the time). Nothing here starts a thread before the forks: JAX's backend, orbax and torch's
# thread pools all start in the savers.
_ZYGOTE = """
import json, os, signal, sys, time
sys.path.insert(0, {tests!r})
import functional_state as fs
from test_checkpoint_kill import generation
for path, delay in {trials!r}:
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        gen, first = 1, generation(1)
        os.write(ready_w, b"1")
        while True:  # sync and async saves in turn; an async one is not waited for, the next save waits
            fs.save_session(first if gen == 1 else generation(gen), "a", path, asynchronous=gen % 2 == 1)
            gen += 1
    os.close(ready_w)
    os.read(ready_r, 1)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({{"path": path, "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL}}))
"""


def test_a_saver_killed_at_any_moment_leaves_a_loadable_bit_exact_checkpoint(tmp_path):
    paths = [tmp_path / f"ck{i}" for i in range(len(DELAYS))]
    for path in paths:
        fs.save_session(generation(0), "a", path)
    code = _ZYGOTE.format(tests=str(ROOT / "tests"), trials=[(str(p), d) for p, d in zip(paths, DELAYS)])
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["path"] for r in results] == [str(p) for p in paths]
    assert all(r["killed"] for r in results), done.stderr[-3000:]  # each saver was still saving when killed
    gens = [loaded_generation(path) for path in paths]
    print("generations loaded after each kill:", gens)
    assert gens[-1] > 0, gens  # the longest-lived saver completed saves of its own
    for path, gen in zip(paths, gens):  # and what a kill left behind does not stand in the next save's way
        fs.save_session(generation(gen + 100), "a", path)
        assert loaded_generation(path) == gen + 100
