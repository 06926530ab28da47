"""A stand-in world model for the serving tests: each step mixes the session's last latent with noise drawn
from the step's own seed, so a rollout is bit-reproducible and any lost or repeated step shows."""

from __future__ import annotations

import numpy as np

import functional_state as fs

SIZE = 1 << 16  # floats per latent (256 KiB)


def init(handle) -> None:
    handle.put("latents", fs.LatentBuffer.create(maxlen=2))
    handle.put("first", fs.DenseValue.create([np.full(SIZE, 1.0, np.float32)]))


def step(handle, t: int) -> float:
    items = handle.view("latents")
    prev = items[-1] if len(items) else handle.view("first")[0]
    noise = np.random.default_rng(t).standard_normal(SIZE).astype(np.float32)
    new = prev * np.float32(0.5) + noise
    handle.commit("latents", new)
    return float(new.astype(np.float64).sum())


def replay(session_id: str, from_step: int, to_step: int) -> list[tuple[int]]:
    """The arguments of the steps a failover lost: a step's only input is its index."""
    return [(t,) for t in range(from_step, to_step)]
