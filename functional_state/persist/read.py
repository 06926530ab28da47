"""Reading a checkpoint: the newest step's manifest checked, its arrays restored by orbax where the caller
places them (host-bound torch storages straight into aligned memory), and every leaf's checksum verified."""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..errors import CheckpointError
from ..memory.huge_pages import advise_huge_pages
from ..memory.shardings import single_device_sharding
from .confined import check_depth, check_tree
from .decode import decode_sharding
from .direct import DirectReads, database, stored_leaves
from .directory import list_steps, orbax_manager, read_manifest
from .handlers import import_orbax, read_into
from .manifest import (
    CHECKSUM,
    check_manifest,
    checksum,
    copy_checksum,
    in_arrays_item,
    in_parallel,
    leaf_nbytes,
)
from .paths import is_url, local_path, remote_path
from .remote import staged_read
from .validate import check_stored


def read_checkpoint(path: Any, placement: Any, torch_device: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(manifest, arrays)`` of the checkpoint at ``path``, verified; `CheckpointError` for anything else."""
    if is_url(path):
        with staged_read(remote_path(path)) as staged:
            return read_checkpoint(staged, placement, torch_device)
    root = local_path(path)
    try:
        return _read_step(root, placement, torch_device)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:  # fields a manifest lacks or garbles
        raise CheckpointError(
            f"{root}: the manifest does not describe a checkpoint this version can read ({type(e).__name__}: "
            f"{str(e)[:200]}); it is damaged or was not written by functional_state."
        ) from e
    except OSError as e:
        raise CheckpointError(f"{root} cannot be read ({type(e).__name__}: {e}).") from e


def _read_step(root: Path, placement: Any, torch_device: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    ocp = import_orbax()
    steps = list_steps(root)
    if not steps:
        what = "does not exist" if not root.exists() else "holds no complete checkpoint"
        raise CheckpointError(f"{root} {what} (expected a directory written by functional_state's save).")
    step = max(steps)
    step_dir = root / str(step)
    # Nothing of the step is read by orbax or tensorstore (which follow links) before it is known to hold only
    # regular files and directories.
    check_tree(step_dir, str(root))
    manifest = steps[step]
    if manifest is None:
        read_manifest(step_dir)  # (raises what is wrong with it, where that is its file or its JSON)
        raise CheckpointError(
            f"{step_dir}: its manifest is missing, unreadable or not functional_state's; the checkpoint is "
            f"damaged or another tool wrote this directory."
        )
    check_depth(manifest, f"{root}: the manifest")
    check_manifest(manifest, root)
    leaves = manifest["leaves"]
    stored = {key: info for key, info in leaves.items() if in_arrays_item(info)}
    databases: dict[str, Any] = {}
    if stored:  # every declared size against what the data holds, before a buffer is allocated for it
        arrays_dir = os.path.normpath(step_dir / "arrays")
        databases[arrays_dir] = database(arrays_dir)
        check_stored(stored, stored_leaves(databases[arrays_dir], str(root)), str(root))
    on_cpu = _storages_on_cpu(manifest, torch_device)
    # Host-bound storages are read straight into aligned memory JAX can alias: from the data file itself where a
    # storage is one raw chunk (`direct.plan_direct`: no copy at all, the kernel's copy is the only one), else
    # through tensorstore's read buffer (one copy).
    prepared, owners = _prepare(leaves, on_cpu)
    # Leaves of no bytes are not in orbax's arrays item (`in_arrays_item`), and a checkpoint of none else has none.
    arrays = _read_arrays(ocp, root, step, stored, prepared, placement, databases) if stored else {}
    for key in leaves.keys() - stored.keys():
        arrays[key] = _empty_leaf(key, leaves[key], prepared, placement)
    missing = [key for key in leaves if arrays.get(key) is None]
    if missing:
        raise CheckpointError(f"{root}: leaf {missing[0]!r} is missing from the arrays.")

    def verify(key: str) -> tuple[Any, bool]:
        got, info = arrays[key], leaves[key]
        algorithm = next((a for a in (CHECKSUM, "sha256") if a in info), None)
        out = prepared.get(key)
        if algorithm is None:  # (`check_fields` refused a byte leaf without one)
            return got, info["kind"] == "jax"  # a leaf no process could read whole (sharded over hosts) has none
        if out is not None and got is out:  # read into its aligned buffer: what gets checked is what is used
            return owners[key], checksum(out, algorithm) == info[algorithm]
        if key in on_cpu:  # copied out once, aligned, and the copy is what gets checked
            src = np.asarray(got, dtype=np.uint8)
            out, owner = host_storage(src.nbytes)
            return owner, copy_checksum(src, out, algorithm) == info[algorithm]
        return got, checksum(np.asarray(got), algorithm) == info[algorithm]

    keys = sorted(leaves, key=lambda k: -leaf_nbytes(leaves[k]))  # largest first, so the cores finish together
    results = in_parallel(verify, keys, sum(leaf_nbytes(info) for info in leaves.values()))
    for key, (got, ok) in zip(keys, results):
        if not ok:
            info = leaves[key]
            raise CheckpointError(
                f"{root}: leaf {key!r} ({info['kind']}, {info.get('dtype', 'bytes')}) fails its checksum: the "
                f"checkpoint is corrupted."
            )
        arrays[key] = got
    return manifest, arrays


def _read_arrays(
    ocp: Any,
    root: Path,
    step: int,
    leaves: dict[str, Any],
    prepared: dict[str, np.ndarray],
    placement: Any,
    databases: dict[str, Any],
) -> dict[str, Any]:
    """The ``leaves`` of ``step`` that orbax's arrays item holds, restored (``prepared`` ones into their buffers);
    ``databases``: the arrays database's entries, listed already (`direct.database`)."""
    manager = orbax_manager(ocp, root, ocp.CheckpointManagerOptions(create=False))
    reads = DirectReads()  # this load's own direct reads
    reads.databases.update(databases)
    try:
        abstract: dict[str, Any] = {}
        for key, info in leaves.items():
            if info["kind"] == "jax":
                sharding = _placement_for(placement, key, info)
                abstract[key] = jax.ShapeDtypeStruct(tuple(info["shape"]), np.dtype(info["dtype"]), sharding=sharding)
            else:
                abstract[key] = np.empty(info["nbytes"], np.uint8)
        try:
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
            restore_args.update({key: read_into(out, reads) for key, out in prepared.items() if key in leaves})
            restore = ocp.args.PyTreeRestore(abstract, restore_args=restore_args)
            with reads.active():  # every handler settles before orbax returns (`direct.DirectReads.active`)
                restored = dict(manager.restore(step, args=ocp.args.Composite(arrays=restore))["arrays"])
            if reads.errors:
                raise reads.errors[0]
            return restored
        except Exception as e:
            reads.wait()  # none still writes into the buffers of a load that failed
            raise CheckpointError(
                f"{root}: reading the arrays failed, the checkpoint is damaged or truncated ({type(e).__name__}: "
                f"{str(e)[:300]})."
            ) from e
    finally:
        manager.close()


def _empty_leaf(key: str, info: dict[str, Any], prepared: dict[str, np.ndarray], placement: Any) -> Any:
    """A leaf of no bytes, rebuilt from the manifest alone (`in_arrays_item`): a JAX array of its dtype and shape
    where the load places it, or the empty byte buffer of a storage or numpy array (checked as any other)."""
    if info["kind"] == "jax":
        empty = np.zeros(tuple(info["shape"]), np.dtype(info["dtype"]))
        return jax.device_put(empty, _placement_for(placement, key, info))
    return prepared.get(key, np.empty(0, np.uint8))


def host_storage(nbytes: int) -> tuple[np.ndarray, Any]:
    """A host buffer of ``nbytes`` that torch allocates (64-byte aligned, as JAX needs to alias it), as
    ``(numpy view, uint8 tensor)``; the view is valid while the tensor lives. Not ``.numpy()``: a tensor whose
    numpy view was taken, or one over numpy memory, is never resizable again, and a model that grew a loaded
    tensor in place (``resize_``) raised. Not DLPack either: numpy before 2.1 imports read-only arrays."""
    import torch  # (the caller reads torch storages: a checkpoint holding them needs torch to load them)

    tensor = torch.empty(nbytes, dtype=torch.uint8)
    if not nbytes:
        return np.empty(0, np.uint8), tensor
    advise_huge_pages(tensor.data_ptr(), nbytes)  # (before the first touch: torch's allocator never asks)
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())), tensor


