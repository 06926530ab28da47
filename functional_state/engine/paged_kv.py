"""Engine-owned paged KV in the session accounting: `PagedKVPool` and the `PagedKVHandle` state object.

A serving engine owns its KV memory: a pool of fixed-size blocks per layer (``[num_blocks, block_size, ...]``
tensors or arrays) and an allocator that hands block ids to requests. A session keeps a `PagedKVHandle`:
the pool it draws from and the ids of its blocks, oldest first. The handle never allocates or frees pool
memory; it delegates:

- **Accounting by block.** Each block a handle references counts as one extent of its pool's storage per
  layer, so a session reports the bytes of its blocks (not the whole pool), blocks shared by several
  sessions (prefix sharing, forks) count once across the table, and a tensor view into the pool held
  elsewhere (an attr, a buffer) counts the blocks it spans, deduplicated with the handle's. Extents live in
  a stable address space per pool (``PagedKVPool.extent_base``): a JAX pool is replaced by a new array at
  every engine write, and its blocks must keep their identity across versions.
- **Freeing.** A block goes back to the engine (``free(block_ids)``) when the last handle in a manager
  that references it lets go: the handle is evicted or reset, or its session is dropped or evicted. Pure
  functions stay pure: they return the new state, and `released_blocks(before, after)` says which blocks
  the change released; the `SessionStateManager` calls the engine for every write it makes (exactly once
  per block), and a failing callback leaves its state unchanged.
- **Parking** goes through the engine's ``offload(block_ids) -> token`` and ``reload(token) -> block_ids``
  when it offers them.

Example:
  >>> import numpy as np
  >>> from functional_state import PagedKVHandle
  >>> freed = []
  >>> layer = np.zeros((8, 4, 2), np.float32)  # the engine's pool: it owns it (the pool holds it weakly)
  >>> pool = PagedKVPool(layer, free=freed.extend, name="kv")
  >>> h = PagedKVHandle.create(pool).commit([3, 5])
  >>> h.view().shape, h.nbytes_by_device()
  ((8, 2), {'cpu': 64})
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from ..errors import (
    InvalidArgumentError,
    InvalidTypeError,
    PoolChangedError,
)
from ..memory import accounting
from ..memory.extents import Extent

__all__ = ["PagedKVPool"]

# Extents of engine pools live above every real address (user space ends below 2**57 on every platform we
# run on), one window of 2**48 bytes per pool: a block keeps its extent while a JAX pool is replaced.
_EXTENT_SPACE = 1 << 60
_EXTENT_WINDOW = 1 << 48
_UIDS = itertools.count(1)

_STORAGES = accounting.POOL_STORAGES  # (pool key, storage start) -> (storage end, extent base, block bytes)
_STORAGES_LOCK = threading.Lock()
POOLS: weakref.WeakValueDictionary[int, PagedKVPool] = weakref.WeakValueDictionary()


def is_torch(x: Any) -> bool:
    torch = accounting.torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def _storage_of(layer: Any) -> tuple[str, int, int, int]:
    """``(pool key, storage start, first byte, end byte)``: where a contiguous ``layer`` lies in its allocation
    (offsets from the allocation's start: several layers may share one flat allocation)."""
    out: accounting.Extents = []
    if is_torch(layer):
        accounting.torch_extents(layer, out, raw=True)
        lo = layer.storage_offset() * layer.element_size()
        size = layer.numel() * layer.element_size()
    elif isinstance(layer, jax.Array):
        accounting.jax_extents(layer, out, accounting.WalkReport(), {}, raw=True)
        lo, size = 0, (out[0][2] - out[0][1]) if len(out) == 1 else 0
    else:
        accounting.numpy_extents(layer, out, raw=True)
        lo = (layer.__array_interface__["data"][0] - out[0][1]) if len(out) == 1 else 0
        size = layer.nbytes
    if len(out) != 1 or not size:
        raise InvalidArgumentError(
            f"`PagedKVPool`: a pool layer must be one non-empty allocation on one device; got {len(out)} "
            f"buffers (a sharded or empty array?)."
        )
    key, start, _ = out[0]
    return key, start, lo, lo + size


def _signature(layer: Any) -> tuple[Any, ...]:
    return (tuple(layer.shape), str(layer.dtype), _storage_of(layer))


class PagedKVPool:
    """A reference to an engine's paged KV pool: its per-layer storage, block geometry and callbacks.

    Args:
      layers: one tensor or array, or a sequence of them (one per layer, or K and V apart), each
        ``[num_blocks, block_size, ...]`` and contiguous; torch tensors, JAX arrays or numpy arrays, all of
        one kind, on one device.
      free: the engine's ``free(block_ids)``; called with a tuple of ints, ascending.
      block_size: tokens per block (default: each layer's second dimension).
      device: the device the pool is declared on (``"cpu"``, ``"cuda:0"``); checked against the layers.
      offload: optional ``offload(block_ids) -> token``: copy the blocks to engine-managed host memory (it
        must not free them: the manager frees device blocks when their last holder lets go).
      reload: optional ``reload(token) -> block_ids``: allocate blocks, copy the token back, return their ids.
        It may consume the token: a restore that is then refused (the byte budget) offloads the blocks again
        for a new token before freeing them.
      free_block_count: optional ``() -> int``: the engine's free blocks now (`stats` reports pool bytes).
      name: shown in errors and in `stats` keys (default ``"pool<uid>"``).

    Raises:
      InvalidArgumentError: layers of different block counts or devices, non-contiguous, or not on ``device``.
      InvalidTypeError: a layer is not a tensor or array, or a callback is not callable.

    The pool holds its layers weakly: a handle whose engine freed or resized the pool raises
    `PoolChangedError` instead of reading memory that is no longer the pool. A JAX engine that replaces its
    pool array at every write calls `update` with the new one.
    """

    def __init__(
        self,
        layers: Any,
        *,
        free: Callable[[tuple[int, ...]], Any],
        block_size: int | None = None,
        device: str | None = None,
        offload: Callable[[tuple[int, ...]], Any] | None = None,
        reload: Callable[[Any], Sequence[int]] | None = None,
        free_block_count: Callable[[], int] | None = None,
        name: str | None = None,
    ):
        for label, fn in (
            ("free", free),
            ("offload", offload),
            ("reload", reload),
            ("free_block_count", free_block_count),
        ):
            if fn is not None and not callable(fn):
                raise InvalidTypeError(f"`PagedKVPool`: {label} must be callable, got {type(fn).__name__}.")
        if (offload is None) != (reload is None):
            raise InvalidArgumentError("`PagedKVPool`: give both offload and reload, or neither.")
        self.uid = next(_UIDS)
        self.name = name or f"pool{self.uid}"
        self.free_fn = free
        self.offload_fn = offload
        self.reload_fn = reload
        self.free_block_count = free_block_count
        self.extent_base = _EXTENT_SPACE + self.uid * _EXTENT_WINDOW
        layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
        self._check_layers(layers, device, block_size)
        first = layers[0]
        self.num_blocks = int(first.shape[0])
        self.block_size = int(block_size if block_size is not None else (first.shape[1] if first.ndim > 1 else 1))
        self.device = self._signatures[0][2][0]
        self.kind = "torch" if is_torch(first) else "jax" if isinstance(first, jax.Array) else "numpy"
        # Per layer: bytes of one block and its extent base (layers laid end to end in the pool's window).
        self.layer_block_bytes = tuple((sig[2][3] - sig[2][2]) // self.num_blocks for sig in self._signatures)
        offsets = itertools.accumulate((b * self.num_blocks for b in self.layer_block_bytes), initial=0)
        self.layer_bases = tuple(self.extent_base + o for o in list(offsets)[:-1])
        self.block_nbytes = sum(self.layer_block_bytes)
        if self.block_nbytes * self.num_blocks >= _EXTENT_WINDOW:
            raise InvalidArgumentError("`PagedKVPool`: a pool of 256 TiB or more is beyond the accounting's window.")
        # Blocks handed back to the engine by a change whose other frees failed, so the table that still
        # holds them was kept: the change's retry must not free them again (see `engine_blocks`).
        self._handed_back: set[int] = set()
        self._handed_back_lock = threading.Lock()
        POOLS[self.uid] = self
        self._register()
        weakref.finalize(self, _forget, accounting.POOL_LIVE, self.uid)

    def _check_layers(self, layers: list[Any], device: str | None, block_size: int | None) -> None:
        if not layers:
            raise InvalidArgumentError("`PagedKVPool`: needs at least one layer.")
        for i, layer in enumerate(layers):
            if not (is_torch(layer) or isinstance(layer, (jax.Array, np.ndarray))):
                raise InvalidTypeError(
                    f"`PagedKVPool`: layer {i} is {type(layer).__name__}; expected a torch tensor, JAX array "
                    f"or numpy array of shape [num_blocks, block_size, ...]."
                )
            if layer.ndim < 1 or layer.shape[0] < 1:
                raise InvalidArgumentError(
                    f"`PagedKVPool`: layer {i} has shape {tuple(layer.shape)}; expected [num_blocks, ...]."
                )
            if is_torch(layer) and not layer.is_contiguous():
                raise InvalidArgumentError(f"`PagedKVPool`: layer {i} is not contiguous; blocks must be contiguous.")
            if isinstance(layer, np.ndarray) and not layer.flags.c_contiguous:
                raise InvalidArgumentError(f"`PagedKVPool`: layer {i} is not contiguous; blocks must be contiguous.")
        kinds = {type(x).__module__.split(".")[0] for x in layers}
        if len(kinds) > 1:
            raise InvalidArgumentError(f"`PagedKVPool`: layers mix array kinds {sorted(kinds)}; use one.")
        counts = {int(x.shape[0]) for x in layers}
        if len(counts) > 1:
            raise InvalidArgumentError(f"`PagedKVPool`: layers disagree on num_blocks: {sorted(counts)}.")
        if block_size is not None and (
            isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
        ):
            raise InvalidArgumentError(f"`PagedKVPool`: block_size must be an int >= 1, got {block_size!r}.")
        self._signatures = [_signature(x) for x in layers]
        devices = {sig[2][0] for sig in self._signatures}
        if len(devices) > 1:
            raise InvalidArgumentError(f"`PagedKVPool`: layers lie on several devices {sorted(devices)}; use one.")
        (actual,) = devices
        if device is not None and device != actual:
            raise InvalidArgumentError(
                f"`PagedKVPool` {device=!r}: the layers lie on {actual!r}. Declare the device the engine "
                f"allocated the pool on."
            )
        for sig in self._signatures:
            if (sig[2][3] - sig[2][2]) % int(layers[0].shape[0]):
                raise InvalidArgumentError("`PagedKVPool`: a layer's bytes are not a whole number of blocks.")
        if all(_weakrefable(x) for x in layers):
            # A layer the engine frees takes the pool out of the accounting at once: its memory may hold
            # other tensors next, which must not be counted as this pool's blocks.
            callback = functools.partial(_layer_died, self.uid, weakref.ref(self), accounting.POOL_LIVE)
            self._layers: list[weakref.ref] | None = [weakref.ref(x, callback) for x in layers]
        else:
            self._layers = None
        self._strong = None if self._layers is not None else list(layers)  # numpy arrays cannot be weakly held

    def _register(self) -> None:
        with _STORAGES_LOCK:
            _purge_locked(self.uid)
            accounting.POOL_LIVE.add(self.uid)
            for (_, _, (key, start, lo, hi)), base, bb in zip(
                self._signatures, self.layer_bases, self.layer_block_bytes
            ):
                _STORAGES[(key, start)] = (*_STORAGES.get((key, start), ()), (lo, hi, base, bb, self.uid))

    # --- the live storage ---------------------------------------------------------------------------
    def layers(self) -> list[Any]:
        """The pool's layers now.

        Raises:
          PoolChangedError: the engine freed a layer, or resized or moved it since the pool was declared.
        """
        layers = list(self._strong) if self._strong is not None else [ref() for ref in self._layers or ()]
        for i, (layer, sig) in enumerate(zip(layers, self._signatures)):
            if layer is None or (isinstance(layer, jax.Array) and layer.is_deleted()):
                raise PoolChangedError(
                    f"KV pool {self.name!r}: layer {i} was freed by its engine; its blocks are gone."
                )
            now = _signature(layer)
            if now != sig:
                raise PoolChangedError(
                    f"KV pool {self.name!r}: layer {i} changed since the pool was declared (shape, dtype, "
                    f"storage) {sig} -> {now}; handles into it no longer name the same memory."
                )
        return layers

    def update(self, layers: Any) -> None:
        """Point the pool at the engine's new layers (a JAX engine replaces its pool array at every write).

        Raises:
          PoolChangedError: the new layers differ in count, shape or dtype (a resize: handles are stale).
        """
        layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
        if len(layers) != len(self._signatures) or any(
            (tuple(x.shape), str(x.dtype)) != sig[:2] for x, sig in zip(layers, self._signatures)
        ):
            raise PoolChangedError(
                f"KV pool {self.name!r}: update() got layers of another geometry; declare a new pool for a resize."
            )
        old = self._signatures
        self._check_layers(layers, self.device, self.block_size)
        if [s[2][0] for s in self._signatures] != [s[2][0] for s in old]:
            self._signatures = old
            raise PoolChangedError(f"KV pool {self.name!r}: update() moved the pool to another device.")
        self._register()

    def check_ids(self, block_ids: Any, what: str) -> tuple[int, ...]:
        """``block_ids`` as a tuple of ints, each in range and none repeated.

        Raises:
          InvalidTypeError, InvalidArgumentError: not ints, out of range, or repeated.
        """
        if isinstance(block_ids, (int, np.integer)) and not isinstance(block_ids, bool):
            block_ids = (block_ids,)
        if is_torch(block_ids) or isinstance(block_ids, (np.ndarray, jax.Array)):
            block_ids = np.asarray(block_ids).reshape(-1).tolist()
        if not isinstance(block_ids, (list, tuple, range)):
            raise InvalidTypeError(f"`{what}`: block ids are a sequence of ints, got {type(block_ids).__name__}.")
        ids = []
        for b in block_ids:
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
                raise InvalidTypeError(f"`{what}`: block ids are ints, got {type(b).__name__} {b!r}.")
            ids.append(int(b))
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise InvalidArgumentError(
                f"`{what}`: block ids {bad[:5]} are out of range for pool {self.name!r} of {self.num_blocks} blocks."
            )
        if len(set(ids)) != len(ids):
            dup = sorted({b for b in ids if ids.count(b) > 1})
            raise InvalidArgumentError(f"`{what}`: block ids {dup[:5]} repeat; each block appears once.")
        if self._handed_back:
            # Ids entering a handle are the engine's allocation (again): they are owed to it once more.
            with self._handed_back_lock:
                self._handed_back.difference_update(ids)
        return tuple(ids)

    def _still_owed(self, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        """``block_ids`` minus those already handed back to the engine by an attempt that was not installed."""
        if not self._handed_back:
            return block_ids
        with self._handed_back_lock:
            return tuple(b for b in block_ids if b not in self._handed_back)

    def _note_handed_back(self, block_ids: Iterable[int], settled: bool) -> None:
        """Record that the engine took ``block_ids`` back; ``settled``: the change releasing them is complete
        (its caller installs the state that no longer holds them), so nothing about them is owed or recorded."""
        with self._handed_back_lock:
            if settled:
                self._handed_back.difference_update(block_ids)
            else:
                self._handed_back.update(block_ids)

    def extents(self, block_ids: Iterable[int]) -> list[Extent]:
        """The accounting extents of ``block_ids``: one per block per layer."""
        key, ids = self.device, tuple(block_ids)
        out: list[Extent] = []
        for base, bb in zip(self.layer_bases, self.layer_block_bytes):
            out.extend(Extent(key, base + b * bb, base + (b + 1) * bb) for b in ids)
        return out

    def capacity(self) -> dict[str, int]:
        """``{"total_nbytes": ..., "free_nbytes": ...}`` (free only when the engine exposes its free count)."""
        out = {"total_nbytes": self.block_nbytes * self.num_blocks}
        if self.free_block_count is not None:
            out["free_nbytes"] = int(self.free_block_count()) * self.block_nbytes
        return out

    def __repr__(self) -> str:
        return f"PagedKVPool({self.name!r}, {self.kind}, {self.num_blocks} blocks x {self.block_nbytes} B on {self.device})"


def _weakrefable(x: Any) -> bool:
    try:
        weakref.ref(x)
    except TypeError:
        return False
    return True


def _pool_still_there(uid: int, key: str, start: int) -> bool:
    """Whether pool ``uid`` still has a live, unchanged layer in the storage at ``(key, start)``."""
    pool = POOLS.get(uid)
    if pool is None:
        return False
    refs: list[Any] = list(pool._layers) if pool._layers is not None else [None] * len(pool._signatures)
    for ref, sig in zip(refs, pool._signatures):
        if sig[2][0] != key or sig[2][1] != start:
            continue
        if ref is None:
            return True  # a numpy layer, held strongly: alive while the pool is
        layer: Any = ref()
        if layer is None or (isinstance(layer, jax.Array) and layer.is_deleted()):
            return False
        if is_torch(layer):  # freed storage, or resized in place (its memory moved)
            storage = layer.untyped_storage()
            return bool(storage.data_ptr() == start and storage.nbytes() >= sig[2][3])
        return True
    return False


accounting.register_pool_check(_pool_still_there)


def _layer_died(uid: int, pool_ref: weakref.ref, live: set[int], layer_ref: weakref.ref) -> None:
    # A weakref callback: it also runs while the interpreter shuts down, after module globals (builtins
    # too) may have been cleared, so it reads only what it was bound with (``live`` is the accounting's set).
    pool = pool_ref()
    if pool is not None:
        for ref in pool._layers or ():
            if ref is layer_ref:
                break
        else:
            return  # a layer `update` replaced: the pool lives on in its new layers
    live.discard(uid)


def _forget(live: set[int], uid: int) -> None:
    # A finalizer: it may run inside any allocation, even one made while `_STORAGES_LOCK` is held, so it
    # takes no lock (the registry entries are purged at the next registration), and at shutdown, so it
    # reads no module global.
    live.discard(uid)


def _purge_locked(uid: int) -> None:
    """Drop the segments of pool ``uid`` and of pools no longer alive (under `_STORAGES_LOCK`)."""
    live = accounting.POOL_LIVE
    for key, segments in list(_STORAGES.items()):
        kept = tuple(seg for seg in segments if seg[4] != uid and seg[4] in live)
        if len(kept) != len(segments):
            if kept:
                _STORAGES[key] = kept
            else:
                _STORAGES.pop(key, None)


def pool_by_uid(uid: int) -> PagedKVPool | None:
    return POOLS.get(uid)
