"""Zero-copy DLPack exchange between PyTorch and JAX that never copies behind your back.

``to_jax`` imports a torch tensor as a JAX array over the same memory and checks the pointers after every
import. When aliasing is impossible it either raises `CopyRequiredError` (``strict=True``) or makes one
explicit, correct copy, counted in `report()` and logged once per reason. ``wrap`` never copies: it
returns the alias when there is one and the tensor itself otherwise.

While a JAX alias of a tensor is alive, do not write to the tensor in place, ``set_`` it, ``resize_`` it,
or free its storage: JAX assumes immutable buffers (jitted code may even bake them in as constants).
`check_alias` detects a storage that moved or shrank since the import.

On CUDA, JAX asks torch to export on JAX's stream and torch orders it after the *current* torch stream
only: work queued on other torch streams must be synchronized by the caller before ``to_jax``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal, overload

import jax
import torch

from functional_state import (
    CopyRequiredError,
    InvalidArgumentError,
    InvalidTypeError,
    SessionStateError,
    register_alias,
)
from functional_state.memory.accounting import alias_owner
from functional_state.memory.shardings import is_single_device

from . import _report

_log = logging.getLogger("functional_state")

__all__ = [
    "AliasInvalidatedError",
    "check_alias",
    "copy_reason",
    "to_jax",
    "to_torch",
    "tree_to_jax",
    "tree_to_torch",
    "unwrap",
    "wrap",
]

_64BIT = {torch.int64, torch.float64, torch.complex128, torch.uint64}
# Dtypes JAX represents; anything else (complex32, quantized, ...) stays a torch tensor.
_JAX_DTYPES = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.uint16,
    torch.uint32,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
} | _64BIT
_ALIGNMENT = {"cpu": 64, "cuda": 16}  # CPU: XLA copies below 64 B; GPU: executables need 16 B


class AliasInvalidatedError(SessionStateError, RuntimeError):
    """The torch storage behind a JAX alias moved or shrank after the import (``set_``/``resize_``)."""


class _AliasRecord:
    """What an alias keeps alive: the exported tensor, and its storage extent at import time."""

    __slots__ = ("storage_nbytes", "storage_ptr", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        storage = tensor.untyped_storage()
        self.storage_ptr = storage.data_ptr()
        self.storage_nbytes = storage.nbytes()

    def _accounting_children(self) -> tuple[torch.Tensor]:
        return (self.tensor,)


def _x64() -> bool:
    return bool(jax.config.read("jax_enable_x64"))


def _is_compact(t: torch.Tensor) -> bool:
    """True when the elements fill a dense block in some dim order (what JAX can describe as a layout)."""
    if t.is_contiguous() or t.numel() == 0:  # the common case, answered in C
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _diagnose(t: torch.Tensor) -> tuple[str | None, str, bool]:
    """``(category, detail, copyable)``: why JAX cannot alias ``t`` (category None if it can), in one of the
    bounded `CATEGORIES` and in words, and whether a copy would help."""
    if t.layout != torch.strided:
        return "layout", f"{t.layout} tensors have no DLPack form", False
    if t.device.type not in _ALIGNMENT:
        return "device", f"device {t.device} is not exchanged (cpu and cuda only)", False
    if t.dtype not in _JAX_DTYPES:
        return "dtype", f"JAX has no dtype for {t.dtype}", False
    if t.dtype in _64BIT and not _x64():
        return "x64", f"{t.dtype} would be downcast to 32 bits (jax_enable_x64 is off)", False
    if t.is_conj():
        return "conj", "conjugate-bit view (torch refuses to export it)", True
    if t.is_neg():
        return "neg", "negative-bit view (it would export without its negation)", True
    if not _is_compact(t):
        return "strides", f"non-compact strides {tuple(t.stride())} for shape {tuple(t.shape)}", True
    align = _ALIGNMENT[t.device.type]
    if t.numel() and t.data_ptr() % align:
        offset = t.storage_offset() * t.element_size()
        return "alignment", f"start address not {align}-byte aligned (storage offset {offset} B)", True
    return None, "", True


def copy_reason(t: torch.Tensor) -> str | None:
    """Why ``t`` cannot be aliased by JAX, or None when it can.

    Example:
      >>> copy_reason(torch.zeros(4, 4)) is None, copy_reason(torch.zeros(4, 4)[:, :2])
      (True, 'non-compact strides (4, 1) for shape (4, 2)')
    """
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"`copy_reason`: expected a torch.Tensor, got {type(t).__name__}.")
    category, detail, _ = _diagnose(t)
    return None if category is None else detail


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# DLPack import. JAX's public `jax.dlpack.from_dlpack` wraps a ~6 us C++ import in Python that costs several
# times more (a caught UNIMPLEMENTED error per CPU call, `jnp.asarray`, placement), all of it moot for a tensor
# `_diagnose` passed: it is on its own device, of a canonical dtype, and no copy is asked for. So the bridge
# calls the C++ import directly where a feature check shows it behaves as the public function, and the public
# function everywhere else. Both are followed by the same pointer check.
_CPU, _CUDA = 1, 2  # DLDeviceType codes
_FAST_DEVICES: dict[tuple[int, int], Any] = {}  # (DLDeviceType, id) -> jax Device, or None: use the public path


def _public_from_dlpack(exported: torch.Tensor) -> jax.Array:
    return jax.dlpack.from_dlpack(exported)


def _c_import() -> Callable[..., Any] | None:
    """JAX's internal DLPack import with the signature this bridge was written against, or None."""
    try:
        from jax._src.dlpack import jaxlib_extension_version
        from jax._src.lib import _jax
    except ImportError:
        return None
    fn = getattr(_jax, "dlpack_managed_tensor_to_buffer", None)
    return fn if callable(fn) and jaxlib_extension_version >= 467 else None


