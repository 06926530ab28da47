"""Reading a checkpoint's byte leaves ourselves, straight from their data files into the load's buffers
(`plan_direct`, `read_direct`), on threads of each load's own (`DirectReads`); and the errors of a load's
type handlers, recorded there so that every handler's reads settle before orbax closes its event loop."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np

from ..errors import CheckpointError
from .confined import check_depth, load_json, open_inside, relative_parts
from .validate import StoredLeaf

T = TypeVar("T")


# Reading a byte leaf ourselves. tensorstore reads each chunk into a buffer of its own and copies it into the
# load's: a second pass over 607 MiB of fresh memory (page faults and a copy, 150-250 ms on two cores), when the
# chunk is already, byte for byte, what the buffer must hold. An orbax byte leaf is a 1-D zarr v2 uint8 array of
# one uncompressed, unfiltered chunk in an OCDBT database; `tensorstore.ocdbt.dump` (public) says in which data
# file, at which offset and length, its chunk lies, and a leaf that is anything else goes through tensorstore as
# before. What is read is checked against the leaf's checksum afterwards all the same.
_RAW_CHUNK = {"compressor": None, "filters": None, "dtype": "|u1", "order": "C", "zarr_format": 2}


# ``{key: inline bytes or (data file relative to the database's directory, offset, length)}``, None: unreadable
Database = dict[bytes, Any] | None


class DataFile(NamedTuple):
    """A data file of a database: ``name`` (relative, checked by `database`) inside directory ``root``."""

    root: Path
    name: str

    def __str__(self) -> str:
        return str(self.root / self.name)


def plan_direct(
    specs: list[dict[str, Any]], outs: list[Any], databases: dict[str, Database] | None = None
) -> dict[int, tuple[Any, Any, int, int, bytes | None]]:
    """``{index: (out, data file, offset, length, inline bytes)}`` for the leaves this can read straight into
    their ``outs``; the others are left out (tensorstore reads them). ``databases``: the entries of databases
    already listed (`database`), by directory."""
    found: dict[int, tuple[Any, Any, int, int, bytes | None]] = {}
    if not hasattr(os, "preadv"):  # a platform without it (Windows): tensorstore reads every leaf
        return found
    databases = dict(databases or {})
    for i, (spec, out) in enumerate(zip(specs, outs)):
        store = spec.get("kvstore", {})
        base = store.get("base")
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint8
            or out.ndim != 1
            or spec.get("driver") != "zarr"
            or store.get("driver") != "ocdbt"
            or not isinstance(base, (str, dict))
        ):
            continue
        root = _local_directory(base)
        if root is None or _local_directory(store.get("manifest", base)) != root:
            continue
        root = os.path.normpath(root)
        if root not in databases:
            try:
                databases[root] = database(root)
            except CheckpointError:
                databases[root] = None
        entries = databases[root]
        name = str(store.get("path", "")).rstrip("/")
        if entries is None or not name:
            continue
        meta, chunk = entries.get(f"{name}/.zarray".encode()), entries.get(f"{name}/0".encode())
        try:
            zarray = json.loads(meta) if isinstance(meta, bytes) else None
        except ValueError:
            zarray = None
        n = out.size
        if (
            not isinstance(zarray, dict)
            or any(zarray.get(k, "?") != v for k, v in _RAW_CHUNK.items())
            or zarray.get("shape") != [n]
            or zarray.get("chunks") != [n]
        ):
            continue
        if isinstance(chunk, bytes) and len(chunk) == n:
            found[i] = (out, Path(root), 0, n, chunk)
        elif isinstance(chunk, tuple) and chunk[2] == n:
            # (`database` refused an id that leaves the directory; `read_direct` opens it without following links)
            found[i] = (out, DataFile(Path(root), chunk[0]), chunk[1], n, None)
    return found


def _local_directory(base: Any) -> str | None:
    """The local directory of an OCDBT database's base kvstore (``file://...`` or a file driver spec)."""
    if isinstance(base, str):
        return base[len("file://") :] if base.startswith("file://") else None
    if base.get("driver") == "file" and isinstance(base.get("path"), str):
        return str(base["path"])
    return None


