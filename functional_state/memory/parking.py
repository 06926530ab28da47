"""Parking: move committed storage to host memory and bring it back exactly where it was, bit for bit.

`park_values` turns the values an object holds (a pytree of JAX arrays, torch tensors and anything else)
into a `ParkedStorage`; `restore_values` gives them back.

* **JAX arrays** move with ``jax.device_put`` to the ``pinned_host`` memory kind of their own sharding
  (per shard, for a sharded array) and back to the sharding they had: same devices, same memory kind,
  same dtype and shape. One ``device_put`` call moves all of an object's arrays.
* **torch tensors** are grouped by storage: each storage is copied once, whole, into one contiguous host
  buffer per device (coalesced: one allocation, and for CPU sources one ``torch.cat`` call; for a GPU, a
  pinned buffer filled with ``non_blocking`` copies and one stream sync), and restored into a fresh
  allocation on its device; every tensor is rebuilt as a view of it with its own offset, shape, strides
  and conjugate/negative bits. Tensors that were views of one storage are views of one storage again;
  separate storages stay separate. Large CPU buffers come from `host_buffers` (recycled once nothing holds
  them, else fresh from numpy's huge pages): first-touch page faults otherwise double the cost of a copy.
* **JAX arrays that alias a torch storage** through the bridge park that whole storage (the memory they
  keep alive) and come back as JAX arrays over the restored storage.
* Anything else (numpy arrays, which already live in host memory, Python values) is kept as it is.

A leaf that appears more than once (one JAX array under two names) is copied once and restored as one
array, so the restore holds exactly the device memory the park released. A torch tensor keeps
``requires_grad`` (as a checkpoint does). A JAX array that was deleted (donated to a jitted call) holds no
bytes to park: `park_values` refuses it with `DeletedArrayError` before moving anything.

The accounting files parked bytes under the host pools: ``cpu/pinned_host`` (JAX's pinned host memory
kind, and pinned torch buffers) and ``cpu/unpinned_host`` (pageable torch buffers, the only kind torch
has without CUDA), apart from the device pools (``cpu``, ``cuda:0``), so a CPU run shows the move too.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import numpy as np

from ..errors import DeletedArrayError
from . import accounting, host_buffers

__all__ = ["HOST_KINDS", "ParkedStorage", "park_values", "restore_values"]

HOST_KINDS = ("pinned_host", "unpinned_host")
# Runs of storages share a host buffer up to this size: many small tensors share one allocation and copy,
# and the allocator serves each from memory it holds; a 27.7 MiB Wan feat cache in one buffer took ~1,900
# page faults per park (fresh pages after a heap trim), in runs of 256 KiB about 1.
_CHUNK = 256 << 10
_NUMPY_MIN = host_buffers.MIN_NBYTES  # a buffer of a huge page or more comes from the recycling cache


@dataclasses.dataclass(frozen=True)
class JaxLeaf:
    host: jax.Array  # the array in a host memory kind
    sharding: Any  # where it came from (devices and memory kind)


@dataclasses.dataclass(frozen=True)
class TorchLeaf:
    storage: int  # index into ParkedStorage.storages
    dtype: Any
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset, in elements
    conj: bool
    neg: bool
    jax_owner_type: type | None  # not None: the leaf was a bridge alias of this storage, owned by this type
    requires_grad: bool = False  # a torch leaf's autograd flag, kept across the round trip


@dataclasses.dataclass(frozen=True)
class _Storage:
    device: Any  # torch.device of the original storage
    buffer: int  # index into ParkedStorage.buffers
    start: int  # byte offset in that host buffer
    nbytes: int


@dataclasses.dataclass(frozen=True, eq=False)
class ParkedStorage:
    """The host copy of an object's committed storage, and what restoring it needs. Immutable."""

    treedef: Any  # structure of the parked values
    leaves: tuple[Any, ...]  # per leaf: JaxLeaf, TorchLeaf, or the value kept as is
    storages: tuple[_Storage, ...]
    buffers: tuple[Any, ...]  # one contiguous uint8 torch tensor per source device

    @property
    def nbytes(self) -> int:
        """Host bytes held (each host buffer and JAX host array once)."""
        return sum(accounting.walk(self)[0].values())

    def _accounting_children(self) -> list[Any]:
        # JAX host arrays report their memory kind themselves; torch buffers are filed by _accounting_extents.
        return [
            leaf.host if isinstance(leaf, JaxLeaf) else leaf for leaf in self.leaves if not isinstance(leaf, TorchLeaf)
        ]

    def _accounting_extents(self) -> accounting.Extents:
        out: accounting.Extents = []
        for buf in self.buffers:
            n = buf.untyped_storage().nbytes()
            if n:
                start = buf.untyped_storage().data_ptr()
                out.append(("cpu/pinned_host" if buf.is_pinned() else "cpu/unpinned_host", start, start + n))
        return out

    def __repr__(self) -> str:
        return f"ParkedStorage(leaves={len(self.leaves)}, torch_storages={len(self.storages)})"