_C_IMPORT = _c_import()


def _fast_device(dl_type: int, dl_id: int) -> Any:
    """The JAX device for a DLPack device if the direct import works there (checked once per device against
    the public path on a probe tensor: same pointer, dtype, shape, sharding, commitment and values), else None."""
    key = (dl_type, dl_id)
    if key in _FAST_DEVICES:
        return _FAST_DEVICES[key]
    device = None
    if _C_IMPORT is not None and dl_type in (_CPU, _CUDA):
        try:
            from jax._src import xla_bridge

            platform = "cpu" if dl_type == _CPU else "cuda"
            candidate = xla_bridge.get_backend(platform).device_from_local_hardware_id(dl_id)
            torch_device = torch.device("cpu") if dl_type == _CPU else torch.device("cuda", dl_id)
            probe = torch.arange(16, dtype=torch.float32, device=torch_device)
            fast = _direct_import(probe, candidate, dl_type)
            public = _public_from_dlpack(probe)
            same = (
                type(fast) is type(public)
                and fast.dtype == public.dtype
                and fast.shape == public.shape
                and fast.sharding == public.sharding
                and fast.weak_type == public.weak_type
                and getattr(fast, "_committed", None) == getattr(public, "_committed", None)
                and fast.unsafe_buffer_pointer() == probe.data_ptr() == public.unsafe_buffer_pointer()
                and bool((torch.from_dlpack(fast) == probe).all())
            )
            device = candidate if same else None
        except Exception as err:  # any surprise in an internal API: the public path is always correct
            _log.debug("torch_bridge: direct DLPack import unavailable on %s: %r", key, err)
            device = None
    _FAST_DEVICES[key] = device
    return device


def _direct_import(exported: torch.Tensor, device: Any, dl_type: int) -> jax.Array:
    """What `jax.dlpack.from_dlpack(exported)` does for an on-device, canonical-dtype, no-copy import."""
    # JAX asks for the stream it will read on; CPU has none (the public path learns so from an error).
    stream = device.get_stream_for_external_ready_events() if dl_type == _CUDA else None
    array = _C_IMPORT(exported.__dlpack__(stream=stream), device, stream, None, dl_type)  # type: ignore[misc]
    if array.dtype != jax.dtypes.canonicalize_dtype(array.dtype):
        return _public_from_dlpack(exported)  # never reached for a tensor `_diagnose` passed; kept exact anyway
    return array


def _from_dlpack(exported: torch.Tensor) -> jax.Array:
    """A JAX array over ``exported``'s memory: the direct import where it was checked, the public one else."""
    dl_type, dl_id = exported.__dlpack_device__()
    device = _FAST_DEVICES.get((dl_type, dl_id), False)
    if device is False:
        device = _fast_device(dl_type, dl_id)
    if device is None:
        return _public_from_dlpack(exported)
    return _direct_import(exported, device, dl_type)


