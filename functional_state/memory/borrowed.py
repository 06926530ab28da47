"""Borrowed storages: torch storages over read-only memory another owner keeps (the object store's buffers
that a transfer import aliases instead of copying).

An import over Ray reads the blob in place: ``ray.get`` returns numpy arrays over the store's shared,
sealed memory. Copying each into memory of the session's own was most of a transfer's time, so an import
may instead build the session's torch storages over those buffers. The memory is not the session's: other
readers of the same object see it, so nothing may write it. The session treats such a storage as one
another holder shares (as a fork's): `table.torch_writes.writable` copies it before any in-place write, and
a write made outside `writable` is refused as for a fork. This module keeps the registry that says which
storages are borrowed, and decides which buffers are safe to borrow at all.

A storage stays registered exactly as long as it lives: the registry holds the numpy view torch keeps as the
storage's owner only weakly, and that view (through its ``base`` chain) keeps the store's buffer alive.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import numpy as np

__all__ = ["borrow", "borrowed", "immutable", "n_borrowed"]

# (data address, bytes) of a borrowed CPU storage -> a weak reference to the numpy view torch keeps as its owner
_BORROWED: dict[tuple[int, int], weakref.ref[np.ndarray]] = {}


def immutable(buf: Any) -> bool:
    """Whether the memory of ``buf`` (a numpy array, memoryview or bytes) can never change while it is
    referenced: every array on its ``base`` chain is read-only, and the chain ends in a read-only buffer
    (``bytes``, the object store's sealed buffer). A read-only array over writable memory (a view of a
    writable array, of a ``bytearray``, an array that owns its memory and could be flagged writable again)
    is not: another reference may write it.

    Example:
      >>> import numpy as np
      >>> immutable(np.frombuffer(b"abcd", np.uint8)), immutable(np.zeros(4, np.uint8))
      (True, False)
    """
    obj = buf
    while isinstance(obj, np.ndarray):
        if obj.flags.writeable or obj.base is None:
            return False
        obj = obj.base
    while isinstance(obj, memoryview):
        if not obj.readonly:
            return False
        if obj.obj is None:
            return True
        obj = obj.obj
    if isinstance(obj, bytes):
        return True
    if isinstance(obj, np.ndarray):  # (a memoryview of an array)
        return immutable(obj)
    try:
        with memoryview(obj) as view:
            return bool(view.readonly)
    except TypeError:
        return False


def borrow(buf: np.ndarray) -> Any:
    """A 1-D uint8 torch tensor over the memory of ``buf`` (1-D uint8, `immutable`), registered as borrowed
    for as long as its storage lives.

    Example:
      >>> import numpy as np
      >>> t = borrow(np.frombuffer(b"abcd", np.uint8))
      >>> borrowed(t), t.tolist()
      (True, [97, 98, 99, 100])
    """
    import torch  # (only a blob holding torch storages borrows)

    owner = buf.view()  # (a view of its own: torch keeps it, so it dies with the storage, and not before)
    with warnings.catch_warnings():
        # torch warns that the array is not writable: the point of the registry is that nothing writes it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(owner)
    if not owner.nbytes:
        return tensor
    key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
    _BORROWED[key] = weakref.ref(owner, functools.partial(_forget, _BORROWED, key))
    return tensor


def _forget(registry: dict[tuple[int, int], Any], key: tuple[int, int], ref: Any) -> None:
    if registry.get(key) is ref:
        del registry[key]


def borrowed(tensor: Any) -> bool:
    """Whether torch ``tensor``'s storage is a borrowed one (`borrow`): memory no in-place write may reach.
    One dictionary lookup; nothing at all while no storage is borrowed."""
    if not _BORROWED or not tensor.is_cpu:
        return False
    storage = tensor.untyped_storage()
    ref = _BORROWED.get((storage.data_ptr(), storage.nbytes()))
    return ref is not None and ref() is not None


def n_borrowed() -> int:
    """How many borrowed storages are alive (tests: a dropped session leaves none)."""
    return sum(1 for ref in list(_BORROWED.values()) if ref() is not None)
