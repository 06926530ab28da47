"""Torch tensors written in place: `writable`, the write path that keeps every fork a snapshot, and the
check that catches an in-place write made outside it to a storage something else shares.

A fork shares its source's buffers (`fork_session` copies nothing). That is safe for values nobody writes in
place, and torch models do write in place: transformers' ``StaticCache.update`` is ``index_copy_`` into the
cache it was given. Two halves keep a fork a snapshot:

* `writable` copies exactly the torch storages that anything else holds (another session, an attr, another
  object: the ledger's holder counts, the answer donation asks too; or a live transfer blob exported from it
  or imported over it: `memory.outside_readers`), each storage once, rebuilds every view of it over its one
  copy, and installs the copies in this session. In-place writes on what it returns reach
  nobody else.
* Torch keeps a version counter per tensor (shared by a tensor and its views), raised by every in-place
  write. The versions of the tensors an object holds are recorded where the table takes the object in
  (`put`, `commit`, `stage`, `fork_session`, `writable`) and compared before the object is served, written,
  stepped, parked, forked or saved. A newer version in a storage that another holder shares raises
  `SharedStorageWrittenError`, naming the session, the object and the storage, before anything is read. A
  write to a storage nothing else holds is the owner's own: accepted, and recorded anew, unless another holder
  shared it when it was written and has left the table since (`torch_versions.release`).
* An inference-mode tensor keeps no counter yet can be written in place inside `torch.inference_mode()`:
  `fork_session` gives the fork its own copy of each such storage instead of sharing it.

The records sit beside the objects (a map by object identity, each entry dropped with its object), never
inside them: objects are immutable values, and a JAX-only object never gets one. A check of an object
without a record is one dictionary lookup.
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import jax
import numpy as np

from ..core.pytree import MISSING
from ..core.session import SessionState
from ..core.state_object import StateObject
from ..errors import SharedStorageWrittenError
from ..memory.holders import held_elsewhere
from ..memory.huge_pages import HUGE_PAGE, advise_huge_pages
from ..memory.outside_readers import read_outside
from ..memory.torch_host import leaf_recipe, rebuild
from .checks import find_object, locate
from .ledger import held_by, value_extents
from .lru import replace_session
from .manager_state import ManagerState, ledger_of
from .torch_versions import RECORDS, WRITTEN_SHARED, Versions, torch_leaves
from .torch_versions import version as _version

__all__ = [
    "RECORDS",
    "check_object",
    "check_session",
    "check_sessions",
    "record",
    "record_commit",
    "record_fork",
    "recorded",
    "writable",
]

# id(object) -> a weak reference to it, for the objects a fork found holding no torch tensor: read once each.
_NONE: dict[int, weakref.ref[Any]] = {}
_NO_TORCH_PAYLOADS = (type(None), np.ndarray, jax.Array)


def _forget(ref: weakref.ref[Any], key: int, records: dict[int, Any] = RECORDS, none: dict[int, Any] = _NONE) -> None:
    # (the maps bound here: at interpreter exit the module's globals may be gone before the last objects)
    entry = records.get(key)
    if entry is not None and entry[0] is ref:
        del records[key]
    if none.get(key) is ref:
        del none[key]


def recorded(obj: StateObject) -> Versions:
    """The versions recorded for ``obj``'s torch tensors (empty: none recorded)."""
    entry = RECORDS.get(id(obj))
    return entry[1] if entry is not None and entry[0]() is obj else ()


def record(obj: StateObject) -> None:
    """Record the version of every torch tensor ``obj`` holds now (replacing an earlier record of it)."""
    key = id(obj)
    versions = _versions(torch_leaves(obj)) if obj.resident else ()
    if versions:
        RECORDS[key] = (weakref.ref(obj, partial(_forget, key=key)), versions)
    elif (entry := RECORDS.get(key)) is not None and entry[0]() is obj:
        RECORDS.pop(key, None)  # (another thread may have let it go meanwhile)


def _versions(tensors: list[Any]) -> Versions:
    """Each tensor with its version now (one pass reading the counters; `version` for an inference-mode one)."""
    try:
        return tuple([(t, t._version) for t in tensors])
    except RuntimeError:  # (an inference-mode tensor keeps no counter)
        return tuple([(t, _version(t)) for t in tensors])


