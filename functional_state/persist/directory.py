"""Checkpoint directories: which are ours (the marker), their orbax steps, and dropping old steps once a new one is
complete."""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import os
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .confined import load_json, read_inside
from .handlers import registry as type_handlers
from .manifest import (
    FORMAT,
)
from .paths import is_url, local_path, remote_path
from .remote import newest_manifest

_log = logging.getLogger("functional_state")


_MARKER = "_FUNCTIONAL_STATE"  # in a checkpoint directory: written by functional_state, before its first step

_STEP_NAME = re.compile(r"(0|[1-9][0-9]*)")  # the step directories orbax finds

_DROPPED = ".functional-state-dropped"  # an old step renamed out of the way, about to be deleted


def make_durable(root: Path, step: int) -> None:
    """Flush step ``step`` of ``root`` to the disk: every file in it, its directories, and ``root`` (which the
    step was renamed into). tensorstore syncs the array data it writes, but orbax writes the manifest, its
    own metadata files and the final rename without a sync (strace of a save: none of those fsynced), so
    after a power loss a step reported saved could lack its manifest, and the previous one is deleted right
    after. A file or directory already flushed costs little to sync again.

    The syncs are issued together, on threads (the files', then the directories'): the filesystem's journal
    commits concurrent syncs as one (ext4 here: a 12-file step took 66 ms synced one after another, 18 ms
    together, medians of 6 interleaved), and what is durable once this returns is the same either way."""
    top = root / str(step)
    files: list[Path] = []
    dirs = [top]
    for current, names, found in os.walk(top):
        dirs += [Path(current) / n for n in names]
        files += [Path(current) / name for name in found]
    dirs.append(root)
    directory = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    with ThreadPoolExecutor(max(1, min(_SYNC_THREADS, len(files))), thread_name_prefix="functional_state sync") as pool:
        list(pool.map(lambda f: _sync(f, os.O_RDONLY), files))  # (raises the first error, once all are done)
        list(pool.map(lambda d: _sync(d, directory), dirs))


_SYNC_THREADS = 8


def _sync(path: Path, flags: int) -> None:
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:  # (Windows cannot open a directory: nothing more to do there)
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno in (errno.EIO, errno.ENOSPC, errno.EDQUOT):  # the data did not reach the disk
            raise
        # (a filesystem or platform that cannot sync this, a directory say: nothing more to do there)
    finally:
        os.close(fd)


def drop_steps_before(root: Path, step: int) -> None:
    """Delete the steps of ours older than ``step`` (complete now). Each is first renamed out of the step
    namespace, in one atomic step, so a process killed part-way leaves a whole step or a renamed remnant that
    the next save clears; never a step with half its files."""
    for old in sorted(s for s, manifest in list_steps(root).items() if s < step and manifest is not None):
        dropped = root / f"{old}{_DROPPED}"
        try:
            os.replace(root / str(old), dropped)
            shutil.rmtree(dropped)
        except OSError as e:  # the new checkpoint is complete and found first; the old one only takes space
            _log.warning("checkpoint %s: removing old step %d failed: %r", root, old, e)


def discard_step(root: Path, step: int) -> None:
    """Take step ``step`` of ``root``, from a save that failed, out of the step namespace (renamed, then deleted),
    so that the previous step is the one a load finds: orbax renames a step into place before the save has made
    it durable (`make_durable`), and a save that fails after that left it in front of the previous one. Best
    effort (the save has failed already): whatever is left is renamed away or cleared by the next save."""
    current, dropped = root / str(step), root / f"{step}{_DROPPED}"
    try:
        if not current.exists():
            return
        os.replace(current, dropped)
        _sync(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))  # the rename, before anything else is believed
    except OSError as e:
        _log.warning("checkpoint %s: taking away step %d of a failed save failed: %r", root, step, e)
        return
    shutil.rmtree(dropped, ignore_errors=True)


def prepare_directory(root: Path) -> int:
    """The step a save writes into ``root``, made ready for it; refuses a directory it might damage.

    A save writes only into a directory that does not exist, is empty, or is a checkpoint directory: marked
    as ours, or holding a step with our manifest (as earlier versions left them). Every step directory in it
    must hold our manifest, since orbax deletes the old steps once the new one is complete.
    """
    try:
        if os.path.lexists(root) and not root.is_dir():
            what = "a symlink that leads to no directory" if root.is_symlink() else "not a directory"
            raise CheckpointError(f"{root} exists and is {what}; a checkpoint is a directory.")
        steps = list_steps(root)
        if root.is_dir():
            foreign = sorted(step for step, manifest in steps.items() if manifest is None)
            if foreign:
                raise CheckpointError(
                    f"{root / str(foreign[0])} looks like a checkpoint step but holds no functional_state "
                    f"manifest; a save there would delete it, so nothing was written. Save elsewhere, or remove it."
                )
            marked = _is_marked(root)
            # Our own marker, or another controller's marker being written, is no foreign content.
            if not marked and not steps and any(not p.name.startswith(_MARKER) for p in root.iterdir()):
                raise CheckpointError(
                    f"{root} is a non-empty directory that holds no checkpoint; refusing to write into it."
                )
        else:
            root.mkdir(parents=True, exist_ok=True)  # another controller of this save may have made it just now
            marked = False
        if marked:  # what an earlier save here renamed away and did not finish deleting
            for p in root.glob(f"*{_DROPPED}"):
                shutil.rmtree(p, ignore_errors=True)
        else:
            tmp = root / f"{_MARKER}.{os.getpid()}.{threading.get_ident()}.tmp"  # controllers write it concurrently
            tmp.write_text(json.dumps({"format": FORMAT}))
            os.replace(tmp, root / _MARKER)
    except OSError as e:
        raise CheckpointError(f"{root} cannot be used as a checkpoint directory ({type(e).__name__}: {e}).") from e
    return max(steps, default=-1) + 1


