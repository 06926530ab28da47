"""Torch storages that something outside the table reads: a transfer blob exported from them, the
read-only buffer an import built them over, or a parked copy that took them without copying (a CPU park,
`parking`). `writable` copies such a storage before any in-place write.

Moving a session between processes costs a copy on each side unless both sides share memory:

* An export hands out views of the session's host storages (`export_session`): the blob must keep holding
  the exported state while it lives (until ``ray.put`` copied it into the object store, say), yet the
  session may be stepped meanwhile.
* An import over Ray reads the blob in place: ``ray.get`` returns numpy arrays over the store's sealed,
  shared memory. An import may build the session's torch storages over those buffers (`borrow`) instead of
  copying them; other readers of the same object see that memory, so nothing may write it.

Both are the contract a fork already has: memory the session shares with another reader. The storages are
registered here for as long as the outside reader lives (the blob's buffer, or the numpy view torch keeps as
a borrowed storage's owner, is held weakly), and `table.torch_writes` treats a registered storage as one
another holder shares: `writable` copies it before an in-place write, and a write made outside `writable`
is refused.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["borrow", "immutable", "n_read_outside", "read_at", "read_by", "read_outside"]

# (data address, bytes) of a CPU storage -> weak references to the arrays outside the table that read it
_READERS: dict[tuple[int, int], list[weakref.ref[Any]]] = {}
_LOCK = threading.RLock()  # (re-entrant: a collection inside `read_by` may run `_forget`)


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


def read_by(address: int, nbytes: int, reader: Any) -> None:
    """Register the CPU storage at ``address`` of ``nbytes`` as read by ``reader`` (an array outside the
    table over its memory, or a parked copy that took the storage) for as long as ``reader`` lives."""
    if nbytes:
        key = (address, nbytes)
        ref = weakref.ref(reader, functools.partial(_forget, key))
        with _LOCK:  # (lists replaced, never changed in place: a reader's callback may run inside this block)
            _READERS[key] = [*_READERS.get(key, ()), ref]


def _forget(key: tuple[int, int], ref: Any) -> None:
    with _LOCK:
        refs = _READERS.get(key)
        if refs is not None:
            alive = [r for r in refs if r is not ref and r() is not None]
            if alive:
                _READERS[key] = alive
            else:
                del _READERS[key]


def borrow(buf: np.ndarray) -> Any:
    """A 1-D uint8 torch tensor over the memory of ``buf`` (1-D uint8, `immutable`), registered as read
    outside the table for as long as its storage lives.

    Example:
      >>> import numpy as np
      >>> t = borrow(np.frombuffer(b"abcd", np.uint8))
      >>> read_outside(t), t.tolist()
      (True, [97, 98, 99, 100])
    """
    import torch  # (only a blob holding torch storages borrows)

    # A view by address, not ``torch.from_numpy(buf)``: torch warns about a read-only array, and silencing it
    # (``warnings.catch_warnings``) is not thread-safe. The view keeps ``buf`` alive: the store's buffer lives
    # as long as the storage does.
    window = (ctypes.c_ubyte * buf.nbytes).from_address(buf.ctypes.data)
    window._keep = buf  # type: ignore[attr-defined]
    owner = np.ctypeslib.as_array(window)
    tensor = torch.from_numpy(owner)
    storage = tensor.untyped_storage()
    read_by(storage.data_ptr(), storage.nbytes(), owner)
    return tensor


def read_outside(tensor: Any) -> bool:
    """Whether something outside the table reads torch ``tensor``'s storage (a live blob exported from it,
    or the buffer it was borrowed over). One dictionary lookup; nothing at all while none is registered."""
    if not _READERS or not tensor.is_cpu:
        return False
    storage = tensor.untyped_storage()
    return read_at(storage.data_ptr(), storage.nbytes())


def read_at(address: int, nbytes: int) -> bool:
    """`read_outside` for the CPU storage at ``address`` of ``nbytes``."""
    return any(ref() is not None for ref in _READERS.get((address, nbytes), ()))


def n_read_outside() -> int:
    """How many storages something outside the table reads now (tests: a dropped session leaves none)."""
    return sum(1 for refs in list(_READERS.values()) if any(ref() is not None for ref in list(refs)))