def record_commit(old: StateObject, new: StateObject, payload: Any) -> None:
    """Record ``new`` (``old`` after a write of ``payload``) if either may hold a torch tensor; O(payload) for
    one that holds none (a fresh tensor an object makes itself is recorded by the next fork that shares it)."""
    if new is not old and (
        (RECORDS and id(old) in RECORDS)
        or (payload is not MISSING and not isinstance(payload, _NO_TORCH_PAYLOADS) and torch_leaves(payload))
    ):
        record(new)


def _storage_name(tensor: Any) -> str:
    storage = tensor.untyped_storage()
    return f"the {storage.nbytes()}-byte {tensor.device} storage at {storage.data_ptr():#x}"


def check_object(state: ManagerState, sid: str, name: str, obj: StateObject, what: str) -> None:
    """Raise if a torch storage of object ``name`` (``obj``, of session ``sid``) that something else in
    ``state`` holds was written in place since the table took it in; a write to a storage only ``obj`` holds is
    accepted and recorded. Nothing to do (one lookup) for an object without a record.

    Raises:
      SharedStorageWrittenError: names the session, the object and the storage, and says how to write instead.
    """
    entry = RECORDS.get(id(obj))
    if entry is None or entry[0]() is not obj:
        return
    try:
        written = [(t, v) for t, v in entry[1] if t._version != v]
    except RuntimeError:  # (an inference-mode tensor keeps no counter: `version` reads it as -1)
        written = [(t, v) for t, v in entry[1] if _version(t) != v]
    if not written:
        return
    acct, own = ledger_of(state), held_by(obj)
    for tensor, version in written:
        extents = value_extents(tensor)
        if extents and held_elsewhere(acct, extents, own):
            sharer = "which another holder (a fork of the session, an attr or another object) shares"
        elif read_outside(tensor):
            sharer = (
                "which a transfer blob reads (a blob exported from it, or the read-only buffer it was imported over)"
            )
        elif WRITTEN_SHARED.get(tensor.untyped_storage(), version) > version:
            sharer = "which another holder shared when it was written (that holder has left the table since)"
        else:
            continue
        raise SharedStorageWrittenError(
            f"`{what}`: object {name!r} of session {sid!r} holds a torch tensor in {_storage_name(tensor)}, "
            f"{sharer}, and it was "
            f"written in place (version {version} -> {_version(tensor)}) outside `writable`: the sessions "
            f"sharing it no longer hold what they were given. Take what you write in place from "
            f"`writable(state, {sid!r}, {name!r})` (`SessionHandle.writable`), which copies shared storages "
            f"first; to keep this write, `put` a fresh object in each session that should see it."
        )
    record(obj)


def check_session(state: ManagerState, sid: str, session: SessionState, what: str) -> None:
    """`check_object` for every object of ``session`` (session ``sid`` of ``state``)."""
    if RECORDS:
        for name, obj in session._objects.items():
            check_object(state, sid, name, obj, what)


def record_fork(state: ManagerState, sid: str, session: SessionState) -> dict[str, StateObject] | None:
    """Before ``session`` (``sid``) is forked: check its objects, and record each object not read before
    (a tensor an object made itself, never taken in as a payload), since the fork makes them shared. An
    object is read once: its tensors never change (objects are immutable), only their versions.

    Returns the fork's own copies of the objects holding an inference-mode tensor, by name (None: no such
    object). Such a tensor keeps no version counter, so a write to it inside `torch.inference_mode()` could
    not be caught: the fork stays a snapshot by holding copies of those storages instead (counted by the
    ledger as the fork's own bytes)."""
    if sys.modules.get("torch") is None:
        return None
    copies = None
    for name, obj in session._objects.items():
        key = id(obj)
        if recorded(obj):
            check_object(state, sid, name, obj, "fork_session")
        elif (ref := _NONE.get(key)) is None or ref() is not obj:
            record(obj)
            if key not in RECORDS:
                _NONE[key] = weakref.ref(obj, partial(_forget, key=key))
        if any(v < 0 for _, v in recorded(obj)):
            copy = _copied(obj, lambda leaf: leaf.is_inference())
            record(copy)
            copies = {**(copies or {}), name: copy}
    return copies


def _copied(obj: StateObject, copy_storage_of: Callable[[Any], bool]) -> StateObject:
    """``obj`` with the storage of each torch tensor leaf ``copy_storage_of`` picks replaced by a copy (each
    storage copied once, every view of it rebuilt over that copy), or ``obj`` itself when it picks none."""
    torch = sys.modules.get("torch")
    if torch is None:
        return obj
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    copies: dict[tuple[str, int], Any] = {}  # (device, address) -> the storage's copy, or None: not copied
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            key = (str(leaf.device), storage.data_ptr())
            if key not in copies:
                copies[key] = _clone(storage, leaf.is_cpu) if copy_storage_of(leaf) else None
            if (copy := copies[key]) is not None:
                leaf = rebuild(leaf_recipe(leaf, 0, None), copy, leaf.device)
        out.append(leaf)
    if not any(c is not None for c in copies.values()):
        return obj
    return jax.tree_util.tree_unflatten(treedef, out)


