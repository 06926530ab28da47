"""Batched sessions: one model's sessions in the slots of stacked arrays, stepped in one jitted, donated call."""

from .sessions import BatchedSessions, BatchUsage
from .slot_map import SlotMap

__all__ = ["BatchUsage", "BatchedSessions", "SlotMap"]
