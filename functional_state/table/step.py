"""`step`: run a jitted update of one state object, donating its buffers only where that is safe.

Donation lets XLA write a step's output into its input's buffer (no second copy of a large ring), and
deletes the input. In a table of immutable states that is dangerous: a fork shares every buffer of its
source, an attr or another object may hold the same array, and any earlier state still reads it. `step`
donates a buffer only when nothing else in the table (nor anything the caller retains) holds it, as the
table's ledger counts holders; any other buffer is copied first and the copy donated.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from ..core.state_object import StateObject
from ..errors import InvalidTypeError
from ..memory.extents import Extent
from ..memory.holders import held_elsewhere, holder_extents
from .buffer_record import object_record, seed_extents
from .checks import find_object, locate
from .ledger import Acct, held_by
from .lru import replace_session
from .manager_state import ConsumedManagerState, ManagerState, ledger_of, node_session
from .torch_writes import check_object

__all__ = ["step"]

# Scalars (a ring's head and size) often cannot be reused in place, and JAX warns on every such call; nothing
# is lost. Filtered once, for this message only: `warnings.catch_warnings()` around each call would change
# the process-wide filters from whichever thread steps (it is not thread-safe).
warnings.filterwarnings("ignore", message="Some donated buffers were not usable", category=UserWarning)

_JITTED: weakref.WeakKeyDictionary[Callable[..., Any], dict[tuple[bool, bool], Callable[..., Any]]] = (
    weakref.WeakKeyDictionary()
)
_JITTED_LOCK = threading.Lock()


def _jitted(fn: Callable[..., Any], donate: bool, has_aux: bool) -> Callable[..., Any]:
    """One jitted wrapper per (fn, donate, has_aux): jit caches traces per wrapper, so reuse keeps it at one
    trace. The wrapper checks what ``fn`` returns while it is traced (`_returning_same_type`)."""
    known = _JITTED.get(fn)  # (read without the lock: an entry is only added, or dropped with its function)
    jitted = known.get((donate, has_aux)) if known is not None else None
    if jitted is not None:
        return jitted
    with _JITTED_LOCK:
        per_fn = _JITTED.setdefault(fn, {})
        jitted = per_fn.get((donate, has_aux))
        if jitted is None:
            jitted = jax.jit(_returning_same_type(fn, has_aux), donate_argnums=(0,) if donate else ())
            per_fn[(donate, has_aux)] = jitted
        return jitted


def _returning_same_type(fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``fn``, raising `InvalidTypeError` unless it returns an object of its input's type (with ``has_aux``, a
    pair whose first item is one). Checked as jit traces it: once per input structure, and before the call
    runs, so a refused call has donated nothing (no per-step walk of the arguments' structure either)."""

    @functools.wraps(fn)
    def checked(obj: Any, *args: Any) -> Any:
        out = fn(obj, *args)
        new = out
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise InvalidTypeError(
                    f"`step(..., has_aux=True)`: fn must return a pair (new {type(obj).__name__}, aux), got "
                    f"{_kind(out)}."
                )
            new = out[0]
        if type(new) is not type(obj):
            raise InvalidTypeError(
                f"`step`: fn must return a {type(obj).__name__} (the object it was given, updated), got {_kind(new)}."
            )
        return out

    return checked


def _kind(value: Any) -> str:
    """What a refused result is, as its author would name it (a traced array is a tracer while jit traces)."""
    if isinstance(value, jax.Array):
        return f"an array of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _protected(state: ManagerState, retained: Iterable[Any]) -> tuple[list[Acct], set[Extent]]:
    """The ledgers of the retained tables, and the extents of the other retained values: a state object's
    as the ledger figures it (memoized on it: objects are immutable), anything else walked."""
    tables, values = [], []
    extents: set[Extent] = set()
    for value in retained:
        if isinstance(value, ManagerState):
            if value is not state:
                tables.append(ledger_of(value))
        elif isinstance(value, StateObject):
            extents.update(held_by(value))
        else:
            values.append(value)
    if values:
        extents.update(holder_extents(values))
    return tables, extents


