"""Per-session caches of a stateful model, given as a pure ``apply(cache, params, *args)``.

`functional_state.nnx.SessionCaches` and `functional_state.equinox.SessionStates` are this class over
the split/merge boundary of their framework: the model's parameters are held once, each session's cache
is a `PytreeValue` in the table, and a step is one `functional_state.step` with ``has_aux=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .batched.sessions import BatchedSessions
from .core.pytree_value import PytreeValue, check_layout
from .errors import InvalidArgumentError, ObjectNotFoundError, SessionExistsError
from .table.manager_state import ManagerState
from .table.object_verbs import put
from .table.parked import restore
from .table.session_verbs import get_or_create, lookup
from .table.step import step as _step

Apply = Callable[..., tuple[Any, Any]]  # (cache, params, *args) -> (new cache, output)


class ModelCaches:
    """Each session's cache of one model, as a `PytreeValue` named ``name`` in its session."""

    def __init__(self, initial: Any, params: Any, apply: Apply, name: str, what: str):
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"`{what}`: name must be a non-empty str, got {name!r}.")
        self.name = name
        self._what = what
        self._initial = PytreeValue.create(initial)
        if not len(self._initial):
            raise InvalidArgumentError(
                f"`{what}`: the model holds no cache (no array matched the filter); initialise it first "
                f"(e.g. `model.init_cache(...)` for an NNX attention layer)."
            )
        self._params = params
        self._apply = apply
        treedef = self._initial.treedef
        # The parameters pass every call as their flat leaves, rebuilt inside the jitted call: jit's dispatch
        # reads a tuple of arrays in C++, where the parameters' own pytree (NNX Variables, Equinox modules)
        # would be flattened in Python on every call, at a cost that grows with their leaves.
        flat_params, params_treedef = jax.tree_util.tree_flatten(params)
        self._flat_params = tuple(flat_params)

        def step_fn(obj: PytreeValue, flat_params: tuple[Any, ...], *args: Any) -> tuple[PytreeValue, Any]:
            new_cache, out = apply(obj.view(), jax.tree_util.tree_unflatten(params_treedef, flat_params), *args)
            return obj.commit(new_cache), out

        def many_fn(
            per_session: list[tuple[Any, ...]], flat_params: tuple[Any, ...], *args: Any
        ) -> tuple[list[tuple[Any, ...]], Any]:
            params = jax.tree_util.tree_unflatten(params_treedef, flat_params)

            def one(session_leaves: tuple[Any, ...], *session_args: Any) -> tuple[tuple[Any, ...], Any]:
                new_cache, out = apply(jax.tree_util.tree_unflatten(treedef, session_leaves), params, *session_args)
                return tuple(jax.tree_util.tree_leaves(new_cache)), out

            # Stacked and split inside the jitted call: one dispatch, not one per leaf and session.
            stacked = tuple(jnp.stack(leaves) for leaves in zip(*per_session))
            new, out = jax.vmap(one)(stacked, *args)
            return [tuple(x[j] for x in new) for j in range(len(per_session))], out

        # Held for the object's life: `step` keeps one jitted wrapper (one trace) per function object.
        self._step_fn = step_fn
        self._many_fn = jax.jit(many_fn)

    @property
    def initial(self) -> PytreeValue:
        """The cache a session starts from (the model's own, as it was when this object was made)."""
        return self._initial

    def batched(self, capacity: int, *, batch_id: str = "batch", exact: bool = True) -> BatchedSessions:
        """This model's sessions batched in ``capacity`` slots of stacked state (see `BatchedSessions`): one
        jitted, donated call steps any subset of them. A session's state reads the same batched or not
        (`BatchedSessions.session_state`), and a parked one is this object's kind of session.

        Example:
          >>> import jax.numpy as jnp, functional_state as fs
          >>> from flax import nnx
          >>> from functional_state.nnx import SessionCaches
          >>> attn = nnx.MultiHeadAttention(2, 4, decode=True, rngs=nnx.Rngs(0))
          >>> attn.init_cache((1, 8, 4))
          >>> batch = SessionCaches(attn).batched(capacity=8)
          >>> s = batch.join(batch.create(fs.ManagerState.create()), "a")
          >>> s, out = batch.step(s, ["a"], jnp.ones((8, 1, 1, 4)))     # one row per slot
          >>> out.shape, int(batch.session_state(s, "a").view()["cache_index"][...])
          ((8, 1, 1, 4), 1)
        """
        return BatchedSessions(
            self._initial, self._params, self._apply, capacity, name=self.name, batch_id=batch_id, exact=exact
        )

    def begin(self, state: ManagerState, session_id: str | None) -> ManagerState:
        """Start session ``session_id`` (created if absent) from the model's initial cache.

        Raises:
          SessionExistsError: the session already holds an object named ``name``.
        """
        state, session = get_or_create(state, session_id)
        if self.name in session:
            raise SessionExistsError(
                f"`{self._what}.begin({session_id!r})`: the session already holds {self.name!r}; keep stepping it, "
                f"or drop it first (`drop_session`, or `SessionState.remove`) to start over."
            )
        return put(state, session_id, self.name, self._initial)

    def _resident(self, state: ManagerState, session_id: str | None, what: str) -> ManagerState:
        """``state`` with the session's cache checked and resident (restored if parked)."""
        session = lookup(state, session_id)
        obj = session.get(self.name, None)
        if obj is None:
            raise ObjectNotFoundError(
                f"`{self._what}.{what}({session_id!r})`: the session holds no {self.name!r}; call "
                f"`begin(state, {session_id!r})` first."
            )
        check_layout(obj, self._initial, f"{self._what}.{what}")
        if obj.parked:
            state, _ = restore(state, session_id, self.name)
        return state

    def step(
        self, state: ManagerState, session_id: str | None, *args: Any, donate: bool = True
    ) -> tuple[ManagerState, Any]:
        """Run the model on ``args`` with the session's cache; returns ``(state, output)``.

        A parked cache is restored first. With ``donate`` (the default) the cache's buffers are reused for
        the new cache where nothing else holds them (a fork, a snapshot), and the input ``state`` is consumed
        (see `functional_state.step`). Every session and step shares one trace per argument structure.

        Raises:
          SessionStateLostError: no such session. ObjectNotFoundError: the session was never begun.
          InvalidArgumentError: the session's cache has another layout than this model's.
        """
        state = self._resident(state, session_id, "step")
        # The initial cache is held here, outside the table, for sessions begun later: never donated.
        return _step(
            state,
            session_id,
            self.name,
            self._step_fn,
            self._flat_params,
            *args,
            donate=donate,
            has_aux=True,
            retained=(self._initial,),
        )

    def step_many(self, state: ManagerState, session_ids: Sequence[str], *args: Any) -> tuple[ManagerState, Any]:
        """Step several sessions in one batched call: ``args`` and the output are stacked on a leading axis,
        one entry per id of ``session_ids``. Returns ``(state, outputs)``; the input state is unchanged.

        Batched numerics (``jax.vmap``) may differ from single `step`\\ s in the last bits: XLA may order a
        batched reduction differently. Greedy tokens agree in practice; bitwise equality is only promised
        between single steps.

        Raises:
          InvalidArgumentError: ``session_ids`` is empty or repeats an id; and as `step`.
        """
        ids = list(session_ids)
        if not ids or len(set(ids)) != len(ids):
            raise InvalidArgumentError(
                f"`{self._what}.step_many`: session_ids must be distinct and non-empty, got {ids!r}."
            )
        for sid in ids:
            state = self._resident(state, sid, "step_many")
        objs = [lookup(state, sid).get(self.name) for sid in ids]
        new_leaves, outs = self._many_fn([o.leaves for o in objs], self._flat_params, *args)
        for sid, obj, leaves in zip(ids, objs, new_leaves):
            # The jitted call returns the very structure, shapes and dtypes it was given: no check needed.
            state = put(state, sid, self.name, obj._replace(leaves=leaves))
        return state, outs
