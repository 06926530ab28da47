"""A 600 MiB checkpoint load with the untrusted-input checks (issue 35) against the loader before them,
interleaved in fresh processes.

    python benchmarks/ab_checkpoint_checks.py OLD_TREE NEW_TREE [rounds] [warm|cold]

OLD_TREE is a checkout of the loader before the checks (``git worktree add --detach /tmp/old f0b77d6``). One
checkpoint (40 torch storages of 15 MiB of random float32, and a few small leaves) is written once by NEW_TREE
(the format on disk did not change); each round runs one subprocess per tree (alternating which goes first)
that loads it ``LOADS`` times with ``read_session`` (page cache warm, or dropped before each load with
``cold``) and reports the median wall and CPU time (all threads: what the checks add, less disturbed by other users of
the cores); the figure is the median of the rounds. NEW_TREE's child also times the checks alone.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

LOADS = 5

WRITE = r"""
import sys, torch, numpy as np, jax.numpy as jnp, functional_state as fs
torch.manual_seed(0)
s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
s = fs.put(s, "a", "feat", fs.DenseValue.create([torch.rand(15 << 18) for _ in range(40)]))
s = fs.put(s, "a", "ring", fs.ArrayRing.create(4, (64,), jnp.float32))
s = fs.put(s, "a", "np", fs.DenseValue.create([np.arange(4096.0)]))
fs.save_session(s, "a", sys.argv[1])
"""

CHILD = r"""
import json, os, statistics, sys, time
import functional_state as fs
path, cold = sys.argv[1], sys.argv[3] == "cold"
def drop():  # the checkpoint's pages out of the page cache (written back first), as a cold read finds them
    for d, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
fs.read_session("a", path)  # warm: imports, page cache
times, cpu = [], []
for _ in range(int(sys.argv[2])):
    if cold:
        drop()
    t0, c0 = time.perf_counter(), time.process_time()
    fs.read_session("a", path)
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
out = {"load": statistics.median(times), "cpu": statistics.median(cpu)}
try:
    from functional_state.persist import confined, direct, directory, manifest, validate
except ImportError:
    pass
else:
    from pathlib import Path
    root = Path(path).absolute()
    checks = []
    for _ in range(int(sys.argv[2])):
        t0 = time.perf_counter()
        confined.check_tree(root / "0", str(root))
        m = directory.read_manifest(root / "0")
        confined.check_depth(m, str(root))
        manifest.check_manifest(m, root)
        entries = direct.database(os.path.normpath(root / "0" / "arrays"))
        stored = {k: v for k, v in m["leaves"].items() if manifest.in_arrays_item(v)}
        validate.check_stored(stored, direct.stored_leaves(entries, str(root)), str(root))
        checks.append(time.perf_counter() - t0)
    out["checks"] = statistics.median(checks)
print(json.dumps(out))
"""


def _run(tree: str, code: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, cwd=tree, capture_output=True, text=True, check=True
    )
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def main() -> None:
    old, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    cache = sys.argv[4] if len(sys.argv) > 4 else "warm"
    work = tempfile.mkdtemp(prefix="fs-ab-checks-")
    try:
        path = os.path.join(work, "ck")
        _run(new, WRITE, path)
        nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs_ in os.walk(path) for f in fs_)
        got: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
        for i in range(rounds):
            for label in ("old", "new") if i % 2 == 0 else ("new", "old"):
                got[label].append(json.loads(_run(old if label == "old" else new, CHILD, path, str(LOADS), cache)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a = statistics.median(r["load"] for r in got["old"])
    b = statistics.median(r["load"] for r in got["new"])
    checks = statistics.median(r["checks"] for r in got["new"])
    ca, cb = (statistics.median(r["cpu"] for r in got[k]) for k in ("old", "new"))
    fa, fb = min(r["load"] for r in got["old"]), min(r["load"] for r in got["new"])
    print(f"checkpoint on disk: {nbytes / 2**20:.0f} MiB; {rounds} rounds of {LOADS} {cache} loads per process")
    print(f"read_session  before {a * 1e3:7.1f} ms  with checks {b * 1e3:7.1f} ms  after/before {b / a:.3f}")
    print(f"CPU time of a load, all threads: before {ca * 1e3:.1f} ms  with checks {cb * 1e3:.1f} ms  {cb / ca:.3f}")
    print(
        f"fastest round (the least disturbed on a shared machine): {fa * 1e3:.1f} ms  {fb * 1e3:.1f} ms  {fb / fa:.3f}"
    )
    print(f"the checks alone (tree, manifest, database, sizes): {checks * 1e3:.1f} ms ({checks / b:.1%} of a load)")
    for label in ("old", "new"):
        print(f"  {label} rounds (ms): " + " ".join(f"{r['load'] * 1e3:.0f}" for r in got[label]))


if __name__ == "__main__":
    main()