def _donation_copies(state: ManagerState, obj: StateObject, retained: Iterable[Any] = ()) -> tuple[StateObject, int]:
    """``obj`` (an object ``state`` holds once, under the name being stepped) with every JAX array that
    anything else may read, or that ``obj`` holds more than once, replaced by a copy; and how many.

    "Anything else" is every other holder in ``state`` (answered by its ledger: objects, their unaccounted
    leaves, attr values, in O(size of ``obj``)) and everything in ``retained``. Compared by extent, so
    aliases, views and forks count. Each leaf's extents come from the record of ``obj``'s structure and
    buffers where one was made (`buffer_record`): only the holders are asked anew.
    """
    acct = ledger_of(state)
    own = held_by(obj)
    tables, walked = _protected(state, retained)
    leaves, treedef, record = object_record(obj)
    # Asked once for all the leaves' extents (each extent's answer is its own): held by another holder.
    every = record.every
    elsewhere = held_elsewhere(acct, every, own)
    for t in tables:
        elsewhere |= held_elsewhere(t, every)
    if walked:
        elsewhere |= walked.intersection(every)
    if not elsewhere and record.separate:
        return obj, 0  # nothing else holds a buffer of it, and it holds none twice: every leaf donated as is
    new_leaves = []
    donated: set[Extent] = set()  # XLA refuses one buffer donated twice: a leaf repeated in obj is copied
    for leaf, extents in zip(leaves, record.per_leaf):
        if extents is not None:
            if (
                not extents  # an empty buffer: no address to compare, and a copy costs nothing
                or not donated.isdisjoint(extents)
                or not elsewhere.isdisjoint(extents)
            ):
                leaf = jnp.array(leaf, copy=True)
            else:
                donated.update(extents)
        new_leaves.append(leaf)
    copied = sum(a is not b for a, b in zip(leaves, new_leaves))
    return (jax.tree_util.tree_unflatten(treedef, new_leaves) if copied else obj), copied


def step(
    state: ManagerState,
    session_id: str | None,
    name: str,
    fn: Callable[..., Any],
    *args: Any,
    donate: bool = False,
    retained: Iterable[Any] = (),
    has_aux: bool = False,
) -> Any:
    """Replace object ``name`` of a session by ``jax.jit(fn)(object, *args)``, optionally donating it.

    Args:
      state: the table.
      session_id: the session (None means ``"default"``).
      name: the object to update, e.g. an `ArrayRing`.
      fn: a pure function ``(object, *args) -> object`` of the same structure, e.g. ``ArrayRing.commit``.
        Pass the same function every step: it is jitted once and traced once per structure.
      *args: the step's other inputs (traced, never baked in as constants).
      donate: let XLA reuse the object's buffers for the result. With ``donate=True`` the input ``state``
        is *consumed*, as with ``jax.jit(..., donate_argnums=...)``: it may read deleted buffers, so every
        function refuses it afterwards with `StateConsumedError`. Keep using the returned state. What is
        protected (copied first, the copy donated) is decided by ownership, never by reference counts:

        * everything ``state`` holds besides this object: other objects, forks, parked sharers, attrs
          (aliases and views included), answered exactly by the table's ledger in O(size of the object);
        * everything in ``retained``: other tables (older states, snapshots) through their ledgers, any
          other value by a walk of it.

        An array or object you took *out* of the table (``view``, ``get_attr``, ``lookup(...).get``) and
        still read is yours, as an argument you donate to ``jax.jit`` is: pass it (or the state you read it
        from) in ``retained``, or it may be deleted, and reading it then raises JAX's "Array has been
        deleted" error (never wrong values). `SessionStateManager.step` retains its snapshots and detached
        handles itself.
      retained: values the caller still reads (older states, views, objects): their buffers are protected.
      has_aux: ``fn`` returns ``(new_object, aux)`` (a decode step's logits, say), as with
        ``jax.value_and_grad(has_aux=True)``; ``aux`` is any pytree, returned beside the new table.

    Returns:
      The new table; with ``has_aux``, ``(table, aux)``.

    Raises:
      SessionStateLostError, ObjectNotFoundError: no such session or object.
      InvalidTypeError: ``fn`` returned something that is not a state object of the same type.
      SharedStorageWrittenError: a torch storage it shares was written in place outside `writable`.

    Example:
      >>> import jax.numpy as jnp
      >>> from functional_state import ArrayRing, ManagerState, get_or_create, put, view, fork_session
      >>> s, _ = get_or_create(ManagerState.create(), "a")
      >>> s = put(s, "a", "ring", ArrayRing.create(2, (3,)))
      >>> s = fork_session(s, "a", "b")            # "b" shares the ring's buffer
      >>> s = step(s, "a", "ring", ArrayRing.commit, jnp.ones(3), donate=True)
      >>> view(s, "a", "ring").shape, view(s, "b", "ring").shape   # "b" still reads its buffer
      ((1, 3), (0, 3))
      >>> def push(ring, x):
      ...     return ring.commit(x), x.sum()           # the new ring, and an output beside it
      >>> s, total = step(s, "a", "ring", push, jnp.full(3, 2.0), has_aux=True)
      >>> float(total), view(s, "a", "ring").shape
      (6.0, (2, 3))
    """
    sid, node = locate(state, session_id, "step")
    obj = find_object(node, name, "step")
    obj._require_resident("step")
    check_object(state, sid, name, obj, "step")
    jitted = _jitted(fn, donate, has_aux)  # (a wrong return type is refused as it traces, before it runs)
    if donate:
        obj, _ = _donation_copies(state, obj, retained)
    out = jitted(obj, *args)
    new_obj, aux = out if has_aux else (out, None)
    seed_extents(new_obj)  # (the ledger reads the new object's extents from the record of its buffers, if any)
    if donate:
        state.__class__ = ConsumedManagerState
    new_state = replace_session(state, sid, node, node_session(node)._with_object(name, new_obj))
    return (new_state, aux) if has_aux else new_state