def database(root: str) -> dict[bytes, Any]:
    """The entries of the newest version of the OCDBT database at ``root``: ``{key: inline bytes or (data file
    relative to root, offset, length)}``.

    Raises:
      CheckpointError: a tree this does not read (a leaf node at the root is what orbax writes: a node holds up
        to 100 MB of keys), an unreadable database, or a data file id that is absolute or leaves ``root``.
    """
    import tensorstore as ts

    try:
        kv = ts.KvStore.open({"driver": "file", "path": root.rstrip("/") + "/"}).result()
        versions = ts.ocdbt.dump(kv).result().get("versions") or []
        node = None
        if versions and versions[-1].get("root_height") == 0 and "location" in versions[-1].get("root", {}):
            node = ts.ocdbt.dump(kv, versions[-1]["root"]["location"]).result()
    except Exception as e:
        raise CheckpointError(
            f"{root}: the arrays database cannot be read: the checkpoint is damaged ({type(e).__name__}: {e})."
        ) from e
    if node is None:
        raise CheckpointError(f"{root}: the arrays database is not one this version reads (no single root node).")
    entries: dict[bytes, Any] = {}
    sizes: dict[str, int] = {}  # data file -> its bytes: an entry's claim is held to what the file holds
    for entry in node["entries"]:
        key = entry["key"]
        if key in entries:
            raise CheckpointError(f"{root}: the arrays database holds the key {key!r} twice.")
        if "inline_value" in entry:
            entries[key] = bytes(entry["inline_value"])
            continue
        # "value:<base prefix>:<file>:<offset>:<length>"
        try:
            prefix, offset, length = entry["indirect_value"].rsplit(":", 2)
            kind, base_path, relative = prefix.split(":", 2)
            location = (os.path.join(base_path, relative), int(offset), int(length))
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"{root}: the arrays database entry {key!r} is not one this reads ({e}).") from e
        if kind != "value" or location[1] < 0 or location[2] < 0:
            raise CheckpointError(f"{root}: the arrays database entry {key!r} is not a value this reads.")
        relative_parts(location[0], f"{root}: the data file of {key!r}")  # inside root, or refused
        if location[0] not in sizes:
            fd = open_inside(Path(root), location[0], f"{root}: the data file of {key!r}")
            try:
                sizes[location[0]] = os.fstat(fd).st_size
            finally:
                os.close(fd)
        if location[1] + location[2] > sizes[location[0]]:
            raise CheckpointError(
                f"{root}: the arrays database entry {key!r} claims bytes {location[1]}..{location[1] + location[2]} "
                f"of {location[0]}, which holds {sizes[location[0]]}: the file is truncated or the entry crafted."
            )
        entries[key] = location
    return entries


def stored_leaves(entries: dict[bytes, Any], where: str) -> dict[str, StoredLeaf]:
    """What the database ``entries`` hold for each array (by name): its zarr shape and dtype, and the bytes its
    chunks take (as `StoredLeaf.nbytes` where stored uncompressed, else as its ``compressed_nbytes``)."""
    chunk_bytes: dict[str, int] = {}
    for key, value in entries.items():
        name, _, last = key.decode(errors="replace").rpartition("/")
        if last != ".zarray":
            chunk_bytes[name] = chunk_bytes.get(name, 0) + (len(value) if isinstance(value, bytes) else value[2])
    out: dict[str, StoredLeaf] = {}
    for key, value in entries.items():
        name, _, last = key.decode(errors="replace").rpartition("/")
        if last != ".zarray":
            continue
        meta = load_json(value, f"{where}: {name}/.zarray") if isinstance(value, bytes) else None
        check_depth(meta, f"{where}: {name}/.zarray", 8)
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if not (
            isinstance(meta, dict) and isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
        ):
            raise CheckpointError(f"{where}: the array {name!r} has no zarr shape this reads.")
        raw = meta.get("compressor") is None and not meta.get("filters")
        held = chunk_bytes.get(name, 0)
        out[name] = StoredLeaf(tuple(shape), str(meta.get("dtype")), held if raw else None, 0 if raw else held)
    return out


