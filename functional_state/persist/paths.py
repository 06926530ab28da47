"""Checkpoint paths: a local directory, or a URL (a bucket) through the path layer orbax uses, `etils.epath`.

Every entry point of the checkpoint API takes its ``path`` through `local_path` or, for a URL, through
`persist.remote`. A local path may be a ``str``, any ``os.PathLike``, a local ``epath.Path`` or a ``file://``
URL; it is read and written with the issue 35 confinement (regular files inside the directory only, no link
followed). Any other ``scheme://`` (``gs://``, ``s3://``, ...), as a string or an ``epath.Path``, is remote.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

__all__ = ["child", "is_url", "local_path", "remote_path"]

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def _text(path: Any) -> str:
    if isinstance(path, str):
        return path
    if isinstance(path, os.PathLike):
        text = os.fspath(path)
        return text.decode() if isinstance(text, bytes) else text
    raise CheckpointError(
        f"a checkpoint path must be a str, an os.PathLike or an etils.epath.Path, got {type(path).__name__}."
    )


def is_url(path: Any) -> bool:
    """Whether ``path`` names a remote store (``gs://...``; ``file://`` is local).

    Example:
      >>> is_url("gs://bucket/robot"), is_url("file:///tmp/robot"), is_url("/tmp/robot")
      (True, False, False)
    """
    found = _SCHEME.match(_text(path))
    return found is not None and found.group(1).lower() != "file"


def local_path(path: Any) -> Path:
    """``path`` as an absolute local `Path` (a ``file://`` URL or a local ``epath.Path`` too).

    Raises:
      CheckpointError: ``path`` is remote (its callers send those to `persist.remote`), or not a path.
    """
    text = _text(path)
    if is_url(text):
        raise CheckpointError(f"{text} is a remote path; this reads local directories only.")
    if text.lower().startswith("file://"):
        text = text[len("file://") :]
    return Path(text).absolute()


def remote_path(path: Any) -> Any:
    """``path`` (a URL, or a remote ``epath.Path``) as an ``epath.Path``."""
    from etils import epath

    return epath.Path(_text(path))


def child(root: Any, name: str) -> Any:
    """``root / name``, of the kind ``root`` is (a URL string stays a URL string).

    Example:
      >>> child("gs://bucket/sessions", "robot"), child("/tmp/sessions", "robot")
      ('gs://bucket/sessions/robot', '/tmp/sessions/robot')
    """
    if isinstance(root, str):
        return root.rstrip("/") + "/" + name if is_url(root) else os.path.join(root, name)
    return root / name
