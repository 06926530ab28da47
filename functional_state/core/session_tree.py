"""`SessionState` as a pytree: objects and array attrs are children, every other attr static aux data.

A jit over sessions therefore traces the arrays and compares the rest; changing a non-array attr retraces.
Unflatten takes any children (tracers, orbax's ``SaveArgs``, a ``tree_map`` with ``is_leaf``) and checks
nothing: the constructor and the write paths validate.
"""

from __future__ import annotations

from typing import Any

import immutables
import jax
import numpy as np

from .._repr import short
from .session import SessionState, make_session, objects_of

__all__: list[str] = []


class _Static:
    """A non-array attr carried as aux data: equal by ``==`` (when that is a plain bool) or identity."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static):
            return NotImplemented
        a, b = self.value, other.value
        if a is b:
            return True
        if type(a) is not type(b):
            return False
        try:
            return bool(a == b)
        except Exception:  # arrays inside a container compare elementwise: identity decides
            return False

    def __hash__(self) -> int:
        return hash(type(self.value).__qualname__)

    def __repr__(self) -> str:
        return f"static({short(self.value)})"


def _array_attr(value: Any) -> bool:
    """True when ``value`` is an array, or a pytree whose every leaf is one: an attr a jit traces."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return True
    try:
        leaves = jax.tree_util.tree_leaves(value)
    except Exception:
        return False
    return bool(leaves) and all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)


def _split(s: SessionState) -> tuple[tuple[str, ...], tuple[str, ...], Any]:
    """``(object names, traced attr keys, aux)`` of ``s``, each in sorted order."""
    names = tuple(sorted(s._objects))
    dynamic = getattr(s, "_dynamic", None)  # unset where a fast path built the session
    keys = sorted(s._attrs)
    if dynamic is None:
        dynamic = tuple(k for k in keys if _array_attr(s._attrs[k]))
    static = tuple((k, _Static(s._attrs[k])) for k in keys if k not in dynamic)
    return names, dynamic, (names, dynamic, static, tuple(sorted(s._policies.items())))


def _flatten_with_keys(s: SessionState) -> tuple[list[tuple[Any, Any]], Any]:
    key = jax.tree_util.GetAttrKey
    names, dynamic, aux = _split(s)
    children = [(key(f"objects[{n!r}]"), s._objects[n]) for n in names]
    children.extend((key(f"attrs[{k!r}]"), s._attrs[k]) for k in dynamic)
    return children, aux


def _flatten(s: SessionState) -> tuple[list[Any], Any]:
    names, dynamic, aux = _split(s)
    return [s._objects[n] for n in names] + [s._attrs[k] for k in dynamic], aux


def _unflatten(aux: Any, children: Any) -> SessionState:
    # Any children at all (tracers, orbax's SaveArgs, the results of a tree_map with is_leaf): no checks here,
    # the constructor and the write paths validate.
    names, dynamic, static, policies = aux
    children = list(children)
    attrs = dict(zip(dynamic, children[len(names) :]))
    attrs.update((k, v.value) for k, v in static)
    new = make_session(objects_of(zip(names, children)), immutables.Map(attrs), immutables.Map(policies))
    new._dynamic = dynamic
    return new


jax.tree_util.register_pytree_with_keys(SessionState, _flatten_with_keys, _unflatten, flatten_func=_flatten)
