"""Checkpoints at a URL (a bucket: ``gs://``, ``s3://``, whatever ``etils.epath`` opens), staged through a
local directory.

A save writes the checkpoint into a fresh local directory with the local writer (its checksums, its manifest
checks), then uploads that step's files to ``<url>/<step>/`` and writes ``<url>/<step>/_COMMITTED`` last: a
reader counts a step only once that file is there, since an object store has no atomic rename. Older steps go
after the commit. A load downloads the newest committed step into a fresh local directory and reads it there
with every local check (the manifest, the checksums, the confinement).

What a remote store is trusted for, and how it is confined: an object store holds no links, so there is
nothing to follow; every name downloaded must be a plain name (letters, digits, ``._-``), at most
`confined.MAX_FILES` of them, within `MAX_DOWNLOAD` bytes, and they land only inside the staging directory,
where the local reader then checks them as it checks any checkpoint. A save's fencing check
(`persist.fencing`) reads the newest committed manifest (`newest_manifest`) before the upload; two processes saving one URL at once are ordered by
their claims, as on a shared local directory.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .confined import MAX_FILES, MAX_JSON_BYTES, load_json
from .manifest import FORMAT

__all__ = [
    "COMMITTED",
    "MAX_DOWNLOAD",
    "newest_manifest",
    "remote_manifest",
    "remote_steps",
    "staged_read",
    "upload_step",
]

COMMITTED = "_COMMITTED"  # in <url>/<step>/: written last, so a reader never takes a step half uploaded

MAX_DOWNLOAD = 1 << 40  # bytes a load downloads at most (1 TiB: a bound, not a budget)

_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
_STEP = re.compile(r"0|[1-9][0-9]{0,17}")


def remote_steps(url: Any) -> list[int]:
    """The committed steps at ``url``, oldest first."""
    if not url.is_dir():
        return []
    steps = [int(p.name) for p in url.iterdir() if _STEP.fullmatch(p.name)]
    return sorted(s for s in steps if (url / str(s) / COMMITTED).exists())


def remote_manifest(url: Any, step: int) -> Any:
    """The parsed manifest of committed step ``step`` at ``url`` (bounded, as a local load reads one)."""
    where = f"{url}/{step}: the manifest"
    with (url / str(step) / "manifest" / "metadata").open("rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise CheckpointError(f"{where} is larger than {MAX_JSON_BYTES} bytes; refused unread.")
    return load_json(data, where)


def newest_manifest(url: Any) -> tuple[int | None, Any]:
    """``(step, manifest)`` of the newest committed step at ``url`` (``(None, None)`` when there is none)."""
    steps = remote_steps(url)
    if not steps:
        return None, None
    manifest = remote_manifest(url, steps[-1])
    return steps[-1], manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def upload_step(local_step: Path, url: Any, step: int) -> None:
    """Copy the local step directory ``local_step`` to ``<url>/<step>/``, commit it, then drop older steps."""
    target = url / str(step)
    for path in sorted(p for p in local_step.rglob("*") if p.is_file()):
        dest = target.joinpath(*path.relative_to(local_step).parts)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with path.open("rb") as src, dest.open("wb") as out:
            shutil.copyfileobj(src, out, 16 << 20)
    (target / COMMITTED).write_text(FORMAT)
    for old in remote_steps(url):
        if old < step:
            with contextlib.suppress(OSError):
                (url / str(old) / COMMITTED).unlink()  # (uncommitted first: a reader never sees it half deleted)
                (url / str(old)).rmtree()


@contextlib.contextmanager
def staged_read(url: Any) -> Iterator[Path]:
    """A local checkpoint directory holding a copy of the newest committed step at ``url`` (removed after).

    Raises:
      CheckpointError: no committed step, a name that is not a plain name, too many files or bytes.
    """
    steps = remote_steps(url)
    if not steps:
        raise CheckpointError(f"{url} holds no complete checkpoint (no committed step).")
    step = steps[-1]
    with tempfile.TemporaryDirectory(prefix="functional-state-") as tmp:
        root = Path(tmp) / "checkpoint"
        local = root / str(step)
        local.mkdir(parents=True)
        _download(url / str(step), local, f"{url}/{step}")
        yield root


def _download(source: Any, local: Path, where: str) -> None:
    files = total = 0
    stack = [(source, local)]
    while stack:
        src, dst = stack.pop()
        for entry in src.iterdir():
            name = entry.name
            if not _NAME.fullmatch(name) or name in (".", ".."):
                raise CheckpointError(f"{where}: the entry {name!r} is not a plain name; refused (nothing loaded).")
            files += 1
            if files > MAX_FILES:
                raise CheckpointError(f"{where} holds more than {MAX_FILES} entries; refused (nothing loaded).")
            if entry.is_dir():
                (dst / name).mkdir()
                stack.append((entry, dst / name))
                continue
            with entry.open("rb") as f, (dst / name).open("xb") as out:
                while chunk := f.read(16 << 20):
                    total += len(chunk)
                    if total > MAX_DOWNLOAD:
                        raise CheckpointError(f"{where} holds more than {MAX_DOWNLOAD} bytes; refused.")
                    out.write(chunk)
