"""Per-session operations against table size: cost(n) / cost(1) at 1, 64, 1,000 and 100,000 sessions.

Every session holds one tiny `ArrayRing` (2 frames of 4 float32, its own three buffers) and an empty
`LatentBuffer` (what ``commit`` writes a 4-float numpy item into: an ArrayRing commit is ~1 ms of eager JAX
dispatch that would hide the table's cost), so the table's size, not its bytes, is what varies. One table per size is built once and every operation runs on it,
interleaved with the others, the garbage collector on and torch on one thread (as a server runs):

Every per-session op acts on a session drawn uniformly at random, a fresh draw per call (they all used to
act on ``s0``: one path through the map, always in the caches, which hid the map's growth):

* ``step(donate=True)`` on a session's ring (a chain: each step consumes the state the last one returned;
  its table holds rings of its own, so a step may land on any session);
* ``step(donate=False)``, ``park``, ``restore`` (of a parked ring: one of 64 sessions spread over the
  table), ``fork_session``, ``get_or_create`` + ``commit`` (a hit), ``stats``, ``plan_release`` (one ring's
  bytes from ``cpu``; again on the table with a 32-byte tensor attr in every session, whose holders a plan
  must price against) and ``enforce_budget`` (a budgeted table one ring over its budget), each on the same
  input state (they are pure).

Goals (issue 24): <= 1.5x cost(1) at 100k for every per-session operation and for ``stats`` (kept totals,
O(pools)); a flat per-session cost (<= 1.5x that at 1,000 sessions) for the walks ``plan_release`` and
``enforce_budget``. Reproduce: ``python benchmarks/run.py scaling`` (``SCALING_SIZES=1,64,1000`` for a
quick look).
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import random
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

import functional_state as fs
from _timing import cell_of, fmt_cell, fmt_time, rotation

SIZES = tuple(int(s) for s in os.environ.get("SCALING_SIZES", "1,64,1000,100000").split(","))
ROUNDS = 5
TARGET_S = 0.02  # a sample lasts at least this long (number of calls per sample chosen per op and size)
SLOW_S = 0.05  # an op slower than this runs once per sample
WALKS = ("plan_release", "plan_release (attrs)", "enforce_budget")
ORDER = (
    "step(donate=True)",
    "step(donate=False)",
    "park",
    "park (attrs)",
    "restore",
    "fork_session",
    "get_or_create+commit",
    "stats",
    "stats (attrs)",
    "stats (parked)",
    "plan_release",
    "plan_release (attrs)",
    "enforce_budget",
)
RING_BYTES = 2 * 4 * 4
PARKED = 64  # sessions whose ring is parked in the table restore runs on
DRAWS = 4096  # uniformly drawn session ids, cycled through by the per-session ops
_PICK = random.Random(0)


def _rings(n: int) -> list[fs.ArrayRing]:
    """n rings, each with buffers of its own; built from one template's tree structure, because one
    `ArrayRing.create` per session takes ~30 s at 100k and device_put of numpy batches ~10 s."""
    template = fs.ArrayRing.create(2, (4,))
    leaves, treedef = jax.tree_util.tree_flatten(template)
    host = [np.asarray(leaf) for leaf in leaves]
    columns = [jax.device_put([h.copy() for _ in range(n)]) for h in host]
    return [jax.tree_util.tree_unflatten(treedef, [c[i] for c in columns]) for i in range(n)]


def _tables(n: int) -> dict:
    """The states the operations run on, built once per size."""
    rings = _rings(n + 1)
    latents = fs.LatentBuffer.create(maxlen=4)  # empty and immutable: sharing it shares no buffer
    table = fs.ManagerState.create(max_sessions=n + 16)
    for i in range(n):
        table, _ = fs.get_or_create(table, f"s{i}")
        table = fs.put(fs.put(table, f"s{i}", "ring", rings[i]), f"s{i}", "buf", latents)
    total = fs.stats(table)["nbytes:cpu"]
    # Over budget by half a ring: enforce_budget must release one (it parks the least recently used).
    budgeted = fs.ManagerState.create(max_sessions=n + 16, byte_budget={"cpu": total - RING_BYTES // 2})
    for i in range(n):
        budgeted, _ = fs.get_or_create(budgeted, f"s{i}")
        budgeted = fs.put(fs.put(budgeted, f"s{i}", "ring", rings[i]), f"s{i}", "buf", latents)
    # The donating chain: the same table with every ring replaced by one nothing else holds (a donated
    # buffer is deleted: sharing it with the other tables would break them), so a step may land anywhere.
    donating = table
    for i, ring in enumerate(_rings(n)):
        donating = fs.put(donating, f"s{i}", "ring", ring)
    # What restore restores: the rings of PARKED sessions spread uniformly over the table, parked (a park of
    # every ring would cost ~2 ms each, 200 s at 100k).
    parked_ids = _PICK.sample(range(n), min(n, PARKED))
    parked = table
    for i in parked_ids:
        parked = fs.put(parked, f"s{i}", "ring", rings[i].park())
    # The same table with a buffer attr in every session (a prompt embedding): what a plan prices parks against.
    attrs = table
    for i in range(n):
        attrs = fs.set_attr(attrs, f"s{i}", "prompt", torch.zeros(8))
    # The same table with a parked object in every session (a host copy of its own: what `parked_nbytes`
    # reports); a latent buffer of one numpy item parks in ~75 us, a JAX ring in ~2 ms (200 s at 100k).
    all_parked = table
    for i in range(n):
        held = fs.LatentBuffer.create(maxlen=2).commit(np.zeros(4, np.float32)).park()
        all_parked = fs.put(all_parked, f"s{i}", "buf", held)
    return {
        "parked_ids": [f"s{i}" for i in parked_ids],
        "table": table,
        "budgeted": budgeted,
        "donating": donating,
        "parked": parked,
        "attrs": attrs,
        "all_parked": all_parked,
    }


def _ops(n: int) -> dict[str, Callable[[], object]]:
    t = _tables(n)
    table, budgeted, parked, attrs, all_parked = (t[k] for k in ("table", "budgeted", "parked", "attrs", "all_parked"))
    chain = {"state": t.pop("donating")}
    frame = jnp.ones(4, jnp.float32)
    item = np.ones(4, np.float32)
    commit_ring = fs.ArrayRing.commit
    # Every per-session op acts on a session drawn uniformly at random, a fresh draw per call (an op on one
    # session over and over finds its path through the map in the caches, which no server does).
    live = itertools.cycle([f"s{_PICK.randrange(n)}" for _ in range(DRAWS)]).__next__
    held = itertools.cycle([_PICK.choice(t["parked_ids"]) for _ in range(DRAWS)]).__next__

    def step_donate() -> None:
        chain["state"] = fs.step(chain.pop("state"), live(), "ring", commit_ring, frame, donate=True)

    def get_or_create_commit() -> None:
        sid = live()
        s, _ = fs.get_or_create(table, sid)
        fs.commit(s, sid, "buf", item)

    return {
        "step(donate=True)": step_donate,
        "step(donate=False)": lambda: fs.step(table, live(), "ring", commit_ring, frame),
        "park": lambda: fs.park(table, live(), "ring"),
        "park (attrs)": lambda: fs.park(attrs, live(), "ring"),
        "restore": lambda: fs.restore(parked, held(), "ring"),
        "fork_session": lambda: fs.fork_session(table, live(), "fork"),
        "get_or_create+commit": get_or_create_commit,
        "stats": lambda: fs.stats(table),
        "stats (attrs)": lambda: fs.stats(attrs),
        "stats (parked)": lambda: fs.stats(all_parked),
        "plan_release": lambda: fs.plan_release(table, "cpu", RING_BYTES),
        "plan_release (attrs)": lambda: fs.plan_release(attrs, "cpu", RING_BYTES),
        "enforce_budget": lambda: fs.enforce_budget(budgeted),
    }


def _once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(fns: dict[tuple[str, int], Callable[[], object]]) -> tuple[dict, dict]:
    """The `Cell` of every (op, size) over ROUNDS rounds, every call timed on its own, every cell sampled once
    per round in an order rotated round by round, so that the machine's load drifts over all sizes alike;
    and the calls per sample of each cell."""
    numbers = {}
    samples: dict[tuple[str, int], list[float]] = {k: [] for k in fns}
    for (_, n), fn in fns.items():
        if n <= 1_000:  # warm-up (jit compilation, lazily built accounting); the big tables' first call is cheap
            fn()  # to skip, as the small ones compiled every function already
    for key, fn in fns.items():
        first = _once(fn)  # the calibration, and the warm-up of the big tables
        if first > SLOW_S:
            numbers[key] = 1
            samples[key].append(first)  # at one call per sample, the calibration call is the first sample
        else:
            numbers[key] = max(1, min(2000, math.ceil(TARGET_S / max(_once(fn), 1e-7))))
    keys = list(fns)
    clock = time.perf_counter
    for r in range(ROUNDS):
        for key in rotation(keys, r):
            if len(samples[key]) >= ROUNDS * numbers[key]:
                continue
            fn, out = fns[key], samples[key]
            for _ in range(numbers[key]):
                start = clock()
                fn()
                out.append(clock() - start)
    return {k: cell_of(v) for k, v in samples.items()}, numbers


def run() -> dict:
    torch.set_num_threads(1)
    gc.enable()
    build: dict[int, float] = {}
    fns: dict[tuple[str, int], Callable[[], object]] = {}
    for n in SIZES:  # every table lives through the whole run: each cell pays the same heap's collections
        start = time.perf_counter()
        for op, fn in _ops(n).items():
            fns[(op, n)] = fn
        build[n] = time.perf_counter() - start
    cells, calls = _measure(fns)
    tails = {n: {op: cells[(op, n)] for op in ORDER} for n in SIZES}
    times = {n: {op: tails[n][op].median for op in ORDER} for n in SIZES}
    numbers = {n: {op: calls[(op, n)] for op in ORDER} for n in SIZES}
    base = SIZES[0]
    big = SIZES[-1]
    ref = 1000 if 1000 in SIZES else SIZES[min(1, len(SIZES) - 1)]
    rows, verdicts = [], {}
    for op in ORDER:
        row_cells = [fmt_cell(tails[n][op]) for n in SIZES]
        growth = [f"{times[n][op] / times[base][op]:.3g}x" for n in SIZES[1:]]
        if op in WALKS:
            per = {n: times[n][op] / n for n in SIZES}
            flat = per[big] / per[ref]
            verdict = f"per session {fmt_time(per[big])}, {flat:.3g}x that at {ref:,}: " + (
                "met" if flat <= 1.5 else "MISSED"
            )
            verdicts[op] = flat
        else:
            g = times[big][op] / times[base][op]
            verdict = "met" if g <= 1.5 else "MISSED"
            verdicts[op] = g
        rows.append((op, *row_cells, *growth, verdict))
    reduced = sorted({f"{op} at {n:,}" for n in SIZES for op in ORDER if numbers[n][op] == 1})
    header = (
        "operation",
        *(f"{n:,} session{'' if n == 1 else 's'} (p99, p99.9)" for n in SIZES),
        *(f"{n:,} / {base:,}" for n in SIZES[1:]),
        f"goal at {big:,} (<= 1.5x; walks: flat per session)",
    )
    return {
        "title": "Scaling: per-session operations against table size, uniform session ids (GC on, torch 1 thread)",
        "header": header,
        "rows": rows,
        "ratio": (f"step(donate=True) at {big:,} / at {base:,} (goal <= 1.5)", verdicts["step(donate=True)"]),
        "extra_ratios": [
            (f"{op} at {big:,} / at {base:,} (goal <= 1.5)", verdicts[op])
            for op in ORDER
            if op not in WALKS and op != "step(donate=True)"
        ]
        + [(f"{op} per session at {big:,} / at {ref:,} (goal <= 1.5, flat)", verdicts[op]) for op in WALKS],
        "notes": (
            f"Each session holds one ArrayRing of 2 x 4 float32 with buffers of its own (what step, park, restore "
            f"and the budget act on) and a LatentBuffer (what commit writes); the tables are built "
            f"once per size ({', '.join(f'{n:,}: {build[n]:.1f} s' for n in SIZES)}). Every per-session op acts on "
            f"a session drawn uniformly at random per call (restore: one of {PARKED} parked sessions spread over "
            f"the table). Each cell is every call of {ROUNDS} rounds timed on its own (median, p99, p99.9), each "
            f"round one sample of every cell in an order rotated round by round (all sizes' tables alive "
            f"throughout), GC on; a sample is as many calls as fill {TARGET_S * 1e3:.0f} ms, "
            f"but one call for ops slower than {SLOW_S * 1e3:.0f} ms (their calibration call counts as the first "
            f"of the {ROUNDS} samples), which is so for: "
            f"{', '.join(reduced) or 'none'}. `stats` is held to the per-session goal because kept totals "
            f"make it O(pools); the walks' goal is a flat per-session cost. The (attrs) rows run on the same table with "
            f"a torch tensor attr of 32 bytes in every session (a prompt embedding); `stats (parked)` on the same "
            f"table with a parked latent buffer in every session (a host copy each). The machine is shared: the "
            f"figures are noisy. Reproduce: `python benchmarks/run.py scaling`."
        ),
        "figures": {
            "cells": {str(n): {op: list(c) for op, c in v.items()} for n, v in tails.items()},
            "numbers": {str(n): v for n, v in numbers.items()},
        },
    }


if __name__ == "__main__":
    result = run()
    print(" | ".join(result["header"]))
    for row in result["rows"]:
        print(" | ".join(str(c) for c in row))
    print(result["notes"])
