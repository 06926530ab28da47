"""Moved to `functional_state.memory.accounting`; this path stays because code imports it."""

from .memory.accounting import WalkReport, alias_owner, nbytes_by_device, register_alias, total_nbytes, walk

__all__ = ["WalkReport", "alias_owner", "nbytes_by_device", "register_alias", "total_nbytes", "walk"]
