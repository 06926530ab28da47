"""`SlotMap`: which session occupies which slot of a batch, as an immutable host record.

A batch's slot map changes on every join, leave, park, restore and fork, never on a step. It is carried as
an attr of the batch's own session in the table, so it travels with the table value (an older table keeps
its own map) and holds no array: it is registered as bufferless, so the ledger keeps no holder entry for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from ..errors import InvalidArgumentError, SessionAdmissionError, SessionExistsError
from ..memory.values import register_bufferless

__all__ = ["SlotMap"]


@register_bufferless
class SlotMap(NamedTuple):
    """The sessions in a batch's slots. Build with `SlotMap.empty`; every change returns a new map."""

    ids: tuple[str | None, ...]  # per slot, the session in it or None; len == capacity
    slots: Mapping[str, int]  # session id -> slot, in the order the sessions came in (read-only)

    @classmethod
    def empty(cls, capacity: int) -> SlotMap:
        """A map of ``capacity`` free slots.

        Example:
          >>> SlotMap.empty(4).free
          4
        """
        return cls((None,) * capacity, MappingProxyType({}))

    @property
    def capacity(self) -> int:
        """The number of slots, free or taken."""
        return len(self.ids)

    @property
    def free(self) -> int:
        """The number of free slots."""
        return len(self.ids) - len(self.slots)

    def taken(self, session_id: str, what: str, batch: str) -> SlotMap:
        """The map with ``session_id`` in the lowest free slot.

        Raises:
          SessionExistsError: the session is in the batch already.
          SessionAdmissionError: no slot is free.
        """
        if session_id in self.slots:
            raise SessionExistsError(
                f"`{what}({session_id!r})`: the session is in batch {batch!r} already (slot "
                f"{self.slots[session_id]}); step it, or `leave` it first to start over."
            )
        if not self.free:
            raise SessionAdmissionError(
                f"`{what}({session_id!r})`: batch {batch!r} is full ({self.capacity} of {self.capacity} slots taken). "
                f"`park` or `leave` a session first, or build the batch with a larger capacity."
            )
        slot = self.ids.index(None)
        slots = dict(self.slots)
        slots[session_id] = slot
        return SlotMap(self.ids[:slot] + (session_id,) + self.ids[slot + 1 :], MappingProxyType(slots))

    def without(self, session_id: str) -> SlotMap:
        """The map with ``session_id``'s slot free (the session must be in it)."""
        slot = self.slots[session_id]
        slots = dict(self.slots)
        del slots[session_id]
        return SlotMap(self.ids[:slot] + (None,) + self.ids[slot + 1 :], MappingProxyType(slots))

    def slot_of(self, session_id: str, what: str) -> int:
        """The slot of ``session_id``.

        Raises:
          InvalidArgumentError: ``session_id`` is not a str.
          KeyError: the session is not in the batch (callers turn it into the error that fits).
        """
        if not isinstance(session_id, str):
            raise InvalidArgumentError(f"`{what}`: session ids are str, got {type(session_id).__name__}.")
        return self.slots[session_id]
