"""Many small tensors parked with one ``torch.cat`` that checks most of what a park must refuse, in C++.

A park of thousands of small 1-D tensors of one dtype (a list cache, per-layer scalars) costs per-tensor
checks, not bytes: each refusal `torch_host.gather` makes reads a property per tensor in Python. Here Python
reads only what ``torch.cat`` does not check (`one_run`): the type, the dtype (``cat`` would convert it, and a
quantized tensor crashed it), that each tensor spans its own storage from the start (no view of another leaf,
no storage twice) and the negative bit. The copy then checks the rest (`copied`): into a CPU host buffer, with
autograd on, ``torch.cat`` raises for a tensor on another device, of a sparse, nested or mkldnn layout, of
other dimensions than the first, or that requires grad (an ``out=`` copy cannot record one). Whatever either
turns down takes `parking.park_values`'s general path, which refuses it naming the leaf or parks it as it
always did; the unused buffer goes back to `host_buffers`. Where the optional extension
``tensor_run_checks.cpp`` is built (setup.py, with torch importable at build time), the same facts are read
in one C++ pass (`NATIVE`); elsewhere in Python, block by block. Measured in benchmarks/bench_park.py.
"""

from __future__ import annotations

import operator
from typing import Any

from . import host_buffers
from .torch_host import ONE_D, Gathered, plain_dtypes, torch_module

__all__ = ["NATIVE", "copied", "native", "one_run"]

_DTYPE, _NBYTES = operator.attrgetter("dtype"), operator.attrgetter("nbytes")
_BLOCK = 256  # leaves per block of checks: their tensors' metadata stays in the cache across the passes


_UNRESOLVED: Any = object()
# The same checks in one C++ pass over the leaves (a Python call per tensor and fact cost about as much as
# the copy itself: BENCHMARKS.md, park section), or None where they run in Python. Resolved once torch is
# imported (the extension links against libtorch, which only `import torch` loads; importing it before that
# fails, and this package never imports torch itself just to find out).
NATIVE: Any = _UNRESOLVED


def native() -> Any:
    """The compiled checks (`NATIVE`), resolved on first use once torch is imported, or None: not built (no
    torch at build time, a pure build), or built against a torch this process does not run (its import fails)."""
    global NATIVE
    if NATIVE is _UNRESOLVED:
        if torch_module() is None:
            return None
        try:
            from . import tensor_run_checks  # type: ignore[attr-defined]
        except (ImportError, OSError):
            tensor_run_checks = None
        NATIVE = tensor_run_checks
    return NATIVE


def one_run(leaves: list[Any], most: int) -> Gathered | None:
    """The leaves as `torch_host.gather` files them, when every one is a 1-D plain tensor of one real dtype
    spanning a storage of its own from the start (no negative bit, no storage twice, more than one element: a
    one-element tensor may carry any stride), each of at most ``most`` bytes; else None, from the first check
    that fails. The rest is `copied`'s ``torch.cat``'s to check."""
    torch = torch_module()
    if torch is None or not leaves or type(leaves[0]) is not torch.Tensor:
        return None
    dtype = leaves[0].dtype
    if dtype not in plain_dtypes(torch) or dtype.is_complex or leaves[0].ndim != 1:
        return None
    checks = native()
    if checks is not None and type(leaves) is list:
        try:
            native_sizes = checks.run_sizes(leaves, most, torch.Tensor)
        except (RuntimeError, NotImplementedError):  # (a tensor whose metadata cannot be read: the general path)
            return None
        return None if native_sizes is None else _gathered(torch, leaves, native_sizes, dtype)
    return _checked_in_python(torch, leaves, most, dtype)


def _checked_in_python(torch: Any, leaves: list[Any], most: int, dtype: Any) -> Gathered | None:
    """`one_run`'s checks read tensor by tensor from Python (no `NATIVE` helper)."""
    tensor, n = torch.Tensor, len(leaves)
    storage_nbytes, storage_ptr = torch.UntypedStorage.nbytes, torch.UntypedStorage.data_ptr
    one_type, one_dtype = {tensor}, {dtype}
    sizes: list[int] = []
    ptrs: set[int] = set()
    try:  # (a sparse or mkldnn tensor raises on these reads: the general path names it)
        for lo in range(0, n, _BLOCK):
            block = leaves[lo : lo + _BLOCK]
            if set(map(type, block)) != one_type or set(map(_DTYPE, block)) != one_dtype:
                return None
            size = list(map(_NBYTES, block))
            if min(size) <= dtype.itemsize or max(size) > most:
                return None
            storages = list(map(tensor.untyped_storage, block))
            ptrs.update(map(storage_ptr, storages))  # (each tensor starts its storage: checked next)
            if (
                any(map(tensor.storage_offset, block))
                or not all(map(tensor.is_contiguous, block))
                or size != list(map(storage_nbytes, storages))
                or any(map(tensor.is_neg, block))
            ):
                return None
            sizes += size
    except (RuntimeError, NotImplementedError):
        return None
    if len(ptrs) != n:  # views of one storage, or one tensor twice
        return None
    return _gathered(torch, leaves, sizes, dtype)


def _gathered(torch: Any, leaves: list[Any], sizes: list[int], dtype: Any) -> Gathered:
    """The `Gathered` of a checked run: one storage per leaf, in order, each 1-D on the host."""
    n = len(leaves)
    g = Gathered()
    g.sources, g.devices, g.sizes = leaves, [torch.device("cpu")] * n, sizes
    g.dtypes, g.shapes = [dtype] * n, [ONE_D] * n
    g.leaf, g.storage, g.recipe = list(range(n)), list(range(n)), [None] * n
    g.trail, g.direct = (), True
    return g


def copied(leaves: list[Any], most: int, least: int) -> tuple[Gathered, Any] | None:
    """``(gathered, host buffer)``: the leaves (`one_run`, each of at most ``most`` bytes, ``least`` bytes or
    more in all) copied back to back into one host buffer by one ``torch.cat``; None where they are not such a
    run or the ``torch.cat`` refuses one of them. Under inference mode, where ``torch.cat`` would not refuse a
    tensor that requires grad, None."""
    torch = torch_module()
    if torch is None or len(leaves) < 2 or torch.is_inference_mode_enabled():
        return None
    g = one_run(leaves, most)
    if g is None or (total := sum(g.sizes)) < least:
        return None
    pool = host_buffers.host_bytes(total, False)
    try:
        with torch.enable_grad():
            torch.cat(leaves, out=pool.view(g.dtypes[0]))
    except (RuntimeError, NotImplementedError):
        return None
    return g, pool
