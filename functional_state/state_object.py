"""The `StateObject` contract: one typed unit of session state with a uniform, pure lifecycle.

Lifecycle (every call returns a new object; the receiver is never changed)::

    unallocated --allocate()--> resident --evict()--> allocated, not resident --allocate()--> resident
         ^                          |
         +--------reset()-----------+

``stage(payload)`` holds a payload for an in-progress window without making it part of the persistent
context; ``commit(payload)`` promotes a payload (``commit()`` with no payload promotes the staged one);
``discard()`` drops what is staged. Staged bytes are reported apart from committed bytes, and ``evict()``
neither counts nor frees them.
"""

from __future__ import annotations

import abc
from typing import Any, Protocol, TypeVar, runtime_checkable

from . import accounting
from ._pytree import MISSING, replace
from .errors import NotAllocatedError, NothingStagedError, NotResidentError

__all__ = ["StateObject", "SupportsResidency"]

S = TypeVar("S", bound="StateObject")


@runtime_checkable
class SupportsResidency(Protocol):
    """Anything that can say whether it still holds its data (a recompute source)."""

    @property
    def resident(self) -> bool: ...


class StateObject(abc.ABC):
    """Base class of state objects. Subclasses are frozen pytree dataclasses.

    Every subclass has these fields: ``staged`` (a child: the staged payload or ``None``) and the static
    ``allocated``, ``resident`` and ``recompute_source``. Subclasses implement the storage-specific
    ``_commit_payload``, ``_committed_view``, ``_allocated_storage``, ``_released_storage`` and
    ``_committed_roots``.
    """

    # Provided by subclasses as dataclass fields.
    staged: Any
    allocated: bool
    resident: bool
    recompute_source: Any

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

    def _check_payload(self, payload: Any) -> None:
        """Raise if ``payload`` does not fit this object. Default: accept anything."""

    # --- lifecycle ---------------------------------------------------------------------------------
    def _require_resident(self, what: str) -> None:
        if not self.allocated:
            raise NotAllocatedError(
                f"`{type(self).__name__}.{what}` called before `allocate()`: this object is unallocated "
                f"(new with allocate=False, or reset). Call `.allocate()` first."
            )
        if not self.resident:
            raise NotResidentError(
                f"`{type(self).__name__}.{what}` called after `evict()` released its storage. "
                f"Call `.allocate()` to start again from empty"
                + (" or rebuild it from its recompute_source." if self.recompute_source is not None else ".")
            )

    def allocate(self: S) -> S:
        """Return a resident object with empty committed storage (staged payload is kept)."""
        return replace(self, allocated=True, resident=True, **self._allocated_storage())

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
        self._require_resident("commit")
        if payload is MISSING:
            if self.staged is None:
                raise NothingStagedError(
                    f"`{type(self).__name__}.commit()` with no payload needs a staged payload, but nothing is "
                    f"staged. Call `.stage(x)` first, or pass the payload: `.commit(x)`."
                )
            return replace(self._commit_payload(self.staged), staged=None)
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
        return replace(
            self, allocated=False, resident=False, staged=None, **self._released_storage()
        )

    def evict(self: S) -> tuple[S, int]:
        """Release committed storage. Returns ``(new_object, freed_bytes)``; staged bytes are neither freed
        nor counted. Evicting a non-resident object frees nothing."""
        if not (self.allocated and self.resident):
            return self, 0
        freed = accounting.total_nbytes(self._committed_roots())
        return replace(self, resident=False, **self._released_storage()), freed

    # --- accounting --------------------------------------------------------------------------------
    def nbytes_by_device(self) -> dict[str, int]:
        """Committed bytes per device (see `functional_state.nbytes_by_device`)."""
        return accounting.nbytes_by_device(self._committed_roots())

    def staged_nbytes_by_device(self) -> dict[str, int]:
        """Staged bytes per device."""
        return accounting.nbytes_by_device(self.staged)

    @property
    def recomputable(self) -> bool:
        """True only while this object's ``recompute_source`` exists and is resident."""
        source = self.recompute_source
        return source is not None and bool(getattr(source, "resident", False))

    def _accounting_children(self) -> tuple[Any, ...]:
        return (self._committed_roots(), self.staged)