# Files read at once (orbax writes the arrays into a few data files). One stream per file, each one ``preadv``
# per run of chunks that lie end to end, reads closest to a plain sequential read on this disk; tensorstore's
# ~10 concurrent chunk reads and more streams over 32 MiB pieces measured slower (interleaved cold rounds of
# 607 MiB over a raw read: tensorstore 1.57x; pieces on 1, 2, 4 threads 1.22x, 1.54x, 1.60x; runs on 1 thread
# 1.16x, one thread per file 0.88x, both 1.2x fastest over fastest). A save is one OCDBT commit, so its bulk is
# one data file: that file is read as two streams over its two halves (a 607 MiB load right after its save,
# medians of 5 on this disk: one stream 1.2-1.46 s, two halves 0.72-0.82 s; six files before: 0.87-1.32 s).
READ_THREADS = 2


def read_direct(reads: list[tuple[Any, Any, int, int, bytes | None]]) -> None:
    """Fill each ``out`` from its data file: a stream per file (a lone file, a stream per half), in offset order,
    each run of chunks that lie end to end one ``preadv`` into their buffers (the kernel's readahead then
    streams the file as it does a plain sequential read)."""
    by_file: dict[DataFile, list[tuple[int, memoryview]]] = {}
    for out, path, offset, length, inline in reads:
        if inline is not None:
            out[:] = np.frombuffer(inline, np.uint8)
        else:
            by_file.setdefault(path, []).append((offset, memoryview(out).cast("B")[:length]))

    streams: dict[Any, list[tuple[int, memoryview]]] = {}
    for path, chunks in by_file.items():
        chunks = sorted(chunks, key=lambda chunk: chunk[0])
        if len(by_file) == 1 and READ_THREADS > 1 and len(chunks) > 1:  # one file: a stream per half
            total, acc, cut = sum(len(c[1]) for c in chunks), 0, 0
            while cut < len(chunks) - 1 and acc + len(chunks[cut][1]) <= total // 2:
                acc += len(chunks[cut][1])
                cut += 1
            cut = max(cut, 1)
            streams[(path, 0)], streams[(path, 1)] = chunks[:cut], chunks[cut:]
        else:
            streams[(path, 0)] = chunks

    def one_stream(key: Any) -> None:
        path, chunks = key[0], streams[key]
        fd = open_inside(path.root, path.name, f"{path.root}: a direct read")
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            i = 0
            while i < len(chunks):
                start, run, end = chunks[i][0], [chunks[i][1]], chunks[i][0] + len(chunks[i][1])
                i += 1
                while i < len(chunks) and chunks[i][0] == end and len(run) < 512:
                    run.append(chunks[i][1])
                    end += len(chunks[i][1])
                    i += 1
                _read_run(fd, path, start, run)
        finally:
            os.close(fd)

    if len(streams) <= 1 or READ_THREADS <= 1:
        for key in sorted(streams):
            one_stream(key)
        return
    with ThreadPoolExecutor(min(len(streams), READ_THREADS)) as pool:
        list(pool.map(one_stream, sorted(streams)))


