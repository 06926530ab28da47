"""`SessionState`: one session's named state objects plus the attributes the manager only carries."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Callable, Mapping, TypeVar

from . import accounting
import jax

from ._pytree import MISSING
from .errors import ObjectNotFoundError
from .state_object import StateObject

__all__ = ["SessionState"]

O = TypeVar("O", bound=StateObject)


def _check_name(name: Any, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"`SessionState.{what}`: names must be non-empty str, got {name!r}.")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class SessionState:
    """Named `StateObject`s (``objects``) and carried values (``attrs``), immutable.

    Objects are what the manager can act on (stage, commit, evict, reset). Attrs are values the manager
    only carries: counters, conditioning tensors, lists a model mutates in place. Attrs are stored by
    reference: ``get_attr`` returns the very object ``set_attr`` stored. Both maps flatten in sorted key
    order, so equal states have equal tree structures.

    Example:
      >>> from functional_state import LatentBuffer
      >>> s = SessionState.empty().put("frames", LatentBuffer.create(maxlen=4)).set_attr("step", 3)
      >>> s2 = s.update("frames", lambda b: b.commit(1.0))
      >>> len(s.get("frames")), len(s2.get("frames")), s2.get_attr("step")
      (0, 1, 3)
    """

    objects: Mapping[str, StateObject]  # read-only mapping
    attrs: Mapping[str, Any]  # read-only mapping

    def __post_init__(self):
        # Read-only views keep the frozen contract honest: `state.attrs["k"] = v` raises TypeError.
        for field in ("objects", "attrs"):
            value = getattr(self, field)
            if not isinstance(value, MappingProxyType):
                object.__setattr__(self, field, MappingProxyType(dict(value)))

    @classmethod
    def empty(cls) -> "SessionState":
        """A session with no objects and no attrs."""
        return cls(objects={}, attrs={})

    # --- objects -----------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        """Object names, sorted."""
        return tuple(sorted(self.objects))

    def __contains__(self, name: str) -> bool:
        return name in self.objects

    def get(self, name: str, default: Any = MISSING) -> Any:
        """The object named ``name``; ``default`` if given and absent.

        Raises:
          ObjectNotFoundError: absent and no default given.
        """
        obj = self.objects.get(name, MISSING)
        if obj is MISSING:
            if default is not MISSING:
                return default
            raise ObjectNotFoundError(
                f"session holds no state object named {name!r}; it holds {list(self.names)}. "
                f"Create it with `put(name, obj)` or `get_or_create(name, factory, cls)`."
            )
        return obj

    def put(self, name: str, obj: StateObject) -> "SessionState":
        """Return a state with ``obj`` stored under ``name`` (replacing any object there)."""
        _check_name(name, "put")
        if not isinstance(obj, StateObject):
            raise TypeError(
                f"`SessionState.put({name!r}, ...)`: expected a StateObject (e.g. LatentBuffer, ArrayRing), "
                f"got {type(obj).__name__}. Carried values belong in attrs: use `set_attr`."
            )
        objects = dict(self.objects)
        objects[name] = obj
        return _session(objects, self.attrs)

    def remove(self, name: str) -> "SessionState":
        """Return a state without the object ``name`` (a no-op if absent)."""
        if name not in self.objects:
            return self
        objects = dict(self.objects)
        del objects[name]
        return _session(objects, self.attrs)

    def get_or_create(
        self, name: str, factory: Callable[[], O], cls: type[O] | None = None
    ) -> tuple["SessionState", O]:
        """Return ``(state, obj)``, building ``obj = factory()`` when ``name`` is absent, is not an
        instance of ``cls`` (if given), or is not resident.

        Raises:
          TypeError: the factory built something that is not an instance of ``cls``.
        """
        obj = self._reusable(name, cls)
        if obj is not None:
            return self, obj
        new = factory()
        if cls is not None and not isinstance(new, cls):
            raise TypeError(
                f"`SessionState.get_or_create({name!r})`: factory built {type(new).__name__}, "
                f"expected {cls.__name__}."
            )
        return self.put(name, new), new

    def _reusable(self, name: str, cls: type | None) -> StateObject | None:
        """The object ``name`` if `get_or_create` may return it as is (present, right type, resident)."""
        obj = self.objects.get(name)
        if obj is not None and (cls is None or isinstance(obj, cls)) and obj.resident:
            return obj
        return None

    def update(self, name: str, fn: Callable[[StateObject], StateObject]) -> "SessionState":
        """Return a state with object ``name`` replaced by ``fn(object)``."""
        return self.put(name, fn(self.get(name)))

    # --- attrs -------------------------------------------------------------------------------------
    def get_attr(self, key: str, default: Any = MISSING) -> Any:
        """The carried value ``key`` (the very object stored); ``default`` if given and absent.

        Raises:
          KeyError: absent and no default given.
        """
        value = self.attrs.get(key, MISSING)
        if value is MISSING:
            if default is not MISSING:
                return default
            raise KeyError(f"session carries no attr {key!r}; it carries {sorted(self.attrs)}.")
        return value

    def set_attr(self, key: str, value: Any) -> "SessionState":
        """Return a state carrying ``value`` under ``key``, by reference (never copied)."""
        _check_name(key, "set_attr")
        attrs = dict(self.attrs)
        attrs[key] = value
        return _session(self.objects, attrs)

    def del_attr(self, key: str) -> "SessionState":
        """Return a state without attr ``key`` (a no-op if absent)."""
        if key not in self.attrs:
            return self
        attrs = dict(self.attrs)
        del attrs[key]
        return _session(self.objects, attrs)

    # --- whole session -----------------------------------------------------------------------------
    def reset(self) -> "SessionState":
        """Return a state whose every object is reset (unallocated) and whose attrs are cleared."""
        return SessionState(objects={n: o.reset() for n, o in self.objects.items()}, attrs={})

    def nbytes_by_device(self) -> dict[str, int]:
        """Every byte the session holds, in objects (committed and staged) and attrs, each allocation once."""
        return accounting.nbytes_by_device(self)

    def _accounting_children(self) -> tuple[Any, ...]:
        return (*self.objects.values(), *self.attrs.values())

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        from treescope import repr_lib

        attributes = {"objects": dict(sorted(self.objects.items())), "attrs": dict(sorted(self.attrs.items()))}
        return repr_lib.render_object_constructor(type(self), attributes, path, subtree_renderer)

    def __repr__(self) -> str:
        objs = ", ".join(f"{n}={self.objects[n]!r}" for n in self.names)
        return f"SessionState(objects={{{objs}}}, attrs={sorted(self.attrs)})"


def _session(objects: dict, attrs: Mapping[str, Any]) -> SessionState:
    """Build a state from a dict this module just made (no defensive copy needed)."""
    new = object.__new__(SessionState)
    object.__setattr__(new, "objects", MappingProxyType(objects))
    object.__setattr__(new, "attrs", attrs if isinstance(attrs, MappingProxyType) else MappingProxyType(attrs))
    return new


def _flatten_with_keys(s: SessionState):
    keys = jax.tree_util.GetAttrKey
    return ((keys("objects"), dict(s.objects)), (keys("attrs"), dict(s.attrs))), None


jax.tree_util.register_pytree_with_keys(
    SessionState,
    _flatten_with_keys,
    lambda _, children: SessionState(*children),
    flatten_func=lambda s: ((dict(s.objects), dict(s.attrs)), None),
)
