"""Engine-owned memory: paged KV pools and the handles that name their blocks."""

# What users see of this layer (re-exported by `functional_state`); the rest are its modules' names.
from .kv_handle import PagedKVHandle, paged_gather
from .paged_kv import PagedKVPool

__all__ = ["PagedKVHandle", "PagedKVPool", "paged_gather"]
