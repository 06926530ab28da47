"""Moved to `torch_bridge.harness.paged_engine` (issue 20); this old import path keeps its public names."""

from ..harness.paged_engine import EngineError as EngineError
from ..harness.paged_engine import ReferenceKVEngine as ReferenceKVEngine

__all__ = ["EngineError", "ReferenceKVEngine"]
