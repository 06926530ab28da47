"""The jitted functions over a batch's stacked state: a step of the active slots, and one slot's rows written,
copied and read. Which slots take part is data (an index array and a count), never shape, so joins and leaves
never retrace.

Two formulations of the step, chosen per batch:

* ``exact`` (the default): a loop over the active slots, each iteration the single-session computation on
  one slot's rows. Each session's outputs and state are bit-identical to the same session stepped alone
  (XLA compiles the same per-session matmuls); the cost grows with the active sessions, not the capacity.
  Each iteration writes back only what the session's computation wrote: where a row leaf comes out as
  ``dynamic_update_slice(row leaf, update, *starts)`` (a K/V cache taking one position), the loop writes that
  region of the new row into the stacked buffer, not the whole row; any other leaf is written whole. The
  written region is read from the new row (not taken as the update), so the write depends on the row read
  and XLA keeps updating the donated buffers in place: taken directly, the write no longer follows every
  read of the old rows and XLA copies the whole stacked state each iteration (100x slower).
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
from jax.extend import core as jex_core

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


class _RowStep(NamedTuple):
    """One session's step traced once: ``fn`` maps the flat (row, params, args) leaves to the new row's leaves,
    the output's leaves, then the start indices of every region write; ``regions`` holds, per row leaf, the
    shape of the region the step wrote and its number of start indices, or None where the leaf is new whole."""

    fn: Callable[..., list[Any]]
    regions: tuple[tuple[tuple[int, ...], int] | None, ...]
    out_tree: Any
    out_shape: Any


def _trace_row_step(one: Callable[..., tuple[list[Any], Any]], row: list[Any], params: Any, args: Any) -> _RowStep:
    flat, in_tree = jax.tree_util.tree_flatten((row, params, args))

    def flat_one(*leaves: Any) -> tuple[list[Any], Any]:
        row, params, args = jax.tree_util.tree_unflatten(in_tree, leaves)
        return one(list(row), params, *args)

    closed, (_, out_shape) = jax.make_jaxpr(flat_one, return_shape=True)(*flat)
    jaxpr = closed.jaxpr
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}
    regions: list[tuple[tuple[int, ...], int] | None] = []
    starts: list[Any] = []
    for k, v in enumerate(jaxpr.outvars[: len(row)]):
        e = made_by.get(v) if isinstance(v, jex_core.Var) else None
        if e is not None and e.primitive.name == "dynamic_update_slice" and e.invars[0] is jaxpr.invars[k]:
            regions.append((tuple(e.invars[1].aval.shape), len(e.invars) - 2))
            starts.extend(e.invars[2:])
        else:
            regions.append(None)
    info: Any = jaxpr.debug_info
    if info is not None and isinstance(info.result_paths, tuple):  # keep it naming every output, as JAX checks
        info = info._replace(result_paths=(*info.result_paths, *(f"region start {i}" for i in range(len(starts)))))
    widened = jaxpr.replace(outvars=[*jaxpr.outvars, *starts], debug_info=info)
    fn = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(widened, closed.consts))
    return _RowStep(fn, tuple(regions), jax.tree_util.tree_structure(out_shape), out_shape)


def _write_back(x: Any, new_row: Any, region: tuple[tuple[int, ...], int] | None, starts: list[Any], slot: Any) -> Any:
    if region is None:
        return lax.dynamic_update_index_in_dim(x, new_row, slot, 0)
    shape, _ = region
    # ``starts`` are what the step's own write received, after JAX turned its negative indices into offsets
    # from the end; wrapping them again would move a start below minus the size. Left to XLA's clamp, both
    # slices clamp alike, so the region read and written is exactly the one the step wrote.
    part = lax.dynamic_slice(new_row, starts, shape, allow_negative_indices=False)
    at = (slot.astype(starts[0].dtype) if starts else slot, *starts)
    return lax.dynamic_update_slice(x, part[None], at, allow_negative_indices=False)


def make_kernels(treedef: Any, apply: Apply, capacity: int, exact: bool) -> Kernels:
    """The step, write, copy and read functions of a batch of ``capacity`` slots of ``treedef``-shaped rows."""

    def one(row_leaves: list[Any], params: Any, *args: Any) -> tuple[list[Any], Any]:
        new_row, out = apply(jax.tree_util.tree_unflatten(treedef, row_leaves), params, *args)
        return jax.tree_util.tree_leaves(new_row), out

    def step_exact(stacked: PytreeValue, params: Any, index: Any, count: Any, *args: Any) -> tuple[PytreeValue, Any]:
        args0 = jax.tree_util.tree_map(lambda a: a[0], args)
        traced = _trace_row_step(one, _row(stacked.leaves, 0), params, args0)
        outs0 = jax.tree_util.tree_map(lambda s: jnp.zeros((capacity, *s.shape), s.dtype), traced.out_shape)
        n_row, n_out = len(stacked.leaves), traced.out_tree.num_leaves

        def body(i: Any, carry: tuple[tuple[Any, ...], Any]) -> tuple[tuple[Any, ...], Any]:
            leaves, outs = carry
            slot = index[i]
            slot_args = jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, slot, keepdims=False), args)
            res = traced.fn(*jax.tree_util.tree_leaves((_row(leaves, slot), params, slot_args)))
            out = jax.tree_util.tree_unflatten(traced.out_tree, res[n_row : n_row + n_out])
            outs = jax.tree_util.tree_map(lambda o, x: lax.dynamic_update_index_in_dim(o, x, slot, 0), outs, out)
            starts, new = iter(res[n_row + n_out :]), []
            for x, new_row, region in zip(leaves, res[:n_row], traced.regions):
                taken = [next(starts) for _ in range(region[1])] if region is not None else []
                new.append(_write_back(x, new_row, region, taken, slot))
            return tuple(new), outs

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
