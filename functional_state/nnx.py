"""Flax NNX models served per session: each session's ``nnx.Cache`` state held in the table.

Needs the ``[flax]`` extra (``pip install 'functional-state[flax]'``).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import functional_state as fs
  >>> from functional_state.nnx import SessionCaches
  >>> attn = nnx.MultiHeadAttention(2, 4, decode=True, rngs=nnx.Rngs(0))
  >>> attn.init_cache((1, 8, 4))                # batch 1, up to 8 positions
  >>> caches = SessionCaches(attn)
  >>> s = caches.begin(caches.begin(fs.ManagerState.create(), "a"), "b")
  >>> s, out = caches.step(s, "a", jnp.ones((1, 1, 4)))
  >>> out.shape, int(fs.view(s, "a", "kv")["cache_index"][...]), int(fs.view(s, "b", "kv")["cache_index"][...])
  ((1, 1, 4), 1, 0)
"""

from __future__ import annotations

from typing import Any

try:
    from flax import nnx as _nnx
except ImportError as e:  # pragma: no cover - exercised in a subprocess without flax
    raise ImportError(
        "`functional_state.nnx` needs Flax: install the `[flax]` extra (`pip install 'functional-state[flax]'`)."
    ) from e

from .model_caches import ModelCaches

__all__ = ["SessionCaches"]


class SessionCaches(ModelCaches):
    """Per-session caches of one NNX model: the graph and the non-cache state (parameters) held once here,
    each session's cache (the state matching ``filter``) a `PytreeValue` named ``name`` in its session.

    A step merges the session's cache with the parameters, calls the model, splits the cache back out and
    commits it. The model's non-cache state is read-only: a change the call makes to it (an ``nnx.Rngs``
    count, a ``BatchStat``) is dropped; put such state under ``filter`` to keep it per session.

    Args:
      model: the model, its cache already initialised (``init_cache``); its current cache is each new
        session's starting point.
      filter: the NNX filter that selects the per-session state (default ``nnx.Cache``).
      name: the object name of the cache in each session (exposed as ``.name``).

    Raises:
      InvalidArgumentError: no state of the model matches ``filter`` (the cache is not initialised).
    """

    def __init__(self, model: Any, filter: Any = _nnx.Cache, name: str = "kv"):
        graphdef, cache, rest = _nnx.split(model, filter, ...)  # type: ignore[misc]

        def apply(cache: Any, params: Any, *args: Any) -> tuple[Any, Any]:
            merged = _nnx.merge(graphdef, cache, params)
            out = merged(*args)
            return _nnx.state(merged, filter), out

        super().__init__(cache, rest, apply, name, "SessionCaches")
        self.graphdef = graphdef
        self.filter = filter
