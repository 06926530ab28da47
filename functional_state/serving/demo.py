"""The Ray serving tour (`functional-state serve-demo`, notebook 06): a local Ray cluster, 3 replicas, 12
sessions of mixed sizes, a replica killed mid-rollout and its sessions resumed from their checkpoints with a
replay, then a replacement replica and a rebalance onto it; the rollouts checked against uninterrupted ones, and bytes per replica over time.

The model is a stand-in with a world model's shape of state (a ring of latents per session, a first frame),
each step seeded by its index, so that a lost or repeated step would show as a different rollout.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, NamedTuple

import numpy as np

from ..core.dense_value import DenseValue
from ..core.latent_buffer import LatentBuffer
from .cluster import SessionCluster
from .replica import SessionReplica

__all__ = ["DemoResult", "init_session", "main", "report", "run", "step_session"]

ITEM = 1 << 15  # floats per latent row (128 KiB)


def init_session(handle: Any) -> None:
    """A new session: a first frame of 1 to 4 latent rows (by its id: sessions differ in bytes, so their count
    is not their load) and an empty ring of latents."""
    rows = 1 + sum(map(ord, handle.session_id)) % 4
    handle.put("first", DenseValue.create([np.ones((rows, ITEM), np.float32)]))
    handle.put("latents", LatentBuffer.create(maxlen=2))


def step_session(handle: Any, t: int) -> float:
    """One step: the last latent mixed with noise seeded by ``t``; returns a digest of the new latent."""
    items = handle.view("latents")
    prev = items[-1] if len(items) else handle.view("first")[0]
    noise = np.random.default_rng(t).standard_normal(prev.shape).astype(np.float32)
    new = prev * np.float32(0.5) + noise
    handle.commit("latents", new)
    return float(new.astype(np.float64).sum())


class DemoResult(NamedTuple):
    rows: list[list[Any]]  # per session: id, replica before, after the failover, after the rebalance, MiB, match
    bytes_over_time: dict[str, list[int]]  # replica -> bytes held after each step (0 once killed)
    events: list[tuple[int, str]]  # (step index, what happened)
    replayed: dict[str, int]  # session -> steps replayed after the failover
    identical: bool  # every rollout equals its uninterrupted run


def run(
    sessions: int = 12, steps: int = 8, save_every: int = 3, kill_at: int = 5, root: str | None = None
) -> DemoResult:
    """Run the tour on a local Ray it starts (and shuts down). See the module docstring."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return _tour(ray, sessions, steps, save_every, kill_at, root or tmp)
    finally:
        ray.shutdown()


def _tour(ray: Any, sessions: int, steps: int, save_every: int, kill_at: int, root: str) -> DemoResult:
    actor = ray.remote(SessionReplica).options(num_cpus=0)
    names = ["r0", "r1", "r2"]
    replicas = {n: actor.remote(n, model="demo@1", step=step_session, init=init_session) for n in names}
    outputs: dict[str, list[float]] = {}
    done: dict[str, int] = {}

    def replay(cluster: SessionCluster, sid: str, from_step: int) -> int:
        del outputs[sid][from_step:]
        for t in range(from_step, done[sid]):
            outputs[sid].append(cluster.step(sid, t))
        return done[sid] - from_step

    cluster = SessionCluster(replicas, os.path.join(root, "checkpoints"), replay=replay)
    ids = [f"s{i}" for i in range(sessions)]
    first = [0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2]  # skewed on purpose: r0 holds the most
    for i, sid in enumerate(ids):
        name = names[first[i % len(first)]]
        cluster.owners[sid] = (name, ray.get(replicas[name].open.remote(sid)))
        outputs[sid], done[sid] = [], 0
    before = {sid: cluster.owners[sid][0] for sid in ids}
    series: dict[str, list[int]] = {n: [] for n in names}
    events: list[tuple[int, str]] = []
    replayed: dict[str, int] = {}
    for t in range(steps):
        if t == kill_at:
            ray.kill(cluster.replicas["r0"])
            replayed = cluster.failover("r0")
            events.append((t, f"r0 killed; {len(replayed)} sessions resumed, {sum(replayed.values())} steps replayed"))
        for sid in ids:
            outputs[sid].append(cluster.step(sid, t))
            done[sid] = t + 1
            if done[sid] % save_every == 0:
                cluster.save(sid)
        _record(cluster, series)
    after_failover = {sid: cluster.owners[sid][0] for sid in ids}
    cluster.replicas["r3"] = actor.remote("r3", model="demo@1", step=step_session, init=init_session)
    series["r3"] = [0] * steps
    moved = cluster.rebalance()  # onto the replacement replica, while that narrows the gap
    events.append((steps, f"r3 started; rebalance moved {moved} sessions"))
    _record(cluster, series)
    figures = cluster.figures()
    rows, identical = [], True
    for sid in ids:
        expected = _reference(sid, steps)
        same = outputs[sid] == expected
        identical &= same
        owner = cluster.owners[sid][0]
        mib = figures[owner].sessions[sid].nbytes / (1 << 20)
        rows.append([sid, before[sid], after_failover[sid], owner, round(mib, 2), "yes" if same else "NO"])
    return DemoResult(rows, series, events, replayed, identical)


def _record(cluster: SessionCluster, series: dict[str, list[int]]) -> None:
    figures = cluster.figures()
    for name in series:
        f = figures.get(name)
        series[name].append(sum(held for held, _ in f.pools.values()) if f is not None else 0)


def _reference(sid: str, steps: int) -> list[float]:
    r = SessionReplica("reference", model="demo@1", step=step_session, init=init_session)
    epoch = r.open(sid)
    return [r.step(sid, epoch, t) for t in range(steps)]


HEADER = ["session", "first on", "after failover", "after rebalance", "MiB", "identical"]


def report(result: DemoResult) -> str:
    """The tour's outcome as text: events, a table of where each session went, and the verdict."""
    widths = [max(len(str(x)) for x in col) for col in zip(HEADER, *result.rows)]
    lines = [f"step {t}: {what}" for t, what in result.events]
    for row in [HEADER, *result.rows]:
        lines.append("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    verdict = "every rollout matches its uninterrupted run" if result.identical else "A ROLLOUT DIFFERS"
    lines.append(f"{len(result.rows)} sessions; {verdict}; steps replayed per resumed session: {result.replayed}")
    return "\n".join(lines)


def main(sessions: int = 12, steps: int = 8) -> int:
    """`functional-state serve-demo`: run the tour and print `report`; 1 if any rollout differs."""
    result = run(sessions=sessions, steps=steps, kill_at=min(5, steps - 1))
    print(report(result))
    return 0 if result.identical else 1
