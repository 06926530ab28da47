"""One way to declare frozen, key-registered pytree dataclasses (public: `pytree_dataclass`), and a fast ``replace``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, dataclass_transform

import jax

T = TypeVar("T")


class _Missing:
    """Sentinel type for 'argument not given' where ``None`` is a legitimate value."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Missing, ())


MISSING: Any = _Missing()
_KEEP = object()  # "field unchanged" marker of the generated replace functions


def _make_replace(cls: type, names: list[str]) -> Callable[..., Any]:
    """Build ``replace(obj, *, field=...)`` for ``cls``: keyword-only, so a misspelt field is a TypeError.

    Generated code (one line per field) because it runs on every commit: it is several times faster than
    ``dataclasses.replace`` and does not re-run ``__init__`` (which validates, and may not run on tracers).
    Each slot is written through its own descriptor, past the frozen class's ``__setattr__`` (which
    refuses), on an object of ``type(obj)`` (a subclass declared without the decorator keeps its type). No
    other class is made: a stand-in class of the same layout, whose instances took plain stores and then
    ``cls``'s ``__class__``, was faster, but CPython only swaps classes whose layout comes from the same
    base, so it had to be a subclass of ``cls``'s base, visible in its ``__subclasses__()`` and to its
    ``__init_subclass__`` hooks (issue 24).
    """
    params = ", ".join(f"{n}=_KEEP" for n in names)
    body = "".join(f"    _set_{n}(new, obj.{n} if {n} is _KEEP else {n})\n" for n in names)
    src = f"def replace(obj, *, {params}):\n    new = _new(type(obj))\n{body}    return new\n"
    namespace: dict[str, Any] = {"_KEEP": _KEEP, "_new": object.__new__}
    namespace.update({f"_set_{n}": cls.__dict__[n].__set__ for n in names})
    exec(src, namespace)
    fn = namespace["replace"]
    fn.__qualname__ = f"{cls.__name__}._replace"
    return fn


@dataclass_transform(frozen_default=True, eq_default=False)
def pytree_dataclass(*, static: tuple[str, ...] = ()) -> Callable[[type[T]], type[T]]:
    """Make ``cls`` a frozen, slotted dataclass registered with JAX, with ``static`` fields as aux data.

    This is how every state object of the library is declared, and how to declare your own: subclass
    `StateObject`, give it the fields ``staged``, ``host_copy``, ``status``, ``recompute_source`` and
    ``recompute_cost`` (the last three static) and implement its storage hooks. ``obj._replace(field=...)``
    is a fast copy with some fields changed (a misspelt name is a ``TypeError``).

    Equality and hashing are by identity: instances hold arrays, whose ``==`` is elementwise. Static fields
    must be stable config (names, capacities, dtypes, a lifecycle status): JAX compares aux data on every
    jit call, and a change means a new trace. Unflatten does no validation (it runs on tracers): validate in
    a ``create`` classmethod instead.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functional_state import StateObject, pytree_dataclass
      >>> @pytree_dataclass(static=("status", "recompute_source", "recompute_cost"))
      ... class RunningMean(StateObject):
      ...     total: jax.Array  # f32[d], the sum of committed rows
      ...     count: jax.Array  # i32[], how many rows
      ...     staged: jax.Array | None
      ...     host_copy: object
      ...     status: str
      ...     recompute_source: str | None
      ...     recompute_cost: float
      ...
      ...     @classmethod
      ...     def create(cls, d):
      ...         return cls(jnp.zeros(d), jnp.zeros((), jnp.int32), None, None, "resident", None, float("inf"))
      ...
      ...     def _commit_payload(self, row):
      ...         return self._replace(total=self.total + row, count=self.count + 1)
      ...     def _committed_view(self):
      ...         return self.total / jnp.maximum(self.count, 1)
      ...     def _view_with(self, row):
      ...         return (self.total + row) / (self.count + 1)
      ...     def _allocated_storage(self):
      ...         return {"total": jnp.zeros_like(self.total), "count": jnp.zeros((), jnp.int32)}
      ...     def _released_storage(self):
      ...         return {"total": None, "count": None}
      ...     def _committed_roots(self):
      ...         return (self.total, self.count)
      ...     def _parkable_fields(self):
      ...         return {"total": self.total, "count": self.count}
      >>> m = jax.jit(lambda m, x: m.commit(x))(RunningMean.create(2), jnp.array([2.0, 4.0]))
      >>> m.commit(jnp.zeros(2)).view().tolist(), m.park().restore().view().tolist()
      ([1.0, 2.0], [2.0, 4.0])
    """

    def wrap(declared: type[T]) -> type[T]:
        cls = dataclasses.dataclass(frozen=True, eq=False, repr=False, slots=True)(declared)
        _forget_declared(cls, declared)
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = set(static) - set(names)
        if unknown:
            raise TypeError(f"{cls.__name__}: static fields {sorted(unknown)} are not dataclass fields")
        data = [n for n in names if n not in static]
        jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(static))
        cls._static_fields = tuple(static)  # type: ignore[attr-defined]
        cls._replace = _make_replace(cls, names)  # type: ignore[attr-defined]
        return cls

    return wrap


def _forget_declared(cls: type, declared: type) -> None:
    """Point ``cls``'s frozen ``__setattr__``/``__delattr__`` at ``cls`` instead of ``declared``.

    ``dataclass(slots=True)`` builds a second class; on CPython 3.11 the frozen methods close over the
    first (unslotted) one, which then lives as long as ``cls`` does and stays in every base's
    ``__subclasses__()``: a user registry enumerating them saw the class twice (issue 24).
    """
    if cls is declared:
        return
    for name in ("__setattr__", "__delattr__"):
        for cell in getattr(cls.__dict__.get(name), "__closure__", None) or ():
            if cell.cell_contents is declared:
                cell.cell_contents = cls


def replace(obj: T, **changes: Any) -> T:
    """A copy of pytree dataclass ``obj`` with ``changes``; an unknown field name raises TypeError."""
    return type(obj)._replace(obj, **changes)  # type: ignore[attr-defined]