def _import(t: torch.Tensor, count: bool = True) -> jax.Array:
    """DLPack import of an aliasable tensor, with the pointer check that proves no copy happened."""
    # JAX keeps the detached tensor, and so the storage, alive; requires_grad is dropped.
    exported = t.detach()
    if exported.is_cuda:
        with torch.cuda.device(exported.device):  # torch exports only tensors of the current device
            array = _from_dlpack(exported)
    else:
        array = _from_dlpack(exported)
    if exported.numel() and array.unsafe_buffer_pointer() != exported.data_ptr():
        raise CopyRequiredError(
            f"`to_jax`: JAX copied a tensor the bridge judged aliasable (shape {tuple(t.shape)}, dtype {t.dtype}, "
            f"strides {tuple(t.stride())}); please report this layout."
        )
    register_alias(array, _AliasRecord(exported))  # the accounting counts the storage once, through the record
    if count:
        _report.record("wrapped", _nbytes(t))
    return array


@overload
def to_jax(tensor: torch.Tensor, *, strict: Literal[True]) -> jax.Array: ...
@overload
def to_jax(tensor: torch.Tensor, *, strict: bool = False) -> jax.Array | torch.Tensor: ...
def to_jax(tensor: torch.Tensor, *, strict: bool = False) -> jax.Array | torch.Tensor:
    """A JAX array over the tensor's memory, bit-exact and of the same dtype.

    Typed as such: with ``strict=True`` the result is always a `jax.Array` (anything else raises), so
    ``to_jax(t, strict=True).unsafe_buffer_pointer()`` type-checks; without it the result may be the tensor
    itself (below), and a type checker asks you to narrow it (``isinstance(a, jax.Array)``).

    Args:
      tensor: a CPU or CUDA torch tensor (``requires_grad`` is fine: it is detached, not copied).
      strict: raise instead of copying when aliasing is impossible.

    Returns:
      The JAX alias; or, when aliasing is impossible and ``strict`` is False, a JAX alias of one explicit
      copy (counted in `report()`, announced once per reason category with a `BridgeCopyWarning`); or, when
      JAX has no dtype for the tensor (complex32, 64-bit without ``jax_enable_x64``), the tensor itself
      (announced once per category with a `BridgeKeptTorchWarning`).

    Raises:
      CopyRequiredError: ``strict`` and the tensor cannot be aliased; the message names the reason.

    Example:
      >>> t = torch.arange(16, dtype=torch.float32)
      >>> a = to_jax(t)
      >>> a.unsafe_buffer_pointer() == t.data_ptr(), a.dtype
      (True, dtype('float32'))
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTypeError(
            f"`to_jax`: expected a torch.Tensor, got {type(tensor).__name__}; use `tree_to_jax` for trees."
        )
    category, detail, copyable = _diagnose(tensor)
    if category is None:
        return _import(tensor)
    if strict:
        raise CopyRequiredError(
            f"`to_jax(strict=True)`: cannot alias a tensor of shape {tuple(tensor.shape)}, dtype {tensor.dtype}: "
            f"{detail}. Pass strict=False to copy explicitly, or use `wrap` to keep it a torch tensor."
        )
    if not copyable:
        _report.record("kept_torch", _nbytes(tensor), category, detail, warn=True)
        return tensor
    # One fresh contiguous allocation (aligned by the allocator) with conj/neg bits materialized.
    copy = tensor.detach().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    _report.record("copied", _nbytes(tensor), category, detail, warn=True)
    return _import(copy, count=False)


def wrap(tensor: torch.Tensor) -> jax.Array | torch.Tensor:
    """The JAX alias of ``tensor`` when one is possible, else ``tensor`` itself; never a copy, never a warning.

    For values a model only hands around (K/V that are strided slices of padded allocations), this moves
    them by reference whatever their layout. `unwrap` gives back a torch tensor over the same storage.

    Example:
      >>> padded = torch.zeros(8, 16)
      >>> wrap(padded[:, :4]) is not None and isinstance(wrap(padded[:, :4]), torch.Tensor)
      True
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTypeError(f"`wrap`: expected a torch.Tensor, got {type(tensor).__name__}.")
    category, _, _ = _diagnose(tensor)
    if category is None:
        return _import(tensor)
    _report.record("kept_torch", _nbytes(tensor), category)  # by design: counted, never warned about
    return tensor


