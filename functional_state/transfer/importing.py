"""`import_session`: a `SessionBlob` checked whole (the checkpoint's untrusted-input checks, its buffers' sizes
and checksums, its epoch and model) and only then built and installed, or refused with the table unchanged."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .. import table as ms
from ..core.session import SessionState
from ..errors import CheckpointError, InvalidArgumentError, InvalidTypeError, StaleEpochError, TransferError
from ..memory.outside_readers import borrow, immutable
from ..persist.checkpoint import check_free, install_session
from ..persist.confined import check_depth
from ..persist.decode import Reader, check_templates, decode_sharding, release_sessions
from ..persist.encode import AttrHooks
from ..persist.fencing import manifest_epoch
from ..persist.manifest import CHECKSUM, check_manifest, checksum, copy_checksum, in_parallel
from ..persist.read import host_storage
from ..persist.validate import StoredLeaf, check_stored
from ..table.manager_state import ManagerState
from .blob import TRANSFER, SessionBlob

__all__ = ["import_session", "read_blob"]


def import_session(
    state: ManagerState,
    blob: SessionBlob,
    *,
    as_id: str | None = None,
    epoch: int | None = None,
    model: str | None = None,
    placement: Any = None,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
    templates: Mapping[str, Any] | None = None,
    copy: bool = False,
) -> ManagerState:
    """``state`` holding the session ``blob`` carries (under ``as_id`` if given) as its most recent session.

    Everything is checked before anything is installed: the manifest's seal and every node (the checks a
    checkpoint load makes, `persist.validate`), the buffers' count and sizes, the epoch, the model, and every
    buffer's checksum.

    Copy-on-write: a torch storage of the session's objects is built over the blob's buffer itself, with no
    copy, where that buffer's memory can never change (`memory.outside_readers.immutable`: what ``ray.get`` returns,
    the object store's sealed memory, read in place) and is 64-byte aligned. Such a storage is *borrowed*:
    `writable` copies it into the session's own memory before any in-place write (as it copies a storage a
    fork shares), and a write made outside `writable` is refused (`SharedStorageWrittenError`) as for a fork.
    The storages keep the buffer alive while any tensor uses them, and with it the store's pin on the object:
    Ray neither frees, evicts nor reuses that memory while the session lives, even once the object's owner
    dies, every ``ObjectRef`` is dropped, the store spills under pressure, or Ray is shut down (each tested
    on a local Ray, `tests/test_transfer_ray.py`). The ledger counts their bytes as the session's. Everything else is copied, checksummed in the same pass: a writable buffer (a caller could
    change it after the import), a storage an attr holds (attrs are not written through `writable`), JAX
    leaves and storages a JAX alias views (a step donates JAX buffers, and XLA may write into a donated one). ``copy=True`` copies every
    storage into private memory at once.

    Args:
      epoch: the epoch the caller expects the session at (a router's record); None skips the check.
      model: this table's model identity: a blob naming another model (or none, when this is given) is refused.
      placement: where JAX leaves go: None (the sharding they were exported with, when its devices are here),
        a ``jax.Device`` or a ``jax.sharding.Sharding``. Torch tensors go to the device they were on.
      attr_hooks, object_hooks, templates: as for `load_session` (engine KV comes back through ``object_hooks``).
      copy: copy every buffer into memory of the session's own now instead of borrowing the read-only ones.

    Returns:
      The new table; ``state`` is unchanged.

    Raises:
      TransferError: the blob is truncated, damaged or tampered with, or from another model (named).
      StaleEpochError: the blob's epoch is not ``epoch``. SessionExistsError: the id is live in ``state``.
      Nothing changes unless the import fully succeeds; KV blocks an import hook took are handed back.

    Example:
      >>> import numpy as np, functional_state as fs
      >>> from functional_state.transfer import export_session, import_session
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "robot")
      >>> s = fs.commit(fs.put(s, "robot", "ring", fs.LatentBuffer.create(maxlen=2)), "robot", "ring", np.ones(2))
      >>> t = import_session(fs.ManagerState.create(), export_session(s, "robot"))
      >>> fs.view(t, "robot", "ring")[0].tolist()
      [1.0, 1.0]
    """
    target = None if as_id is None else ms.resolve_id(as_id, "import_session")
    if target is not None:
        check_free(state, target, False)  # (refused before the blob is read)
    sid, session = read_blob(
        blob,
        epoch=epoch,
        model=model,
        placement=placement,
        attr_hooks=attr_hooks,
        object_hooks=object_hooks,
        templates=templates,
        free_in=state if target is None else None,
        copy=copy,
    )
    try:
        return install_session(state, target if target is not None else sid, session)
    except BaseException as e:
        release_sessions([session], e)
        raise


def read_blob(
    blob: SessionBlob,
    *,
    epoch: int | None = None,
    model: str | None = None,
    placement: Any = None,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
    templates: Mapping[str, Any] | None = None,
    free_in: ManagerState | None = None,
    copy: bool = False,
) -> tuple[str, SessionState]:
    """``(session id, the SessionState)`` a blob carries, checked whole and built (what `import_session`
    installs; a shell installs it with ``SessionStateManager.install_session``). See `import_session` for the
    arguments and errors; ``free_in``: a table in which the blob's id must not be live (checked before the
    buffers are copied).

    Example:
      >>> import numpy as np, functional_state as fs
      >>> from functional_state.transfer import export_session
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "robot")
      >>> read_blob(export_session(s, "robot"))[0]
      'robot'
    """
    if not isinstance(blob, SessionBlob):
        raise InvalidTypeError(
            f"`import_session`: expected a SessionBlob (`export_session`), got {type(blob).__name__}."
        )
    check_templates(templates)
    sid, entry = _checked(blob)
    where = f"transfer blob of session {sid!r}"
    info = blob.manifest[TRANSFER]
    if model is not None and info["model"] != model:
        raise TransferError(
            f"{where}: it belongs to model {info['model']!r}, and this table serves {model!r}; a session moves only "
            f"between replicas of one model. Import it where that model is served."
        )
    if epoch is not None and info["epoch"] != epoch:
        raise StaleEpochError(
            f"`import_session`: {where} is at epoch {info['epoch']}, not {epoch}: "
            + ("it was exported by a superseded owner." if info["epoch"] < epoch else "the caller's record is stale.")
        )
    if free_in is not None:
        check_free(free_in, sid, False)
    arrays = _owned_arrays(blob, where, placement, copy)
    try:
        return sid, Reader(arrays, attr_hooks, None, object_hooks, templates).session(entry)
    except CheckpointError as e:
        raise TransferError(f"{where}: {e}") from e
    except Exception as e:
        raise TransferError(f"{where}: the session cannot be rebuilt ({type(e).__name__}: {e}).") from e


def _checked(blob: SessionBlob) -> tuple[str, dict[str, Any]]:
    """The blob's session id and manifest entry, once its manifest and buffers passed every check."""
    manifest = blob.manifest
    info = manifest.get(TRANSFER) if isinstance(manifest, dict) else None
    sid = info.get("session_id") if isinstance(info, dict) else None
    where = f"transfer blob of session {sid!r}"
    try:
        check_depth(manifest, where)  # (before anything recurses into it)
    except CheckpointError as e:
        raise TransferError(str(e)) from e
    try:
        check_manifest(manifest, where)  # (format, layout, its seal, then every field and node)
    except CheckpointError as e:
        raise TransferError(str(e)) from e
    # (a sealed manifest may still be crafted: a blob is one session, and its record a mapping of str keys)
    keys = info.get("buffers") if isinstance(info, dict) else None
    if manifest["kind"] != "session" or not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise TransferError(
            f"{where}: it is not one session's blob (kind {manifest['kind']!r}, buffer keys not a list of names); "
            f"the blob is damaged or crafted."
        )
    assert isinstance(info, dict)
    leaves = manifest["leaves"]
    with_bytes = sorted(k for k, leaf in leaves.items() if _nbytes(leaf))
    if not (
        isinstance(sid, str)
        and isinstance(info.get("epoch"), int)
        and not isinstance(info["epoch"], bool)
        and info["epoch"] >= 0
        and (info.get("model") is None or isinstance(info["model"], str))
        and isinstance(keys, list)
        and sorted(keys) == with_bytes
        and manifest["sessions"][0]["id"] == sid
        and manifest_epoch(manifest["sessions"][0]) == info["epoch"]
    ):
        raise TransferError(
            f"{where}: its transfer record (session id, epoch, model, buffer keys) disagrees with its manifest; "
            f"the blob is damaged or crafted."
        )
    if not isinstance(blob.buffers, (tuple, list)) or len(blob.buffers) != len(keys):
        got = len(blob.buffers) if isinstance(blob.buffers, (tuple, list)) else type(blob.buffers).__name__
        raise TransferError(f"{where}: it names {len(keys)} buffers and carries {got}; the blob is truncated.")
    stored = {}
    for key, buf in zip(keys, blob.buffers):
        if not isinstance(buf, (np.ndarray, memoryview, bytes, bytearray)):
            raise TransferError(f"{where}: buffer {key!r} is a {type(buf).__name__}, not host bytes.")
        try:
            n = _as_bytes(buf).nbytes
        except (TypeError, ValueError, BufferError) as e:  # (an object array; a strided memoryview)
            raise TransferError(
                f"{where}: buffer {key!r} is not plain contiguous bytes ({type(e).__name__}: {e})."
            ) from e
        leaf = leaves[key]
        shape = tuple(leaf["shape"]) if leaf["kind"] == "jax" and n == _nbytes(leaf) else (n,)
        stored[key] = StoredLeaf(shape, leaf["dtype"] if leaf["kind"] == "jax" else "uint8", n)
    try:
        check_stored(leaves, stored, where)
    except CheckpointError as e:
        raise TransferError(f"{e} (a buffer was truncated or swapped)") from e
    return sid, manifest["sessions"][0]


