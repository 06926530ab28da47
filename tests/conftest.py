"""The suite without torch: a test module that imports torch (or a package built on it) at its top is skipped,
with the reason, when torch is not installed, so a JAX-only install collects and runs everything else.

Decided from the module's source (its top-level imports), before pytest imports it: one rule here instead of an
`importorskip` line in each of the modules, and a new module that imports torch is covered without a change.
A test that imports torch inside its body says so itself (`pytest.importorskip("torch", reason=...)`).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
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


# pytest-xdist (`make test` runs the suite on two workers with `--dist loadgroup`): every test belongs to one
# group, and a group runs whole on one worker, in collection order. A test module is its own group, so a
# module-scoped fixture (a tiny model, a local Ray) is built once, on one worker, and no module's tests race
# each other. Named groups join what must not run at the same time on the two workers: everything that starts
# a local Ray (test modules and notebooks alike, found from their source, so a new one is covered without a
# change here: two local Rays at once find each other and refuse to start), the notebooks (each starts a
# Jupyter kernel), and the doctests. The groups are decided from each test's id, here, rather than by
# `xdist_group` marks: pytest-xdist 3.8 adds a mark's group to `item._nodeid`, which pytest 9.2 no longer
# reads, so on the pinned pair the marks are ignored and every test is scheduled alone.
RAY_START = re.compile(r"\bray\.init\(")
# The longest groups (minutes each), handed out first (`make test` passes --no-loadscope-reorder, which keeps
# this order), so that neither worker is left running one of them alone at the end.
LONG_GROUPS = ("ray", "notebooks")


@functools.cache
def xdist_group(path: Path, root: Path) -> str:
    """The group of the tests collected from ``path``: ``ray`` (its source calls ``ray.init(``), ``notebooks``,
    ``doctest`` (a module outside tests/, collected by --doctest-modules), or the test module's own path."""
    if RAY_START.search(path.read_text()):
        return "ray"
    if path.suffix == ".ipynb":
        return "notebooks"
    relative = path.relative_to(root)
    return relative.as_posix() if relative.parts[0] == "tests" else "doctest"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # (one process runs the suite in its own order)
        rank = {name: i for i, name in enumerate(LONG_GROUPS)}
        items.sort(key=lambda item: rank.get(xdist_group(item.path, config.rootpath), len(rank)))


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # (optional: a venv without pytest-xdist has no such hook)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` with this module's groups: xdist's scheduler by scope, each group one scope."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(config.rootpath / nodeid.split("::", 1)[0], config.rootpath)

    return GroupScheduling(config, log)
