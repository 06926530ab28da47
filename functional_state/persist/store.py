"""Writing a checkpoint with orbax: one save per directory at a time, and asynchronous saves with their handles
(waited for at exit); their writes run at a lower CPU priority (`priority`)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .confined import MAX_JSON_BYTES, MAX_JSON_VALUES, json_values_at_most
from .directory import (
    discard_step,
    drop_steps_before,
    list_steps,
    make_durable,
    orbax_manager,
    prepare_directory,
)
from .encode import Writer
from .fencing import check_newest_not_behind, check_not_behind
from .handlers import import_orbax
from .manifest import in_arrays_item, seal
from .paths import is_url, local_path, remote_path
from .priority import background_begin, background_end, lower_this_thread
from .remote import newest_manifest, upload_step

_log = logging.getLogger("functional_state")


class SaveHandle:
    """A save in progress (``asynchronous=True``) or done. ``wait()`` blocks until the checkpoint is complete
    on disk (and raises what the save raised, as often as it is called; ``wait_until_finished()`` is the same,
    under orbax's name); ``done()`` says whether the save has finished, either way.

    An asynchronous save finishes on a thread of its own, so it completes (and frees the host copies it
    holds) whether or not anyone waits; one still running when the interpreter exits is waited for then.
    """

    def __init__(
        self,
        start: Callable[[], tuple[Any, bool]],
        keep: list[Any],
        path: Path,
        step: int,
        asynchronous: bool,
    ):
        self.manager: Any = None  # orbax's manager, once ``start`` has made it and handed it the save
        self._lowered = False  # whether this save holds tensorstore's workers at `BACKGROUND_NICE`
        self._keep = keep  # buffers the write reads from stay alive until it is complete
        self._step = step
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._heard = False  # whether a caller was told of the error (else it is reported at exit)
        self.path = path
        if asynchronous:
            with _REGISTRY_LOCK:
                _PENDING.add(self)
            thread = threading.Thread(
                target=self._finish, args=(start,), name=f"functional_state save {path.name}", daemon=True
            )
            _THREADS.add(thread)
            thread.start()
        else:
            self._finish(start)

    def _finish(self, start: Callable[[], tuple[Any, bool]]) -> None:
        try:
            # An asynchronous save's caller has returned by now: orbax's manager is made and handed the save
            # here, on the save's own thread (`_start` cleans up after itself and raises a `CheckpointError`).
            self.manager, self._lowered = start()
        except BaseException as e:
            self._error = e.__cause__ if isinstance(e, CheckpointError) and e.__cause__ is not None else e
            self._keep = []
            self._settled()
            return
        try:
            self.manager.wait_until_finished()
            make_durable(self.path, self._step)  # before the previous step is deleted
            drop_steps_before(self.path, self._step)
        except BaseException as e:
            self._error = e
            _log.debug("saving %s failed: %r", self.path, e)
            discard_step(self.path, self._step)  # the previous step is the one a load finds, as the error says
        finally:
            try:
                self.manager.close()
            except Exception as e:
                self._error = self._error or e
            self._keep = []
            if self._lowered:
                self._lowered = False
                background_end()
            self._settled()

    def _settled(self) -> None:
        """Mark the save finished; a failed one stays pending until a caller hears of it (`wait`), else it is
        reported at exit however long before exit it failed."""
        with _REGISTRY_LOCK:
            if self._error is None:
                _PENDING.discard(self)
        self._finished.set()

    def wait(self) -> Path:
        self._finished.wait()
        if self._error is not None:
            self._heard = True
            with _REGISTRY_LOCK:
                _PENDING.discard(self)
            raise CheckpointError(
                f"saving {self.path} failed ({type(self._error).__name__}: {self._error}); the checkpoint that was "
                f"there before, if any, is still the one there."
            ) from self._error
        return self.path

    def wait_until_finished(self) -> Path:
        """`wait` under the name orbax's checkpointers use, for code written against them."""
        return self.wait()

    def done(self) -> bool:
        return self._finished.is_set()

    def __repr__(self) -> str:
        return f"SaveHandle({str(self.path)!r}, {'done' if self.done() else 'pending'})"


# One writer per checkpoint directory: orbax numbers a new step after the ones it finds and deletes the older
# ones once it is complete, so two saves into one directory at once would both write one step, or one would
# delete the other's. `write` holds the directory's lock while it writes (and, for an asynchronous save, the
# next save to the directory first waits for it). Within one process; one process writes a directory at a time.
_REGISTRY_LOCK = threading.Lock()

_PATH_LOCKS: dict[str, threading.Lock] = {}

_IN_FLIGHT: dict[str, SaveHandle] = {}  # resolved directory -> its asynchronous save, until the next save there

# Asynchronous saves not finished yet, waited for at exit, and failed ones nobody has waited for yet, reported then
_PENDING: set[SaveHandle] = set()

# The threads of asynchronous saves, joined at exit too (one that has just set its handle finished included):
# orbax ran on them, and the native threads it started there must end before the interpreter does (a save
# still running at exit aborted the process in C++ when its thread was left behind).
_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()

_AT_EXIT: list[bool] = []  # whether `_finish_pending_saves` is registered


def _path_lock(key: str) -> threading.Lock:
    with _REGISTRY_LOCK:
        return _PATH_LOCKS.setdefault(key, threading.Lock())


def _finish_pending_saves() -> None:
    """At exit, let every asynchronous save finish, and say on stderr which failed unheard.

    Registered with ``threading._register_atexit``: Python runs those before it shuts down the thread pools
    that orbax's background commit submits to (`concurrent.futures` registers its shutdown the same way, at
    import, and they run last in first out), and before it joins threads. A plain ``atexit`` hook runs after
    both, when the commit has already failed with "cannot schedule new futures after shutdown".
    """
    with _REGISTRY_LOCK:
        pending = list(_PENDING)
    for handle in pending:
        handle._finished.wait()
        if handle._error is not None and not handle._heard:
            handle._heard = True
            with _REGISTRY_LOCK:
                _PENDING.discard(handle)
            print(
                f"functional_state: the asynchronous save to {handle.path} failed before exit "
                f"({type(handle._error).__name__}: {handle._error}); the checkpoint there is the previous one.",
                file=sys.stderr,
            )
    for thread in list(_THREADS):
        thread.join()


def _wait_at_exit() -> bool:
    """Make sure pending saves are waited for at exit; False when the interpreter is already exiting."""
    with _REGISTRY_LOCK:
        if _AT_EXIT:
            return True
        try:
            threading._register_atexit(_finish_pending_saves)  # type: ignore[attr-defined]
        except RuntimeError:  # shutting down already: too late for a background write
            return False
        _AT_EXIT.append(True)
        return True


def _sealed_in_background(manifest: dict[str, Any], writer: Writer, lowered: bool) -> Future[dict[str, Any]]:
    """``manifest`` with every leaf's checksum and its seal, computed on a thread of its own (at
    `BACKGROUND_NICE` where ``lowered``, with the threads it starts)."""

    def run() -> dict[str, Any]:
        if lowered:
            lower_this_thread()
        writer.checksums()
        seal(manifest)
        return manifest

    pool = ThreadPoolExecutor(1, thread_name_prefix="functional_state checksums")
    try:
        return pool.submit(run)
    finally:
        pool.shutdown(wait=False)


def _check_loadable(manifest: dict[str, Any], root: Path) -> None:
    """Refuse, before anything is written, a manifest larger than a load accepts (`confined.load_json`'s
    bounds): a checkpoint that saves but cannot be loaded back would lose the sessions it was taken for."""
    text = json.dumps(manifest, separators=(",", ":"))
    later = len(manifest["leaves"])  # each leaf gains its checksum after this, and the manifest its seal
    values, nbytes = json_values_at_most(text) + 2 * later + 4, len(text) + 64 * later + 256
    if values > MAX_JSON_VALUES or nbytes > MAX_JSON_BYTES:
        raise CheckpointError(
            f"{root}: this checkpoint's manifest would hold {values} values in {nbytes} bytes, more than a load "
            f"accepts ({MAX_JSON_VALUES} values, {MAX_JSON_BYTES} bytes: a load refuses larger ones unparsed, "
            f"as crafted); nothing was written. Save fewer leaves per checkpoint: `save_session` each session, "
            f"or group a session's many small arrays into fewer larger ones."
        )


def write(path: Any, manifest: dict[str, Any], writer: Writer, asynchronous: bool) -> SaveHandle:
    if is_url(path):
        return _write_remote(remote_path(path), manifest, writer)
    import_orbax()  # (here: the first save imports orbax, which a thread must not do while the interpreter exits)
    root = local_path(path)
    if asynchronous and not _wait_at_exit():
        asynchronous = False  # a save asked for while the interpreter exits finishes before it returns
    manifest["leaves"] = writer.leaves
    _check_loadable(manifest, root)
    if asynchronous:
        # What the caller waits for: one copy of the buffers the model may change in place (none of a JAX
        # array), and the refusals below that write nothing (a foreign directory, a stale epoch). orbax's
        # manager, its save call, the checksums and the manifest's seal run on the save's own thread.
        writer.own_copies()
    key = os.path.realpath(root)
    with _path_lock(key):
        earlier = _IN_FLIGHT.pop(key, None)
        if earlier is not None:
            earlier._finished.wait()  # its outcome is for its own caller's wait()
        step = prepare_directory(root)
        check_not_behind(root, manifest)  # (under the lock: no save of this process can slip between)
        start = functools.partial(_start, root, step, manifest, writer, asynchronous)
        handle = SaveHandle(start, writer.keep, root, step, asynchronous)
        if asynchronous:
            _IN_FLIGHT[key] = handle  # (before the lock is let go: the next save here waits for this one)
        else:
            handle.wait()
    return handle


def _start(root: Path, step: int, manifest: dict[str, Any], writer: Writer, asynchronous: bool) -> tuple[Any, bool]:
    """Hand orbax the save of ``step`` (an asynchronous one's on its own thread): its manager made, the
    checksums and the manifest's seal started beside the writes. Returns the manager and whether tensorstore's
    workers were lowered for it.

    Raises:
      CheckpointError: orbax failed or declined; nothing of this save is left in ``root``.
    """
    ocp = import_orbax()
    manager = None
    declined = lowered = False
    # The checksums run while orbax writes the arrays, and the manifest is written once they are done
    # (`directory.orbax_manager`); an asynchronous save's at the writes' lowered priority.
    sealed = _sealed_in_background(manifest, writer, asynchronous)
    try:
        # Orbax keeps every step: `drop_steps_before` removes the old ones itself, in a way a kill cannot
        # leave half done.
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=asynchronous, create=True)
        manager = orbax_manager(ocp, root, options, sealed)
        lowered = asynchronous and background_begin()
        if lowered:
            lower_this_thread()  # (after `background_begin`, which reads this thread's priority as the normal one)
        items = {"manifest": ocp.args.JsonSave(manifest)}
        # Leaves of no bytes are the manifest's alone (`in_arrays_item`), and a session holding no other
        # array (none at all, or only empty ones) has no arrays item: orbax refuses an empty one.
        arrays = {k: v for k, v in writer.arrays.items() if in_arrays_item(writer.leaves[k])}
        if arrays:
            items["arrays"] = ocp.args.PyTreeSave(arrays)
        args = ocp.args.Composite(**items)
        if not manager.save(step, args=args):
            declined = True  # nothing of this save's in that step: it is left alone
            raise RuntimeError(f"orbax declined to write step {step}")
    except Exception as e:
        with contextlib.suppress(Exception):  # no thread of this save still reads the caller's buffers
            sealed.result()
        if lowered:
            background_end()
        if manager is not None:
            try:
                manager.close()
            except Exception as close_error:
                e.add_note(f"closing the orbax manager also failed: {close_error!r}")
        if not declined:
            discard_step(root, step)  # (orbax may have renamed it into place before it failed)
        raise CheckpointError(
            f"saving {root} failed ({type(e).__name__}: {str(e)[:300]}); the checkpoint that was there before, "
            f"if any, is still the one there."
        ) from e
    return manager, lowered


def _write_remote(url: Any, manifest: dict[str, Any], writer: Writer) -> SaveHandle:
    """A save to a URL (`persist.remote`): fenced against the newest committed step there, written locally
    (synchronously: the upload reads the finished files), uploaded, committed."""
    newest_step, newest = newest_manifest(url)
    check_newest_not_behind(newest, manifest, str(url))
    step = 0 if newest_step is None else newest_step + 1
    with tempfile.TemporaryDirectory(prefix="functional-state-") as tmp:
        staged = Path(tmp) / "checkpoint"
        handle = write(staged, manifest, writer, asynchronous=False)
        try:
            upload_step(staged / str(max(list_steps(staged))), url, step)
        except OSError as e:
            raise CheckpointError(
                f"uploading the checkpoint to {url} failed ({type(e).__name__}: {e}); the checkpoint that was "
                f"there before, if any, is still the one there."
            ) from e
    handle.path = url
    return handle
