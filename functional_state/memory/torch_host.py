"""Torch leaves for parking: which storage each tensor lives in, and how it is rebuilt over a restored one.

`parking` copies storages; this module reads tensors. `gather` walks a pytree's leaves once and files every
torch tensor (and every JAX array that aliases a torch storage through the bridge) under its storage, each
storage once. A *plain* storage is one a tensor spans exactly, from its start, in order (contiguous, no
offset, no conjugate or negative bit, a dtype whose copies are byte moves): its bytes are that tensor's
values, so it is copied by the tensor itself (many per ``torch.cat`` call) and restored as a fresh tensor of
that shape (many per ``split_with_sizes_copy`` call), with no per-tensor byte views or rebuilds. Any other
storage is copied as raw bytes and each of its leaves rebuilt as a view with its own offset, shape, strides
and bits (`rebuild`). Cost per tensor matters here: a state of 4,096 small tensors parks in a few ms.

A storage is known by its extent, ``(address, bytes)``: two storage objects over the same memory (one numpy
buffer wrapped twice) are one storage, while two over overlapping memory of different extents (``X[:5]``
and ``X``, which share an address) stay two, each copied and restored whole, as independent copies. A leaf
of a tensor subclass is rebuilt as that subclass with its ``__dict__`` (a ``torch.nn.Parameter`` comes back
one); a subclass that cannot be is refused before anything moves (`rebuildable`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import sys
from typing import Any

import jax

from ..errors import InvalidTypeError
from . import accounting

__all__ = [
    "Gathered",
    "TorchLeaf",
    "as_torch",
    "bytes_view",
    "gather",
    "host_storage",
    "jax_alias",
    "leaf_recipe",
    "plain_dtypes",
    "rebuild",
    "rebuild_leaf",
    "rebuildable",
]


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
    tensor_type: type | None = None  # a torch.Tensor subclass the leaf was (torch.nn.Parameter, say), else None
    attrs: tuple[tuple[str, Any], ...] = ()  # that subclass instance's attributes (its ``__dict__``), as they were


def torch_module() -> Any:
    return sys.modules.get("torch")


@functools.cache
def plain_dtypes(torch: Any) -> frozenset[Any]:
    # Copied by `torch.cat` / `clone`, whose same-dtype CPU copies move bytes. Bool (a byte that may hold
    # any value through a view) and the float8 types (not every op has them) are copied as raw bytes instead.
    names = [
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
    ]
    return frozenset(getattr(torch, n) for n in names)


ONE_D = (0,)  # the shape recorded for every 1-D plain storage: only its trailing shape, (), is read


class Gathered:
    """The torch storages of one park, in columns (no object per tensor: a park of 4,096 small tensors must
    not cost a collection): per storage its first tensor, device, bytes, dtype and shape (dtype ``None``: not
    plain, copied as raw bytes); per torch leaf its index among the leaves, its storage and its recipe, the
    recipe ``None`` when the leaf is its plain storage's own tensor (restored as that tensor)."""

    __slots__ = (
        *("devices", "direct", "dtypes", "leaf", "others", "recipe", "shapes", "sizes", "sources", "storage"),
        "trail",
    )

    def __init__(self) -> None:
        self.sources: list[Any] = []
        self.devices: list[Any] = []
        self.sizes: list[int] = []
        self.dtypes: list[Any] = []
        self.shapes: list[Any] = []  # a plain storage's tensor shape, else None
        self.leaf: list[int] = []
        self.storage: list[int] = []
        self.recipe: list[TorchLeaf | None] = []
        self.others: list[int] = []  # indices of the leaves that are not torch tensors
        # Every storage plain, on the CPU, of one dtype and this trailing shape (``()``: 1-D), so a run of them
        # is one segment; None otherwise.
        self.trail: tuple[int, ...] | None = None
        self.direct = False  # leaf i is storage i's own tensor, for every leaf (restored as the storages)


