"""Type-checked by mypy (`make typecheck` lists this file), never run: a user's code against the public types.

A wrong overload or a return type widened to a union makes `make typecheck` fail here (mypy, then pyright).
"""

from typing import assert_type

import jax
import torch

import functional_state as fs
from torch_bridge import to_jax


def pointer_of_a_strict_alias(t: torch.Tensor) -> int:
    # strict=True never returns the tensor (it raises instead), so the result is a jax.Array.
    return to_jax(t, strict=True).unsafe_buffer_pointer()


def pointer_of_a_lenient_alias(t: torch.Tensor) -> int:
    a = to_jax(t)  # may be the tensor itself (a dtype JAX lacks): narrow before using jax.Array methods
    assert_type(a, jax.Array | torch.Tensor)
    return a.unsafe_buffer_pointer() if isinstance(a, jax.Array) else a.data_ptr()


def typed_getters(session: fs.SessionState) -> int:
    # `cls=` types what `get` and `get_or_create` return (checked at run time); without it `get` stays `Any`.
    buf = session.get("latents", cls=fs.LatentBuffer)
    assert_type(buf, fs.LatentBuffer)
    ring_or_none = session.get("frames", None, cls=fs.ArrayRing)
    assert_type(ring_or_none, fs.ArrayRing | None)
    session, ring = session.get_or_create("frames", lambda: fs.ArrayRing.create(4, (16,)), fs.ArrayRing)
    assert_type(ring, fs.ArrayRing)
    assert_type(session, fs.SessionState)
    return len(buf) + ring.capacity + (0 if ring_or_none is None else int(ring_or_none.size))


def readme_torch_pipeline() -> None:
    # README.md's adapters block, verbatim (tests/test_readme.py keeps the two equal): what a user pastes must
    # type-check as it stands.
    import torch

    import functional_state as fs
    from torch_bridge.adapters import DreamZeroStateAdapter, request_session

    manager = fs.SessionStateManager()

    # DreamZero: the same surface as the bespoke per-session state, over a manager session.
    state = DreamZeroStateAdapter("robot-0", manager, vae_encoder_window=2)
    window = state.accumulate_frames(torch.zeros(352, 640, 3, dtype=torch.uint8))  # stitched camera frame
    state.append_vae_encoder_chunk(torch.zeros(1, 32, 1, 44, 80, dtype=torch.bfloat16))
    latents = state.observation_latents(1)  # None until the first chunk is encoded
    shapes = tuple(window.shape), latents is not None and tuple(latents.shape)
    print(*shapes)  # (1, 352, 640, 3) (1, 32, 1, 44, 80)

    # Cosmos3: per-request encode-once K/V (per layer) and M-RoPE tables, dropped when the request ends.
    with request_session(manager, "request-7") as kv:
        layers = [(torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)) for _ in range(2)]
        kv.set_branch(False, layers, (torch.ones(16, 8), torch.zeros(16, 8)))  # the cond branch, stored once
        print(kv.is_branch_initialized(False))  # True
    print("request-7" in manager)  # False