def _as_bytes(buf: Any) -> np.ndarray:
    """A buffer as 1-D uint8, without a copy where it is contiguous (object-store memory is)."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return np.frombuffer(buf, np.uint8)


def _nbytes(leaf: dict[str, Any]) -> int:
    if leaf["kind"] == "jax":
        return int(np.prod(leaf["shape"], dtype=object)) * np.dtype(leaf["dtype"]).itemsize
    return int(leaf["nbytes"])


def _owned_arrays(blob: SessionBlob, where: str, placement: Any, copy: bool) -> dict[str, Any]:
    """Each leaf's data, checksummed: a torch storage borrowed over the blob's buffer where that is safe
    (`_borrowable`), else copied into memory the new session owns (checksummed in the same pass); leaves of
    no bytes rebuilt from the manifest."""
    leaves, keys = blob.manifest["leaves"], blob.manifest[TRANSFER]["buffers"]
    private = set() if copy else _private_storages(blob.manifest["sessions"][0])

    def read(job: tuple[str, Any]) -> tuple[str, Any]:
        key, buf = job
        src = _as_bytes(buf)
        if leaves[key]["kind"] == "torch_storage":
            if not copy and key not in private and _borrowable(buf, src):
                return checksum(src), src  # (borrowed below, once its checksum held)
            out, owner = host_storage(src.nbytes)  # (aligned, resizable: as a checkpoint load gives)
            return copy_checksum(src, out), owner
        # A JAX leaf is always copied: a step donates JAX buffers, and XLA may write its output into a donated
        # buffer, which for one adopted from the blob would be the object store's shared memory.
        out = np.empty(src.nbytes, np.uint8)
        return copy_checksum(src, out), out

    jobs = list(zip(keys, blob.buffers))
    done = in_parallel(read, jobs, sum(int(_as_bytes(b).nbytes) for b in blob.buffers))
    arrays: dict[str, Any] = {}
    for (key, _), (digest, data) in zip(jobs, done):
        if digest != leaves[key].get(CHECKSUM):
            raise TransferError(
                f"{where}: buffer {key!r} fails its checksum ({CHECKSUM}); the blob was damaged or tampered with in "
                f"transit. Export it again."
            )
        arrays[key] = borrow(data) if isinstance(data, np.ndarray) and leaves[key]["kind"] == "torch_storage" else data
    for key, leaf in leaves.items():
        if leaf["kind"] == "jax":
            host = arrays.get(key, np.empty(0, np.uint8)).view(np.dtype(leaf["dtype"])).reshape(leaf["shape"])
            arrays[key] = jax.device_put(host, _sharding(placement, leaf))
        elif key not in arrays:
            arrays[key] = np.empty(0, np.uint8)
    return arrays


def _borrowable(buf: Any, src: np.ndarray) -> bool:
    """Whether a torch storage may be built over ``buf`` itself: memory nobody can write (`immutable`: the
    object store's sealed buffer, not a writable array a caller may change after the import), aligned as
    JAX needs to alias a tensor through the bridge."""
    return src.nbytes > 0 and src.ctypes.data % _ALIGN == 0 and immutable(buf)


_ALIGN = 64  # (what `read.host_storage` gives, and JAX's DLPack import needs to alias rather than copy)


def _private_storages(entry: dict[str, Any]) -> set[str]:
    """The storage keys that are copied, never borrowed: those the session's attrs name (`writable` guards
    objects only, and a model may write an attr tensor in place), and those a JAX alias of the torch bridge
    views (a step may donate the alias, and XLA may write its output into a donated buffer)."""
    found: set[str] = set()
    stack: list[tuple[Any, bool]] = [(entry.get("attrs"), True), (entry.get("objects"), False)]
    while stack:
        x, private = stack.pop()
        if isinstance(x, dict):
            private = private or x.get("t") == "jax_alias"
            if private and x.get("t") == "torch" and isinstance(x.get("storage"), str):
                found.add(x["storage"])
            stack.extend((v, private) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, private) for v in x)
    return found


def _sharding(placement: Any, leaf: dict[str, Any]) -> Any:
    if placement is None:
        return decode_sharding(leaf["sharding"])
    if isinstance(placement, jax.Device):
        return jax.sharding.SingleDeviceSharding(placement)
    if isinstance(placement, jax.sharding.Sharding):
        return placement
    raise InvalidArgumentError(f"`import_session`: placement must be a jax.Device or a Sharding, got {placement!r}.")
