"""Equinox stateful models served per session: each session's ``eqx.nn.State`` held in the table.

Needs the ``[equinox]`` extra (``pip install 'functional-state[equinox]'``). The model is one made by
``eqx.nn.make_with_state`` and called as ``model(*args, state) -> (output, new_state)``.

Example:
  >>> import jax, jax.numpy as jnp, equinox as eqx
  >>> import functional_state as fs
  >>> from functional_state.equinox import SessionStates
  >>> class Counter(eqx.Module):
  ...     index: eqx.nn.StateIndex
  ...     def __init__(self):
  ...         self.index = eqx.nn.StateIndex(jnp.zeros((), jnp.int32))
  ...     def __call__(self, x, state):
  ...         n = state.get(self.index) + 1
  ...         return x * n, state.set(self.index, n)
  >>> states = SessionStates(*eqx.nn.make_with_state(Counter)())
  >>> s = states.begin(states.begin(fs.ManagerState.create(), "a"), "b")
  >>> s, _ = states.step(s, "a", jnp.float32(2.0))
  >>> s, out = states.step(s, "a", jnp.float32(2.0))
  >>> float(out), float(states.step(s, "b", jnp.float32(2.0))[1])
  (4.0, 2.0)
"""

from __future__ import annotations

from typing import Any

try:
    import equinox as _eqx
except ImportError as e:  # pragma: no cover - exercised in a subprocess without equinox
    raise ImportError(
        "`functional_state.equinox` needs Equinox: install the `[equinox]` extra "
        "(`pip install 'functional-state[equinox]'`)."
    ) from e

from .model_caches import ModelCaches

__all__ = ["SessionStates"]


class SessionStates(ModelCaches):
    """Per-session ``eqx.nn.State`` of one Equinox model: the model's arrays held once here, each session's
    state a `PytreeValue` named ``name`` in its session.

    Every read of a session's state builds a new ``State`` object, so forks never share one (an Equinox
    ``State`` invalidates its old object when it is used: a shared one would break the other fork).

    Args:
      model: the model (``model(*args, state) -> (output, new_state)``).
      state: its initial state, as ``eqx.nn.make_with_state`` returned it: each new session's start.
      name: the object name of the state in each session (exposed as ``.name``).
    """

    def __init__(self, model: Any, state: Any, name: str = "state"):
        params, static = _eqx.partition(model, _eqx.is_array)

        def apply(session_state: Any, params: Any, *args: Any) -> tuple[Any, Any]:
            out, new_state = _eqx.combine(params, static)(*args, session_state)
            return new_state, out

        super().__init__(state, params, apply, name, "SessionStates")
