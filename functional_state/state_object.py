"""The `StateObject` contract: one typed unit of session state with a uniform, pure lifecycle.

Lifecycle (every call returns a new object; the receiver is never changed)::

    unallocated --allocate()--> resident --evict()--> evicted --allocate()--> resident
         ^                          |
         +---------reset()----------+          (reset() works from any status)

The status is static pytree metadata: it changes the structure (an evicted object holds no storage), so
a jitted function over an object traces once per status, never once per step.

``stage(payload)`` holds a payload for an in-progress window without making it part of the persistent
context; ``commit(payload)`` promotes a payload (``commit()`` with no payload promotes the staged one);
``discard()`` drops what is staged. Staged bytes are reported apart from committed bytes, and ``evict()``
neither counts nor frees them.

An object may name a *recompute source*: another object of the same session it can be rebuilt from. The
name is checked when the object is put into a session (`SessionState.put`): unknown names and cycles
raise. `SessionState.recomputable` says whether the source is resident right now.
"""

from __future__ import annotations

import abc
from typing import Any, Literal, TypeVar

from . import accounting
from ._pytree import MISSING, replace
from .errors import InvalidArgumentError, NotAllocatedError, NothingStagedError, NotResidentError

__all__ = ["EVICTED", "RESIDENT", "STATUSES", "StateObject", "Status", "UNALLOCATED"]

S = TypeVar("S", bound="StateObject")

Status = Literal["resident", "evicted", "unallocated"]
RESIDENT: Status = "resident"
EVICTED: Status = "evicted"
UNALLOCATED: Status = "unallocated"
STATUSES: tuple[Status, ...] = (RESIDENT, EVICTED, UNALLOCATED)


