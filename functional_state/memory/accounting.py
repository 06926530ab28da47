"""Per-device byte accounting, counted per allocation and deduplicated by memory extent.

A buffer is modelled as an extent ``[start, end)`` on a device. Each call unions the extents of everything
reachable from its roots, per device, so two views of one storage, an alias between an attribute and a
state object, a tensor shared by several sessions, and a JAX array that aliases a torch tensor through
DLPack all count once. Sizes are those of the *allocation* a value keeps alive, never ``numel * element_size``:
a narrow slice of a large tensor reports the whole storage (and a ``memoryview``, the whole buffer it exports).

The walk never raises: what it cannot read is counted in its report (``unaccounted_objects``), and a JAX array
that was deleted (donated) is reported as ``deleted_arrays`` instead of silently counting zero.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import sys
import types
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from .aliases import OWNED, alias_owner, register_alias
from .extents import Extent, Loose
from .shardings import is_single_device
from .values import NO_BUFFER_TYPES, exported

__all__ = ["WalkReport", "alias_owner", "jax_device_pool", "nbytes_by_device", "register_alias", "total_nbytes"]


def torch_module() -> Any:
    """The torch module if something already imported it, else None (never import torch just to account)."""
    return sys.modules.get("torch")


_MISSING_KEY = object()
_TORCH_KEYS: dict[Any, str | None] = {}  # torch.device -> key; devices are few, lookups are many


def _torch_device_key(device: Any) -> str | None:
    key = _TORCH_KEYS.get(device, _MISSING_KEY)
    if key is not _MISSING_KEY:
        return key  # type: ignore[return-value]
    if device.type == "meta":
        key = None
    elif device.type == "cuda":
        index = device.index
        key = f"cuda:{torch_module().cuda.current_device() if index is None else index}"
    else:
        key = str(device)  # ("cpu" for the host)
    if device.index is not None or device.type != "cuda":  # "cuda" alone depends on the current device
        _TORCH_KEYS[device] = key
    return key


def _jax_pool_key(device: Any, memory_kind: str | None) -> str:
    """The pool a JAX buffer lives in: its device's key, or ``cpu/<kind>`` for a host memory kind (pinned
    host memory of a GPU is host RAM, so it is filed with the host, apart from the CPU's default pool)."""
    if memory_kind in ("pinned_host", "unpinned_host"):
        return f"cpu/{memory_kind}"
    return jax_device_pool(device)


def jax_device_pool(device: Any) -> str:
    """The pool the accounting files a JAX device's own memory under (``"cpu"`` for every host device)."""
    platform = device.platform
    if platform == "cpu":
        return "cpu"  # One host pool, whatever the number of (fake) CPU devices.
    if platform in ("gpu", "cuda"):
        hardware_id = getattr(device, "local_hardware_id", None)
        return f"cuda:{device.id if hardware_id is None else hardware_id}"
    return f"{platform}:{device.id}"


Extents = list[Extent]


@dataclasses.dataclass
class WalkReport:
    """What a walk could not count: deleted (donated) JAX arrays, and objects it could not look into."""

    deleted_arrays: int = 0
    unaccounted_objects: int = 0


# Engine KV pools (see `functional_state.paged_kv`): (pool key, storage start) -> segments of that storage that
# are pool layers, each (first byte offset, end offset, extent base, block bytes, pool uid). A value lying in a
# pool layer counts the blocks it spans, in the pool's block extents: it deduplicates with their handles.
POOL_STORAGES: dict[tuple[str, int], tuple[tuple[int, int, int, int, int], ...]] = {}
POOL_LIVE: set[int] = set()  # uids of pools alive (a pool's finalizer removes its uid: no lock, GC-safe)


def _pool_check_default(uid: int, key: str, start: int) -> bool:
    return True


# Whether pool ``uid`` still has a layer in the storage at ``start`` (an engine may free or resize a layer
# behind the pool's back, and the memory hold other tensors next); the engine layer registers its check.
_POOL_CHECK = _pool_check_default


def register_pool_check(check: Any) -> None:
    """Install ``check(uid, key, start) -> bool``: whether pool ``uid`` still has a layer in the storage at
    ``start`` of device ``key``. Called once by `functional_state.engine.paged_kv` at import."""
    global _POOL_CHECK
    _POOL_CHECK = check