def gather(leaves: list[Any], plain_max: int, where: tuple[Any, str] = (None, "gather")) -> Gathered:
    """File every torch leaf of ``leaves`` under its storage (see the module docstring). Storages of
    ``plain_max`` bytes or more are never plain (`parking` copies those through its recycled host buffers).

    Raises:
      InvalidTypeError: a leaf is a tensor subclass that cannot be rebuilt over a restored storage (see
        `rebuildable`); the message names its path in ``where[0]`` (the pytree ``leaves`` came from) and
        the call ``where[1]``.
    """
    g = Gathered()
    torch = torch_module()
    if torch is None:
        g.others = list(range(len(leaves)))
        return g
    plain = plain_dtypes(torch)
    tensor_type, cpu, strided = torch.Tensor, torch.device("cpu"), torch.strided
    if _all_plain(leaves, torch, plain, plain_max, g):
        return g
    # A CPU storage by its extent (address, bytes), any other by (device, address, bytes). Not by address
    # alone: two storages over overlapping memory (``torch.from_numpy`` of ``X[:5]`` and of ``X``) share an
    # address, and filing the larger under the smaller one read past the bytes that were copied.
    ids: dict[Any, int] = {}
    sources, devices, sizes, dtypes, shapes = g.sources, g.devices, g.sizes, g.dtypes, g.shapes
    leaf_at, storage_of, recipe_of = g.leaf.append, g.storage.append, g.recipe.append
    for i, leaf in enumerate(leaves):
        if type(leaf) is tensor_type and leaf.is_cpu and leaf.layout is strided and not leaf.is_nested:
            n = leaf.nbytes
            ptr = (leaf.data_ptr(), n)  # (the storage's extent when the leaf is plain: the only case read)
            k = ids.get(ptr) if n else -1
            if k is None:
                dtype = leaf.dtype
                shape = leaf.shape
                if (
                    n < plain_max
                    and shape
                    and dtype in plain
                    and not leaf.storage_offset()
                    and leaf.is_contiguous()
                    and leaf.untyped_storage().nbytes() == n
                    and not leaf.is_neg()
                    and not leaf.is_conj()
                ):
                    ids[ptr] = k = len(sources)
                    sources.append(leaf)
                    devices.append(cpu)
                    sizes.append(n)
                    dtypes.append(dtype)
                    shapes.append(shape)
                    leaf_at(i)
                    storage_of(k)
                    # Restored by a contiguous copy: exact for the leaf itself unless a size-1 dim let it
                    # carry other strides (or it needs its autograd flag back): those get a recipe.
                    recipe_of(leaf_recipe(leaf, k, None) if needs_recipe(leaf) else None)
                    continue
        tensor, owner = as_torch(leaf)
        if tensor is None:
            g.others.append(i)
            continue
        _check_copyable(tensor, owner, i, where)
        storage = tensor.untyped_storage()
        n = storage.nbytes()
        key: Any = (storage.data_ptr(), n) if n else ("empty", i)
        device = tensor.device
        if device.type != "cpu":
            key = (device, *key)
        k = ids.get(key)
        if k is None:
            ids[key] = k = len(sources)
            sources.append(tensor)
            devices.append(cpu if device.type == "cpu" else device)
            sizes.append(n)
            dtypes.append(None)
            shapes.append(None)
        leaf_at(i)
        storage_of(k)
        recipe_of(leaf_recipe(tensor, k, owner))
    return g


_GET = {a: operator.attrgetter(a) for a in ("dtype", "shape", "nbytes")}
_PROPS = operator.attrgetter("is_cpu", "dtype", "ndim", "requires_grad", "layout", "is_nested")
_BLOCK = 256  # leaves per block of the plain check: their tensors' metadata stays in the L2 cache


