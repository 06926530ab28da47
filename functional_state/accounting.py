"""Per-device byte accounting, counted per allocation and deduplicated by memory extent.

A buffer is modelled as an extent ``[start, end)`` on a device. Each call unions the extents of everything
reachable from its roots, per device, so two views of one storage, an alias between an attribute and a
state object, a tensor shared by several sessions, and a JAX array that aliases a torch tensor through
DLPack all count once. Sizes are those of the *allocation* a value keeps alive, never
``numel * element_size``: a narrow slice of a large tensor reports the whole storage.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["nbytes_by_device", "total_nbytes", "register_alias", "alias_owner"]

# id(jax array) -> (weakref to it, owner). Filled by the torch bridge: an array imported from a torch tensor
# reports only its own bytes, but keeps the whole torch storage alive, so the accounting counts the owner.
_ALIASES: dict[int, tuple[weakref.ref, Any]] = {}
_ALIASES_LOCK = threading.Lock()


def register_alias(array: jax.Array, owner: Any) -> None:
    """Record that ``array`` lies inside the allocation of ``owner`` (e.g. the torch tensor it aliases).

    The accounting then counts ``owner``'s allocation wherever it meets ``array``. The record disappears
    with ``array``.

    Args:
      array: a JAX array created as a zero-copy view of ``owner``'s memory.
      owner: the object that owns the memory (a torch tensor or numpy array).
    """
    key = id(array)

    def _forget(_ref, key=key):
        with _ALIASES_LOCK:
            entry = _ALIASES.get(key)
            if entry is not None and entry[0] is _ref:
                del _ALIASES[key]

    with _ALIASES_LOCK:
        _ALIASES[key] = (weakref.ref(array, _forget), owner)


def alias_owner(array: Any) -> Any:
    """The owner recorded for ``array`` by `register_alias`, or None."""
    entry = _ALIASES.get(id(array))
    if entry is not None and entry[0]() is array:
        return entry[1]
    return None


_MISSING_KEY = object()
_TORCH_KEYS: dict[Any, str | None] = {}  # torch.device -> key; devices are few, lookups are many


def _torch_device_key(device: Any) -> str | None:
    key = _TORCH_KEYS.get(device, _MISSING_KEY)
    if key is not _MISSING_KEY:
        return key
    if device.type == "meta":
        key = None
    elif device.type == "cuda":
        index = device.index
        if index is None:
            import torch

            index = torch.cuda.current_device()
        key = f"cuda:{index}"
    elif device.type == "cpu":
        key = "cpu"
    else:
        key = str(device)
    if device.index is not None or device.type != "cuda":  # "cuda" alone depends on the current device
        _TORCH_KEYS[device] = key
    return key


def _jax_device_key(device: Any) -> str:
    platform = device.platform
    if platform == "cpu":
        return "cpu"  # One host pool, whatever the number of (fake) CPU devices.
    if platform in ("gpu", "cuda"):
        hardware_id = getattr(device, "local_hardware_id", None)
        return f"cuda:{device.id if hardware_id is None else hardware_id}"
    return f"{platform}:{device.id}"


def _torch_tensor_type() -> type | None:
    torch = sys.modules.get("torch")  # never import torch just to account: it may not be in use
    return None if torch is None else torch.Tensor


def _is_torch_tensor(x: Any) -> bool:
    cls = _torch_tensor_type()
    return cls is not None and isinstance(x, cls)


def _torch_extents(t: Any, out: list[tuple[str, int, int]]) -> None:
    if t.layout is not sys.modules["torch"].strided:
        return  # Sparse layouts have no single storage; counted as unknown (zero).
    key = _torch_device_key(t.device)
    if key is None:
        return
    storage = t.untyped_storage()
    size = storage.nbytes()
    if size:
        start = storage.data_ptr()
        out.append((key, start, start + size))


def _numpy_extents(a: np.ndarray, out: list[tuple[str, int, int]]) -> None:
    owner = a
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    base = owner.base
    if _is_torch_tensor(base):
        _torch_extents(base, out)
        return
    if owner.size == 0:
        return
    if base is None:
        start = owner.__array_interface__["data"][0]
        out.append(("cpu", start, start + owner.nbytes))
        return
    # Memory owned by some other object (bytes, mmap, a foreign buffer): count the span this array covers.
    start = owner.__array_interface__["data"][0]
    lo = hi = 0
    for n, s in zip(owner.shape, owner.strides):
        if s >= 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    out.append(("cpu", start + lo, start + hi + owner.itemsize))


def _jax_extents(a: jax.Array, out: list[tuple[str, int, int]]) -> None:
    owner = alias_owner(a)
    if owner is not None:
        _collect(owner, out, {})
        # Fall through: the owner covers this array's bytes, and the union makes the overlap free.
    if a.is_deleted():
        return
    for shard in a.addressable_shards:
        data = shard.data
        size = data.on_device_size_in_bytes()
        if size:
            start = data.unsafe_buffer_pointer()
            out.append((_jax_device_key(shard.device), start, start + size))


def _children(x: Any) -> Iterable[Any] | None:
    """The values below ``x`` that may hold buffers, or None when ``x`` is a leaf."""
    own = getattr(type(x), "_accounting_children", None)
    if own is not None:
        return own(x)
    if isinstance(x, Mapping):
        return x.values()
    if isinstance(x, (list, tuple, set, frozenset)):
        return x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [getattr(x, f.name) for f in dataclasses.fields(x)]
    leaves, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1 and leaves and leaves[0] is x:
        return None
    return leaves


_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None))


def _collect(root: Any, out: list[tuple[str, int, int]], seen: dict[int, Any]) -> None:
    # `seen` maps id -> object: holding the object keeps temporaries (children a pytree's flatten built)
    # alive for the whole walk, so no later object can reuse their id and be skipped.
    tensor_type = _torch_tensor_type() or ()
    stack = [root]
    while stack:
        x = stack.pop()
        if isinstance(x, _SCALARS):
            continue
        if id(x) in seen:
            continue  # Cycles, shared containers and repeated arrays are visited once.
        seen[id(x)] = x
        if isinstance(x, tensor_type):
            _torch_extents(x, out)
            continue
        if isinstance(x, jax.Array):
            if not isinstance(x, jax.core.Tracer):
                _jax_extents(x, out)
            continue
        if isinstance(x, np.ndarray):
            _numpy_extents(x, out)
            continue
        try:
            kids = _children(x)
        except Exception:  # An object we cannot look into counts zero; accounting never raises.
            kids = None
        if kids is not None:
            stack.extend(kids)


def _union_by_device(extents: list[tuple[str, int, int]]) -> dict[str, int]:
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


def nbytes_by_device(*roots: Any) -> dict[str, int]:
    """Bytes held by everything reachable from ``roots``, per device, each allocation counted once.

    Walks manager and session states, state objects, dicts, lists, tuples, sets, dataclasses and registered
    pytrees. Scalars, strings and ``None`` count zero; so does any object it cannot look into (it never
    raises). One deduplication scope spans all roots, so passing a manager state together with the fields
    of a model that may still alias its tensors reports what the process really holds.

    Args:
      *roots: anything.

    Returns:
      ``{device: bytes}`` with keys in torch naming (``"cpu"``, ``"cuda:0"``), sorted, and no zero entries.

    Example:
      >>> import numpy as np
      >>> x = np.zeros(1024, np.uint8)
      >>> nbytes_by_device([x, x[:10]], {"again": x})
      {'cpu': 1024}
    """
    extents: list[tuple[str, int, int]] = []
    seen: dict[int, Any] = {}
    for root in roots:
        _collect(root, extents, seen)
    return _union_by_device(extents)


def total_nbytes(*roots: Any) -> int:
    """Sum over devices of :func:`nbytes_by_device`."""
    return sum(nbytes_by_device(*roots).values())