def _torch() -> Any:
    return sys.modules.get("torch")


def _bytes_view(t: Any) -> Any:
    """A 1-D uint8 tensor over the whole storage of ``t`` (same device, no copy)."""
    torch = _torch()
    t = t.detach()  # the bytes, not the autograd graph (an out= copy refuses tensors that require grad)
    if t.storage_offset() == 0 and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        flat = t.reshape(-1).view(torch.uint8)  # the cheap path: the tensor spans its storage from the start
        if flat.numel() == t.untyped_storage().nbytes():
            return flat
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _host_bytes(n: int, pinned: bool) -> Any:
    """An uninitialised uint8 host tensor of ``n`` bytes: pinned for GPU transfers (torch caches those);
    else, when large, a recycled or fresh page-aligned buffer (`host_buffers`), and when small from torch's
    allocator (64-byte aligned, which DLPack aliasing on the CPU needs)."""
    torch = _torch()
    if pinned:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)
    if n >= _NUMPY_MIN:
        return host_buffers.host_buffer(n)
    return torch.empty(n, dtype=torch.uint8)


def as_torch(leaf: Any) -> tuple[Any, Any]:
    """``(tensor, jax_owner)`` when ``leaf`` is a torch tensor or a bridge alias of one, else ``(None, None)``."""
    torch = _torch()
    if torch is None:
        return None, None
    if isinstance(leaf, torch.Tensor):
        return leaf, None
    if isinstance(leaf, jax.Array):
        owner = accounting.alias_owner(leaf)
        tensor = getattr(owner, "tensor", owner)
        if isinstance(tensor, torch.Tensor):
            return tensor, owner
    return None, None


def park_values(values: Any, what: str = "park_values") -> ParkedStorage:
    """Copy the storage of every array in ``values`` (any pytree) to host memory; see the module docstring.

    Args:
      values: the pytree to park.
      what: the call named in an error message.

    Raises:
      DeletedArrayError: a JAX array in ``values`` was deleted (donated); nothing was copied.

    Example:
      >>> import jax.numpy as jnp
      >>> parked = park_values({"storage": jnp.arange(4.0)})
      >>> parked.leaves[0].host.sharding.memory_kind
      'pinned_host'
      >>> restore_values(parked)["storage"].tolist()
      [0.0, 1.0, 2.0, 3.0]
    """
    leaves, treedef = jax.tree_util.tree_flatten(values)
    recipes: list[Any] = [None] * len(leaves)
    jax_index: dict[int, list[int]] = {}  # id(array) -> the leaves that are that array
    storage_ids: dict[tuple[Any, int], int] = {}
    sources: list[Any] = []  # one tensor per distinct storage
    for i, leaf in enumerate(leaves):
        tensor, owner = as_torch(leaf)
        if tensor is not None:
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr() if storage.nbytes() else -1 - i)
            if key not in storage_ids:
                storage_ids[key] = len(sources)
                sources.append(tensor)
            recipes[i] = TorchLeaf(
                storage_ids[key],
                tensor.dtype,
                tuple(tensor.shape),
                tuple(tensor.stride()),
                tensor.storage_offset(),
                bool(tensor.is_conj()),
                bool(tensor.is_neg()),
                None if owner is None else type(owner),
                owner is None and bool(tensor.requires_grad),
            )
        elif isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            if leaf.is_deleted():
                _raise_deleted(values, i, leaf, what)
            jax_index.setdefault(id(leaf), []).append(i)
        else:
            recipes[i] = leaf
    if jax_index:
        arrays = [leaves[same[0]] for same in jax_index.values()]
        targets = [a.sharding.with_memory_kind("pinned_host") for a in arrays]
        hosts = jax.device_put(arrays, targets)
        for same, a, host in zip(jax_index.values(), arrays, hosts):
            recipe = JaxLeaf(host, a.sharding)
            for i in same:  # one host array per distinct array, so its restore is one array again
                recipes[i] = recipe
    storages, buffers = _copy_storages_to_host(sources)
    return ParkedStorage(treedef, tuple(recipes), tuple(storages), tuple(buffers))


