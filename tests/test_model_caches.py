"""`ModelCaches`, the split/merge core under `functional_state.nnx` and `functional_state.equinox`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import functional_state as fs
from functional_state.model_caches import ModelCaches

FLATTENS = {"n": 0}


@jax.tree_util.register_pytree_node_class
class Params:
    """Parameters whose pytree flattening is counted (as NNX Variables' or an Equinox module's runs in Python)."""

    def __init__(self, w: jax.Array):
        self.w = w

    def tree_flatten(self):
        FLATTENS["n"] += 1
        return (self.w,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def _apply(cache, params, x):
    new = {"h": cache["h"] * params.w + x, "n": cache["n"] + 1}
    return new, new["h"].sum()


def test_a_step_does_not_flatten_the_parameters_per_call():
    # Each step passed the parameters' pytree to the jitted call, whose dispatch flattened it in Python on
    # every call (for an NNX model, one Python call per Variable: ~20 us of a ~100 us decode step).
    caches = ModelCaches({"h": jnp.zeros(4), "n": jnp.int32(0)}, Params(jnp.full(4, 2.0)), _apply, "kv", "Test")
    state = caches.begin(fs.ManagerState.create(), "a")
    for _ in range(2):  # traced and recorded
        state, _ = caches.step(state, "a", jnp.float32(1.0))
    FLATTENS["n"] = 0
    for _ in range(3):
        state, out = caches.step(state, "a", jnp.float32(1.0))
    assert FLATTENS["n"] == 0, "a step flattened the parameters' pytree again"
    np.testing.assert_array_equal(fs.view(state, "a", "kv")["h"], np.full(4, 31.0))  # h <- 2h + 1, five times
    assert int(fs.view(state, "a", "kv")["n"]) == 5
    assert float(out) == 124.0
