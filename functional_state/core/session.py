"""`SessionState`: one session's named state objects plus the attributes the manager only carries."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, Literal, TypeVar, overload

import immutables

from .._repr import repr_html, short, treescope_repr
from ..errors import AttrNotFoundError, InvalidArgumentError, InvalidTypeError, ObjectNotFoundError
from ..memory import accounting
from .fork_values import clone, copy_container
from .pytree import MISSING
from .state_object import PARKED, RESIDENT, StateObject

__all__ = ["FORK_POLICIES", "ForkPolicy", "SessionState"]

ObjectT = TypeVar("ObjectT", bound=StateObject)
DefaultT = TypeVar("DefaultT")

ForkPolicy = Literal["share", "copy_container", "clone"]
FORK_POLICIES: tuple[str, ...] = ("share", "copy_container", "clone")

_EMPTY: immutables.Map = immutables.Map()

# A session's objects: a dict while it holds at most `SMALL_OBJECTS` (copied on write, never mutated once a
# state holds it), an `immutables.Map` past that. Most sessions hold a handful of objects, where a dict is
# one container for the collector to traverse (the HAMT is two or more) and its copy is no slower than the
# HAMT's write; past the crossover the HAMT's O(log n) write wins (BENCHMARKS.md, "Notes on the hot path").
SMALL_OBJECTS = 32
Objects = dict[str, StateObject] | immutables.Map


def objects_of(items: Iterable[tuple[str, StateObject]] | Mapping[str, StateObject]) -> Objects:
    """A session's objects map holding ``items``, in the representation its size calls for."""
    objects = dict(items)
    return objects if len(objects) <= SMALL_OBJECTS else immutables.Map(objects)


def _set_object(objects: Objects, name: str, obj: StateObject) -> Objects:
    """``objects`` with ``obj`` under ``name`` (a new map: ``objects`` is never changed)."""
    if isinstance(objects, dict):
        if len(objects) < SMALL_OBJECTS or name in objects:
            new = objects.copy()
            new[name] = obj
            return new
        return immutables.Map(objects).set(name, obj)
    return objects.set(name, obj)


def _delete_object(objects: Objects, name: str) -> Objects:
    """``objects`` without ``name`` (present; a new map: ``objects`` is never changed)."""
    if isinstance(objects, dict):
        new = objects.copy()
        del new[name]
        return new
    return objects.delete(name)


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidTypeError(f"`SessionState.{what}`: names must be non-empty str, got {name!r}.")
    return name


def check_policy(policy: Any, what: str) -> str:
    if policy not in FORK_POLICIES:
        raise InvalidArgumentError(f"`{what}`: on_fork must be one of {FORK_POLICIES}, got {policy!r}.")
    return policy