def _is_marked(root: Path) -> bool:
    try:
        return json.loads((root / _MARKER).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def list_steps(root: Path) -> dict[int, dict[str, Any] | None]:
    """Each complete step directory in ``root`` (what orbax counts as one), with its manifest when that is a
    functional_state manifest (else None: damaged, crafted, a symlink, or another tool's directory)."""
    if not root.is_dir():
        return {}
    out: dict[int, dict[str, Any] | None] = {}
    with os.scandir(root) as entries:
        for entry in entries:
            if _STEP_NAME.fullmatch(entry.name) and (entry.is_symlink() or entry.is_dir(follow_symlinks=False)):
                out[int(entry.name)] = None if entry.is_symlink() else _step_manifest(Path(entry.path))
    return out


def read_manifest(step_dir: Path) -> Any:
    """The parsed manifest of ``step_dir``, read as untrusted input (`confined.read_inside`, `confined.load_json`).

    Raises:
      CheckpointError: the manifest is missing, not a regular file inside the step, or not bounded JSON.
    """
    where = f"{step_dir}: the manifest"
    return load_json(read_inside(step_dir, "manifest/metadata", where), where)


def _step_manifest(step_dir: Path) -> dict[str, Any] | None:
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError:
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def orbax_manager(ocp: Any, root: Path, options: Any, manifest: Future[dict[str, Any]] | None = None) -> Any:
    """An orbax manager for our two items, with the arrays written uncompressed.

    Orbax compresses arrays with zstd by default. Latents, feature maps and KV are near-random bytes that do
    not shrink, and on 600 MiB the compression took 3.1 s of CPU where the uncompressed write took 0.3 s.
    During an asynchronous save that CPU is taken from the model step. Checkpoints written compressed by an
    earlier version still read, because tensorstore takes the codec from each array's metadata. Byte leaves go
    through `handlers.registry` (no copy of orbax's own on save, read into the load's buffers). ``manifest``,
    where given, is the manifest the save writes once it is complete (its checksums are computed while the
    arrays are written: `store.write`).
    """
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    arrays = ocp.handlers.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=type_handlers())
    registry.add("arrays", ocp.args.PyTreeSave, arrays)
    registry.add("arrays", ocp.args.PyTreeRestore, arrays)
    handler = _manifest_handler(ocp)(manifest)
    registry.add("manifest", ocp.args.JsonSave, handler)
    registry.add("manifest", ocp.args.JsonRestore, handler)
    return ocp.CheckpointManager(root, options=options, handler_registry=registry)


@functools.cache
def _manifest_handler(ocp: Any) -> type:
    """orbax's JSON handler, writing the manifest a future delivers (once the checksums are done) in place of
    the one it was handed."""

    class ManifestHandler(ocp.handlers.JsonCheckpointHandler):
        def __init__(self, manifest: Future[dict[str, Any]] | None) -> None:
            super().__init__()
            self._manifest = manifest

        async def _save_fn(self, x: Any, directory: Any) -> None:
            if self._manifest is not None:
                x = await asyncio.wrap_future(self._manifest)
            await super()._save_fn(x, directory)

    return ManifestHandler


def _latest_step(root: Path) -> int | None:
    """The newest step in ``root``, if its manifest is ours.

    Kept instead of orbax's step helpers (issue 23, measured in benchmarks/bench_checkpoint.py): a poll of
    `has_checkpoint` costs ~50 µs here against ~1.2 ms for ``ocp.utils.checkpoint_steps`` and ~1.5 ms for
    ``ocp.path.step.latest_step_metadata`` (each starts a thread pool per call) and ~3 ms for
    ``CheckpointManager(...).latest_step()``; and none of them checks that a step holds our manifest, while
    ``checkpoint_steps`` also counts names the manager never writes (``0007``), which `prepare_directory`
    must refuse as foreign rather than overwrite."""
    try:
        steps = list_steps(root)
    except (OSError, CheckpointError):
        return None
    return max(steps) if steps and steps[max(steps)] is not None else None


def has_checkpoint(path: Any) -> bool:
    """Whether ``path`` holds a complete checkpoint (a save still being written does not count).

    A loader in another process can poll this to wait for a migrating session: orbax writes each step into a
    temporary directory and renames it into place only once every array and the manifest are on disk. Another
    tool's directory that merely looks like a step (no functional_state manifest in it) does not count.

    Example:
        >>> import tempfile
        >>> has_checkpoint(tempfile.mkdtemp())
        False
    """
    if is_url(path):
        try:
            return newest_manifest(remote_path(path))[1] is not None
        except (OSError, CheckpointError):
            return False
    return _latest_step(local_path(path)) is not None
