"""`DenseValue`: one large value a model replaces whole or item by item, as a parkable state object."""

from __future__ import annotations

from typing import Any

from .._repr import short
from ..errors import InvalidArgumentError, InvalidTypeError
from .codec import ObjectCodec, field_error, refused_field, register_checkpoint_type
from .pytree import pytree_dataclass
from .state_object import RESIDENT, UNALLOCATED, StateObject, Status

__all__ = ["DenseValue"]


# Types whose class defines ``shape`` and ``dtype`` and whose instance passed once: a torch tensor's ``shape`` is a
# getter that builds a new object per call, and a commit checks every tensor of a K/V cache at every step.
_ARRAY_TYPES: set[type] = set()


def _is_array(x: Any) -> bool:
    cls = type(x)
    if cls in _ARRAY_TYPES:
        return True
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        return False
    if hasattr(cls, "shape") and hasattr(cls, "dtype"):  # (attributes of the class, not of this instance alone)
        _ARRAY_TYPES.add(cls)
    return True


def _check_value(value: Any, what: str) -> Any:
    """An array, or a list/tuple of arrays and Nones (stored as a tuple), or None."""
    if value is None or _is_array(value):
        return value
    if isinstance(value, (list, tuple)):
        bad = [i for i, x in enumerate(value) if x is not None and not _is_array(x)]
        if bad:
            raise InvalidTypeError(
                f"`{what}`: a DenseValue holds an array or a list of arrays; items {bad[:5]} are "
                f"{type(value[bad[0]]).__name__}. Carry other values as attrs."
            )
        return tuple(value)
    raise InvalidTypeError(
        f"`{what}`: a DenseValue holds an array (JAX, numpy, torch) or a list/tuple of them, got {type(value).__name__}."
    )


class _DenseCodec(ObjectCodec):
    """The default codec, whose check holds a decoded value to what `DenseValue.create` and its verbs keep: the
    value (and a staged one) an array, a tuple of arrays and Nones, or None (None unless resident), and no
    recompute source (nothing can rebuild it: a source would let the planner drop it)."""

    def check(self, obj: Any, where: str) -> None:
        super().check(obj, where)
        if obj.recompute_source is not None:
            raise field_error(where, "recompute_source", obj.recompute_source, "None (a DenseValue has no source)")
        if obj.status != RESIDENT and obj.value is not None:
            raise field_error(where, "value", obj.value, f"None (the value is {obj.status})")
        for field in ("value", "staged"):
            x = getattr(obj, field)
            with refused_field(where, field, x):
                if _check_value(x, "DenseValue") is not x:  # (a list would come back a tuple)
                    raise InvalidTypeError("`DenseValue`: a sequence value is a tuple.")


@register_checkpoint_type(codec=_DenseCodec())
@pytree_dataclass(static=("status", "recompute_source", "recompute_cost"))
class DenseValue(StateObject):
    """One value the model replaces wholesale, or item by item: a cache like DreamZero's VAE feat map.

    The value is an array or a sequence of arrays (stored as a tuple: never mutated in place). ``commit``
    replaces it whole, ``set_item`` replaces one item, both returning a new object. It has no recompute
    source (nothing can rebuild it), but it can be parked: ``park()`` moves it to host memory whole and
    ``restore()`` brings it back bit for bit, which is the only release that loses nothing.

    Example:
      >>> import numpy as np
      >>> cache = DenseValue.create([np.zeros(4), np.ones(4)])
      >>> cache = cache.set_item(0, np.full(4, 7.0))
      >>> [float(x[0]) for x in cache.view()], len(cache)
      ([7.0, 1.0], 2)
      >>> cache
      DenseValue(value=(f64[4], f64[4]), status='resident')
    """

    value: Any  # an array, a tuple of arrays (and Nones), or None
    staged: Any  # a staged replacement value, or None
    host_copy: Any  # ParkedStorage of `value` while parked, else None
    status: Status
    recompute_source: str | None  # always None: nothing can rebuild this value
    recompute_cost: float  # unused: never recomputable

    extents_from_leaves = True  # (its storage is its value's arrays; a ClassVar of `StateObject`, not a field)

    @classmethod
    def create(cls, value: Any = None, *, allocate: bool = True) -> DenseValue:
        """A dense value holding ``value`` (an array, a list/tuple of arrays, or None).

        Raises:
          InvalidTypeError: ``value`` is not an array or a sequence of arrays.
        """
        return cls(
            value=_check_value(value, "DenseValue.create") if allocate else None,
            staged=None,
            host_copy=None,
            status=RESIDENT if allocate else UNALLOCATED,
            recompute_source=None,
            recompute_cost=float("inf"),
        )

    def __len__(self) -> int:
        """Items held: the sequence's length, 1 for a single array, 0 for None."""
        self._require_resident("__len__")
        if self.value is None:
            return 0
        return len(self.value) if isinstance(self.value, tuple) else 1

    def set_item(self, index: int, item: Any) -> DenseValue:
        """A copy whose sequence has ``item`` at ``index`` (the model's ``cache[i] = x``).

        Raises:
          InvalidArgumentError: the value is not a sequence, or ``index`` is out of range.
          InvalidTypeError: ``item`` is not an array or None.
        """
        self._require_resident("set_item")
        if not isinstance(self.value, tuple):
            raise InvalidArgumentError(
                f"`DenseValue.set_item`: the value is {type(self.value).__name__}, not a sequence; replace it whole "
                f"with `commit(value)`."
            )
        if item is not None and not _is_array(item):
            raise InvalidTypeError(f"`DenseValue.set_item`: items are arrays or None, got {type(item).__name__}.")
        n = len(self.value)
        if isinstance(index, bool) or not isinstance(index, int) or not -n <= index < n:
            raise InvalidArgumentError(f"`DenseValue.set_item`: index {index!r} is out of range for {n} items.")
        items = list(self.value)
        items[index] = item
        return self._replace(value=tuple(items))

    def _check_payload(self, payload: Any) -> None:
        _check_value(payload, "DenseValue.commit")

    def _commit_payload(self, payload: Any) -> DenseValue:
        # `commit` and `stage` checked it (`_check_payload`); only a list, which may have changed since it was
        # staged, is checked again as it becomes a tuple.
        if payload is None or type(payload) is tuple or _is_array(payload):
            return self._replace(value=payload)
        return self._replace(value=_check_value(payload, "DenseValue.commit"))

    def _committed_view(self) -> Any:
        return self.value

    def _view_with(self, payload: Any) -> Any:
        return _check_value(payload, "DenseValue.view")

    def _allocated_storage(self) -> dict[str, Any]:
        return {"value": None}

    def _released_storage(self) -> dict[str, Any]:
        return {"value": None}

    def _committed_roots(self) -> Any:
        return self.value

    def _parkable_fields(self) -> dict[str, Any]:
        return {"value": self.value}

    def __repr__(self) -> str:
        parts = [f"value={short(self.value)}", f"status={self.status!r}"]
        if self.staged is not None:
            parts.insert(1, f"staged={short(self.staged)}")
        return f"DenseValue({', '.join(parts)})"
