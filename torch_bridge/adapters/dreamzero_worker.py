"""A DreamZero serving worker for restart and migration checks: it runs a script of actions (serve sessions
for a range of steps, save a session, close it, load one) and prints per-step output digests as JSON.

Every worker is one process with its own manager and its own paged KV engine, so a session saved by one and
loaded by another crosses a real process boundary: its tensors, counters, attrs and engine KV come back from
the checkpoint alone. The digests of a session's steps, concatenated across workers, equal those of an
uninterrupted run when restore is exact.

``python -m torch_bridge.adapters.dreamzero_worker --actions '[["serve", [0, 1], 0, 200], ["save", 0, "/tmp/x"]]'``

Actions: ``["serve", [session, ...], start, stop]``, ``["save", session, dir]``, ``["close", session]``,
``["load", session, dir]`` (waits up to ``--wait`` seconds for another worker to finish writing ``dir``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any

from functional_state import CheckpointError, has_checkpoint
from functional_state.shell.config import enable_override

from .. import harness as dz
from .dreamzero_store import DreamZeroSessions

__all__ = ["run_actions"]

_KV = "self_attn_kv"


def _digest(values: list[Any]) -> str:
    h = hashlib.sha256()
    for value in values:
        dz.hash_value(h, value)
    return h.hexdigest()


def run_actions(
    actions: list[list[Any]], *, sessions: int = 3, wait_s: float = 120.0, vae_encoder: str = "stand-in"
) -> dict[str, Any]:
    """Run ``actions`` on the manager path; returns ``{"steps": {session: [digest, ...]}, "latents": {...}}``.

    The VAE encoder defaults to the stand-in, unlike the rollout's: restart and migration checks serve hundreds
    of steps in several processes, which the real encoder makes ~2.5x slower here, and the real encoder's
    feat cache across a checkpoint and a fresh process is checked by tests/test_wan.py. ``vae_encoder="wan"``
    runs it through the worker too.
    """
    cfg = dz.small_config(steps=10**6, sessions=sessions, vae_encoder=vae_encoder)
    nets = dz.Networks(cfg)
    kv = dz.SelfAttnKV(cfg)
    hooks: dict[str, Any] = {"object_hooks": {_KV: kv.engine.checkpoint_hooks()}}
    with enable_override(True):
        store = DreamZeroSessions(resident_bound=sessions)
    steps: dict[str, list[str]] = {}
    latents: dict[str, str] = {}
    for action in actions:
        kind = action[0]
        if kind == "serve":
            _, which, start, stop = action
            for step in range(start, stop):
                for i in which:
                    sid = f"session-{i}"
                    state = store.begin(sid) if step == 0 else store.resume(sid)
                    steps.setdefault(sid, []).append(_digest(dz.pipeline_step(state, nets, cfg, i, step, kv=kv)))
        elif kind == "save":
            sid = f"session-{action[1]}"
            store.save(sid, action[2], **hooks)
            latents[sid] = _digest([store.decode_accumulated_video_latents(sid)])
        elif kind == "close":
            store.close(f"session-{action[1]}")
        elif kind == "load":
            sid = f"session-{action[1]}"
            _load_when_ready(store, sid, action[2], hooks, wait_s)
        else:
            raise ValueError(f"unknown action {kind!r}")
    for sid in list(steps):
        if sid in store:
            latents[sid] = _digest([store.decode_accumulated_video_latents(sid)])
    return {"steps": steps, "latents": latents, "kv_blocks_allocated": len(kv.engine.allocated)}


def _load_when_ready(store: DreamZeroSessions, sid: str, path: str, hooks: dict[str, Any], wait_s: float) -> None:
    """Load ``sid`` from ``path``, waiting for another worker's save to complete (a checkpoint appears whole).

    Not ``orbax.checkpoint.checkpoint_utils.wait_for_new_checkpoint`` (issue 23): it waits for a *step*
    directory (``<dir>/<step>``, a `CheckpointManager` layout) and yields its number, while a session save
    writes one checkpoint at ``path`` itself, so it would wait for a step that never appears; and it sleeps
    whole seconds (``seconds_to_sleep: int``), ten times this loop's 0.1 s, on a migration's critical path.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            store.load(sid, path, **hooks)
            return
        except CheckpointError:
            # Only a missing or half-written checkpoint is worth waiting for; a complete one that fails to load
            # is damaged, and waiting would not mend it.
            if time.monotonic() > deadline or has_checkpoint(path):
                raise
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DreamZero worker: serve, save, close and load sessions.")
    parser.add_argument("--actions", required=True, help="a JSON list of actions (see the module docstring)")
    parser.add_argument("--sessions", type=int, default=3, help="sessions the store and engine are sized for")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds a load waits for a checkpoint")
    parser.add_argument("--vae-encoder", choices=dz.VAE_ENCODERS, default="stand-in", help="the causal VAE encoder")
    args = parser.parse_args(argv)
    result = run_actions(
        json.loads(args.actions), sessions=args.sessions, wait_s=args.wait, vae_encoder=args.vae_encoder
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
