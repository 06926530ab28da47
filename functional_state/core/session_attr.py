"""`SessionAttr`: declare a carried session attribute once, as a typed descriptor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .session import ForkPolicy, check_policy

__all__ = ["SessionAttr"]

T = TypeVar("T")
_ABSENT = object()  # MISSING means "no default" to get_attr, so a private marker is needed here


class SessionAttr(Generic[T]):
    """A class attribute that reads and writes one attr of the owner's session.

    The owner must expose its session handle as ``self._session`` (a `SessionHandle`). Reading returns the
    stored value (``load(value)`` if ``load`` is given), or ``default`` when the session carries none;
    writing stores ``coerce(value)`` (``None`` is stored as is). Without ``load``, reading returns the very
    object stored, so lists a model mutates in place keep their identity.

    Args:
      default: what reading returns while the session carries no value.
      coerce: applied to every non-None value written.
      load: applied to every non-None value read.
      on_fork: what a fork of the session does with the value (see `SessionState.set_attr`): ``"share"``
        (default), ``"copy_container"`` for a list or dict the model assigns into, ``"clone"`` for arrays
        the model writes in place.
      doc: the attribute's docstring.

    Example:
      >>> from functional_state import SessionStateManager
      >>> class Counters:
      ...     steps = SessionAttr(default=0, coerce=int)
      ...     history = SessionAttr(default=None, on_fork="copy_container")
      ...     def __init__(self, handle):
      ...         self._session = handle
      >>> c = Counters(SessionStateManager().get_or_create_session("s"))
      >>> c.steps
      0
      >>> c.steps = "3"
      >>> c.steps
      3
    """

    def __init__(
        self,
        default: T | None = None,
        coerce: Callable[[Any], Any] | None = None,
        load: Callable[[Any], T] | None = None,
        on_fork: ForkPolicy = "share",
        doc: str | None = None,
    ):
        self.default = default
        self.coerce = coerce
        self.load = load
        self.on_fork: ForkPolicy = check_policy(on_fork, "SessionAttr")  # type: ignore[assignment]
        self.name = ""
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj._session.get_attr(self.name, _ABSENT)
        if value is _ABSENT:
            return self.default
        return self.load(value) if self.load is not None and value is not None else value

    def __set__(self, obj: Any, value: Any) -> None:
        if value is not None and self.coerce is not None:
            value = self.coerce(value)
        obj._session.set_attr(self.name, value, on_fork=self.on_fork)

    def __repr__(self) -> str:
        return f"SessionAttr({self.name!r}, default={self.default!r}, on_fork={self.on_fork!r})"