def _raise_deleted(values: Any, index: int, leaf: Any, what: str) -> None:
    path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(values)[0][index][0])
    raise DeletedArrayError(
        f"`{what}`: the JAX array at {path or 'the root'} ({leaf.dtype}{list(leaf.shape)}) was deleted, most "
        f"likely donated to a jitted call (`donate_argnums`, or `step(..., donate=True)` on another copy of "
        f"this state): its bytes are gone, so there is nothing to park. Use the state that call returned, or "
        f"commit a fresh value first."
    )


def _chunks(members: list[int], sizes: dict[int, int]) -> list[list[int]]:
    """Group storages, in order, into runs of at most `_CHUNK` bytes (a larger storage is a run of its own)."""
    runs: list[list[int]] = []
    run_bytes = 0
    for i in members:
        if not runs or run_bytes + sizes[i] > _CHUNK:
            runs.append([])
            run_bytes = 0
        runs[-1].append(i)
        run_bytes += sizes[i]
    return runs


def _copy_storages_to_host(sources: list[Any]) -> tuple[list[_Storage], list[Any]]:
    """Copy each source tensor's whole storage into contiguous host buffers, several storages per buffer."""
    if not sources:
        return [], []
    torch = _torch()
    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(sources):
        by_device.setdefault(t.device, []).append(i)
    sizes = {i: t.untyped_storage().nbytes() for i, t in enumerate(sources)}
    storages: list[_Storage | None] = [None] * len(sources)
    buffers: list[Any] = []
    for device, members in by_device.items():
        pinned = device.type == "cuda"
        for run in _chunks(members, sizes):
            # Packed back to back, no padding: the host pool then rises by exactly the bytes the device pool
            # loses (restores copy out into fresh, allocator-aligned buffers).
            offsets = list(np.cumsum([0] + [sizes[i] for i in run[:-1]]))
            host = _host_bytes(sum(sizes[i] for i in run), pinned)
            if device.type == "cpu":
                torch.cat([_bytes_view(sources[i]) for i in run], out=host)  # one copy call per run
            else:
                for i, start in zip(run, offsets):
                    if sizes[i]:
                        host[start : start + sizes[i]].copy_(_bytes_view(sources[i]), non_blocking=pinned)
            for i, start in zip(run, offsets):
                storages[i] = _Storage(device, len(buffers), int(start), sizes[i])
            buffers.append(host)
        if pinned:
            torch.cuda.current_stream(device).synchronize()  # the device storages may be freed after this
    return storages, buffers  # type: ignore[return-value]


def restore_values(parked: ParkedStorage) -> Any:
    """The values `park_values` was given, back on their devices (fresh device buffers), bit for bit."""
    recipes: dict[int, JaxLeaf] = {id(x): x for x in parked.leaves if isinstance(x, JaxLeaf)}  # each once
    out: list[Any] = list(parked.leaves)
    if recipes:
        restored = jax.device_put([r.host for r in recipes.values()], [r.sharding for r in recipes.values()])
        by_recipe = dict(zip(recipes, restored))
        for i, leaf in enumerate(parked.leaves):
            if isinstance(leaf, JaxLeaf):
                out[i] = by_recipe[id(leaf)]
    if parked.storages:
        device_storages = _copy_storages_to_device(parked)
        for i, leaf in enumerate(parked.leaves):
            if isinstance(leaf, TorchLeaf):
                out[i] = rebuild_leaf(leaf, device_storages[leaf.storage])
    return jax.tree_util.tree_unflatten(parked.treedef, out)


def _copy_storages_to_device(parked: ParkedStorage) -> list[Any]:
    """One fresh allocation per storage, filled from its host buffer (`park_values` packs a buffer's storages
    back to back from its start, so one ``split`` cuts them all out); a CPU storage is one ``clone``."""
    torch = _torch()
    result: list[Any] = [None] * len(parked.storages)
    by_buffer: dict[int, list[int]] = {}
    for i, s in enumerate(parked.storages):
        by_buffer.setdefault(s.buffer, []).append(i)
    synced = set()
    for b, members in by_buffer.items():
        for i, view in zip(members, parked.buffers[b].split([parked.storages[i].nbytes for i in members])):
            device = parked.storages[i].device
            if device.type == "cpu" and view.numel() < _NUMPY_MIN:
                result[i] = view.clone()  # a fresh storage of exactly these bytes: allocation and copy in one call
                continue
            dev = _host_bytes(view.numel(), False) if device.type == "cpu" else torch.empty_like(view, device=device)
            if view.numel():
                dev.copy_(view, non_blocking=device.type == "cuda")
                if device.type == "cuda":
                    synced.add(device)
            result[i] = dev
    for device in synced:
        torch.cuda.current_stream(device).synchronize()  # the host buffer may be freed after this
    return result


