"""What a value can hold, in one place: nothing ever (`NO_BUFFER_TYPES`), fixed buffers (`fixed`), or buffers
that may change without a write (`mutable`), which every kept figure re-reads instead of remembering.

The byte accounting counts array allocations (numpy, torch, JAX). A value of one of `NO_BUFFER_TYPES` holds
none and never will: numbers, strings, ``None``, ranges, slices, and Python's own byte buffers (``bytes``,
``bytearray``: memory, but not array memory; the walk counts them zero, so the kept figures do too, and a
``bytearray`` grown in place changes no figure). A ``memoryview`` counts what it exports: zero over ``bytes``,
the whole array over a numpy array. A *fixed* value holds the same buffers for its whole life: a numpy array
(numpy refuses to resize an array anything else references, and the table references it; a model that
forces it with ``ndarray.resize(refcheck=False)`` breaks numpy's own rule and is outside this contract:
``stats(exact=True)`` still tells the truth, kept figures and the budget do not see it), a JAX array
(immutable; one the torch bridge imported counts its torch owner, so it is fixed only if the owner is), a
memoryview of a fixed value, a tuple of such. Every other value is *mutable*: containers (a list a model
appends to, a dict, a plain object) and torch tensors, which ``resize_``, ``set_``, ``.data = ...``, an
``out=`` argument or ``untyped_storage().resize_`` give other storage in place, with no write the table could
see. The table records a fixed attr value's extents once, on write; a container is read again wherever a
figure must be exact (`functional_state.memory.holders.AttrIndex`). A bare torch tensor in one storage (or a
JAX array the torch bridge imported from one) is recorded on write too, with a stamp of its storage
(address, bytes, device): reading every tensor attr of the table on every `stats()`, plan or donating step
would make each of them O(table). The next budgeted write of its session compares the stamp (one storage
read) and records the tensor anew before it decides, as does any attr write of the session (the same value
set again included). Until then kept figures count it at its recorded size; ``stats(exact=True)`` walks it.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np

from .aliases import alias_owner

__all__ = [
    "NO_BUFFER_TYPES",
    "exported",
    "fixed",
    "holds_no_buffer",
    "mutable",
    "register_bufferless",
    "write_marks",
]

NO_BUFFER_TYPES: frozenset[type] = frozenset(
    {int, float, complex, bool, str, bytes, bytearray, type(None), range, slice}
)
_NO_BUFFER = tuple(NO_BUFFER_TYPES)  # (for isinstance: an int subclass, an str enum hold nothing either)
_BUFFERLESS: set[type] = set()  # package types declared by `register_bufferless`
_MAX_DEPTH = 4
_MAX_ITEMS = 64


def holds_no_buffer(value: Any) -> bool:
    """Whether ``value`` holds no array buffer and never can (one of `NO_BUFFER_TYPES`, or a subclass).

    Example:
      >>> holds_no_buffer(3), holds_no_buffer(bytearray(8)), holds_no_buffer([])
      (True, True, False)
    """
    return type(value) in NO_BUFFER_TYPES or type(value) in _BUFFERLESS or isinstance(value, _NO_BUFFER)


def register_bufferless(cls: type) -> type:
    """Declare that no instance of ``cls`` holds an array buffer, ever (an immutable record of names and
    numbers): the table keeps no holder entry for such an attr value and never walks it on a step. The
    exact walk (``stats(exact=True)``) still reads it, and finds nothing.

    Example:
      >>> from typing import NamedTuple
      >>> @register_bufferless
      ... class Names(NamedTuple):
      ...     ids: tuple
      >>> holds_no_buffer(Names(("a",) * 100)), holds_no_buffer(tuple(range(100)))
      (True, False)
    """
    _BUFFERLESS.add(cls)
    return cls


def fixed(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` holds the same buffers for its whole life (its contents may change, its buffers do
    not): no buffer at all, a numpy array of numbers, a JAX array (unless it aliases a mutable owner), or a
    short tuple of such. Such a value's extents can be recorded once, when it arrives.

    Example:
      >>> fixed(np.zeros(4)), fixed((np.zeros(4), 1)), fixed([np.zeros(4)])
      (True, True, False)
    """
    if holds_no_buffer(value):
        return True
    if isinstance(value, memoryview):  # (its exporter cannot change size while exported; a released one: nothing)
        return _exporter_fixed(value, depth)
    if isinstance(value, jax.Array):
        owner = alias_owner(value)
        return owner is None or (depth < _MAX_DEPTH and fixed(owner, depth + 1))
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return False
        base: Any = value
        while isinstance(base, np.ndarray):
            base = base.base
        # A view of torch memory (``t.numpy()``) is as mutable as the tensor; other foreign buffers (an mmap,
        # a bytes object) cannot change size while numpy holds their export.
        torch = sys.modules.get("torch")
        return base is None or torch is None or not isinstance(base, torch.Tensor)
    if type(value) in (tuple, frozenset) or (isinstance(value, tuple) and hasattr(type(value), "_fields")):
        return depth < _MAX_DEPTH and len(value) <= _MAX_ITEMS and all(fixed(v, depth + 1) for v in value)
    return False


def exported(view: memoryview) -> list[Any]:
    """What ``view`` exports: ``[the object whose buffer it is]``, or nothing once released.

    Example:
      >>> a = np.zeros(4); exported(memoryview(a))[0] is a
      True
    """
    try:
        return [view.obj]
    except ValueError:  # released: it holds nothing
        return []


def _exporter_fixed(view: memoryview, depth: int) -> bool:
    return depth < _MAX_DEPTH and all(fixed(v, depth + 1) for v in exported(view))


def mutable(value: Any) -> bool:
    """Whether ``value`` may come to hold other buffers without a write: neither `fixed` nor buffer-free.

    Example:
      >>> import torch
      >>> mutable(torch.zeros(4)), mutable([np.zeros(4)]), mutable(np.zeros(4))
      (True, True, False)
    """
    return not fixed(value)


def write_marks(values: Any) -> tuple[int, ...]:
    """Per leaf of ``values``: -1 once a JAX array is deleted (donated), a torch tensor's version (raised by each
    in-place write), else 0; two readings differ when anything wrote or donated a leaf in between."""
    return tuple(_write_mark(x) for x in jax.tree_util.tree_leaves(values))


def _write_mark(x: Any) -> int:
    if isinstance(x, jax.Array):
        return -1 if x.is_deleted() else 0
    try:
        return int(x._version)
    except (AttributeError, RuntimeError):  # (not a tensor; an inference-mode tensor keeps no counter)
        return 0