class SessionState:
    """Named `StateObject`s (``objects``) and carried values (``attrs``), immutable.

    Objects are what the manager can act on (stage, commit, evict, reset). Attrs are values the manager
    only carries: counters, conditioning tensors, lists a model mutates in place. Attrs are stored by
    reference: ``get_attr`` returns the very object ``set_attr`` stored. What a fork does with each attr is
    its *fork policy* (``"share"``, ``"copy_container"`` or ``"clone"``, see `forked`).

    A write never changes a map a state holds: objects are a small dict copied on write (a persistent
    map past `SMALL_OBJECTS`, where a write costs O(log n)), attrs a persistent map. Both flatten in sorted
    key order, so equal states have equal tree structures.

    As a pytree (what `jax.jit` over `functional_state.sessions` sees), the children are the objects and the
    attrs that are arrays (or pytrees of arrays); every other attr (an int, a str, a list of ints) is static
    aux data, returned as is, compared by ``==``: changing one retraces, as a changed static argument does.

    Example:
      >>> from functional_state import LatentBuffer
      >>> s = SessionState.empty().put("frames", LatentBuffer.create(maxlen=4)).set_attr("step", 3)
      >>> s2 = s.update("frames", lambda b: b.commit(1.0))
      >>> len(s.get("frames")), len(s2.get("frames")), s2.get_attr("step")
      (0, 1, 3)
    """

    __slots__ = ("_attrs", "_dynamic", "_objects", "_policies", "_tick", "_uid")
    _objects: Objects
    _attrs: immutables.Map
    _policies: immutables.Map
    # Where a `ManagerState` holds this very object: the tick of the session's last use there and its
    # incarnation (the table's bookkeeping, not part of the value: a session a table stores carries them, so
    # that the table keeps one object per session, not a node around it; -1 until a table stores it). A table
    # storing a session that carries other figures stores a copy carrying its own (`_stamped`).
    _tick: int
    _uid: int
    # The attr keys a pytree flatten yields as children, when an unflatten fixed them (its children may be
    # anything, e.g. orbax's SaveArgs); None: decided from the values (arrays are children, the rest aux).
    _dynamic: tuple[str, ...] | None

    def __init__(
        self,
        objects: Mapping[str, StateObject] | None = None,
        attrs: Mapping[str, Any] | None = None,
        attr_policies: Mapping[str, str] | None = None,
    ):
        """Build a session from mappings (always copied: later changes to them are never seen).

        Raises:
          InvalidTypeError: a name is not a non-empty str, or an object is not a `StateObject`.
          InvalidArgumentError: an unknown fork policy, or a recompute source that is unknown or cyclic.
        """
        objs = dict(objects or {})
        for name, obj in objs.items():
            _check_name(name, "__init__")
            _check_object(name, obj, "SessionState")
        attr_map = dict(attrs or {})
        for key in attr_map:
            _check_name(key, "__init__")
        policies = {k: check_policy(p, "SessionState") for k, p in dict(attr_policies or {}).items() if p != "share"}
        object_map = objects_of(objs)
        for name in objs:
            _check_source_graph(object_map, name, "SessionState")
        # Immutable by construction: the public fields are read-only properties over private slots.
        self._objects = object_map
        self._attrs = immutables.Map(attr_map)
        self._policies = immutables.Map(policies)
        self._dynamic = None
        self._tick = self._uid = -1

    @classmethod
    def empty(cls) -> SessionState:
        """A session with no objects and no attrs."""
        return make_session({}, _EMPTY, _EMPTY)

    # --- read-only views ---------------------------------------------------------------------------
    @property
    def objects(self) -> Mapping[str, StateObject]:
        """The objects by name: an immutable mapping."""
        objects = self._objects
        return MappingProxyType(objects) if type(objects) is dict else objects

    @property
    def attrs(self) -> Mapping[str, Any]:
        """The carried attrs by key: an immutable mapping (the values are the very objects stored)."""
        return self._attrs

    @property
    def attr_policies(self) -> Mapping[str, str]:
        """The fork policy of every attr whose policy is not ``"share"``."""
        return self._policies

    def __bool__(self) -> bool:
        return True  # a session is a value; an empty one is still a session

    def _repr_html_(self) -> str | None:
        return repr_html(self)

    # --- objects -----------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        """Object names, sorted."""
        return tuple(sorted(self._objects))

    def __contains__(self, name: object) -> bool:
        return name in self._objects

    # `cls` types the result (`get("latents", cls=LatentBuffer)` is a `LatentBuffer` to mypy and pyright) and
    # is checked at run time, so the type a checker sees is never a guess.
    @overload
    def get(self, name: str, *, cls: type[ObjectT]) -> ObjectT: ...
    @overload
    def get(self, name: str, default: DefaultT, *, cls: type[ObjectT]) -> ObjectT | DefaultT: ...
    @overload
    def get(self, name: str, default: Any = ..., *, cls: None = None) -> Any: ...
    def get(self, name: str, default: Any = MISSING, *, cls: type[StateObject] | None = None) -> Any:
        """The object named ``name``; ``default`` if given and absent.

        Args:
          name: the object's name.
          default: returned when there is no object ``name`` (without it, that raises).
          cls: the type the object must have; the result is typed as it. A present object of another type
            raises, rather than being returned under a type it does not have.

        Raises:
          ObjectNotFoundError: absent and no default given.
          InvalidTypeError: present but not an instance of ``cls``.

        Example:
          >>> from functional_state import ArrayRing, LatentBuffer, SessionState
          >>> s = SessionState.empty().put("latents", LatentBuffer.create())
          >>> type(s.get("latents", cls=LatentBuffer)).__name__
          'LatentBuffer'
          >>> s.get("latents", cls=ArrayRing)
          Traceback (most recent call last):
            ...
          functional_state.errors.InvalidTypeError: `SessionState.get('latents', cls=ArrayRing)`: the object is a LatentBuffer, expected ArrayRing.
        """
        obj = self._objects.get(name, MISSING)
        if obj is MISSING:
            if default is not MISSING:
                return default
            raise ObjectNotFoundError(no_object_message(self, name, "SessionState.get"))
        if cls is not None and not isinstance(obj, cls):
            raise InvalidTypeError(
                f"`SessionState.get({name!r}, cls={cls.__name__})`: the object is a {type(obj).__name__}, "
                f"expected {cls.__name__}."
            )
        return obj

    def put(self, name: str, obj: StateObject) -> SessionState:
        """Return a state with ``obj`` stored under ``name`` (replacing any object there).

        Raises:
          InvalidTypeError: ``name`` is not a non-empty str, or ``obj`` is not a `StateObject`.
          InvalidArgumentError: ``obj.recompute_source`` names no object of this session, or makes a cycle.
        """
        if type(name) is not str or not name:  # (the checks' common case first: an ABC isinstance is ~0.1 us)
            _check_name(name, "put")
        if type(obj) not in _OBJECT_TYPES:
            _check_object(name, obj, "put")
            _OBJECT_TYPES.add(type(obj))
        objects = _set_object(self._objects, name, obj)
        if obj.recompute_source is not None:
            _check_source_graph(objects, name, "put")
        return make_session(objects, self._attrs, self._policies)

    def _with_object(self, name: str, obj: StateObject, tick: int = -1, uid: int = -1) -> SessionState:
        """`put` without checks, for an object derived from the one under ``name`` (same static config);
        ``tick`` and ``uid``: the table's figures the new session carries (see `_tick`), for a table that
        stores it."""
        return make_session(_set_object(self._objects, name, obj), self._attrs, self._policies, tick, uid)

    def _stamped(self, tick: int, uid: int) -> SessionState:
        """This session carrying a table's figures ``tick`` and ``uid`` (see `_tick`): itself if it carries
        them, else a copy (the maps shared, never changed)."""
        if self._tick == tick and self._uid == uid:
            return self
        new = make_session(self._objects, self._attrs, self._policies, tick, uid)
        new._dynamic = self._dynamic
        return new

    def remove(self, name: str) -> SessionState:
        """Return a state without the object ``name`` (a no-op if absent).

        Raises:
          InvalidArgumentError: another object names ``name`` as its recompute source.
        """
        if name not in self._objects:
            return self
        dependents = sorted(n for n, o in self._objects.items() if o.recompute_source == name)
        if dependents:
            raise InvalidArgumentError(
                f"`SessionState.remove({name!r})`: {dependents} name it as their recompute source; remove them "
                f"first, or put a replacement under {name!r}."
            )
        return make_session(_delete_object(self._objects, name), self._attrs, self._policies)

    # With `cls` the object is of that type (reused only if it is one, built and checked otherwise); without
    # it an object already there is returned whatever its type, so it is typed `Any`, not the factory's type.
    @overload
    def get_or_create(
        self, name: str, factory: Callable[[], ObjectT], cls: type[ObjectT]
    ) -> tuple[SessionState, ObjectT]: ...
    @overload
    def get_or_create(
        self, name: str, factory: Callable[[], StateObject], cls: None = None
    ) -> tuple[SessionState, Any]: ...
    def get_or_create(
        self, name: str, factory: Callable[[], StateObject], cls: type[StateObject] | None = None
    ) -> tuple[SessionState, Any]:
        """Return ``(state, obj)``, building ``obj = factory()`` when ``name`` is absent, is not an
        instance of ``cls`` (if given), or is evicted or unallocated.

        Pass ``cls`` to have ``obj`` typed (``cls=LatentBuffer`` makes it a `LatentBuffer` to mypy and pyright):
        without it, an object already under ``name`` is returned whatever its type.

        Raises:
          InvalidTypeError: the factory built something that is not an instance of ``cls``.
          ObjectParkedError: the object is parked: it holds data, so it is never replaced by an empty one;
            restore it first (session handles do that on access).
        """
        obj = self._reusable(name, cls)
        if obj is not None:
            return self, obj
        new = factory()
        if cls is not None and not isinstance(new, cls):
            raise InvalidTypeError(
                f"`SessionState.get_or_create({name!r})`: factory built {type(new).__name__}, expected {cls.__name__}."
            )
        return self.put(name, new), new

    def _reusable(self, name: str, cls: type | None) -> Any:
        """The object ``name`` if `get_or_create` may return it as is (present, right type, resident)."""
        obj = self._objects.get(name)
        if obj is not None and (cls is None or isinstance(obj, cls)):
            if obj.status == RESIDENT:
                return obj
            if obj.status == PARKED:
                obj._require_resident("get_or_create")  # raises ObjectParkedError: never silently rebuilt
        return None

    def update(self, name: str, fn: Callable[[StateObject], StateObject]) -> SessionState:
        """Return a state with object ``name`` replaced by ``fn(object)``."""
        return self.put(name, fn(self.get(name)))

    def evict(self, name: str) -> tuple[SessionState, int]:
        """Release object ``name``'s committed storage.

        Returns:
          ``(state, freed_bytes)``: the bytes that leave this session's accounting. A buffer another object
          or an attr of the session still holds is not freed, and staged bytes never are.

        Raises:
          ObjectNotFoundError: no object named ``name``.
        """
        obj = self._objects.get(name)
        if obj is None:
            raise ObjectNotFoundError(no_object_message(self, name, "evict"))
        new_obj, own = obj.evict()
        if not own:
            return (self if new_obj is obj else self._with_object(name, new_obj)), 0
        new = self._with_object(name, new_obj)
        return new, accounting.total_nbytes(self) - accounting.total_nbytes(new)

    def recomputable(self, name: str) -> bool:
        """True when object ``name`` declares a recompute source and that source is resident now."""
        source = self.get(name).recompute_source
        return source is not None and source in self._objects and self._objects[source].status == RESIDENT

    # --- attrs -------------------------------------------------------------------------------------
    def get_attr(self, key: str, default: Any = MISSING) -> Any:
        """The carried value ``key`` (the very object stored); ``default`` if given and absent.

        Raises:
          AttrNotFoundError: absent and no default given (also a ``KeyError``).
        """
        value = self._attrs.get(key, MISSING)
        if value is MISSING:
            if default is not MISSING:
                return default
            raise AttrNotFoundError(f"session carries no attr {key!r}; it carries {sorted(self._attrs)}.")
        return value

    def set_attr(self, key: str, value: Any, *, on_fork: ForkPolicy | None = None) -> SessionState:
        """Return a state carrying ``value`` under ``key``, by reference (never copied).

        Args:
          key: the attr's name.
          value: anything; stored as is.
          on_fork: what `forked` does with the value: ``"share"`` (the same object in both forks),
            ``"copy_container"`` (a shallow copy of a list/dict/set/deque, so item assignment in one fork
            is never seen by the other) or ``"clone"`` (containers copied and arrays cloned). None keeps the
            policy the key already has (``"share"`` for a new key).
        """
        _check_name(key, "set_attr")
        policies = self._policies
        if on_fork is not None:
            check_policy(on_fork, "SessionState.set_attr")
            if on_fork == "share":
                if key in policies:
                    policies = policies.delete(key)
            elif policies.get(key) != on_fork:
                policies = policies.set(key, on_fork)
        return make_session(self._objects, self._attrs.set(key, value), policies)

    def del_attr(self, key: str) -> SessionState:
        """Return a state without attr ``key`` (a no-op if absent)."""
        if key not in self._attrs:
            return self
        policies = self._policies.delete(key) if key in self._policies else self._policies
        return make_session(self._objects, self._attrs.delete(key), policies)

    # --- whole session -----------------------------------------------------------------------------
    def reset(self) -> SessionState:
        """Return a state whose every object is reset (unallocated) and whose attrs are cleared."""
        objects = objects_of((n, o.reset()) for n, o in self._objects.items())
        return make_session(objects, _EMPTY, _EMPTY)

    def forked(self) -> SessionState:
        """The session as a fork starts it: objects shared (they are immutable), attrs per fork policy.

        ``"share"`` attrs are the same objects; ``"copy_container"`` attrs are shallow copies (lists,
        dicts, sets, deques, namespaces, and registered pytree nodes such as an ``eqx.nn.State``, rebuilt
        over the same leaves; other values are shared); ``"clone"`` attrs are copied recursively, with
        torch tensors, numpy and JAX arrays cloned into new storage (pytree nodes too).
        """
        if not self._policies:
            return self
        attrs = self._attrs.mutate()
        for key, policy in self._policies.items():
            if key in attrs:
                attrs[key] = copy_container(attrs[key]) if policy == "copy_container" else clone(attrs[key])
        return make_session(self._objects, attrs.finish(), self._policies)

    def nbytes_by_device(self) -> dict[str, int]:
        """Every byte the session holds, in objects (committed and staged) and attrs, each allocation once."""
        return accounting.nbytes_by_device(self)

    def _accounting_children(self) -> tuple[Any, ...]:
        return (*self._objects.values(), *self._attrs.values())

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        attributes = {"objects": dict(sorted(self._objects.items())), "attrs": dict(sorted(self._attrs.items()))}
        return treescope_repr(self, path, subtree_renderer, attributes)

    def __repr__(self) -> str:
        objs = ", ".join(f"{n!r}: {self._objects[n]!r}" for n in self.names)
        attrs = ", ".join(f"{k!r}: {short(self._attrs[k])}" for k in sorted(self._attrs))
        return f"SessionState(objects={{{objs}}}, attrs={{{attrs}}})"


