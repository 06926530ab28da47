"""Parking: move committed storage to host memory and bring it back exactly where it was, bit for bit.

`park_values` turns the values an object holds (a pytree of JAX arrays, torch tensors and anything else)
into a `ParkedStorage`; `restore_values` gives them back.

* **JAX arrays** move with ``jax.device_put`` to the ``pinned_host`` memory kind of their own sharding
  (per shard, for a sharded array) and back to the sharding they had: same devices, same memory kind,
  same dtype and shape. One ``device_put`` call moves all of an object's arrays, and always copies: an
  array already in ``pinned_host`` gets a host copy of its own, and a restore never hands out the parked one.
* **torch tensors** are grouped by storage (`torch_host`): each storage is copied once, whole, into host
  memory in runs of at most `_CHUNK` bytes per device, back to back (`host_buffers.pack_runs`; on the CPU
  the runs of small storages share one host buffer once they fill a huge page). For CPU sources that is one
  ``torch.cat`` per run of tensors that span their storages exactly, of one dtype, and one of raw bytes for
  the rest (storages of one dtype and trailing shape that share a buffer are one segment: one ``torch.cat``); for a GPU, a pinned buffer filled with ``non_blocking`` copies and one stream sync. A restore
  makes a fresh allocation per storage on its device (one ``split_with_sizes_copy`` per such run); every
  other tensor is rebuilt as a view with its own offset, shape, strides and conjugate/negative bits. Tensors that were
  views of one storage are views of one storage again; separate storages stay separate, also over
  overlapping memory (``torch.from_numpy`` of ``X[:5]`` and of ``X``): each comes back as a copy of its own
  bytes, no longer aliased (a storage is its extent: two over the same extent are one). Large CPU buffers
  come from `host_buffers` (recycled, else fresh from numpy's huge pages): first-touch page faults
  otherwise double the cost of a copy.
* **CPU torch storages nothing else holds are taken, not copied** (`StateObject.park`, the table's `park`):
  on the CPU the device's memory is host memory, and a copy would hold the same bytes twice for a moment
  and evict the model's weights from the caches. A storage is taken only when no reference outside the
  parked object reaches it (`_take`: no tensor, container, view, storage object or numpy view the caller
  keeps, memory torch allocated, nothing outside the table reading it); any other is copied as above, and
  ``copy=True`` copies every one. A taken storage is read by the parked copy while it lives
  (`outside_readers`): the contract a fork's shared storages have, so `writable` copies it before an
  in-place write (through the restored tensors, or the resident object an older table still holds) and a
  write outside `writable` is refused; a restore hands the storages back as they are when nothing else
  holds them (else it copies, as above), and refuses a parked copy written in place since. The figures
  move the bytes from ``cpu`` to ``cpu/unpinned_host`` exactly as a copy would: they are what a budget
  reads, and on the CPU both name the same memory.
* **JAX arrays that alias a torch storage** through the bridge park that whole storage (the memory they
  keep alive) and come back as JAX arrays over the restored storage.
* Anything else (numpy arrays, which already live in host memory, Python values) is kept as it is.

A leaf that appears more than once (one JAX array under two names) is copied once and restored as one
array, so the restore holds exactly the device memory the park released. A torch tensor keeps
``requires_grad`` and its type (a ``torch.nn.Parameter`` comes back one; a subclass that cannot be rebuilt,
see `torch_host.rebuildable`, is refused with `InvalidTypeError`). A JAX array that was deleted (donated)
holds no bytes to park: `park_values` refuses it with `DeletedArrayError`. Either refusal moves nothing.

The accounting files parked bytes under the host pools: ``cpu/pinned_host`` (JAX's pinned host memory
kind, and pinned torch buffers) and ``cpu/unpinned_host`` (pageable torch buffers, the only kind torch
has without CUDA), apart from the device pools (``cpu``, ``cuda:0``), so a CPU run shows the move too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Sequence
from typing import Any

import jax

from ..errors import DeletedArrayError, SharedStorageWrittenError
from . import accounting, host_buffers, outside_readers, small_tensors, torch_host
from .extents import Extent
from .shardings import copy_to
from .torch_host import TorchLeaf as TorchLeaf
from .torch_host import as_torch as as_torch
from .torch_host import host_storage as host_storage
from .torch_host import jax_alias as jax_alias
from .torch_host import rebuild_leaf as rebuild_leaf

__all__ = ["HOST_KINDS", "ParkedStorage", "park_values", "restore_values"]

HOST_KINDS = ("pinned_host", "unpinned_host")
# Runs of storages share a host buffer up to this size: many small tensors share one allocation and copy,
# and the allocator serves each from memory it holds; a 27.7 MiB Wan feat cache in one buffer took ~1,900
# page faults per park (fresh pages after a heap trim), in runs of 256 KiB about 1.
_CHUNK = 256 << 10
_NUMPY_MIN = host_buffers.MIN_NBYTES  # a buffer of a huge page or more comes from the recycling cache
_TORCH = object()  # in `ParkedStorage.slots`: a torch leaf, restored from the storages


@dataclasses.dataclass(frozen=True)
class JaxLeaf:
    host: jax.Array  # the array in a host memory kind
    sharding: Any  # where it came from (devices and memory kind)


@dataclasses.dataclass(frozen=True)
class _Storage:
    device: Any  # torch.device of the original storage
    buffer: int  # index into ParkedStorage.buffers
    start: int  # byte offset in that host buffer
    nbytes: int


class _Layout:
    """Where the parked torch storages sit, in columns (no object per storage or leaf): per storage its device
    and bytes; per torch leaf its index, storage and recipe (`torch_host.Gathered`); and the segments a
    restore cuts out, each ``(buffer, start, end, storages, dtype, trail)``: ``dtype`` None for raw bytes, else
    plain storages of that dtype and trailing shape back to back (each storage's shape ``(n, *trail)``)."""

    __slots__ = ("devices", "direct", "leaf", "nbytes", "recipe", "segments", "storage")

    def __init__(self, g: torch_host.Gathered):
        self.devices, self.nbytes, self.direct = g.devices, g.sizes, g.direct
        self.leaf, self.storage, self.recipe = g.leaf, g.storage, g.recipe
        self.segments: list[tuple[int, int, int, Sequence[int], Any, tuple[int, ...]]] = []

    def split_sizes(self, members: Any, dtype: Any, trail: tuple[int, ...]) -> list[int]:
        """The first-dim sizes of a plain segment's storages (their bytes for raw ones)."""
        per = 1 if dtype is None else math.prod(trail, start=dtype.itemsize)
        if type(members) is range:  # (the storages of a run cut from the whole range: a slice of the sizes)
            return [n // per for n in self.nbytes[members.start : members.stop]]
        return [self.nbytes[k] // per for k in members]


class _Views(Sequence[Any]):
    """The host buffers of a parked copy that took its tensors: a uint8 view of each, made on first read (a
    restore that hands the tensors back, the common case, never reads them), then kept (the same objects on
    every read: `_ParkedAux` compares buffers by identity)."""

    __slots__ = ("_made", "_tensors")

    def __init__(self, tensors: tuple[Any, ...]):
        self._tensors = tensors
        self._made: tuple[Any, ...] | None = None

    def made(self) -> bool:
        """Whether the views exist (each holds its storage once more: `_hand_back` counts them)."""
        return self._made is not None

    def _views(self) -> tuple[Any, ...]:
        made = self._made
        if made is None:
            uint8 = torch_host.torch_module().uint8
            self._made = made = tuple(t.view(-1).view(uint8) for t in self._tensors)
        return made

    def __getitem__(self, index: Any) -> Any:
        return self._views()[index]

    def __len__(self) -> int:
        return len(self._tensors)


@dataclasses.dataclass(frozen=True, eq=False)
class ParkedStorage:
    """The host copy of an object's committed storage, and what restoring it needs. Immutable."""

    treedef: Any  # structure of the parked values
    slots: tuple[Any, ...]  # per leaf: JaxLeaf, the value kept as is, or _TORCH (a torch leaf, in `layout`)
    layout: _Layout | None  # the torch storages in `buffers`, and the torch leaves over them
    buffers: Sequence[Any]  # contiguous uint8 torch tensors, in runs of storages per source device
    # Taken, not copied (a CPU park of storages nothing else holds): the parked tensors themselves, one per
    # storage (the buffers are uint8 views of them, made when first read: `_Views`), and their version counters then (shared with every view
    # of them: a write in place since is seen). None: the buffers are this copy's own.
    taken: tuple[Any, ...] | None = None
    versions: tuple[int, ...] = ()
    # The figures `_accounting_extents` gives, when the park read them already (a taken park: the storages'
    # own addresses, relabelled to a host pool); None: read from the buffers on first use.
    host_extents: tuple[Extent, ...] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.taken is not None:  # (also for a copy `_unflatten_parked` makes: it shares the storages too)
            for e in self._accounting_extents():  # (a taken buffer is a whole storage, so its extent)
                outside_readers.read_by(e.start, e.end - e.start, self)

    @functools.cached_property
    def leaves(self) -> tuple[Any, ...]:
        """Per leaf: JaxLeaf, TorchLeaf, or the value kept as is (the recipes written out on first use)."""
        out, lay = list(self.slots), self.layout
        if lay is not None:
            shapes: dict[int, tuple[Any, tuple[int, ...]]] = {}
            for _b, _a, _e, members, dtype, trail in lay.segments:
                if dtype is not None:
                    sizes = lay.split_sizes(members, dtype, trail)
                    shapes.update((k, (dtype, (n, *trail))) for k, n in zip(members, sizes))
            for i, k, recipe in zip(lay.leaf, lay.storage, lay.recipe):
                out[i] = recipe if recipe is not None else torch_host.plain_leaf(k, *shapes[k])
        return tuple(out)

    @functools.cached_property
    def storages(self) -> tuple[_Storage, ...]:
        """Per torch storage: its device, host buffer, start and bytes."""
        lay = self.layout
        if lay is None:
            return ()
        out: list[Any] = [None] * len(lay.nbytes)
        for b, a, _end, members, _dtype, _trail in lay.segments:
            for k in members:
                out[k] = _Storage(lay.devices[k], b, a, lay.nbytes[k])
                a += lay.nbytes[k]
        return tuple(out)

    @property
    def nbytes(self) -> int:
        """Host bytes held (each host buffer and JAX host array once)."""
        return sum(accounting.walk(self)[0].values())

    def _accounting_children(self) -> list[Any]:
        # JAX host arrays report their memory kind themselves; torch buffers are filed by _accounting_extents.
        return [leaf.host if isinstance(leaf, JaxLeaf) else leaf for leaf in self.slots if leaf is not _TORCH]

    def _accounting_extents(self) -> tuple[Extent, ...]:
        # Read once (a memo in the instance dict, as `cached_property` keeps one, without its lock): the host
        # buffers are this copy's own and never change, and the ledger's walk of a parked object and the
        # table's index of parked copies both read them.
        memo = self.__dict__.get("_host_extents", self.host_extents)
        if memo is not None:
            return memo
        out: accounting.Extents = []
        for buf in self.buffers:
            storage = buf.untyped_storage()
            n = storage.nbytes()
            if n:
                start = storage.data_ptr()
                out.append(_host_extent(buf, start, n))
        self.__dict__["_host_extents"] = memo = tuple(out)
        return memo

    def __repr__(self) -> str:
        n = len(self.layout.nbytes) if self.layout is not None else 0
        return f"ParkedStorage(leaves={len(self.slots)}, torch_storages={n})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self.taken is None:
            return super().__reduce_ex__(protocol)
        # A copy (pickled, deep-copied) holds tensors of its own: their version counters and addresses, not
        # the originals' (`_taken_again`); a write since the park stays one.
        written = tuple(t._version != v for t, v in zip(self.taken, self.versions))
        return _taken_again, (self.treedef, self.slots, self.layout, self.taken, written)


def _host_extent(t: Any, start: int, n: int) -> Extent:
    """The figure of ``n`` host bytes at ``start`` held by CPU tensor ``t``: filed under its host pool (pinned
    memory stays pinned)."""
    return Extent("cpu/pinned_host" if t.is_pinned() else "cpu/unpinned_host", start, start + n)


def _taken_again(treedef: Any, slots: Any, layout: _Layout, taken: tuple[Any, ...], written: tuple[bool, ...]) -> Any:
    """A taken `ParkedStorage` over ``taken``, copies of the original's tensors (a pickle, a deep copy): versions
    read from them now (-2, which no counter reads, where the original was written since its park: a restore
    still refuses it), host figures at their own addresses, registered as their reader."""
    versions = tuple(-2 if w else t._version for t, w in zip(taken, written))
    extents = tuple(_host_extent(t, t.data_ptr(), t.nbytes) for t in taken)
    return ParkedStorage(treedef, slots, layout, _Views(taken), taken, versions, extents)


def park_values(values: Any, what: str = "park_values", *, held: int | None = None) -> ParkedStorage:
    """Copy the storage of every array in ``values`` (any pytree) to host memory; see the module docstring.

    Args:
      values: the pytree to park.
      what: the call named in an error message.
      held: None (the default) always copies. An int: ``values`` is a fresh dict of an object's fields (each
        field's value referenced by the object and this dict alone), and each tensor leaf is referenced
        ``held`` more times by the caller's own bookkeeping (the table's write records); CPU storages that
        nothing else holds are then taken as they are instead of copied (`_take`).

    Raises:
      DeletedArrayError: a JAX array in ``values`` was deleted (donated); nothing was copied.
      InvalidTypeError: a tensor subclass in ``values`` cannot be rebuilt (`torch_host.rebuildable`).

    Example:
      >>> import jax.numpy as jnp
      >>> parked = park_values({"storage": jnp.arange(4.0)})
      >>> parked.leaves[0].host.sharding.memory_kind
      'pinned_host'
      >>> restore_values(parked)["storage"].tolist()
      [0.0, 1.0, 2.0, 3.0]
    """
    leaves, treedef = jax.tree_util.tree_flatten(values)
    if held is not None and (taken := _take(values, leaves, held)) is not None:
        return ParkedStorage(treedef, (_TORCH,) * len(leaves), *taken[:4], host_extents=taken[4])
    one = small_tensors.copied(leaves, _CHUNK, _NUMPY_MIN)
    if one is not None:  # many small 1-D tensors of one dtype: one segment, one copy
        layout = _Layout(one[0])
        layout.segments.append((0, 0, one[1].numel(), range(len(leaves)), one[0].dtypes[0], ()))
        return ParkedStorage(treedef, (_TORCH,) * len(leaves), layout, (one[1],))
    gathered = torch_host.gather(leaves, _NUMPY_MIN, (values, what))
    if gathered.direct:  # every leaf a tensor spanning its own storage: nothing else to look at
        layout, buffers = _copy_storages_to_host(gathered)
        return ParkedStorage(treedef, (_TORCH,) * len(leaves), layout, tuple(buffers))
    slots: list[Any] = list(leaves)
    for i in gathered.leaf:
        slots[i] = _TORCH
    jax_index: dict[int, list[int]] = {}  # id(array) -> the leaves that are that array
    for i in gathered.others:
        leaf = leaves[i]
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            if leaf.is_deleted():
                _raise_deleted(values, i, leaf, what)
            jax_index.setdefault(id(leaf), []).append(i)
    if jax_index:
        arrays = [leaves[same[0]] for same in jax_index.values()]
        targets = [a.sharding.with_memory_kind("pinned_host") for a in arrays]
        # Never the source itself: ``device_put`` to the sharding an array already has (one in ``pinned_host``
        # already) returns that array, and a host copy that is the source dies when the source is donated.
        hosts = copy_to(arrays, targets)
        for same, a, host in zip(jax_index.values(), arrays, hosts):
            recipe = JaxLeaf(host, a.sharding)
            for i in same:  # one host array per distinct array, so its restore is one array again
                slots[i] = recipe
    if not gathered.sources:
        return ParkedStorage(treedef, tuple(slots), None, ())
    layout, buffers = _copy_storages_to_host(gathered)
    return ParkedStorage(treedef, tuple(slots), layout, tuple(buffers))


@functools.cache
def _alone() -> tuple[int, int, int, int]:
    """The reference counts `_take` sees for values that the library alone holds: of a container held by its
    parent alone, of a tensor held by its container alone (and the flattened leaves), of its storage
    (tensors and views over it), and of its storage's Python object. Measured once, through the same calls,
    on a fresh tensor in a field of its own."""
    torch = torch_host.torch_module()
    field = (torch.empty(1),)  # (the object's field: this name stands for the object's attribute)
    fields = {"value": field}
    leaves = list(field)
    return _private(fields, None), *_facts(leaves)[0][:3]


def _private(fields: dict[str, Any], counts: tuple[int, int, int, int] | None) -> Any:
    """Whether every container in ``fields`` (tuples, lists and dicts only) is referenced by its parent alone
    (a field's value by the object and ``fields``) per ``counts`` (`_alone`); None measures that count."""
    seen: list[int] = []
    stack: list[tuple[Any, int]] = [(v, 2) for v in fields.values()]  # (a field: the object and ``fields``)
    tensor = torch_host.torch_module().Tensor
    while stack:
        node, parents = stack.pop()
        if type(node) is tensor:
            continue
        if type(node) not in (tuple, list, dict):
            return False
        seen.append(sys.getrefcount(node) - parents)
        stack.extend((x, 1) for x in (node.values() if type(node) is dict else node))
    if counts is None:
        return seen[0]
    return all(n == counts[0] for n in seen)


def _facts(leaves: list[Any]) -> list[tuple[int, int, int, Any]]:
    """Per tensor: its references, its storage's (tensors and views over it), its storage object's, and that
    storage object."""
    use_count = torch_host.torch_module()._C._storage_Use_Count
    out = []
    for t in leaves:
        s = t.untyped_storage()
        out.append((sys.getrefcount(t), use_count(s._cdata), sys.getrefcount(s), s))
    return out


def _take(
    fields: Any, leaves: list[Any], held: int
) -> tuple[_Layout, _Views, tuple[Any, ...], tuple[int, ...], tuple[Extent, ...]] | None:
    """The layout, buffers, tensors, versions and host extents of a parked copy that takes the leaves' own storages instead of
    copying them, or None (copy them) unless every leaf is a plain CPU tensor spanning a storage that torch
    allocated (no ``from_numpy`` or DLPack memory, no engine pool) and that nothing else can write: no other
    reference to the tensor than its one container in ``fields`` (and ``held`` of the caller's), none to a
    container but its parent's (a tuple the user keeps would reach the tensors), no other tensor or view over
    the storage, no reference to the storage's Python object, nothing outside the table reading it
    (`outside_readers`), and a version counter (no inference-mode tensor).

    On the CPU the device's memory is host memory: the copy would hold the same bytes in the same memory.
    The storages are registered as read outside the table for as long as the parked copy lives, the contract
    a fork's shared storages have: `writable` copies one before an in-place write (the restored tensors, or
    the resident object an older table still holds), a write outside it is refused by the table's checks,
    and a restore refuses a parked copy written since (its version counters moved)."""
    torch = torch_host.torch_module()
    if torch is None or not leaves or type(fields) is not dict or set(map(type, leaves)) != {torch.Tensor}:
        return None
    facts = _facts(leaves)  # (first: the loop variable below holds one more reference)
    alone = _alone()
    want = (alone[1] + held, *alone[2:])
    strided, plain, read_at = torch.strided, torch_host.plain_dtypes(torch), outside_readers.read_at
    segments, extents = [], []
    for k, (t, (refs, use, storage_refs, storage)) in enumerate(zip(leaves, facts)):
        n, dtype, start = t.nbytes, t.dtype, storage.data_ptr()
        if (
            (refs, use, storage_refs) != want
            or not n
            or storage.nbytes() != n
            or not storage.resizable()  # (memory torch allocated: no from_numpy, DLPack or `.numpy()` view)
            or not t.is_cpu
            or t.layout is not strided
            or t.is_nested
            or t.requires_grad
            or t.is_inference()
            or dtype not in plain
            or not t.dim()
            or t.storage_offset()
            or not t.is_contiguous()
            or t.is_neg()
            or t.is_conj()
            or torch_host.needs_recipe(t)
            or read_at(start, n)
        ):
            return None
        segments.append((k, 0, n, range(k, k + 1), dtype, tuple(t.shape[1:])))
        # The host copy's figures, read here once: the storages themselves, filed as `_accounting_extents`
        # files a host buffer (the same addresses and bytes; a pinned CPU storage stays pinned).
        extents.append(_host_extent(t, start, n))
    if not _private(fields, alone):
        return None
    g = torch_host.Gathered()
    n = len(leaves)
    g.devices, g.sizes, g.direct = [torch.device("cpu")] * n, [s[2] for s in segments], True
    g.leaf, g.storage, g.recipe = list(range(n)), list(range(n)), [None] * n
    layout = _Layout(g)
    layout.segments.extend(segments)
    taken = tuple(leaves)
    return layout, _Views(taken), taken, tuple(t._version for t in leaves), tuple(extents)


def _raise_deleted(values: Any, index: int, leaf: Any, what: str) -> None:
    path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(values)[0][index][0])
    raise DeletedArrayError(
        f"`{what}`: the JAX array at {path or 'the root'} ({leaf.dtype}{list(leaf.shape)}) was deleted, most "
        f"likely donated to a jitted call (`donate_argnums`, or `step(..., donate=True)` on another copy of "
        f"this state): its bytes are gone, so there is nothing to park. Use the state that call returned, or "
        f"commit a fresh value first."
    )


def _copy_storages_to_host(g: torch_host.Gathered) -> tuple[_Layout, list[Any]]:
    """Copy each gathered storage, whole, into contiguous host buffers: in order, runs of at most `_CHUNK`
    bytes per source device (a larger storage is a run of its own), packed back to back with no padding (the
    host pool rises by exactly the bytes the device pool loses)."""
    torch = torch_host.torch_module()
    layout = _Layout(g)
    devices, sources = g.devices, g.sources
    if (trail := g.trail) is not None and max(g.sizes) <= _CHUNK and (total := sum(g.sizes)) >= _NUMPY_MIN:
        # Plain CPU storages of one dtype and trailing shape, whose runs would sit back to back in the shared
        # buffer below: one segment, so one ``torch.cat`` (and one split on restore) instead of one per run.
        layout.segments.append((0, 0, total, range(len(sources)), g.dtypes[0], trail))
        pool = host_buffers.host_bytes(total, False)
        with torch.no_grad():
            _fill(pool, 0, total, sources, g.dtypes[0], trail, False)
        return layout, [pool]
    groups: dict[Any, Any]
    if devices.count(devices[0]) == len(devices):
        groups = {devices[0]: range(len(devices))}  # (a range: a run's storages are a slice of the sources)
    else:
        groups = {}
        for k, device in enumerate(devices):
            groups.setdefault(device, []).append(k)
    buffers: list[Any] = []
    with torch.no_grad():  # bytes, not graphs (an out= copy refuses inputs that require grad)
        for device, members in groups.items():
            pinned = device.type == "cuda"
            runs = host_buffers.pack_runs(members, g.sizes, g.dtypes, g.shapes, g.trail, _CHUNK)
            # Runs of small storages share one host buffer once they fill a huge page, recycled when the same
            # bytes were parked before: a run each from malloc took pages the heap trimmed as the last parked
            # copy died (~4,000 faults, 6x the park itself, for 4,096 small tensors parked and restored in turn).
            shared = 0 if pinned else sum(total for total, _ in runs if total <= _CHUNK)
            pool = host_buffers.host_bytes(shared, False) if shared >= _NUMPY_MIN else None
            if pool is not None:
                pool_at, base = len(buffers), 0
                buffers.append(pool)
            for total, segments in runs:
                if pool is not None and total <= _CHUNK:
                    host, b, off = pool, pool_at, base
                    base += total
                elif not pinned and total < _NUMPY_MIN and len(segments) == 1 and segments[0][3] is not None:
                    # A run of plain storages of its own from torch's allocator: a ``torch.cat`` allocates it
                    # and copies in one call (as `host_bytes` would allocate it, then `_fill` copy).
                    _a, end, seg, dtype, trail = segments[0]
                    srcs = sources[seg.start : seg.stop] if type(seg) is range else [sources[k] for k in seg]
                    layout.segments.append((len(buffers), 0, end, seg, dtype, trail))
                    buffers.append(torch.cat(srcs).view(-1).view(torch.uint8))
                    continue
                else:
                    host, b, off = host_buffers.host_bytes(total, pinned), len(buffers), 0
                    buffers.append(host)
                for a, end, seg, dtype, trail in segments:
                    layout.segments.append((b, a + off, end + off, seg, dtype, trail))
                    srcs = sources[seg.start : seg.stop] if type(seg) is range else [sources[k] for k in seg]
                    _fill(host, a + off, end + off, srcs, dtype, trail, pinned)
            if pinned:
                torch.cuda.current_stream(device).synchronize()  # the device storages may be freed after this
    return layout, buffers


def _fill(host: Any, a: int, end: int, srcs: list[Any], dtype: Any, trail: tuple[int, ...], pinned: bool) -> None:
    """Copy one segment's storages into ``host[a:end]``."""
    torch = torch_host.torch_module()
    if pinned:  # (a GPU run: one transfer per storage, each a DMA into pinned memory)
        for src in srcs:
            view = torch_host.bytes_view(src)
            if view.numel():
                host[a : a + view.numel()].copy_(view, non_blocking=True)
                a += view.numel()
    elif dtype is not None and not a % dtype.itemsize:
        out = host[a:end].view(dtype)
        torch.cat(srcs, out=out.view(-1, *trail) if trail else out)
    elif a < end:  # raw bytes (or plain storages off their dtype's alignment in a mixed run)
        torch.cat([torch_host.bytes_view(s) for s in srcs], out=host[a:end])


def restore_values(parked: ParkedStorage, *, copy: bool = False) -> Any:
    """The values `park_values` was given, back on their devices (fresh device buffers), bit for bit; a
    copy that took its storages (`_take`) hands them back as they are when nothing else holds them now.

    Raises:
      SharedStorageWrittenError: a taken storage was written in place since the park; nothing changes.
    """
    if parked.taken is not None:
        handed = _hand_back(parked, copy)
        if handed is not None:
            return jax.tree_util.tree_unflatten(parked.treedef, handed)
    if parked.layout is not None and parked.layout.direct:  # the leaves are the restored storages, in order
        return jax.tree_util.tree_unflatten(parked.treedef, _copy_storages_to_device(parked))
    out: list[Any] = list(parked.slots)
    recipes: dict[int, JaxLeaf] = {id(x): x for x in out if isinstance(x, JaxLeaf)}  # each once
    if recipes:
        # (a copy, not the host array itself: see `park_values`)
        restored = copy_to([r.host for r in recipes.values()], [r.sharding for r in recipes.values()])
        by_recipe = dict(zip(recipes, restored))
        for i, leaf in enumerate(parked.slots):
            if isinstance(leaf, JaxLeaf):
                out[i] = by_recipe[id(leaf)]
    lay = parked.layout
    if lay is not None:
        storages = _copy_storages_to_device(parked)
        rebuild = torch_host.rebuild
        for i, k, recipe in zip(lay.leaf, lay.storage, lay.recipe):
            s = storages[k]
            out[i] = s if recipe is None else rebuild(recipe, s.untyped_storage(), s.device)
    return jax.tree_util.tree_unflatten(parked.treedef, out)


def _hand_back(parked: ParkedStorage, copy: bool) -> list[Any] | None:
    """The tensors ``parked`` took, handed back as they are (no copy, the very tensor objects: a caller that
    checked them before knows them), or None when something else holds one now (the resident object an older
    table keeps, an earlier restore): then the restore copies, so that a write through `writable` here never
    reaches the other holder once the parked copy is gone."""
    taken = parked.taken
    assert taken is not None
    written = [k for k, (t, v) in enumerate(zip(taken, parked.versions)) if t._version != v]
    if written:
        t = taken[written[0]]
        storage = t.untyped_storage()
        raise SharedStorageWrittenError(
            f"`restore`: the parked copy took the {storage.nbytes()}-byte cpu storage at {storage.data_ptr():#x} "
            f"without copying it (a CPU park of a storage nothing else held), and that storage was written in "
            f"place since (version {parked.versions[written[0]]} -> {t._version}), outside `writable`, through a "
            f"tensor of the resident object an older table holds: the parked bytes are not what was parked. Write "
            f"in place only through `writable`; to keep a private host copy, park with `copy=True`."
        )
    if copy:
        return None
    refs, use, storage_refs = _alone()[1:]
    # Each tensor held by the parked copy alone (one container), its storage by it and its buffer view alone
    # (when the views were made: `_Views`).
    views = type(parked.buffers) is _Views and parked.buffers.made()
    if any(f[:3] != (refs, use + views, storage_refs) for f in _facts(list(taken))):
        return None
    return list(taken)


def _copy_storages_to_device(parked: ParkedStorage) -> list[Any]:
    """One fresh allocation per storage, filled from its host buffer: a segment of plain storages is one
    ``split_with_sizes_copy`` (each piece a fresh tensor of its own shape), a small raw CPU storage one
    ``clone``, a large one a recycled host buffer (`host_buffers`), a GPU storage a ``non_blocking`` copy."""
    torch = torch_host.torch_module()
    lay = parked.layout
    assert lay is not None
    result: list[Any] = [None] * len(lay.nbytes)
    synced = set()
    for b, a, end, members, dtype, trail in lay.segments:
        seg, sizes = parked.buffers[b], lay.split_sizes(members, dtype, trail)
        if a or end != seg.numel():
            seg = seg[a:end]
        if dtype is not None:
            if a % dtype.itemsize:
                seg = seg.clone()  # (off its dtype's alignment in the host buffer: realigned by one copy)
            typed = seg.view(dtype).view(-1, *trail) if trail else seg.view(dtype)
            pieces = torch.split_with_sizes_copy(typed, sizes) if len(sizes) > 1 else (typed.clone(),)
            lo, hi = members[0], members[-1] + 1
            if hi - lo == len(members):  # (increasing storage indices: consecutive ones are one slice)
                result[lo:hi] = pieces
            else:
                for k, t in zip(members, pieces):
                    result[k] = t
            continue
        for k, view in zip(members, seg.split(sizes)):
            device = lay.devices[k]
            if device.type == "cpu" and view.numel() < _NUMPY_MIN:
                result[k] = view.clone()  # a fresh storage of exactly these bytes: allocation and copy in one call
                continue
            dev = (
                host_buffers.host_bytes(view.numel(), False)
                if device.type == "cpu"
                else torch.empty_like(view, device=device)
            )
            if view.numel():
                dev.copy_(view, non_blocking=device.type == "cuda")
                if device.type == "cuda":
                    synced.add(device)
            result[k] = dev
    for device in synced:
        torch.cuda.current_stream(device).synchronize()  # the host buffer may be freed after this
    return result


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
            ("jax", leaf.sharding) if isinstance(leaf, JaxLeaf) else ("id", id(leaf)) for leaf in parked.slots
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _ParkedAux):
            return NotImplemented
        a, b = self.parked, other.parked
        return (
            a.treedef == b.treedef
            and self._key == other._key
            and a.layout is b.layout
            and len(a.buffers) == len(b.buffers)
            and all(x is y for x, y in zip(a.buffers, b.buffers))
        )

    def __hash__(self) -> int:
        return hash((self.parked.treedef, len(self._key)))


def _jax_recipes(parked: ParkedStorage) -> list[JaxLeaf]:
    seen: dict[int, JaxLeaf] = {}
    for leaf in parked.slots:
        if isinstance(leaf, JaxLeaf):
            seen.setdefault(id(leaf), leaf)
    return list(seen.values())


def _flatten_parked(parked: ParkedStorage) -> tuple[list[Any], _ParkedAux]:
    return [leaf.host for leaf in _jax_recipes(parked)], _ParkedAux(parked)


def _unflatten_parked(aux: _ParkedAux, children: Any) -> ParkedStorage:
    parked = aux.parked
    new = {id(r): JaxLeaf(host, r.sharding) for r, host in zip(_jax_recipes(parked), children)}
    slots = tuple(new.get(id(leaf), leaf) if isinstance(leaf, JaxLeaf) else leaf for leaf in parked.slots)
    return ParkedStorage(
        parked.treedef, slots, parked.layout, parked.buffers, parked.taken, parked.versions, parked.host_extents
    )


jax.tree_util.register_pytree_node(ParkedStorage, _flatten_parked, _unflatten_parked)