def host_storage(parked: ParkedStorage, index: int) -> Any:
    """Storage ``index`` of ``parked`` as it sits in its host buffer: a 1-D uint8 CPU tensor over exactly its
    bytes, with a storage of its own (no copy), which `rebuild_leaf` can rebuild the storage's leaves over.

    Storages share host buffers back to back, so a plain slice of the buffer would still report the whole
    buffer as its storage; through numpy, the view gets a storage that starts where this one starts.
    """
    torch = _torch()
    s = parked.storages[index]
    if not s.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(parked.buffers[s.buffer].numpy()[s.start : s.start + s.nbytes])


def rebuild_leaf(leaf: TorchLeaf, storage: Any) -> Any:
    """``leaf`` as a view of ``storage``, a uint8 tensor that spans a whole storage (its offsets index that)."""
    torch = _torch()
    if storage.storage_offset() or storage.numel() != storage.untyped_storage().nbytes():
        # A slice of a larger buffer: every offset would land in someone else's bytes.
        raise AssertionError("rebuild_leaf needs a tensor that spans its whole storage, not a slice of one")
    t = torch.empty(0, dtype=leaf.dtype, device=storage.device).set_(
        storage.untyped_storage(), leaf.offset, leaf.shape, leaf.stride
    )
    if leaf.conj:
        t = t.conj()
    if leaf.neg:
        t = torch._neg_view(t)
    if leaf.requires_grad:
        t.requires_grad_(True)
    if leaf.jax_owner_type is None:
        return t
    return jax_alias(t, leaf.jax_owner_type)


def jax_alias(t: Any, owner_type: type | None) -> Any:
    """A JAX array over tensor ``t``'s memory, registered as an alias owned by ``owner_type(t)`` (the bridge's
    record type, when it takes a tensor) or by ``t`` itself, so the accounting counts the memory once."""
    exported = t.detach()
    if exported.device.type == "cuda":
        with _torch().cuda.device(exported.device):  # torch exports only tensors of the current device
            array = jax.dlpack.from_dlpack(exported)
    else:
        array = jax.dlpack.from_dlpack(exported)
    if exported.numel() and array.unsafe_buffer_pointer() != exported.data_ptr():
        return array  # JAX copied (an alignment it needs): the values are exact, and nothing aliases
    owner: Any = exported
    if owner_type is not None:
        try:
            owner = owner_type(exported)
        except Exception:
            owner = exported
    accounting.register_alias(array, owner)
    return array


# --- ParkedStorage as a pytree: its JAX host arrays are the leaves, the rest static ----------------------
# So a session tree that holds a parked object can be mapped or jitted over (issue 21). Torch buffers and
# values kept as is are static, compared by identity: a parked torch tensor means a trace per parked copy.


class _ParkedAux:
    """A `ParkedStorage` less its JAX host arrays; equal when the structure, the shardings and every other
    part (by identity) are, so parked copies of equal layouts share a trace."""

    __slots__ = ("_key", "parked")

    def __init__(self, parked: ParkedStorage):
        self.parked = parked
        self._key = tuple(
            ("jax", leaf.sharding) if isinstance(leaf, JaxLeaf) else ("id", id(leaf)) for leaf in parked.leaves
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _ParkedAux):
            return NotImplemented
        a, b = self.parked, other.parked
        return (
            a.treedef == b.treedef
            and self._key == other._key
            and all(x is y for x, y in zip(a.storages + a.buffers, b.storages + b.buffers))
            and len(a.storages) == len(b.storages)
            and len(a.buffers) == len(b.buffers)
        )

    def __hash__(self) -> int:
        return hash((self.parked.treedef, len(self._key)))


def _jax_recipes(parked: ParkedStorage) -> list[JaxLeaf]:
    seen: dict[int, JaxLeaf] = {}
    for leaf in parked.leaves:
        if isinstance(leaf, JaxLeaf):
            seen.setdefault(id(leaf), leaf)
    return list(seen.values())


def _flatten_parked(parked: ParkedStorage) -> tuple[list[Any], _ParkedAux]:
    return [leaf.host for leaf in _jax_recipes(parked)], _ParkedAux(parked)


def _unflatten_parked(aux: _ParkedAux, children: Any) -> ParkedStorage:
    parked = aux.parked
    new = {id(r): JaxLeaf(host, r.sharding) for r, host in zip(_jax_recipes(parked), children)}
    leaves = tuple(new.get(id(leaf), leaf) if isinstance(leaf, JaxLeaf) else leaf for leaf in parked.leaves)
    return ParkedStorage(parked.treedef, leaves, parked.storages, parked.buffers)


jax.tree_util.register_pytree_node(ParkedStorage, _flatten_parked, _unflatten_parked)
