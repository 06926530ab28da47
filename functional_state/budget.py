"""Moved to `functional_state.memory.budget`; this path stays because code imports it."""

from .memory.budget import ANY_DEVICE, MAX_BYTES, POOL_FORMS, capacity_for, format_bytes, normalize_budget, parse_bytes

__all__ = ["ANY_DEVICE", "MAX_BYTES", "POOL_FORMS", "capacity_for", "format_bytes", "normalize_budget", "parse_bytes"]
