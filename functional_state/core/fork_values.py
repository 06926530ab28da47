"""How a fork copies an attr: the ``copy_container`` and ``clone`` policies of `SessionState.forked`."""

from __future__ import annotations

import collections
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..memory import accounting

__all__ = ["clone", "copy_container"]


_CONTAINERS = (list, dict, set, collections.deque, types.SimpleNamespace, bytearray)


def copy_container(value: Any) -> Any:
    """A new outer container over the same items, for the ``copy_container`` fork policy."""
    if isinstance(value, types.SimpleNamespace):
        return types.SimpleNamespace(**vars(value))
    if isinstance(value, collections.deque):
        return collections.deque(value, maxlen=value.maxlen)
    if isinstance(value, (list, dict, set, bytearray)):
        return value.copy()
    return _rebuilt(value, lambda leaf: leaf)


def _rebuilt(value: Any, leaf_fn: Callable[[Any], Any]) -> Any:
    """A registered pytree node (an ``eqx.nn.State``, an ``nnx.State``, a dataclass pytree) rebuilt through
    its own unflatten with ``leaf_fn`` of each leaf: new node objects, so no two forks share a mutable one
    (an ``eqx.nn.State`` invalidates its old object on use). Anything else is returned as is."""
    try:
        leaves, treedef = jax.tree_util.tree_flatten(value)
    except Exception:
        return value
    if treedef.num_nodes == 1 and leaves and leaves[0] is value:  # type: ignore[attr-defined]  # a leaf
        return value
    return jax.tree_util.tree_unflatten(treedef, [leaf_fn(x) for x in leaves])


def clone(value: Any) -> Any:
    """A deep copy of an attr value for the ``clone`` fork policy: arrays copied, containers rebuilt."""
    torch = accounting.torch_module()
    if torch is not None and isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, jax.Array):
        return jax.numpy.array(value, copy=True)
    if isinstance(value, dict):
        new = value.copy()  # keeps the dict's type (OrderedDict, defaultdict)
        for k, v in value.items():
            new[k] = clone(v)
        return new
    if isinstance(value, list):
        return [clone(v) for v in value]
    if isinstance(value, tuple):
        cloned = [clone(v) for v in value]
        return type(value)(*cloned) if hasattr(value, "_fields") else tuple(cloned)
    if isinstance(value, (set, frozenset)):
        return type(value)(clone(v) for v in value)
    if isinstance(value, collections.deque):
        return collections.deque((clone(v) for v in value), maxlen=value.maxlen)
    if isinstance(value, types.SimpleNamespace):
        return types.SimpleNamespace(**{k: clone(v) for k, v in vars(value).items()})
    return _rebuilt(value, clone)
