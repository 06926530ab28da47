"""Which build is running: the table's hot modules compiled by mypyc, or all pure Python.

`MODULES` is the one list of compiled modules: setup.py reads it (by path, without importing the package)
and compiles each from its own source; a build with ``FUNCTIONAL_STATE_PURE=1``, or without mypyc or a C
compiler, installs the same modules as Python. This module imports nothing of the package, so that setup.py
runs it where jax is not installed.
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

__all__ = ["COMPILED", "MODULES", "NATIVE_TORCH", "PURE_ENV", "compiled_modules"]

# The table's recency order and the records it reads and builds (compiled together, so that `lru` reads
# their fields natively), and the session map they read and write (`reroot_map`), on the path of every
# get_or_create and commit. Dotted names; setup.py turns them
# into paths. The public verbs (`session_verbs`, `object_verbs`) stay Python: mypyc checks a compiled
# function's annotated argument types on entry, so a wrong session id would raise its bare TypeError before
# the verb's own InvalidTypeError, which says what was expected and how to fix it.
MODULES: tuple[str, ...] = (
    "functional_state.table.checks",
    "functional_state.table.lru",
    "functional_state.table.recency_log",
    "functional_state.table.records",
    "functional_state.table.reroot_map",
    "functional_state.table.verb_core",
)
# Optional C++ helpers over torch tensors (torch's extension API, built from ``<module path>.cpp`` only where
# torch is importable at build time: never in pip's isolated build environment). Each is imported with a
# fallback to the same checks in Python, so it is not part of `COMPILED`.
NATIVE_TORCH: tuple[str, ...] = ("functional_state.memory.tensor_run_checks",)
# Set (to anything but "" or "0") while building: install pure Python even where a compiler is present.
PURE_ENV = "FUNCTIONAL_STATE_PURE"


def compiled_modules() -> dict[str, bool]:
    """Each module of `MODULES` and whether Python imports it compiled: an extension module for this
    interpreter beside its source (the import system prefers it to the ``.py``).

    Returns:
      ``{dotted name: compiled}``, in the order of `MODULES`.

    Example:
      >>> from functional_state._compiled import compiled_modules
      >>> "functional_state.table.lru" in compiled_modules()
      True
    """
    root = Path(__file__).resolve().parent.parent
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    return {name: any((root / (name.replace(".", "/") + s)).is_file() for s in suffixes) for name in MODULES}


COMPILED: bool = all(compiled_modules().values())
"""Whether the table's hot modules run compiled by mypyc (`make`, `pip install` with a C compiler) or as
pure Python (``FUNCTIONAL_STATE_PURE=1`` at build time, or no compiler): the same source and behaviour
either way. `compiled_modules` says it module by module."""