def _all_plain(leaves: list[Any], torch: Any, plain: frozenset[Any], plain_max: int, g: Gathered) -> bool:
    """The common case, checked a column at a time (one C-level ``map`` per property, no bytecode per
    tensor) in blocks of `_BLOCK` leaves: every leaf a CPU tensor spanning a storage of its own. Fills ``g``
    and says so, else leaves it."""
    tensor, storage_nbytes, strided = torch.Tensor, torch.UntypedStorage.nbytes, torch.strided
    if not leaves or set(map(type, leaves)) != {tensor}:
        return False
    props: set[tuple[Any, ...]] = set()  # (is_cpu, dtype, ndim, requires_grad, layout, is_nested)
    sizes: list[int] = []
    ptrs: set[int] = set()
    # A block's passes find its tensors in the cache (4,096 tensors' metadata outgrow it: each pass over all
    # of them re-read it from memory, and a park after other work paid that ten times over).
    for lo in range(0, len(leaves), _BLOCK):
        block = leaves[lo : lo + _BLOCK]
        new = set(map(_PROPS, block))  # (equal tuples collapse: a uniform list makes one, checked once)
        if not new <= props:  # before any method call: sparse, mkldnn and nested tensors go to `_check_copyable`
            if any(not p[0] or p[1] not in plain or p[2] < 1 or p[4] is not strided or p[5] for p in new):
                return False  # (0-d tensors do not concatenate)
            props |= new
        size = list(map(_GET["nbytes"], block))
        if min(size) <= 0 or max(size) >= plain_max:
            return False
        ptrs.update(map(tensor.data_ptr, block))
        if (
            any(map(tensor.storage_offset, block))
            or not all(map(tensor.is_contiguous, block))
            or size != list(map(storage_nbytes, map(tensor.untyped_storage, block)))
            or any(map(tensor.is_neg, block))
        ):
            return False
        sizes += size
    kinds = {p[1] for p in props}
    dims = {p[2] for p in props}
    if len(ptrs) != len(leaves):  # views of one storage, or one tensor twice: the general path
        return False
    if any(k.is_complex for k in kinds) and any(map(tensor.is_conj, leaves)):
        return False
    n = len(leaves)
    dtypes = [next(iter(kinds))] * n if len(kinds) == 1 else list(map(_GET["dtype"], leaves))
    if dims == {1}:  # 1-D: no shape objects (a park must not allocate one tracked object per tensor)
        g.shapes = [ONE_D] * n
        if len(kinds) == 1:
            g.trail = ()
        if len(kinds) == 1:  # (a 1-element tensor may carry any stride: it gets a recipe)
            unit = dtypes[0].itemsize in sizes
        else:
            unit = any(n == dt.itemsize for n, dt in zip(sizes, dtypes))
    else:
        g.shapes = list(map(_GET["shape"], leaves))
        unit = any(map(operator.contains, g.shapes, itertools.repeat(1)))
        trails = {shape[1:] for shape in g.shapes}
        if len(kinds) == 1 and len(trails) == 1:
            g.trail = tuple(trails.pop())
    g.sources, g.devices, g.sizes, g.dtypes = list(leaves), [torch.device("cpu")] * n, sizes, dtypes
    g.leaf, g.storage, g.recipe = list(range(n)), list(range(n)), [None] * n
    if unit or any(p[3] for p in props):
        g.recipe = [leaf_recipe(t, k, None) if needs_recipe(t) else None for k, t in enumerate(leaves)]
    g.direct = g.recipe.count(None) == n
    return True


def needs_recipe(t: Any) -> bool:
    """Whether plain tensor ``t`` needs a recipe to come back as it was: a contiguous copy of it (what a restore
    makes of a plain storage) has the strides `_contiguous_stride` gives, which a size-1 dim lets ``t`` differ
    from (``torch.empty_strided((3, 1), (1, 9))`` is contiguous); and the copy does not require grad."""
    shape = t.shape
    return bool(t.requires_grad) or (1 in shape and t.stride() != _contiguous_stride(shape))


@functools.lru_cache(maxsize=256)
def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a fresh contiguous tensor of ``shape`` (a size-1 or empty dim counts as 1)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _check_copyable(tensor: Any, owner: Any, index: int, where: tuple[Any, str]) -> None:
    """Refuse, before anything moves, a tensor whose values are not the bytes of one strided storage (a
    sparse, quantized, nested, mkldnn or meta tensor: copying its storage as bytes crashed the process, for
    a quantized one, or raised torch's own error), or a subclass parking cannot rebuild (`rebuildable`)."""
    torch, cls = torch_module(), type(tensor)
    problem = fix = ""
    if tensor.is_meta:
        problem, fix = "a meta tensor, which holds no bytes to copy", "Park a tensor on a real device instead"
    elif tensor.layout is not torch.strided or tensor.is_nested or tensor.is_quantized:
        kind = (
            "nested" if tensor.is_nested else "quantized" if tensor.is_quantized else str(tensor.layout)[6:].strip("_")
        )
        problem = f"a {kind} tensor, whose values are not the bytes of one storage"
        fix = "Park a dense (strided) tensor instead, e.g. `.to_dense()` or `.dequantize()` first"
    elif owner is None and cls is not torch.Tensor:
        reason = rebuildable(cls)
        if reason:
            problem = (
                f"a {cls.__module__}.{cls.__qualname__}, a torch.Tensor subclass parking cannot rebuild over a "
                f"restored storage: {reason}"
            )
            fix = (
                "Park a plain tensor or a torch.nn.Parameter (or a subclass that only adds methods and "
                "attributes) instead"
            )
    if problem:
        values, what = where
        path = f"leaf {index}"
        if values is not None:
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(values)[0][index][0]) or "the root"
        raise InvalidTypeError(f"`{what}`: the tensor at {path} is {problem}. {fix}; nothing was moved.")


