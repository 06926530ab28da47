"""Moved to `functional_state.memory.parking`; this path stays because code imports it."""

from .memory.parking import HOST_KINDS, ParkedStorage, park_values, restore_values

__all__ = ["HOST_KINDS", "ParkedStorage", "park_values", "restore_values"]
