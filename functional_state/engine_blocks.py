"""Moved to `functional_state.table.engine_blocks`; this path stays because code imports it."""

from .table.engine_blocks import free_acquired, free_released, released_blocks

__all__ = ["free_acquired", "free_released", "released_blocks"]
