"""Memory: extents of one array, the alias registry, the accounting walk, parking to host and back, buffer
holders, byte budgets and pool keys. Imports nothing of the package but `errors` (the bottom layer)."""

# What users see of this layer (re-exported by `functional_state`); the rest are its modules' names.
from .accounting import nbytes_by_device, register_alias, total_nbytes
from .budget import capacity_for, format_bytes, parse_bytes
from .pools import Pool
from .usage import Usage

__all__ = [
    "Pool",
    "Usage",
    "capacity_for",
    "format_bytes",
    "nbytes_by_device",
    "parse_bytes",
    "register_alias",
    "total_nbytes",
]
