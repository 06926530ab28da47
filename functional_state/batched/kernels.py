"""The jitted functions over a batch's stacked state: a step of the active slots, and one slot's rows written,
copied and read. Which slots take part is data (an index array and a count), never shape, so joins and leaves
never retrace.

Two formulations of the step, chosen per batch:

* ``exact`` (the default): a loop over the active slots, each iteration the single-session computation on
  one slot's rows. Each session's outputs and state are bit-identical to the same session stepped alone
  (XLA compiles the same per-session matmuls); the cost grows with the active sessions, not the capacity.
* ``vmap``: one `jax.vmap` over every slot, inactive slots masked out. One batched matmul: faster with many
  active sessions, but XLA may order a batched reduction differently, so the last bits can differ from a
  session stepped alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..core.pytree_value import PytreeValue

__all__ = ["Kernels", "make_kernels"]

Apply = Callable[..., tuple[Any, Any]]  # (row state, params, *args) -> (new row state, output)


class Kernels(NamedTuple):
    """The functions one batch layout runs; held for the batch's life (one jit trace per function)."""

    step: Callable[..., tuple[PytreeValue, Any]]  # (stacked, params, index i32[cap], count i32[], *args)
    write: Callable[..., PytreeValue]  # (stacked, row leaves, slot i32[]) -> stacked
    copy: Callable[..., PytreeValue]  # (stacked, source slot, target slot) -> stacked
    read: Callable[..., tuple[Any, ...]]  # jitted (stacked leaves, slot) -> row leaves (new buffers)


def _row(leaves: tuple[Any, ...], slot: Any) -> list[Any]:
    return [lax.dynamic_index_in_dim(x, slot, keepdims=False) for x in leaves]


def _put_row(leaves: tuple[Any, ...], row: list[Any], slot: Any) -> tuple[Any, ...]:
    return tuple(lax.dynamic_update_index_in_dim(x, r, slot, 0) for x, r in zip(leaves, row))


def make_kernels(treedef: Any, apply: Apply, capacity: int, exact: bool) -> Kernels:
    """The step, write, copy and read functions of a batch of ``capacity`` slots of ``treedef``-shaped rows."""

    def one(row_leaves: list[Any], params: Any, *args: Any) -> tuple[list[Any], Any]:
        new_row, out = apply(jax.tree_util.tree_unflatten(treedef, row_leaves), params, *args)
        return jax.tree_util.tree_leaves(new_row), out

    def step_exact(stacked: PytreeValue, params: Any, index: Any, count: Any, *args: Any) -> tuple[PytreeValue, Any]:
        row0 = _row(stacked.leaves, 0)
        args0 = jax.tree_util.tree_map(lambda a: a[0], args)
        out_shape = jax.eval_shape(one, row0, params, *args0)[1]
        outs0 = jax.tree_util.tree_map(lambda s: jnp.zeros((capacity, *s.shape), s.dtype), out_shape)

        def body(i: Any, carry: tuple[tuple[Any, ...], Any]) -> tuple[tuple[Any, ...], Any]:
            leaves, outs = carry
            slot = index[i]
            slot_args = jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, slot, keepdims=False), args)
            new_row, out = one(_row(leaves, slot), params, *slot_args)
            outs = jax.tree_util.tree_map(lambda o, x: lax.dynamic_update_index_in_dim(o, x, slot, 0), outs, out)
            return _put_row(leaves, new_row, slot), outs

        leaves, outs = lax.fori_loop(0, count, body, (stacked.leaves, outs0))
        return stacked._replace(leaves=leaves), outs

    def step_vmap(stacked: PytreeValue, params: Any, index: Any, count: Any, *args: Any) -> tuple[PytreeValue, Any]:
        active = jnp.zeros((capacity,), bool).at[index].max(jnp.arange(capacity) < count)
        new, out = jax.vmap(lambda row, *a: one(row, params, *a))(list(stacked.leaves), *args)

        def keep(new_x: Any, old_x: Any) -> Any:
            return jnp.where(active.reshape((capacity,) + (1,) * (new_x.ndim - 1)), new_x, old_x)

        outs = jax.tree_util.tree_map(lambda o: keep(o, jnp.zeros_like(o)), out)
        return stacked._replace(leaves=tuple(keep(n, o) for n, o in zip(new, stacked.leaves))), outs

    def write(stacked: PytreeValue, row: tuple[Any, ...], slot: Any) -> PytreeValue:
        return stacked._replace(leaves=_put_row(stacked.leaves, list(row), slot))

    def copy(stacked: PytreeValue, source: Any, target: Any) -> PytreeValue:
        return stacked._replace(leaves=_put_row(stacked.leaves, _row(stacked.leaves, source), target))

    read = jax.jit(lambda leaves, slot: tuple(_row(leaves, slot)))
    return Kernels(step_exact if exact else step_vmap, write, copy, read)