def check_alias(array: jax.Array) -> None:
    """Raise if the torch storage behind a bridge alias moved or shrank since the import.

    Raises:
      AliasInvalidatedError: the storage was resized, replaced or freed; the JAX array reads stale memory.
    """
    record = alias_owner(array)
    if not isinstance(record, _AliasRecord):
        return
    storage = record.tensor.untyped_storage()
    if storage.data_ptr() != record.storage_ptr or storage.nbytes() < record.storage_nbytes:
        raise AliasInvalidatedError(
            f"the torch storage behind this JAX array changed after import (was {record.storage_nbytes} B at "
            f"{record.storage_ptr:#x}, now {storage.nbytes()} B at {storage.data_ptr():#x}): a `resize_`, `set_` "
            f"or `.data =` on the source tensor. Do not modify tensors while a JAX alias is alive."
        )


def to_torch(array: jax.Array | torch.Tensor) -> torch.Tensor:
    """A torch tensor over the JAX array's memory (writable: in-place writes show in JAX).

    Waits for pending JAX work on the array first. An array the bridge imported from torch comes back as
    the exported tensor itself: the same storage, strides and dtype. A torch tensor is returned as is.

    Raises:
      AliasInvalidatedError: the array is a bridge alias whose torch storage changed since the import.
      ValueError: the array is deleted (donated) or spans several devices.
    """
    if isinstance(array, torch.Tensor):
        return array
    if not isinstance(array, jax.Array):
        raise InvalidTypeError(f"`to_torch`: expected a jax.Array or torch.Tensor, got {type(array).__name__}.")
    if array.is_deleted():
        raise InvalidArgumentError(
            "`to_torch`: the JAX array was deleted (donated to a jitted call); it has no memory left."
        )
    # One device buffer, read off the sharding's type (the shard list costs a fifth of a whole import).
    if not is_single_device(array.sharding) and len(array.addressable_shards) != 1:
        raise InvalidArgumentError(
            f"`to_torch`: the array spans {len(array.addressable_shards)} device buffers; gather it to one device "
            f"first (e.g. `jax.device_put(a, jax.devices()[0])`)."
        )
    array.block_until_ready()  # never hand torch a buffer JAX is still writing
    record = alias_owner(array)
    if isinstance(record, _AliasRecord):
        check_alias(array)
        return record.tensor
    exporter: Any = array  # jax.Array's stubs lack __dlpack_device__ and max_version
    if _TORCH_DIRECT and exporter.__dlpack_device__()[0] == _CPU:
        return _torch_direct(array)
    return torch.from_dlpack(array)


def _torch_direct(array: jax.Array) -> torch.Tensor:
    """What `torch.from_dlpack(array)` does for a CPU array (no stream to order on), without its Python
    negotiation around the C++ import."""
    exporter: Any = array
    return torch._C._from_dlpack(exporter.__dlpack__(max_version=(1, 0)))


def _check_torch_direct() -> bool:
    """Whether `_torch_direct` gives what `torch.from_dlpack` gives here (the same memory, dtype, shape and
    strides on a probe array); when not, `to_torch` uses the public function."""
    if not callable(getattr(torch._C, "_from_dlpack", None)):
        return False
    try:
        probe = jax.numpy.arange(16, dtype=jax.numpy.float32).reshape(4, 4)
        fast, public = _torch_direct(probe), torch.from_dlpack(probe)
        return (
            fast.data_ptr() == public.data_ptr() == probe.unsafe_buffer_pointer()
            and fast.dtype == public.dtype
            and fast.shape == public.shape
            and fast.stride() == public.stride()
            and fast.device == public.device
        )
    except Exception as err:  # any surprise in an internal API: the public path is always correct
        _log.debug("torch_bridge: direct DLPack export unavailable: %r", err)
        return False


_TORCH_DIRECT = _check_torch_direct()


def unwrap(value: Any) -> Any:
    """Inverse of `wrap` for one value: JAX arrays become torch tensors (same storage); others pass through."""
    return to_torch(value) if isinstance(value, jax.Array) else value


def tree_to_jax(tree: Any, *, strict: bool = False) -> Any:
    """`to_jax` on every torch tensor leaf of ``tree``; every other leaf is returned untouched."""
    return jax.tree_util.tree_map(lambda x: to_jax(x, strict=strict) if isinstance(x, torch.Tensor) else x, tree)


def tree_to_torch(tree: Any) -> Any:
    """`to_torch` on every JAX array leaf of ``tree``; every other leaf is returned untouched."""
    return jax.tree_util.tree_map(unwrap, tree)
