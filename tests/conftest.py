"""The suite without torch: a test module that imports torch (or a package built on it) at its top is skipped,
with the reason, when torch is not installed, so a JAX-only install collects and runs everything else.

Decided from the module's source (its top-level imports), before pytest imports it: one rule here instead of an
`importorskip` line in each of the modules, and a new module that imports torch is covered without a change.
A test that imports torch inside its body says so itself (`pytest.importorskip("torch", reason=...)`).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest

# Top-level packages that need torch: torch itself, the bridge and adapters, and diffusers' models.
NEEDS_TORCH = frozenset({"torch", "torch_bridge", "diffusers"})
TORCH = importlib.util.find_spec("torch") is not None
SKIP_REASON = "needs PyTorch, which is not installed (pip install 'functional-state[torch]')"


def top_level_imports(path: Path) -> set[str]:
    """The top-level package names a module imports in its own body (not inside functions)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


class _NeedsTorch(pytest.Module):
    """A test module collected as one skip: importing it would fail on ``import torch``."""

    def collect(self) -> Any:
        pytest.skip(f"{self.path.name} {SKIP_REASON}", allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> Any:
    if TORCH or not top_level_imports(module_path) & NEEDS_TORCH:
        return None
    return _NeedsTorch.from_parent(parent, path=module_path)
