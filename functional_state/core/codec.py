"""Checkpoint codecs: how each `StateObject` type is written into a checkpoint and read back, one handler per
type, registered where the type is defined (orbax's handler-registry idea).

The persist layer walks sessions and writes buffers; for an object it asks this registry for the type's codec
and never names a type itself, so a new type (the library's or a user's) needs no edit anywhere else. A codec
turns an object into two mappings and back:

- ``static``: the type's configuration (str, int, float, bool, None, numpy dtypes, tuples of those), written
  into the manifest as is;
- ``fields``: its data (arrays, tensors, scalars, str, bytes, None, lists/tuples/dicts of those), whose
  buffers the checkpoint stores and checksums.

`ObjectCodec` (the default) writes a `pytree_dataclass`'s fields as they are: its static fields as
``static``, the others as ``fields`` (``host_copy`` excepted: a parked object is written as the resident
object its host copy stands for, and parked again on load). A type whose fields are not all checkpointable,
or that renames a field between versions, subclasses it.

A load never trusts what it reads (a manifest's seal is a checksum, not a signature): after ``decode`` the
loader calls the codec's ``check(obj, where)``, which raises `CheckpointError` (made with `field_error`, or
with `refused_field` around the type's own validators) unless the object keeps its type's invariants. The
default checks what every `StateObject` has (``status`` one a load produces, ``recompute_source`` and
``recompute_cost`` of their types); a type's codec extends it with what its factory guarantees::

    class AccumulatorCodec(ObjectCodec):
        def check(self, obj, where):
            super().check(obj, where)
            if obj.total is not None and tuple(obj.total.shape) != obj.shape:
                raise field_error(where, "total", obj.total, f"an array of shape {obj.shape} (its `shape`)")

A user's type registers where it is defined, with a codec when the default does not fit (an `enum.Enum`
static field, say, which a manifest cannot hold)::

    class ModeCodec(ObjectCodec):
        def encode(self, obj, where):
            static, fields = self.encode_fields(obj, where)
            return {**static, "mode": static["mode"].value}, fields

        def decode(self, cls, static, fields, context):
            return super().decode(cls, {**static, "mode": Mode(static["mode"])}, fields, context)

    @register_checkpoint_type(codec=ModeCodec())
    @pytree_dataclass(static=("mode", "status", "recompute_source", "recompute_cost"))
    class Accumulator(StateObject): ...

Example:
  >>> import functional_state as fs
  >>> codec_for(fs.LatentBuffer)[0], codec_named("LatentBuffer")[0] is fs.LatentBuffer
  ('LatentBuffer', True)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

from .._repr import short
from ..errors import CheckpointError, InvalidArgumentError, InvalidTypeError, SessionStateError
from .pytree import MISSING
from .state_object import EVICTED, RESIDENT, UNALLOCATED, StateObject, check_source

__all__ = [
    "LOADED_STATUSES",
    "DecodeContext",
    "ObjectCodec",
    "codec_for",
    "codec_named",
    "field_error",
    "refuse",
    "refused_field",
    "register_checkpoint_type",
]

# The statuses a decoded object may have: a parked object is written as the resident object it stands for
# and parked again after the check (its host copy is never in a checkpoint).
LOADED_STATUSES = (RESIDENT, EVICTED, UNALLOCATED)

T = TypeVar("T", bound=type)


@dataclasses.dataclass(frozen=True)
class DecodeContext:
    """What a codec's ``decode`` may need besides the object's own record.

    Attributes:
      name: the object's name in its session.
      where: a phrase naming the object for error messages (``"session 'a': object 'kv'"``).
      template: the caller's ``templates[name]`` passed to the load, or `MISSING`.
    """

    name: str
    where: str
    template: Any = MISSING


class ObjectCodec:
    """The default codec: a `pytree_dataclass`'s static fields and data fields, as they are."""

    def encode_fields(self, obj: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(static, fields)`` of ``obj``, by its dataclass fields (what `encode` returns by default)."""
        meta = set(getattr(type(obj), "_static_fields", ()))
        static, fields = {}, {}
        for f in dataclasses.fields(obj):
            if f.name in meta:
                static[f.name] = getattr(obj, f.name)
            elif f.name != "host_copy":
                fields[f.name] = getattr(obj, f.name)
        return static, fields

    def encode(self, obj: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(static, fields)`` to write for resident ``obj``; raise `CheckpointError` (naming ``where``) to
        refuse it."""
        return self.encode_fields(obj, where)

    def decode(self, cls: type, static: dict[str, Any], fields: dict[str, Any], context: DecodeContext) -> Any:
        """The resident object a record describes (what ``encode`` returned, read back)."""
        return cls(**fields, **static, host_copy=None)

    def check(self, obj: Any, where: str) -> None:
        """Raise `CheckpointError` unless ``obj``, just decoded, keeps its type's invariants (the loader calls it
        on every decoded object before installing it). The default checks the fields every `StateObject` has;
        a type's codec extends it (``super().check(obj, where)`` first) with what its factory guarantees.

        Raises:
          CheckpointError: naming ``where``, the field, what it holds and what was expected.
        """
        status = obj.status
        if not (isinstance(status, str) and status in LOADED_STATUSES):
            raise field_error(
                where, "status", status, f"one of {list(LOADED_STATUSES)} (a parked object is saved resident)"
            )
        with refused_field(where, "recompute_source", obj.recompute_source):
            check_source(obj.recompute_source, f"{type(obj).__name__}.recompute_source")
        with refused_field(where, "recompute_cost", obj.recompute_cost):
            check_source(None, f"{type(obj).__name__}.recompute_cost", obj.recompute_cost)


def field_error(where: str, field: str, found: Any, expected: str) -> CheckpointError:
    """The `CheckpointError` for a decoded object whose ``field`` holds ``found`` where ``expected`` was due.

    Example:
      >>> field_error("session 'a': object 'kv'", "capacity", 2**40, "4, as its storage holds")
      CheckpointError("session 'a': object 'kv': field 'capacity' holds 1099511627776 (int), expected 4, ...")
    """
    return CheckpointError(
        f"{where}: field {field!r} holds {_found(found)}, expected {expected}. The checkpoint was edited or damaged "
        f"after it was saved; load another one, or save this state again."
    )


@contextlib.contextmanager
def refused_field(where: str, field: str, found: Any) -> Iterator[None]:
    """Run a type's own validator (a factory's check) on a decoded field: its refusal (a `SessionStateError`)
    becomes a `CheckpointError` naming ``where``, ``field`` and what it holds, with the validator's message as
    what was expected.

    Example:
      >>> from functional_state.core.state_object import check_source
      >>> with refused_field("session 'a': object 'kv'", "recompute_cost", -1.0):
      ...     check_source(None, "LatentBuffer", -1.0)
      Traceback (most recent call last):
      ...
      functional_state.errors.CheckpointError: session 'a': object 'kv': field 'recompute_cost' holds -1.0 (float), ...
    """
    try:
        yield
    except SessionStateError as e:
        raise field_error(where, field, found, f"what the type's own check allows ({e})") from e


def _found(x: Any) -> str:
    """What a field holds, for a message: an array's dtype and shape, else a bounded repr and the type."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a {type(x).__name__} {short(x)}"
    return f"{short(x)} ({type(x).__name__})"


_BY_TYPE: dict[type, tuple[str, ObjectCodec]] = {}
_BY_NAME: dict[str, tuple[type, ObjectCodec]] = {}


# Overloads so a decorated class keeps its own type for type checkers (a bare `-> Any` made every
# registered StateObject `Any` to pyright and mypy users).
@overload
def register_checkpoint_type(cls: T, *, codec: ObjectCodec | None = None, name: str | None = None) -> T: ...
@overload
def register_checkpoint_type(
    cls: None = None, *, codec: ObjectCodec | None = None, name: str | None = None
) -> Callable[[T], T]: ...
def register_checkpoint_type(cls: T | None = None, *, codec: ObjectCodec | None = None, name: str | None = None) -> Any:
    """Allow checkpoints to hold instances of ``cls``, a `StateObject` subclass (a `pytree_dataclass`), written
    and read by ``codec`` (default `ObjectCodec`: its fields as they are, which must then hold checkpointable
    values). Checkpoints record the type by ``name`` (default: the class name) and never import it: the
    loading process registers it too (importing the module that defines it does). Usable as a decorator,
    with or without arguments: ``@register_checkpoint_type`` or ``@register_checkpoint_type(codec=...)``.

    A codec is any object with the methods of `functional_state.core.codec.ObjectCodec` (``encode(obj,
    where) -> (static, fields)`` and ``decode(cls, static, fields, context) -> obj``); subclass it to change
    one of them.

    A name belongs to one class: registering another class under a taken name (a user class named
    ``DenseValue``, say) is refused, except for the same class defined anew (same module and qualname: a
    reloaded module), which takes the name over.

    Raises:
      InvalidTypeError: ``cls`` is not a StateObject subclass. InvalidArgumentError: ``name`` is not a
        non-empty str, or another class has it (pass ``name=`` to choose another).
    """

    def register(c: T) -> T:
        if not (isinstance(c, type) and issubclass(c, StateObject)):
            raise InvalidTypeError(f"`register_checkpoint_type`: expected a StateObject subclass, got {c!r}.")
        key = c.__name__ if name is None else name
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"`register_checkpoint_type`: name must be a non-empty str, got {key!r}.")
        known = _BY_TYPE.get(c)
        if codec is None and known is not None and name in (None, known[0]):
            return c  # registered already (where it is defined): keep its codec
        handler = ObjectCodec() if codec is None else codec
        previous = _BY_NAME.get(key)
        if previous is not None and previous[0] is not c:
            _refuse_taken(key, previous[0], c)
            _BY_TYPE.pop(previous[0], None)  # the same class, defined anew (a reloaded module): it takes the name
        _BY_TYPE[c] = (key, handler)
        _BY_NAME[key] = (c, handler)
        return c

    return register if cls is None else register(cls)


def _refuse_taken(key: str, taken: type, c: type) -> None:
    """Raise unless ``c`` is the class registered under ``key`` defined anew (same module and qualname)."""
    if (taken.__module__, taken.__qualname__) == (c.__module__, c.__qualname__):
        return
    raise InvalidArgumentError(
        f"`register_checkpoint_type`: the checkpoint type name {key!r} is taken by "
        f"{taken.__module__}.{taken.__qualname__}, so {c.__module__}.{c.__qualname__} cannot have it (checkpoints "
        f"record a type by its name alone). Register it under a name of its own, e.g. "
        f"`register_checkpoint_type({c.__name__}, name={c.__module__ + '.' + c.__qualname__!r})`."
    )


def codec_for(cls: type) -> tuple[str, ObjectCodec] | None:
    """``(name, codec)`` of the registered type ``cls`` (exactly that class), or None."""
    return _BY_TYPE.get(cls)


def codec_named(name: str) -> tuple[type, ObjectCodec] | None:
    """``(class, codec)`` registered under ``name``, or None."""
    return _BY_NAME.get(name)


def refuse(message: Callable[[str], str]) -> ObjectCodec:
    """A codec for a type a checkpoint cannot hold: ``encode`` raises `CheckpointError` with
    ``message(where)``."""
    return _Refused(message)


class _Refused(ObjectCodec):
    def __init__(self, message: Callable[[str], str]):
        self._message = message

    def encode(self, obj: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
        raise CheckpointError(self._message(where))