def make_session(
    objects: Objects, attrs: immutables.Map, policies: immutables.Map, tick: int = -1, uid: int = -1
) -> SessionState:
    """Build a state from maps this module made (no copy, no validation: the hot path); ``tick``, ``uid``:
    the table's figures it carries (see `SessionState._tick`)."""
    new = _new(SessionState)
    new._objects = objects
    new._attrs = attrs
    new._policies = policies
    new._dynamic = None
    new._tick = tick
    new._uid = uid
    return new


_new = object.__new__


_OBJECT_TYPES: set[type] = set()  # classes whose instances passed `_check_object` (a subclass stays one)


def _check_object(name: str, obj: Any, what: str) -> None:
    if not isinstance(obj, StateObject):
        raise InvalidTypeError(
            f"`{what}({name!r}, ...)`: expected a StateObject (e.g. LatentBuffer, ArrayRing), got "
            f"{type(obj).__name__}. Carried values belong in attrs: use `set_attr`."
        )


def _check_source_graph(objects: Objects, name: str, what: str) -> None:
    """Raise unless following recompute sources from ``name`` ends at an object without one."""
    seen = [name]
    current = objects[name].recompute_source
    while current is not None:
        if current not in objects:
            raise InvalidArgumentError(
                f"`{what}({name!r}, ...)`: recompute source {current!r} (reached via {' -> '.join(seen)}) is not an "
                f"object of this session; it holds {sorted(objects)}. Put the source first."
            )
        if current in seen:
            raise InvalidArgumentError(
                f"`{what}({name!r}, ...)`: recompute sources form a cycle: {' -> '.join([*seen, current])}. An "
                f"object cannot be rebuilt from itself."
            )
        seen.append(current)
        current = objects[current].recompute_source


def no_object_message(session: SessionState, name: str, what: str) -> str:
    return (
        f"`{what}`: the session holds no state object named {name!r}; it holds {list(session.names)}. "
        f"Create it with `put(name, obj)`."
    )
