"""The version records of the torch tensors the table took in, and the storages written in place while shared
whose writer has since left the table (the data `torch_writes` checks against).

A check compares an object's recorded versions with its tensors' counters and accepts a newer version in a
storage nothing else holds as the owner's own write. That cannot tell who wrote: once the writer's holder is
released (its session dropped or evicted, its object put over or removed), the survivor would accept the
writer's write as its own. So every release path (`lru.insert`'s eviction, `lru.remove`,
`lru.replace_session`, `lru.replace_sessions`) calls `release` first, which remembers each storage of a
leaving object that was written since its record while another holder shared it, with its version then; a
holder whose record is older than that version is refused by the check even when it is the last holder.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import jax

from ..core.session import SessionState
from ..memory.holders import held_elsewhere
from .ledger import held_by, value_extents
from .manager_state import ManagerState, ledger_of

__all__ = ["RECORDS", "WRITTEN_SHARED", "release", "torch_leaves", "version"]

Versions = tuple[tuple[Any, int], ...]  # (tensor, its version when the table took it in), per tensor leaf

# id(object) -> (a weak reference to it, its versions): only objects holding torch tensors have an entry.
RECORDS: dict[int, tuple[weakref.ref[Any], Versions]] = {}
# torch untyped storage -> its version when a holder that wrote it while it was shared left the table. Keyed by
# the storage object (views share it and the base's counter; an address would be reused once it is freed).
WRITTEN_SHARED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def torch_leaves(tree: Any) -> list[Any]:
    """The torch tensor leaves of ``tree`` (none when torch was never imported)."""
    torch = sys.modules.get("torch")
    if torch is None:  # (torch never imported: no value can hold a tensor)
        return []
    tensor = torch.Tensor
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if isinstance(leaf, tensor)]


def version(tensor: Any) -> int:
    """``tensor``'s version counter; -1 for an inference-mode tensor, which keeps none (it can still be
    written in place inside `torch.inference_mode()`, so `fork_session` gives a fork its own copy of one)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return -1


def release(state: ManagerState, old: SessionState, new: SessionState | None) -> None:
    """Before session ``old`` of ``state`` leaves it (replaced by ``new``, or removed when None): remember in
    `WRITTEN_SHARED` each torch storage of an object leaving with it that was written in place since its
    record while something else in ``state`` holds it. Nothing to do without records (a JAX-only table)."""
    kept = new._objects if new is not None else None
    for name, obj in old._objects.items():
        entry = RECORDS.get(id(obj))
        if entry is None or entry[0]() is not obj or (kept is not None and kept.get(name) is obj):
            continue
        written = [(t, now) for t, v in entry[1] if (now := version(t)) != v]
        if not written or (kept is not None and any(o is obj for o in kept.values())):
            continue
        acct, own = ledger_of(state), held_by(obj)
        for tensor, now in written:
            extents = value_extents(tensor)
            if extents and held_elsewhere(acct, extents, own):
                storage = tensor.untyped_storage()
                WRITTEN_SHARED[storage] = max(now, WRITTEN_SHARED.get(storage, now))
