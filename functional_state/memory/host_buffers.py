"""Host buffers for parking: large CPU buffers recycled once nothing holds them, within a bounded cache.

A park copies each storage into a host buffer and a restore copies it back into a fresh allocation; under a
byte budget the same shapes go back and forth every few steps (DreamZero's 603 MiB feat map, 30 storages of
21 MB each). A fresh large buffer costs its first-touch page faults: the kernel zeroes every page before the
copy writes it, which made a deploy-shape park run at a third of memcpy speed (issue 24). So a buffer of
`MIN_NBYTES` or more is served from buffers of exactly its size that an earlier park or restore used and
nothing holds any more, and comes fresh from numpy (which asks the kernel for huge pages) otherwise.

How a buffer comes back: the tensor handed out wraps a numpy view of the buffer; torch keeps that view alive
as long as any tensor, view, DLPack export or numpy alias of the storage lives, and a `weakref.finalize` on
it returns the buffer to the cache when the last one dies. Nothing that still reads the bytes can be given
them again. (A tensor whose storage is swapped away with ``Tensor.set_`` while a JAX array still aliases
the old one breaks that, as it breaks torch's own allocator: the bridge documents that rule.) The cache
keeps at most `cache_limit` free bytes (1 GiB by default, as torch's own caching host allocator keeps
pinned buffers); `clear_cache` hands them back to the system. Thread-safe.
"""

from __future__ import annotations

import bisect
import itertools
import sys
import threading
import weakref
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .aliases import OWNED
from .extents import Extent

__all__ = [
    "MIN_NBYTES",
    "cache_limit",
    "cached_nbytes",
    "clear_cache",
    "host_buffer",
    "host_bytes",
    "pack_runs",
    "set_cache_limit",
]

MIN_NBYTES = 2 << 20  # from a huge page up: smaller buffers come from torch's allocator, which recycles them

_lock = threading.RLock()  # (a collection inside the lock may free a buffer, whose callback takes it again)
_free: dict[int, list[np.ndarray]] = {}  # nbytes -> free buffers of exactly that size
_state = {"free": 0, "limit": 1 << 30}


def host_buffer(nbytes: int) -> Any:
    """An uninitialised 1-D uint8 CPU tensor of ``nbytes`` (at least `MIN_NBYTES`), spanning its own storage:
    a free cached buffer of that size if there is one, else a fresh 64-byte-aligned one from numpy.

    Example:
      >>> import torch  # (the caller's: this module never imports torch itself)
      >>> a = host_buffer(MIN_NBYTES)
      >>> ptr = a.data_ptr()
      >>> del a  # nothing holds it: it goes back to the cache
      >>> host_buffer(MIN_NBYTES).data_ptr() == ptr
      True
    """
    with _lock:
        stack = _free.get(nbytes)
        base = stack.pop() if stack else None
        if base is not None:
            _state["free"] -= nbytes
    if base is None:
        base = _aligned(nbytes)
    view = base[:]  # the object torch keeps alive for as long as anything holds the storage
    extent = Extent("cpu", view.ctypes.data, view.ctypes.data + nbytes)
    OWNED.add(extent)  # (an allocation of its own until its storage dies: see `aliases.OWNED`)
    done = weakref.finalize(view, _give_back, base, extent)
    done.atexit = False
    return sys.modules["torch"].from_numpy(view)


_ALIGN = 64  # what a JAX import of a CPU tensor needs to alias it (a page measured more first-touch faults)


