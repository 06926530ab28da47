"""Per-step hot paths before and after the layer restructure (issue 20), interleaved in fresh processes.

    python benchmarks/ab_restructure.py OLD_TREE NEW_TREE [rounds]

OLD_TREE is a checkout of the flat layout (``git archive 4a6fee6 | tar -x -C /tmp/old``). Each round runs one
subprocess per tree (alternating which goes first) that times ``fs.stage`` + ``fs.commit`` on a table and
``manager.get_or_create_session(sid).commit(...)`` through the shell; the figure is the median of the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import gc, json, timeit, numpy as np
import functional_state as fs
s = fs.ManagerState.create(max_sessions=8)
s, _ = fs.get_or_create(s, "a")
s = fs.put(s, "a", "r", fs.LatentBuffer.create(maxlen=4))
x = np.ones(4)
def pure():
    global s
    s = fs.commit(fs.stage(s, "a", "r", x), "a", "r")
m = fs.SessionStateManager(max_sessions=8)
m.get_or_create_session("a").put("r", fs.LatentBuffer.create(maxlen=4))
def shell():
    m.get_or_create_session("a").commit("r", x)
out = {}
for name, fn, n in (("pure stage+commit", pure, 20000), ("shell get_or_create_session+commit", shell, 5000)):
    fn()
    out[name] = min(timeit.repeat(fn, setup="gc.enable()", number=n, repeat=5)) / n * 1e6  # gc on, as in a server
print(json.dumps(out))
"""


def run(tree: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    old, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    got: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for i in range(rounds):
        for label in ("old", "new") if i % 2 == 0 else ("new", "old"):
            got[label].append(run(old if label == "old" else new))
    for key in got["old"][0]:
        a = statistics.median(r[key] for r in got["old"])
        b = statistics.median(r[key] for r in got["new"])
        print(f"{key:38s} old {a:7.2f} us  new {b:7.2f} us  new/old {b / a:.3f}")


if __name__ == "__main__":
    main()