# jitted -> {(input structure, has_aux, leaf shapes and dtypes): whether the output keeps the object's leaves}
_KEEPS_LAYOUT: weakref.WeakKeyDictionary[Callable[..., Any], dict[Any, bool]] = weakref.WeakKeyDictionary()


def trace(
    state: ManagerState,
    session_id: str | None,
    name: str,
    fn: Callable[..., Any],
    *args: Any,
    donate: bool = False,
    has_aux: bool = False,
) -> bool:
    """Trace ``fn`` for object ``name`` as `step` would, without running it (or donating anything).

    `step` traces a function once per input structure; a caller that runs `step` under a lock calls this
    first, outside it, so user code (the trace) never runs under its lock.

    Returns:
      Whether the object ``fn`` returns has the leaves it was given (structure, shapes, dtypes): such a step
      leaves the table's bytes as they were, so a byte budget that admitted the table admits the result.

    Raises:
      as `step` before it computes anything (no such session or object, a wrong return type).
    """
    _, node = locate(state, session_id, "step")
    obj = find_object(node, name, "step")
    obj._require_resident("step")
    jitted = _jitted(fn, donate, has_aux)
    # Once per input structure and leaf shapes, as JAX traces: an abstract evaluation costs more than a step.
    leaves, in_tree = jax.tree_util.tree_flatten((obj, args))
    key = (in_tree, has_aux, tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves))
    with _JITTED_LOCK:
        known = _KEEPS_LAYOUT.setdefault(jitted, {}).get(key)
    if known is None:
        out = jitted.eval_shape(obj, *args)  # type: ignore[attr-defined]
        if has_aux:
            out = out[0]
        before, tree = jax.tree_util.tree_flatten(obj)
        after, out_tree = jax.tree_util.tree_flatten(out)
        known = bool(tree == out_tree) and all(  # type: ignore[operator]
            getattr(a, "shape", None) == b.shape and getattr(a, "dtype", None) == b.dtype for a, b in zip(before, after)
        )
        with _JITTED_LOCK:
            _KEEPS_LAYOUT[jitted][key] = known
    return known