def _prepare(leaves: dict[str, Any], keys: set[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A `host_storage` for each of ``keys`` (leaves sized by the manifest): the views to read into, and their
    tensors; none for a size a damaged manifest garbles (that leaf is read into new memory, and refused)."""
    out, owners = {}, {}
    for key in keys:
        with contextlib.suppress(MemoryError, ValueError, TypeError, KeyError, RuntimeError):
            out[key], owners[key] = host_storage(leaf_nbytes(leaves[key]))
    return out, owners


def _storages_on_cpu(manifest: dict[str, Any], torch_device: Any) -> set[str]:
    """The torch storages a load leaves in host memory: the ones to copy into memory JAX can alias. A storage
    bound for a GPU goes there from orbax's read buffer directly, with no host copy between."""
    storages = {key for key, info in manifest["leaves"].items() if info["kind"] == "torch_storage"}
    if torch_device is not None:
        return storages if str(torch_device).split(":")[0] == "cpu" else set()
    found: set[str] = set()
    stack: list[Any] = [manifest["sessions"]]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if x.get("t") == "torch" and str(x.get("device", "cpu")).split(":")[0] == "cpu":
                found.add(x["storage"])
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return found & storages


def _placement_for(placement: Any, key: str, info: dict[str, Any]) -> Any:
    """Where JAX leaf ``key`` goes: the caller's placement, else the sharding it was saved with (``info``)."""
    if placement is None:
        return decode_sharding(info["sharding"])
    if callable(placement) and not isinstance(placement, (jax.Device, jax.sharding.Sharding)):
        placement = placement(key)
    if isinstance(placement, jax.Device):
        return single_device_sharding(placement)
    if isinstance(placement, jax.sharding.Sharding):
        return placement
    raise CheckpointError(
        f"placement must be a jax.Device, a jax.sharding.Sharding, or a callable giving one; got {placement!r}."
    )
