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

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, overload

from ..errors import CheckpointError, InvalidArgumentError, InvalidTypeError
from .pytree import MISSING
from .state_object import StateObject

__all__ = ["DecodeContext", "ObjectCodec", "codec_for", "codec_named", "refuse", "register_checkpoint_type"]

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