# Direct reads (and their planning) run on threads of their own, not `asyncio.to_thread`'s: when another leaf's
# read fails, orbax drops the restore's other reads unfinished and closes its event loop, and a thread of the
# loop's executor then called back into the closed loop ("Event loop is closed", an unraisable exception) while
# it still wrote into the load's buffers. Such a thread settles its future only while the loop runs, and a
# restore that failed waits out its own (`DirectReads.wait`) before it raises: one load's, never every load's
# in the process (a failed load waited for a concurrent load's reads, and it for the failed one's).
class DirectReads:
    """The direct-read threads of one load: started with `run`, waited for with `wait`; and the read errors of
    its handlers while it is `active`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[threading.Thread] = set()
        self.errors: list[BaseException] = []
        self.databases: dict[str, Database] = {}  # the databases this load listed already, by directory

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within: the handlers of a restore run on this thread record their errors here instead of raising."""
        token = _LOAD.set(self)
        try:
            yield
        finally:
            _LOAD.reset(token)

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` on a thread of its own, as a future of the running loop."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if not done.done():
                done.set_result(result) if error is None else done.set_exception(error)

        def body() -> None:
            result, error = None, None
            try:
                result = fn(*args)
            except BaseException as e:
                error = e
            finally:
                with self._lock:
                    self._running.discard(thread)
                with contextlib.suppress(RuntimeError):  # the loop is closed: the restore was abandoned
                    loop.call_soon_threadsafe(settle, result, error)

        thread = threading.Thread(target=body, name="functional_state direct read", daemon=True)
        with self._lock:
            self._running.add(thread)
        thread.start()
        return done

    def wait(self) -> None:
        """Wait until this load's direct reads now running are finished (those of a restore that failed)."""
        with self._lock:
            running = list(self._running)
        for thread in running:
            thread.join()


def _read_run(fd: int, path: Any, offset: int, views: list[memoryview]) -> None:
    """Read the bytes at ``offset`` into ``views``, end to end, however short the reads the kernel returns."""
    while views:
        got = os.preadv(fd, views, offset)
        if got <= 0:
            raise OSError(f"{path} ends before the {sum(map(len, views))} bytes at {offset} (truncated)")
        offset += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views = views[1:]
        if views and got:
            views[0] = views[0][got:]


# orbax restores each handler's leaves together (`asyncio.gather` over the handlers) and closes its event loop
# as soon as one handler raises: the other handlers' tensorstore reads were left running, and called back into
# the closed loop when they completed ("Event loop is closed", an unraisable exception, in the test log after a
# damaged checkpoint's load). So during a load (`DirectReads.active`) no handler raises: each records its error
# in the load's `DirectReads` and returns no leaves, orbax's gather ends once every handler has settled, and
# the load raises the first error recorded. A handler's own reads leak the same way: orbax's JAX array handler
# gathers its leaves' reads and raises at the first failure, its other reads still in flight as tasks of the
# loop (a flipped byte in the OCDBT tree node fails every leaf's open, one after another), so a handler that
# fails waits for every task started while it ran (`_settle_spawned`) before it returns.
_LOAD: contextvars.ContextVar[DirectReads | None] = contextvars.ContextVar("functional_state_load", default=None)


async def errors_deferred(deserialize: Callable[..., Any], infos: Any, args: Any) -> list[Any]:
    """``await deserialize(infos, args)``; during a load (`DirectReads.active`) an error is recorded in the load
    instead of raised, once every read the handler started has settled, and no leaves come back."""
    load = _LOAD.get()
    if load is None:
        return list(await deserialize(infos, args))
    before = asyncio.all_tasks()
    try:
        return list(await deserialize(infos, args))
    except Exception as e:
        load.errors.append(e)
        await _settle_spawned(before)
        return [None] * len(infos)


async def _settle_spawned(before: set[asyncio.Task[Any]]) -> None:
    """Wait until every task of the running loop not in ``before`` (other than this one) is done, and take their
    errors (the failed load reports its first; the rest would be logged as "never retrieved").

    The tasks started since are reads of the restore's handlers (orbax started every handler's task before any
    ran, so they are all in ``before``); none of them waits for this one, so this cannot wait for itself."""
    me = asyncio.current_task()
    seen: set[asyncio.Task[Any]] = set()
    while True:
        spawned = asyncio.all_tasks() - before - {me}  # (all_tasks holds only the tasks not done)
        seen |= spawned
        if not spawned:
            break
        await asyncio.wait(spawned)
    for task in seen:
        if not task.cancelled():
            task.exception()
