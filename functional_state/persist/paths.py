"""Checkpoint paths: a local directory or a URL, through the path layer orbax uses (`etils.epath`)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["child"]


def child(root: Any, name: str) -> Any:
    """``root / name``, of the same kind as ``root`` (a URL string stays a URL)."""
    if isinstance(root, (str, os.PathLike)) and not hasattr(root, "joinpath"):
        return os.path.join(os.fspath(root), name)
    return root / name