def _pool_blocks(key: str, start: int, lo: int, hi: int, out: Extents) -> bool:
    """If the storage at ``start`` holds registered pool layers: the extents of the blocks that bytes
    ``[lo, hi)`` (offsets into the storage) span, plus the raw bytes outside every layer."""
    segments = POOL_STORAGES.get((key, start))
    if segments is None:
        return False
    live = [
        (so, se, b, bb, uid) for so, se, b, bb, uid in segments if uid in POOL_LIVE and _POOL_CHECK(uid, key, start)
    ]
    if not live:  # a dead pool's storage, maybe reused: plain memory again
        return False
    for so, se, base, bb, _ in live:
        a, b = max(lo, so), min(hi, se)
        if a < b:
            out.extend(
                Extent(key, base + i * bb, base + (i + 1) * bb) for i in range((a - so) // bb, (b - so - 1) // bb + 1)
            )
    return True


def _span(shape: Any, strides: Any, itemsize: int) -> tuple[int, int]:
    """``(lo, hi)`` byte offsets, from the first element, that a strided view touches."""
    lo = hi = 0
    for n, s in zip(shape, strides):
        if n == 0:
            return 0, 0
        if s >= 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    return lo, hi + itemsize


def torch_extents(t: Any, out: Extents, raw: bool = False) -> None:
    global _STRIDED
    if (layout := t.layout) is not _STRIDED:  # (torch.strided, kept once seen: a lookup of torch per tensor)
        if _STRIDED is not None or layout is not torch_module().strided:
            return  # Sparse layouts have no single storage; counted as unknown (zero).
        _STRIDED = layout
    key = "cpu" if t.is_cpu else _torch_device_key(t.device)  # (is_cpu: no device object built for the host)
    if key is None:
        return
    storage = t.untyped_storage()
    size = storage.nbytes()
    if size:
        start = storage.data_ptr()
        if POOL_STORAGES and not raw and (key, start) in POOL_STORAGES:
            item = t.element_size()
            lo, hi = _span(t.shape, [s * item for s in t.stride()], item)
            offset = t.storage_offset() * item
            if _pool_blocks(key, start, offset + lo, offset + hi, out):
                return
        # A storage torch did not allocate (from_numpy, from_dlpack: not resizable) may overlap another one.
        e = _new_extent(Extent, (key, start, start + size))  # (unless one of our host buffers: `aliases.OWNED`)
        out.append(e if storage.resizable() or e in OWNED else Loose(key, start, start + size))


_STRIDED, _NO_BYTES, _POINTER = None, ctypes.c_char * 0, ctypes.c_void_p.from_address
# An extent built without the NamedTuple's generated ``__new__`` (a Python-level call) on the per-commit read.
_new_extent = tuple.__new__


def _address_exported(owner: np.ndarray) -> int:
    # The buffer's address without building ``__array_interface__`` (a dict per call; see BENCHMARKS.md, notes
    # on the hot path); read-only, non-contiguous arrays take the latter.
    try:
        return ctypes.addressof(_NO_BYTES.from_buffer(owner))  # type: ignore[arg-type]  # (ndarray is a buffer)
    except (TypeError, ValueError, BufferError):
        return owner.__array_interface__["data"][0]


def _address_field(owner: Any) -> int:
    # The ``data`` field of numpy's PyArrayObject, first after the object header (numpy's ABI since 1.0), read
    # without an export. `_data_field_works` checks the layout at import; foreign objects never read.
    if type(owner) is not np.ndarray and not isinstance(owner, np.ndarray):
        return _address_exported(owner)
    return _POINTER(id(owner) + _HEADER).value or 0


def _data_field_works() -> bool:
    """Whether `_address_field` reads what ``__array_interface__`` says, for every kind of array it meets."""
    base = np.arange(24.0)
    views = (base[3:], base.reshape(4, 6).T, base[::-2], np.zeros(0), np.frombuffer(b"0123", np.uint8))
    try:
        return all(_address_field(p) == np.asarray(p).__array_interface__["data"][0] for p in (base, *views))
    except Exception:  # pragma: no cover - an interpreter whose objects are laid out otherwise
        return False


_HEADER = object.__basicsize__  # a CPython object header's bytes; only CPython's id() is an address to read
_address = _address_field if sys.implementation.name == "cpython" and _data_field_works() else _address_exported


def numpy_extents(a: np.ndarray, out: Extents, raw: bool = False) -> None:
    if a.base is None and not POOL_STORAGES:  # an array that owns its memory, no engine pool: the common case
        if a.size:
            start = _address(a)
            out.append(Extent("cpu", start, start + a.nbytes))
        return
    owner = a
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    base = owner.base
    # (isinstance against torch.Tensor is slow: asked only of a foreign base)
    if base is not None and (torch := torch_module()) is not None and isinstance(base, torch.Tensor):
        torch_extents(base, out, raw)
        return
    if owner.size == 0:
        return
    start = _address(owner)
    if POOL_STORAGES and not raw and ("cpu", start) in POOL_STORAGES and a.size:
        lo, hi = _span(a.shape, a.strides, a.itemsize)
        offset = a.__array_interface__["data"][0] - start
        if _pool_blocks("cpu", start, offset + lo, offset + hi, out):
            return
    if base is None:
        out.append(Extent("cpu", start, start + owner.nbytes))
        return
    # Memory owned by some other object (bytes, mmap, a foreign buffer): count the span this array covers.
    lo, hi = _span(owner.shape, owner.strides, owner.itemsize)  # (owner.size > 0 here)
    out.append(Loose("cpu", start + lo, start + hi))


def jax_extents(a: jax.Array, out: Extents, report: WalkReport, seen: dict[int, Any], raw: bool = False) -> None:
    owner = alias_owner(a)
    if owner is not None and not raw:
        # The owner's allocation holds this array's bytes: count the owner, and only the owner, so the two
        # meet as one extent (the incremental accounting adds allocations up, and unions only `Loose` ones).
        collect_extents(owner, out, seen, report)
        return
    if a.is_deleted():
        report.deleted_arrays += 1
        return
    sharding = a.sharding
    memory_kind = getattr(sharding, "memory_kind", None)
    if is_single_device(sharding):  # one buffer: read it directly (building shard objects is ~2/3 of it)
        size = a.on_device_size_in_bytes()
        if size:
            start = a.unsafe_buffer_pointer()
            key = _jax_pool_key(next(iter(sharding.device_set)), memory_kind)
            if not (POOL_STORAGES and not raw and _pool_blocks(key, start, 0, size, out)):
                out.append(Extent(key, start, start + size))
        return
    for shard in a.addressable_shards:
        data = shard.data
        size = data.on_device_size_in_bytes()
        if size:
            start = data.unsafe_buffer_pointer()
            key = _jax_pool_key(shard.device, memory_kind)
            if POOL_STORAGES and not raw and _pool_blocks(key, start, 0, size, out):
                continue
            out.append(Extent(key, start, start + size))


# Objects never walked into: they reach the whole program (modules, classes, functions) or hold no data.
_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.CodeType, types.FrameType)
_OPAQUE = (type, types.ModuleType, *_CODE, types.GeneratorType, weakref.ref, property, staticmethod, classmethod)
_SCALARS = tuple(NO_BUFFER_TYPES)  # (the walk counts bytes and bytearray zero: not array memory)
_MAX_OBJECT_DEPTH = 16  # plain objects nested deeper than this (attribute chains) count as unaccounted