def _aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh memory starting on a 64-byte boundary. numpy's own large arrays start 16 bytes into
    their mapping (malloc's header), where a JAX import of a restored CPU tensor copies instead of aliasing.
    (Aligned to a page instead, the pressure run took 9,864 minor faults in its copies against 2,702.)"""
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return raw[skip : skip + nbytes]  # (its base keeps the whole allocation alive)


def host_bytes(n: int, pinned: bool) -> Any:
    """An uninitialised uint8 host tensor of ``n`` bytes: pinned for GPU transfers (torch caches those);
    else, when large, a recycled or fresh 64-byte-aligned buffer (`host_buffer`), and when small from torch's
    allocator (64-byte aligned, which DLPack aliasing on the CPU needs)."""
    torch = sys.modules["torch"]
    if pinned:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)
    if n >= MIN_NBYTES:
        return host_buffer(n)
    return torch.empty(n, dtype=torch.uint8)


def _give_back(base: np.ndarray, extent: Extent) -> None:
    OWNED.discard(extent)
    n = base.nbytes
    with _lock:
        if _state["free"] + n <= _state["limit"]:
            _free.setdefault(n, []).append(base)
            _state["free"] += n


def cached_nbytes() -> int:
    """Bytes of free buffers the cache holds (host memory no state holds, kept for the next park)."""
    return _state["free"]


def cache_limit() -> int:
    """The most free bytes the cache keeps."""
    return _state["limit"]


def set_cache_limit(nbytes: int) -> None:
    """Keep at most ``nbytes`` of free buffers (0: none, every buffer is freed when its last holder dies)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgumentError(f"`set_cache_limit`: nbytes must be an int >= 0, got {nbytes!r}.")
    with _lock:
        _state["limit"] = nbytes
    _trim(nbytes)


def clear_cache() -> int:
    """Free every cached buffer; returns the bytes released."""
    return _trim(0)


def _trim(keep: int) -> int:
    released = 0
    with _lock:
        for n in sorted(_free, reverse=True):
            stack = _free[n]
            while stack and _state["free"] > keep:
                stack.pop()
                _state["free"] -= n
                released += n
            if not stack:
                del _free[n]
    return released


def pack_runs(
    members: Any, sizes: list[int], dtypes: list[Any], shapes: list[Any], trail: tuple[int, ...] | None, chunk: int
) -> list[tuple[int, list[Any]]]:
    """How parking packs storages ``members`` (indices into the per-storage ``sizes``, ``dtypes`` and ``shapes``
    of `torch_host.Gathered`; a range or a list) into host buffers: ``(bytes, segments)`` per run of at most
    ``chunk`` bytes, in order (a larger storage is a run of its own). A segment ``(start, end, storages,
    dtype, trail)`` is a stretch of plain storages of one dtype and trailing shape (one ``torch.cat`` of the
    tensors themselves), or of raw storages (``dtype`` None: one ``torch.cat`` of their bytes).
    ``trail``: not None when every storage is plain, of one dtype and this trailing shape (one segment per run).

    Example:
      >>> pack_runs(range(3), [40, 40, 40], [None] * 3, [None] * 3, None, 100)
      [(80, [(0, 80, range(0, 2), None, ())]), (40, [(0, 40, range(2, 3), None, ())])]
    """
    runs: list[tuple[int, list[Any]]] = []
    if trail is not None:  # one segment per run: the same greedy runs, cut by bisecting the running byte count
        every = type(members) is range and len(members) == len(sizes)
        ends = list(itertools.accumulate(sizes if every else (sizes[k] for k in members)))
        j = base = 0
        while j < len(members):
            e = max(bisect.bisect_right(ends, base + chunk, j), j + 1)
            runs.append((ends[e - 1] - base, [(0, ends[e - 1] - base, members[j:e], dtypes[members[j]], trail)]))
            j, base = e, ends[e - 1]
        return runs
    segments: list[Any] = []
    pos = start = lo = 0
    seg_dtype: Any = None
    seg_shape: Any = None
    for j, k in enumerate(members):
        n, dtype, shape = sizes[k], dtypes[k], shapes[k]
        if j and pos + n > chunk:  # a new run (a storage larger than a run is a run of its own)
            segments.append(_segment_of(start, pos, members[lo:j], seg_dtype, seg_shape))
            runs.append((pos, segments))
            segments, pos, start, lo, seg_dtype, seg_shape = [], 0, 0, j, dtype, shape
        elif (
            not j or dtype is not seg_dtype or (dtype is not None and shape != seg_shape and shape[1:] != seg_shape[1:])
        ):
            if j:
                segments.append(_segment_of(start, pos, members[lo:j], seg_dtype, seg_shape))
            start, lo, seg_dtype, seg_shape = pos, j, dtype, shape
        pos += n
    segments.append(_segment_of(start, pos, members[lo:], seg_dtype, seg_shape))
    runs.append((pos, segments))
    return runs


def _segment_of(start: int, end: int, members: list[int], dtype: Any, shape: Any) -> tuple[Any, ...]:
    return (start, end, members, dtype, tuple(shape[1:]) if dtype is not None else ())