def _clone(storage: Any, is_cpu: bool) -> Any:
    """A copy of untyped ``storage``. A large host one goes into memory advised for huge pages before its first
    touch (`memory.huge_pages`), copied by numpy: the first in-place write after a copy-on-write import copies
    whole storages of hundreds of MiB, and ``clone()`` faulted every 4 KiB page (torch's allocator never asks)
    and copied at a fraction of numpy's speed (measured: 5-7x slower for 603 MiB on this 2-core machine)."""
    nbytes = storage.nbytes()
    if not is_cpu or nbytes < 2 * HUGE_PAGE:
        return storage.clone()
    torch = sys.modules["torch"]
    out = torch.empty(nbytes, dtype=torch.uint8)
    advise_huge_pages(out.data_ptr(), nbytes)
    # (views by address, not `.numpy()`: that would make the copy's storage non-resizable for good)
    np.copyto(_bytes_at(out.data_ptr(), nbytes), _bytes_at(storage.data_ptr(), nbytes))
    return out.untyped_storage()


def _bytes_at(address: int, nbytes: int) -> np.ndarray:
    """A uint8 view of ``nbytes`` at ``address`` (valid while the storage there lives)."""
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(address))


def _private(state: ManagerState, obj: StateObject) -> StateObject:
    """``obj`` with each torch storage that anything else in ``state`` holds replaced by a copy (see
    `_copied`), or ``obj`` itself when nothing is shared."""
    acct, own = ledger_of(state), held_by(obj)

    def shared(leaf: Any) -> bool:
        extents = value_extents(leaf)
        return bool(extents and held_elsewhere(acct, extents, own)) or read_outside(leaf)

    return _copied(obj, shared)


def writable(state: ManagerState, session_id: str | None, name: str) -> tuple[ManagerState, Any]:
    """The view of object ``name`` to write in place: its torch storages that anything else holds (a fork, an
    attr, another object) copied into this session first, so that in-place writes reach nobody else.

    Each shared storage is copied once and its views rebuilt over the copy (views of one storage stay views of
    one storage); a storage only this object holds is not copied. Call it before each in-place write (a fork
    made since shares the storages again), write in place into what it returns, then `commit` it. JAX values
    are returned as they are (nothing writes them in place).

    Args:
      state: the table.
      session_id: the session (None means ``"default"``).
      name: the object, e.g. a `PytreeValue` of a model's static K/V cache.

    Returns:
      ``(state, view)``: the table holding the copies (``state`` itself if none was needed), and the object's
      view (`StateObject.view`, staged payload included).

    Raises:
      SharedStorageWrittenError: a shared storage of the object was already written in place outside
        `writable` (see `check_object`).
      SessionStateLostError, ObjectNotFoundError: no such session or object.
      ObjectParkedError, NotResidentError: the object is not resident.

    Example:
      >>> import torch
      >>> from functional_state import ManagerState, PytreeValue, fork_session, get_or_create, put, view
      >>> s, _ = get_or_create(ManagerState.create(), "p")
      >>> s = put(s, "p", "kv", PytreeValue.create({"k": torch.zeros(4)}))
      >>> s = fork_session(s, "p", "c")
      >>> s, tree = writable(s, "p", "kv")
      >>> tree["k"][0] = 1.0                  # in place, as a model's cache update writes
      >>> view(s, "p", "kv")["k"].tolist(), view(s, "c", "kv")["k"].tolist()
      ([1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0])
    """
    sid, node = locate(state, session_id, "writable")
    obj = find_object(node, name, "writable")
    obj._require_resident("writable")
    check_object(state, sid, name, obj, "writable")
    new = _private(state, obj)
    record(new)
    if new is obj:
        return state, obj.view()
    return replace_session(state, sid, node, node._with_object(name, new)), new.view()


def check_sessions(state: ManagerState, items: Iterable[tuple[str, SessionState]], what: str) -> None:
    """`check_session` for each ``(session id, session)`` of ``state`` in ``items`` (a save, an export)."""
    if RECORDS:
        for sid, session in items:
            check_session(state, sid, session, what)