def _object_fields(x: Any) -> list[Any] | None:
    """The attribute values of a plain object (``__dict__`` and ``__slots__``), or None if it has none."""
    values: list[Any] = []
    found = False
    d = getattr(x, "__dict__", None)
    if isinstance(d, dict):
        values.extend(d.values())
        found = True
    for cls in type(x).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        for name in slots:
            if name in ("__dict__", "__weakref__"):
                continue
            found = True
            value = getattr(x, name, None)
            if value is not None:
                values.append(value)
    return values if found else None


def _children(x: Any) -> tuple[Iterable[Any] | None, bool]:
    """``(values below x that may hold buffers, is_plain_object)``; ``(None, False)`` for a leaf."""
    own = getattr(type(x), "_accounting_children", None)
    if own is not None:
        return own(x), False
    if isinstance(x, np.ndarray):  # (of dtype object: its elements)
        return list(x.flat), False
    if isinstance(x, memoryview):  # the object whose buffer it exports (a numpy array's: array memory)
        return exported(x), False
    if isinstance(x, Mapping):
        return list(x.values()), False
    if isinstance(x, (list, tuple, set, frozenset, collections.deque, types.MappingProxyType)):
        return list(x), False
    if isinstance(x, (collections.abc.KeysView, collections.abc.ValuesView, collections.abc.ItemsView)):
        return list(x), False
    if isinstance(x, _OPAQUE):
        return None, False
    if dataclasses.is_dataclass(x):
        return [getattr(x, f.name, None) for f in dataclasses.fields(x)], False
    leaves, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
    if not (treedef.num_nodes == 1 and treedef.num_leaves == 1 and leaves and leaves[0] is x):  # type: ignore[attr-defined]
        return leaves, False
    return _object_fields(x), True


