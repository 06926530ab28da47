"""Reading a checkpoint's files as untrusted input: only regular files inside the checkpoint's own directory,
reached without following a link and opened without blocking; JSON parsed with bounded nesting and no
duplicate keys.

A checkpoint (and a transfer blob) may come from another process or replica, and its manifest's seal is a
checksum anyone can recompute, not a signature; so a load follows no name out of the directory (``..``, an
absolute id, a symlinked file or directory) and opens nothing that could block it (a FIFO, a device).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

MAX_DEPTH = 200  # JSON nesting a manifest may have (`check_depth`): a session's deepest pytree, with room to spare

# What a manifest may hold, bounded so that refusing a crafted one costs little memory: it is read whole, then
# parsed whole before its seal is checked, and parsing builds up to ~120 bytes of Python objects for each JSON
# value (``{}`` is 3 bytes of text; a unique key with its pair ~10). So its values are counted in the raw text
# and bounded before it is parsed: measured, 2**18 values of the costliest kinds grew the peak by 29 MiB, and
# with 8 MiB of text (read, then parsed as strings) a refused manifest stays under 64 MiB. A save writes ~55
# values and ~400 bytes a leaf, so these admit about 4,700 leaves.
MAX_JSON_VALUES = 1 << 18

MAX_JSON_BYTES = 8 << 20  # a manifest larger than this is refused unread

MAX_FILES = 100_000  # entries a step directory may hold (orbax writes a few dozen)

_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)

_FILE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def relative_parts(name: str, where: str) -> list[str]:
    """The components of ``name``, a path relative to a checkpoint directory; `CheckpointError` for an absolute
    path, ``..``, ``.``, an empty component or a NUL, each of which could name something outside it."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or "\0" in name:
        raise CheckpointError(f"{where}: {name!r} is not a path inside the checkpoint directory; it is refused.")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(
            f"{where}: {name!r} leaves the checkpoint directory or is not a plain relative path; it is refused."
        )
    return parts


def open_inside(root: Path, name: str, where: str) -> int:
    """A read-only descriptor of the regular file ``name`` (relative) inside directory ``root``: each component
    opened from the one before without following a link, the file without blocking.

    Raises:
      CheckpointError: ``name`` leaves ``root``, a component is a symlink or not a directory, or the file is
        not a regular file (a FIFO, a device, a directory).
    """
    parts = relative_parts(name, where)
    try:
        fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        raise CheckpointError(f"{where}: {root} cannot be opened ({type(e).__name__}: {e}).") from e
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, _DIRECTORY, dir_fd=fd)
            except OSError as e:
                raise CheckpointError(
                    f"{where}: {root / name} is refused: {part!r} is not a directory inside {root} (a symlink, "
                    f"or missing: {type(e).__name__}: {e})."
                ) from e
            os.close(fd)
            fd = nxt
        try:
            out = os.open(parts[-1], _FILE, dir_fd=fd)
        except OSError as e:
            raise CheckpointError(
                f"{where}: {root / name} cannot be opened as a regular file inside {root} (a symlink, or missing: "
                f"{type(e).__name__}: {e})."
            ) from e
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise CheckpointError(f"{where}: {root / name} is not a regular file (a FIFO, a device or a directory).")
    return out


def read_inside(root: Path, name: str, where: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of regular file ``name`` inside ``root`` (`open_inside`), refused above ``limit`` bytes."""
    fd = open_inside(root, name, where)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{where}: {root / name} holds {size} bytes, more than the {limit} allowed.")
        chunks: list[bytes] = []
        got = 0
        while True:
            chunk = os.read(fd, max(size - got, 0) + 1)
            if not chunk:
                return b"".join(chunks)
            got += len(chunk)
            if got > limit:
                raise CheckpointError(f"{where}: {root / name} grows past the {limit} bytes allowed.")
            chunks.append(chunk)
    finally:
        os.close(fd)


def check_tree(top: Path, where: str) -> None:
    """Refuse a step directory holding anything but plain directories and regular files (a symlink, a FIFO, a
    device), or more than `MAX_FILES` entries, before orbax or tensorstore reads any of it (they follow links)."""
    try:
        if not stat.S_ISDIR(os.lstat(top).st_mode):
            raise CheckpointError(f"{where}: {top} is not a directory (a symlink, or a file); it is refused.")
        pending, seen = [top], 0
        while pending:
            current = pending.pop()
            with os.scandir(current) as entries:
                for entry in entries:
                    seen += 1
                    if seen > MAX_FILES:
                        raise CheckpointError(f"{where}: {top} holds more than {MAX_FILES} entries.")
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(Path(entry.path))
                    elif entry.is_symlink() or not entry.is_file(follow_symlinks=False):
                        what = "a symlink" if entry.is_symlink() else "not a regular file (a FIFO or a device)"
                        raise CheckpointError(
                            f"{where}: {entry.path} is {what}; a checkpoint holds only regular files and "
                            f"directories, so nothing is read from elsewhere."
                        )
    except OSError as e:
        raise CheckpointError(f"{where}: {top} cannot be listed ({type(e).__name__}: {e}).") from e


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the key {key!r} appears twice in one object")
            seen.add(key)
    return out


def check_depth(value: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """Refuse a parsed JSON ``value`` nested deeper than ``limit`` arrays and objects: what is built from it
    recurses (the seal's canonical dump, the decoder), so no RecursionError can come from a crafted depth.

    Raises:
      CheckpointError: naming ``where`` and the depth found.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        x, depth = stack.pop()
        children = x.values() if isinstance(x, dict) else x if isinstance(x, list) else None
        if children is None:
            continue
        if depth > limit:
            raise CheckpointError(f"{where}: the JSON nests more than the {limit} levels allowed.")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def json_values_at_most(data: bytes | str) -> int:
    """An upper bound on the values and keys JSON text ``data`` parses into, counted without parsing it: each
    follows a ``[``, ``{``, ``,`` or ``:`` except the outermost (one in a string counts too, so it only errs high).
    """
    if isinstance(data, str):
        return 1 + sum(data.count(mark) for mark in "[{,:")
    return 1 + sum(data.count(mark) for mark in (b"[", b"{", b",", b":"))


def load_json(data: bytes, where: str, max_values: int = MAX_JSON_VALUES) -> Any:
    """``data`` parsed as JSON; `CheckpointError` for text that is not, that nests past the parser's recursion
    limit, that repeats a key in one object (the seal covers the parsed value, so a repeated key must not
    pick one), or that could hold more than ``max_values`` values (refused before it is parsed, so a crafted
    text of empty containers costs no memory). What a load builds from the value is bounded further by
    `check_depth`."""
    values = json_values_at_most(data)
    if values > max_values:
        raise CheckpointError(
            f"{where}: the JSON may hold {values} values, more than the {max_values} a manifest is allowed "
            f"(a save writes about 55 a leaf); it is refused unparsed as damaged or crafted. A genuine manifest "
            f"this large needs fewer leaves: save the sessions in several checkpoints."
        )
    try:
        return json.loads(data, object_pairs_hook=_refuse_duplicates)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: not valid JSON ({type(e).__name__}: {str(e)[:200]}).") from e