def rebuildable(cls: type) -> str:
    """Why parking cannot rebuild an instance of tensor subclass ``cls`` (empty when it can). It can when the
    subclass's bytes are its storage's and its state its ``__dict__``: a restore makes a plain view over the
    restored storage, turns it into ``cls`` with ``Tensor.as_subclass`` (``cls.__new__`` is not called) and
    gives it its attributes back, as torch's own pickling of a subclass does."""
    torch = torch_module()
    if issubclass(cls, torch.nn.parameter.UninitializedTensorMixin):
        return "an uninitialized parameter holds no data yet"
    if getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
        return "it defines __torch_dispatch__ (a wrapper subclass: its storage is not its data)"
    for c in cls.__mro__[: cls.__mro__.index(torch.Tensor)]:
        if vars(c).get("__slots__"):
            return f"{c.__qualname__} declares __slots__, whose values a restore could not give back"
    return ""


def leaf_recipe(tensor: Any, k: int, owner: Any) -> TorchLeaf:
    """How to rebuild ``tensor`` (storage ``k``) over another storage (`rebuild`); ``owner``: its bridge alias."""
    cls = type(tensor)
    sub = None if owner is not None or cls is torch_module().Tensor else cls
    return TorchLeaf(
        k,
        tensor.dtype,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.storage_offset(),
        bool(tensor.is_conj()),
        bool(tensor.is_neg()),
        None if owner is None else type(owner),
        owner is None and bool(tensor.requires_grad),
        sub,
        tuple(vars(tensor).items()) if sub is not None else (),
    )


def plain_leaf(k: int, dtype: Any, shape: tuple[int, ...]) -> TorchLeaf:
    """The recipe of a plain storage's own tensor (contiguous, from the start), written out on request."""
    return TorchLeaf(k, dtype, tuple(shape), _contiguous_stride(tuple(shape)), 0, False, False, None, False)


def bytes_view(t: Any) -> Any:
    """A 1-D uint8 tensor over the whole storage of ``t`` (same device, no copy)."""
    torch = torch_module()
    t = t.detach()  # the bytes, not the autograd graph (an out= copy refuses tensors that require grad)
    if t.storage_offset() == 0 and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        flat = t.reshape(-1)  # the cheap path: the tensor spans its storage from the start
        # (A one-element tensor is contiguous whatever its stride, and a byte view needs stride 1.)
        if flat.numel() * flat.element_size() == t.untyped_storage().nbytes() and flat.stride(-1) == 1:
            return flat.view(torch.uint8)
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def as_torch(leaf: Any) -> tuple[Any, Any]:
    """``(tensor, jax_owner)`` when ``leaf`` is a torch tensor or a bridge alias of one, else ``(None, None)``."""
    torch = torch_module()
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


def host_storage(parked: Any, index: int) -> Any:
    """Storage ``index`` of ``parked`` (a `ParkedStorage`) as it sits in its host buffer: a 1-D uint8 CPU
    tensor over exactly its bytes, with a storage of its own (no copy), which `rebuild_leaf` can rebuild the
    storage's leaves over.

    Storages share host buffers back to back, so a plain slice of the buffer would still report the whole
    buffer as its storage; through numpy, the view gets a storage that starts where this one starts.
    """
    torch = torch_module()
    s = parked.storages[index]
    if not s.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(parked.buffers[s.buffer].numpy()[s.start : s.start + s.nbytes])


def rebuild_leaf(leaf: TorchLeaf, storage: Any) -> Any:
    """``leaf`` as a view of ``storage``, a uint8 tensor that spans a whole storage (its offsets index that)."""
    if storage.storage_offset() or storage.numel() != storage.untyped_storage().nbytes():
        # A slice of a larger buffer: every offset would land in someone else's bytes.
        raise AssertionError("rebuild_leaf needs a tensor that spans its whole storage, not a slice of one")
    return rebuild(leaf, storage.untyped_storage(), storage.device)


def rebuild(leaf: TorchLeaf, storage: Any, device: Any) -> Any:
    """``leaf`` as a view of the untyped ``storage`` (on ``device``), with its offset, shape, strides and bits."""
    torch = torch_module()
    t = torch.empty(0, dtype=leaf.dtype, device=device).set_(storage, leaf.offset, leaf.shape, leaf.stride)
    if leaf.conj:
        t = t.conj()
    if leaf.neg:
        t = torch._neg_view(t)
    if leaf.tensor_type is not None:  # before the autograd flag: as_subclass of a leaf that wants grad is no leaf
        t = t.as_subclass(leaf.tensor_type)
        vars(t).update(leaf.attrs)
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
        with torch_module().cuda.device(exported.device):  # torch exports only tensors of the current device
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
