"""The Ray Serve tour (`functional-state serve-demo`, notebook 06): a local Ray, a Serve deployment of 3
`SessionServer` replicas behind `SessionAffinityRouter`, 12 sessions of mixed sizes stepped together; a replica
killed mid-rollout (its sessions resume on the others from their last checkpoints, the steps since replayed by
the replay hook), a drain of the busiest survivor as far as headroom allows and a rebalance (`SessionFleet`); the
rollouts checked against uninterrupted ones, and bytes per replica over time.

The model is a stand-in with a world model's shape of state (a ring of latents per session, a first frame),
each step seeded by its index, so that a lost or repeated step would show as a different rollout.
"""

from __future__ import annotations

import logging
import tempfile
import time
from typing import Any, NamedTuple

import numpy as np

from ..core.dense_value import DenseValue
from ..core.latent_buffer import LatentBuffer
from ..errors import StaleEpochError
from .fleet import SessionFleet
from .replica import SessionReplica
from .server import SessionServer

__all__ = ["DemoResult", "init_session", "main", "replay_steps", "report", "run", "step_session", "tour"]

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


def replay_steps(session_id: str, from_step: int, to_step: int) -> list[tuple[int]]:
    """The replay hook: the arguments of steps ``from_step..to_step-1`` (a step's only input is its index; a
    real server reads them from its request log)."""
    return [(t,) for t in range(from_step, to_step)]


class DemoResult(NamedTuple):
    rows: list[list[Any]]  # per session: id, replica first, after the failover, at the end, MiB, identical
    bytes_over_time: dict[str, list[int]]  # replica -> bytes held after each step (0 before it ran, once killed)
    events: list[tuple[int, str]]  # (step index, what happened)
    replayed: dict[str, int]  # session -> steps replayed after the failover
    identical: bool  # every rollout equals its uninterrupted run, and every session is held once at the end
    seconds: float  # the tour's wall time, Ray and Serve start-up included


def run(sessions: int = 12, steps: int = 8, save_every: int = 3, kill_at: int = 4, drain_at: int = 6) -> DemoResult:
    """Run the tour on a local Ray and Serve it starts (and shuts down). See the module docstring."""
    import ray
    from ray import serve

    began = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(proxy_location="Disabled")
        with tempfile.TemporaryDirectory() as root:
            result = tour(
                root, sessions=sessions, steps=steps, save_every=save_every, kill_at=kill_at, drain_at=drain_at
            )
        return result._replace(seconds=time.perf_counter() - began)
    finally:
        serve.shutdown()
        ray.shutdown()


