"""Type-checked by mypy (`make typecheck` lists this file), never run: a user's code against the public types.

A wrong overload or a return type widened to a union makes `make typecheck` fail here.
"""

from typing import assert_type

import jax
import torch

from torch_bridge import to_jax


def pointer_of_a_strict_alias(t: torch.Tensor) -> int:
    # strict=True never returns the tensor (it raises instead), so the result is a jax.Array.
    return to_jax(t, strict=True).unsafe_buffer_pointer()


def pointer_of_a_lenient_alias(t: torch.Tensor) -> int:
    a = to_jax(t)  # may be the tensor itself (a dtype JAX lacks): narrow before using jax.Array methods
    assert_type(a, jax.Array | torch.Tensor)
    return a.unsafe_buffer_pointer() if isinstance(a, jax.Array) else a.data_ptr()