def own_extents(x: Any) -> list[Extent] | None:
    """What `collect_extents` finds in ``x`` when ``x`` files every buffer it holds itself (its
    ``_accounting_extents``) and has no children to walk (``_accounting_children`` empty: a parked copy of
    torch storages alone), read without the walk; None for anything else (walk it)."""
    kind = type(x)
    own, kids = getattr(kind, "_accounting_extents", None), getattr(kind, "_accounting_children", None)
    if own is None or kids is None or kids(x):
        return None
    return list(own(x))


def collect_extents(root: Any, out: Extents, seen: dict[int, Any], report: WalkReport) -> None:
    # `seen` maps id -> object: holding the object keeps temporaries (children a pytree's flatten built)
    # alive for the whole walk, so no later object can reuse their id and be skipped.
    torch = torch_module()
    tensor_type = torch.Tensor if torch is not None else ()
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        x, depth = stack.pop()
        if type(x) in NO_BUFFER_TYPES or id(x) in seen:
            continue  # Cycles, shared containers and repeated arrays are visited once.
        seen[id(x)] = x
        try:  # isinstance itself may raise (an object whose __class__ raises)
            if isinstance(x, _SCALARS):
                continue
            if isinstance(x, tensor_type):
                torch_extents(x, out)
                continue
            if isinstance(x, jax.Array):
                if not isinstance(x, jax.core.Tracer):
                    jax_extents(x, out, report, seen)
                continue
            if isinstance(x, np.ndarray):
                numpy_extents(x, out)
                if x.dtype != object:
                    continue  # (an object array's own buffer holds pointers: what they point to is walked too)
            own_extents = getattr(type(x), "_accounting_extents", None)
            if own_extents is not None:  # buffers an object files under its own pool keys (parked copies)
                out.extend(own_extents(x))
            kids, plain = _children(x)
        except Exception:  # Anything we cannot look into is reported, never raised: stats() must not crash.
            report.unaccounted_objects += 1
            continue
        if kids is None:
            continue
        child_depth = depth + 1 if plain else depth
        if child_depth > _MAX_OBJECT_DEPTH:
            report.unaccounted_objects += 1
            continue
        try:
            stack.extend((k, child_depth) for k in kids)
        except Exception:  # an iterator that fails part-way: keep what it gave
            report.unaccounted_objects += 1


def union_by_device(extents: Extents) -> dict[str, int]:
    totals: dict[str, int] = {}
    extents.sort()
    cur_key, cur_start, cur_end = None, 0, 0
    for key, start, end in extents:
        if key == cur_key and start <= cur_end:
            if end > cur_end:
                cur_end = end
            continue
        if cur_key is not None:
            totals[cur_key] = totals.get(cur_key, 0) + (cur_end - cur_start)
        cur_key, cur_start, cur_end = key, start, end
    if cur_key is not None:
        totals[cur_key] = totals.get(cur_key, 0) + (cur_end - cur_start)
    return dict(sorted(totals.items()))


def walk(*roots: Any) -> tuple[dict[str, int], WalkReport]:
    """`nbytes_by_device` plus the report of what could not be counted."""
    extents: Extents = []
    seen: dict[int, Any] = {}
    report = WalkReport()
    for root in roots:
        collect_extents(root, extents, seen, report)
    return union_by_device(extents), report


def nbytes_by_device(*roots: Any) -> dict[str, int]:
    """Bytes held by everything reachable from ``roots``, per device, each allocation counted once.

    Walks manager and session states, state objects, dicts, lists, tuples, sets, deques, dict views,
    namespaces, dataclasses, registered pytrees and plain objects (``__dict__``/``__slots__``). Scalars,
    strings and ``None`` count zero. It never raises: an object it cannot read counts zero (and
    `functional_state.stats` reports how many there were). One deduplication scope spans all roots, so
    passing a manager state together with the fields of a model that may still alias its tensors reports
    what the process really holds.

    Args:
      *roots: anything.

    Returns:
      ``{pool: bytes}``, sorted, no zero entries. Pools are devices in torch naming (``"cpu"``, ``"cuda:0"``)
      and the host memory kinds parked storage lives in (``"cpu/pinned_host"``, ``"cpu/unpinned_host"``).

    Example:
      >>> import numpy as np
      >>> x = np.zeros(1024, np.uint8)
      >>> nbytes_by_device([x, x[:10]], {"again": x})
      {'cpu': 1024}
    """
    return walk(*roots)[0]


def total_nbytes(*roots: Any) -> int:
    """Sum over devices of :func:`nbytes_by_device`."""
    return sum(nbytes_by_device(*roots).values())