def tour(
    root: str,
    *,
    sessions: int = 12,
    steps: int = 8,
    save_every: int = 3,
    kill_at: int = 4,
    drain_at: int = 6,
) -> DemoResult:
    """The tour on a running Ray and Serve, checkpoints under ``root``; its app is deleted at the end.

    The drain has the surviving replicas only (Serve starts a replacement for the killed one, but on a loaded
    machine only tens of seconds later): a session none of them has headroom for stays where it is.
    """
    import ray
    from ray import serve

    from .router import session_router_config

    began = time.perf_counter()
    # Serve's router logs each retry of a request that reached the replica the tour kills, at WARNING:
    # expected here, and the tour reports what happened itself. (Set once Serve runs: starting resets it.)
    logging.getLogger("ray.serve").setLevel(logging.ERROR)
    deployment: Any = serve.deployment(
        SessionServer,
        name="sessions",
        num_replicas=3,
        ray_actor_options={"num_cpus": 0},
        request_router_config=session_router_config(0.2),
    )
    app = deployment.bind(
        model="demo@1",
        step=step_session,
        init=init_session,
        replay=replay_steps,
        checkpoints=root,
        save_every=save_every,
        byte_budget="8 MiB",  # (a drain moves a session only where it fits)
    )
    handle = serve.run(app, name="serve-demo", route_prefix=None)
    fleet = SessionFleet(handle)
    ids = [f"s{i}" for i in range(sessions)]
    outputs: dict[str, list[float]] = {sid: [] for sid in ids}
    served: dict[str, list[str]] = {sid: [] for sid in ids}
    series: dict[str, list[int]] = {}
    events: list[tuple[int, str]] = []
    killed = ""
    try:
        for t in range(steps):
            if t == kill_at:
                counts = {n: sum(1 for sid in ids if served[sid][-1] == n) for n in fleet.replicas()}
                killed = max(counts, key=lambda n: (counts[n], n))
                ray.kill(fleet.actor(killed), no_restart=True)
                events.append((t, f"{killed} killed holding {counts[killed]} sessions (mid-rollout)"))
            if t == drain_at:
                live = {n: sum(1 for sid in ids if served[sid][-1] == n) for n in fleet.replicas()}
                source = max(live, key=lambda n: (live[n], n))
                stuck = fleet.drain(source)
                events.append((t, f"{source} drained: {live[source] - len(stuck)} sessions moved, {len(stuck)} stayed"))
            for sid, reply in zip(ids, _step_all(ray, handle, ids, t)):
                outputs[sid].append(reply.output)
                served[sid].append(reply.replica)
            _record(fleet, series, t)
        moved = fleet.rebalance(limit=2 * sessions)
        events.append((steps, f"rebalance moved {moved} sessions"))
        _record(fleet, series, steps)
        figures = fleet.figures()
        copies = [sid for f in figures.values() for sid in f.sessions]
        events.append(
            (steps, f"{len(set(copies))} of {sessions} sessions held, {len(copies) - len(set(copies))} twice")
        )
        replayed = {sid: n for f in fleet.replays().values() for sid, n in f.items()}
    finally:
        serve.delete("serve-demo")
    rows, identical = [], True
    for sid in ids:
        same = outputs[sid] == _reference(sid, steps)
        identical &= same
        owner = next(n for n, f in figures.items() if sid in f.sessions)
        mib = figures[owner].sessions[sid].nbytes / (1 << 20)
        after = served[sid][kill_at] if kill_at < steps else served[sid][-1]
        rows.append([sid, served[sid][0], after, owner, round(mib, 2), "yes" if same else "NO"])
    identical &= sorted(copies) == sorted(ids)  # (every session held once: none lost, none duplicated)
    return DemoResult(rows, series, events, replayed, identical, time.perf_counter() - began)


def _step_all(ray: Any, handle: Any, ids: list[str], t: int) -> list[Any]:
    """Step ``t`` of every session, sent together; a request that reached a replica killed meanwhile, or one
    that left (refused: retry), is sent again (bounded)."""
    sent = {sid: handle.step.remote(sid, t, at=t) for sid in ids}
    replies = []
    for sid in ids:
        for attempt in range(50):
            try:
                replies.append(sent[sid].result(timeout_s=60))
                break
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, StaleEpochError):
                if attempt == 49:
                    raise
                time.sleep(0.2)
                sent[sid] = handle.step.remote(sid, t, at=t)
    return replies


def _record(fleet: SessionFleet, series: dict[str, list[int]], t: int) -> None:
    figures = fleet.figures()
    for name in figures:
        series.setdefault(name, [0] * t)
    for name, values in series.items():
        f = figures.get(name)
        values.append(sum(held for held, _ in f.pools.values()) if f is not None else 0)


def _reference(sid: str, steps: int) -> list[float]:
    r = SessionReplica("reference", model="demo@1", step=step_session, init=init_session)
    epoch = r.open(sid)
    return [r.step(sid, epoch, t) for t in range(steps)]


HEADER = ["session", "first on", "after the kill", "at the end", "MiB", "identical"]


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
    result = run(sessions=sessions, steps=steps, kill_at=min(4, steps - 1), drain_at=min(6, steps - 1))
    print(report(result))
    print(f"{result.seconds:.1f} s, Ray and Serve start-up included")
    return 0 if result.identical else 1