class StateObject(abc.ABC):
    """Base class of state objects. Subclasses are `pytree_dataclass`es.

    Every subclass has these fields: ``staged`` (a child: the staged payload or ``None``), and the static
    ``status`` (one of `STATUSES`) and ``recompute_source`` (the name of another object of the session, or
    ``None``). Subclasses implement the storage hooks ``_commit_payload``, ``_committed_view``,
    ``_view_with``, ``_allocated_storage``, ``_released_storage`` and ``_committed_roots``.
    """

    __slots__ = ()

    # Provided by subclasses as dataclass fields.
    staged: Any
    status: Status
    recompute_source: str | None

    # --- storage hooks -----------------------------------------------------------------------------
    @abc.abstractmethod
    def _commit_payload(self: S, payload: Any) -> S:
        """Return a copy with ``payload`` promoted into committed storage (payload already validated)."""

    @abc.abstractmethod
    def _committed_view(self) -> Any:
        """The committed context, oldest first."""

    @abc.abstractmethod
    def _view_with(self, payload: Any) -> Any:
        """The committed context as it would read with ``payload`` committed."""

    @abc.abstractmethod
    def _allocated_storage(self) -> dict[str, Any]:
        """Field values for freshly allocated, empty storage."""

    @abc.abstractmethod
    def _released_storage(self) -> dict[str, Any]:
        """Field values once committed storage is released."""

    @abc.abstractmethod
    def _committed_roots(self) -> Any:
        """The values that hold committed bytes."""

    def _check_payload(self, payload: Any) -> None:  # noqa: B027 - an optional hook, empty by default
        """Raise if ``payload`` does not fit this object. Default: accept anything."""

    # Whether a subclass overrides `_check_payload` (set by __init_subclass__): commit skips the call otherwise.
    _checks_payload = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._checks_payload = cls._check_payload is not StateObject._check_payload

    # --- status ------------------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        """False only while unallocated (new with ``allocate=False``, or after ``reset()``)."""
        return self.status != UNALLOCATED

    @property
    def resident(self) -> bool:
        """True while committed storage is held and readable."""
        return self.status == RESIDENT

    @property
    def evicted(self) -> bool:
        """True after ``evict()`` released committed storage, until ``allocate()``."""
        return self.status == EVICTED

    def __bool__(self) -> bool:
        # An object is a value, never "empty": `if obj:` must not depend on __len__ (which needs residency).
        return True

    def _require_resident(self, what: str) -> None:
        if self.status == RESIDENT:
            return
        name = type(self).__name__
        if self.status == UNALLOCATED:
            raise NotAllocatedError(
                f"`{name}.{what}` called on an unallocated object (built with allocate=False, or reset). "
                f"Call `.allocate()` first."
            )
        hint = (
            f" or rebuild it from its recompute source {self.recompute_source!r}." if self.recompute_source else "."
        )
        raise NotResidentError(
            f"`{name}.{what}` called after `evict()` released its storage. Call `.allocate()` to start again "
            f"from empty{hint}"
        )

    # --- lifecycle ---------------------------------------------------------------------------------
    def allocate(self: S) -> S:
        """Return a resident object. Empty storage is built when unallocated or evicted; the staged payload is
        kept. On a resident object this is a no-op that returns ``self`` (it never empties committed
        context: use ``reset().allocate()`` for that)."""
        if self.status == RESIDENT:
            return self
        return replace(self, status=RESIDENT, **self._allocated_storage())

    def stage(self: S, payload: Any) -> S:
        """Return a copy holding ``payload`` as the staged (uncommitted) payload, replacing any earlier one."""
        self._require_resident("stage")
        self._check_payload(payload)
        return replace(self, staged=payload)

    def commit(self: S, payload: Any = MISSING) -> S:
        """Return a copy with ``payload`` promoted to the committed context.

        With no payload, promotes the staged payload and clears it; raises `NothingStagedError` if
        nothing is staged. An explicit payload leaves the staged one in place.
        """
        if self.status != RESIDENT:
            self._require_resident("commit")
        if payload is MISSING:
            if self.staged is None:
                raise NothingStagedError(
                    f"`{type(self).__name__}.commit()` with no payload needs a staged payload, but nothing is "
                    f"staged. Call `.stage(x)` first, or pass the payload: `.commit(x)`."
                )
            return replace(self._commit_payload(self.staged), staged=None)
        if self._checks_payload:
            self._check_payload(payload)
        return self._commit_payload(payload)

    def append(self: S, payload: Any) -> S:
        """Commit one payload; the same as ``commit(payload)``."""
        return self.commit(payload)

    def discard(self: S) -> S:
        """Return a copy with the staged payload dropped."""
        self._require_resident("discard")
        return replace(self, staged=None)

    def view(self, include_staged: bool = True) -> Any:
        """The committed context, oldest first, and the staged payload after it when ``include_staged``."""
        self._require_resident("view")
        if include_staged and self.staged is not None:
            return self._view_with(self.staged)
        return self._committed_view()

    def reset(self: S) -> S:
        """Return the object unallocated: no storage, nothing staged."""
        return replace(self, status=UNALLOCATED, staged=None, **self._released_storage())

    def evict(self: S) -> tuple[S, int]:
        """Release committed storage. Returns ``(new_object, freed_bytes)``; staged bytes are neither freed
        nor counted. Evicting an object that holds no committed storage frees nothing and returns it as is.

        ``freed_bytes`` are this object's own committed bytes; `functional_state.evict` reports what leaves
        the session, which is less when another object or an attr shares the storage.
        """
        if self.status != RESIDENT:
            return self, 0
        freed = accounting.total_nbytes(self._committed_roots())
        return replace(self, status=EVICTED, **self._released_storage()), freed

    # --- accounting --------------------------------------------------------------------------------
    def nbytes_by_device(self) -> dict[str, int]:
        """Committed bytes per device (see `functional_state.nbytes_by_device`)."""
        return accounting.nbytes_by_device(self._committed_roots())

    def staged_nbytes_by_device(self) -> dict[str, int]:
        """Staged bytes per device."""
        return accounting.nbytes_by_device(self.staged)

    def _accounting_children(self) -> tuple[Any, ...]:
        return (self._committed_roots(), self.staged)


def _check_source(source: Any, what: str) -> None:
    """Validate a ``recompute_source`` argument (the name check against the session happens on put)."""
    if source is not None and (not isinstance(source, str) or not source):
        raise InvalidArgumentError(
            f"`{what}`: recompute_source must be the name (a non-empty str) of another object of the same "
            f"session, or None; got {source!r}."
        )
