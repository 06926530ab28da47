"""The checkpoint manifest: checksums of leaves (XXH3-128), the manifest's own seal, and its validation."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__
from ..errors import CheckpointError
from .validate import check_fields

FORMAT = "functional-state checkpoint"

LAYOUT = 1  # bumped when the manifest's meaning changes; a reader refuses layouts it does not know


def import_torch() -> Any:
    return sys.modules.get("torch")


# A leaf's checksum guards against corruption and truncation, not tampering: XXH3-128 finds those as surely as
# SHA-256 and runs at 20 GB/s per core here against SHA-256's 2 GB/s, which made checking a 600 MiB load take
# longer than reading it. Checkpoints of earlier versions carry SHA-256 and are checked with it.
CHECKSUM = "xxh3_128"


def checksum(data: Any, algorithm: str = CHECKSUM) -> str:
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    if algorithm == "sha256":
        return hashlib.sha256(raw).hexdigest()
    return _xxhash().xxh3_128(raw).hexdigest()


def _xxhash() -> Any:
    try:
        import xxhash
    except ImportError as e:  # pragma: no cover - the checkpoint extra is missing
        raise ImportError("functional_state checkpoints need xxhash: pip install 'functional-state[checkpoint]'") from e
    return xxhash


_PARALLEL_MIN = 8 << 20  # below this many bytes, threads cost more than they save

_CHUNK = 4 << 20  # copied and then hashed while still in cache


def copy_checksum(src: np.ndarray, out: np.ndarray, algorithm: str = CHECKSUM) -> str:
    """Copy the 1-D uint8 ``src`` into ``out`` and return the checksum of what ``out`` holds, in one pass
    over memory (chunk by chunk: each is hashed from cache right after it is copied)."""
    if algorithm != CHECKSUM:
        np.copyto(out, src)
        return checksum(out, algorithm)
    digest = _xxhash().xxh3_128()
    for start in range(0, src.nbytes, _CHUNK):
        chunk = out[start : start + _CHUNK]
        np.copyto(chunk, src[start : start + _CHUNK])
        digest.update(chunk.data)
    return str(digest.hexdigest())


def in_parallel(fn: Callable[[Any], Any], jobs: list[Any], nbytes: int) -> list[Any]:
    """``[fn(job) for job in jobs]``, on threads when there is enough data to share out: hashing and numpy
    copies release the GIL, so a checkpoint's checksums and copies use every core."""
    workers = min(len(jobs), os.cpu_count() or 1, 8)
    if workers < 2 or nbytes < _PARALLEL_MIN:
        return [fn(job) for job in jobs]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, jobs))


def leaf_nbytes(info: dict[str, Any]) -> int:
    if "nbytes" in info:
        return int(info["nbytes"])
    return math.prod(info["shape"]) * np.dtype(info["dtype"]).itemsize  # (Python ints: a crafted shape cannot wrap)


def in_arrays_item(info: dict[str, Any]) -> bool:
    """Whether the leaf ``info`` describes is written to (and read from) orbax's arrays item.

    orbax refuses to save an array of zero size, and a session may hold one (an empty tensor, a ``(0, 4)``
    array, an empty buffer item). A leaf of no bytes is therefore recorded by the manifest alone (its kind,
    dtype and shape, and the checksum of no bytes) and rebuilt from that on read; the save and the load both
    ask this, so neither hands orbax such a leaf. No earlier checkpoint holds one (orbax refused the save).
    """
    return leaf_nbytes(info) > 0


# The manifest's own checksum, over its canonical JSON without this field. Versions before it wrote manifests
# with exactly the `_UNSEALED_FIELDS`; such a manifest still loads (unverified, as it always did), while one
# with any other field and no checksum (a checksum field with its name damaged, say) is refused.
_SEAL = "manifest_xxh3_128"

_UNSEALED_FIELDS = frozenset({"format", "layout", "library_version", "kind", "sessions", "leaves", "table"})


def _canonical(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != _SEAL}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal(manifest: dict[str, Any]) -> None:
    manifest[_SEAL] = _xxhash().xxh3_128(_canonical(manifest)).hexdigest()


def check_manifest(manifest: Any, root: Path | str) -> None:
    """Refuse a manifest that is not ours, of another layout, fails its checksum, or lacks what a load reads,
    before anything is built from it."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{root} is an orbax checkpoint, but not one functional_state wrote.")
    if type(manifest.get("layout")) is not int or manifest["layout"] != LAYOUT:  # (`True == 1`: no bool)
        raise CheckpointError(
            f"{root} has checkpoint layout {manifest.get('layout')!r} (written by functional-state "
            f"{manifest.get('library_version')}); this version ({__version__}) reads layout {LAYOUT}."
        )
    if _SEAL in manifest:
        if manifest[_SEAL] != _xxhash().xxh3_128(_canonical(manifest)).hexdigest():
            raise CheckpointError(f"{root}: the manifest fails its checksum: the checkpoint is corrupted.")
    elif not set(manifest) <= _UNSEALED_FIELDS:
        extra = sorted(set(manifest) - _UNSEALED_FIELDS)
        raise CheckpointError(
            f"{root}: the manifest has no checksum but has fields {extra} no unchecksummed (earlier) manifest has: "
            f"the checkpoint is corrupted."
        )
    check_fields(manifest, str(root))
