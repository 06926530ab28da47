"""Checkpoint, restore and migrate sessions: complete snapshots written by orbax-checkpoint.

A checkpoint is an orbax `CheckpointManager` directory (one step kept): an ``arrays`` item holding every
buffer (JAX arrays as they are, sharded or not; each torch *storage* once, as raw bytes; numpy arrays as raw
bytes) and a ``manifest`` item (JSON) recording the library version, the layout, each session's structure
(objects with their lifecycle status and ring positions, staged payloads, attrs and fork policies) and, per
leaf, its dtype, shape and checksum (XXH3-128); the manifest carries a checksum of its own, and a load checks
it and every leaf's before it builds anything. orbax writes a step to a temporary directory and renames it
when complete, so a checkpoint is complete or absent, and a save that dies part-way (killed, out of space)
leaves the previous one, which is deleted only once the new one is complete.

A save writes only into a directory it made (marked ``_FUNCTIONAL_STATE``) or one holding its checkpoints, and
refuses one holding anything that looks like a step but is not one of ours. Saves into one directory
are serialised within a process: a second waits for the first, an asynchronous one included. An
asynchronous save nobody waits for still completes: its handle finishes on a thread of its own, and one still
running at interpreter exit is waited for then (a failure nobody heard is printed to stderr).

Restoring is not recomputing: counters, ring order, staged payloads, parked objects (parked again on load)
and views that shared one torch storage (one storage again; a JAX array that aliased a torch tensor through
the bridge aliases the restored storage) come back as they were, in the framework,
dtype and shape they had, on the device they had or the ``placement`` asked for. Attrs are saved when they
are arrays, tensors, scalars, str, bytes, None, or lists/tuples/dicts of those; anything else raises
`CheckpointError` before a byte is written, unless an ``attr_hooks`` entry exports it (never pickle).

Example:
  >>> import tempfile, numpy as np, functional_state as fs
  >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "robot")
  >>> s = fs.commit(fs.put(s, "robot", "ring", fs.LatentBuffer.create(maxlen=2)), "robot", "ring", np.arange(3))
  >>> path = tempfile.mkdtemp() + "/robot"
  >>> save_session(s, "robot", path).done()
  True
  >>> t = load_session(fs.ManagerState.create(), "robot", path)
  >>> fs.view(t, "robot", "ring")[0].tolist()
  [0, 1, 2]
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._version import __version__
from ..core.array_ring import ArrayRing
from ..core.dense_value import DenseValue
from ..core.latent_buffer import LatentBuffer
from ..core.session import SessionState
from ..core.state_object import PARKED, RESIDENT, StateObject
from ..engine.paged_kv import PagedKVHandle
from ..errors import CheckpointError, InvalidTypeError, SessionExistsError, SessionStateError
from ..memory import accounting
from ..memory.parking import JaxLeaf, TorchLeaf, host_storage, jax_alias, rebuild_leaf
from ..table import manager_state as ms
from ..table.manager_state import ManagerState

__all__ = [
    "SaveHandle",
    "has_checkpoint",
    "install_session",
    "load",
    "load_session",
    "read_session",
    "register_checkpoint_type",
    "save",
    "save_session",
]

FORMAT = "functional-state checkpoint"
LAYOUT = 1  # bumped when the manifest's meaning changes; a reader refuses layouts it does not know

_log = logging.getLogger("functional_state")

_TYPES: dict[str, type[StateObject]] = {"LatentBuffer": LatentBuffer, "ArrayRing": ArrayRing, "DenseValue": DenseValue}

AttrHooks = Mapping[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]]


def register_checkpoint_type(cls: type[StateObject]) -> type[StateObject]:
    """Allow checkpoints to hold instances of ``cls``, a `StateObject` subclass (a `pytree_dataclass`); its
    fields must hold checkpointable values. Checkpoints name types, they never import them. Usable as a
    decorator."""
    if not (isinstance(cls, type) and issubclass(cls, StateObject)):
        raise InvalidTypeError(f"`register_checkpoint_type`: expected a StateObject subclass, got {cls!r}.")
    _TYPES[cls.__name__] = cls
    return cls


def _torch() -> Any:
    return sys.modules.get("torch")


# A leaf's checksum guards against corruption and truncation, not tampering: XXH3-128 finds those as surely as
# SHA-256 and runs at 20 GB/s per core here against SHA-256's 2 GB/s, which made checking a 600 MiB load take
# longer than reading it. Checkpoints of earlier versions carry SHA-256 and are checked with it.
_CHECKSUM = "xxh3_128"


def _checksum(data: Any, algorithm: str = _CHECKSUM) -> str:
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    if algorithm == "sha256":
        return hashlib.sha256(raw).hexdigest()
    return _xxhash().xxh3_128(raw).hexdigest()


def _xxhash() -> Any:
    try:
        import xxhash
    except ImportError as e:  # pragma: no cover - the checkpoint extra is missing
        raise ImportError("functional_state checkpoints need xxhash: pip install 'functional-state[checkpoint]'") from e
    return xxhash


_ALIGN = 64  # what JAX needs to alias host memory through DLPack (torch's own allocator gives the same)
_PARALLEL_MIN = 8 << 20  # below this many bytes, threads cost more than they save


def _aligned_copy(src: np.ndarray) -> np.ndarray:
    """A copy of the 1-D uint8 array ``src`` in ``_ALIGN``-byte aligned memory of its own."""
    buf = np.empty(src.nbytes + _ALIGN, np.uint8)
    start = -buf.ctypes.data % _ALIGN
    out = buf[start : start + src.nbytes]
    np.copyto(out, src)
    return out


def _in_parallel(fn: Callable[[Any], Any], jobs: list[Any], nbytes: int) -> list[Any]:
    """``[fn(job) for job in jobs]``, on threads when there is enough data to share out: hashing and numpy
    copies release the GIL, so a checkpoint's checksums and copies use every core."""
    workers = min(len(jobs), os.cpu_count() or 1, 8)
    if workers < 2 or nbytes < _PARALLEL_MIN:
        return [fn(job) for job in jobs]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, jobs))


# --- encoding: state -> (JSON nodes, arrays) ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _AliasLeaf:
    """Inside the writer only: a parked bridge alias, as the host tensor it will be saved from."""

    tensor: Any
    owner_type: type | None


def _owner_name(owner_type: type | None) -> str | None:
    return None if owner_type is None else f"{owner_type.__module__}:{owner_type.__qualname__}"


def _owner_type(name: str | None) -> type | None:
    """The alias record type a checkpoint names, if its module is already imported (a checkpoint never
    imports code); else None, and the tensor itself owns the alias."""
    if not name:
        return None
    module, _, qualname = name.partition(":")
    cls = getattr(sys.modules.get(module), qualname, None)
    return cls if isinstance(cls, type) else None


class _Writer:
    def __init__(self, hooks: AttrHooks | None, copy_host: bool, object_hooks: AttrHooks | None = None):
        self.object_hooks = dict(object_hooks or {})
        self.arrays: dict[str, Any] = {}
        self.leaves: dict[str, dict[str, Any]] = {}
        self.storages: dict[tuple[str, int, int], str] = {}  # (device, storage pointer, bytes) -> leaf key
        self.hooks = dict(hooks or {})
        self.copy_host = copy_host  # an asynchronous save copies host buffers a model might change in place
        self.keep: list[Any] = []  # objects whose memory the saved arrays view, kept alive until written
        self._to_hash: list[tuple[str, Any]] = []  # (leaf key, its data): checksummed together in `checksums`
        # Parked leaves are encoded from views of their host copies: where each really belongs.
        self._device_of: dict[int, Any] = {}
        self._sharding_of: dict[int, Any] = {}

    def _key(self) -> str:
        return f"leaf{len(self.leaves)}"

    def value(self, x: Any, where: str) -> dict[str, Any]:
        torch = _torch()
        if x is None or isinstance(x, (bool, str)) or (isinstance(x, int) and not isinstance(x, bool)):
            return {"t": "v", "v": x}
        if isinstance(x, float):
            return {"t": "f", "v": repr(x)}
        if isinstance(x, bytes):
            return {"t": "b", "v": base64.b64encode(x).decode()}
        if torch is not None and isinstance(x, torch.Tensor):
            return self._tensor(x, where, self._device_of.get(id(x), x.device))
        if isinstance(x, _AliasLeaf):
            return self._alias(x.tensor, x.owner_type, where, self._device_of.get(id(x.tensor), x.tensor.device))
        if isinstance(x, jax.Array):
            owner = accounting.alias_owner(x)
            tensor = getattr(owner, "tensor", owner)
            if (
                torch is not None
                and isinstance(tensor, torch.Tensor)
                and tuple(tensor.shape) == x.shape
                and str(tensor.dtype).removeprefix("torch.") == x.dtype.name
            ):  # a bridge alias: saved as the storage it views, so it shares it again on load
                return self._alias(tensor, type(owner) if owner is not tensor else None, where, tensor.device)
            return self._jax(x, where, self._sharding_of.get(id(x)))
        if isinstance(x, np.ndarray):
            return self._numpy(x, where)
        if isinstance(x, np.generic):
            return {"t": "np", "dtype": x.dtype.name, "v": x.item() if x.dtype.kind in "biu" else repr(x.item())}
        if isinstance(x, (list, tuple)):
            return {"t": type(x).__name__, "items": [self.value(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, dict):
            bad = [k for k in x if not isinstance(k, str)]
            if bad:
                raise CheckpointError(f"{where}: dict keys must be str to be checkpointed, got {bad[0]!r}.")
            return {"t": "dict", "items": [[k, self.value(v, f"{where}[{k!r}]")] for k, v in x.items()]}
        raise CheckpointError(
            f"{where} is a {type(x).__module__}.{type(x).__qualname__}, which a checkpoint cannot hold (arrays, "
            f"tensors, scalars, str, bytes, None, and lists/tuples/dicts of those). Give the save an attr_hooks "
            f"entry that exports it to one of those, and the load one that imports it back."
        )

    def _tensor(self, t: Any, where: str, device: Any) -> dict[str, Any]:
        torch = _torch()
        if t.layout is not torch.strided:
            raise CheckpointError(f"{where}: a {t.layout} tensor cannot be checkpointed; save a dense copy.")
        if t.is_conj() or t.is_neg():
            raise CheckpointError(
                f"{where}: a lazily conjugated or negated tensor; call .resolve_conj()/.resolve_neg()."
            )
        storage = t.untyped_storage()
        # The size too: an empty storage can start where the next one in a shared host buffer starts.
        skey = (str(t.device), storage.data_ptr(), storage.nbytes())
        key = self.storages.get(skey)
        if key is None:
            key = self.storages[skey] = self._key()
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage).detach()
            host = raw.cpu().numpy() if raw.device.type != "cpu" else raw.numpy()
            if self.copy_host and raw.device.type == "cpu":
                host = host.copy()
            self.keep.append(raw)
            self.arrays[key] = host
            self.leaves[key] = {"kind": "torch_storage", "nbytes": int(host.nbytes)}
            self._to_hash.append((key, host))
        return {
            "t": "torch",
            "storage": key,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
            "device": str(device),
            "requires_grad": bool(t.requires_grad),
        }

    def _alias(self, t: Any, owner_type: type | None, where: str, device: Any) -> dict[str, Any]:
        return {"t": "jax_alias", "tensor": self._tensor(t, where, device), "owner": _owner_name(owner_type)}

    def _jax(self, a: Any, where: str, sharding: Any) -> dict[str, Any]:
        if a.is_deleted():
            raise CheckpointError(f"{where}: a deleted (donated) JAX array; its values are gone.")
        key = self._key()
        sharding = sharding if sharding is not None else a.sharding
        if getattr(a.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host"):
            a = jax.device_put(a, a.sharding.with_memory_kind("device"))  # orbax writes device arrays
        self.arrays[key] = a
        info: dict[str, Any] = {
            "kind": "jax",
            "dtype": a.dtype.name,
            "shape": list(a.shape),
            "sharding": _encode_sharding(sharding),
        }
        self.leaves[key] = info
        if a.is_fully_addressable:
            self._to_hash.append((key, a))
        return {"t": "jax", "key": key}

    def _numpy(self, a: np.ndarray, where: str) -> dict[str, Any]:
        if a.dtype.hasobject:
            raise CheckpointError(f"{where}: a numpy array of Python objects cannot be checkpointed.")
        key = self._key()
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        self.arrays[key] = raw.copy() if self.copy_host and raw.base is not None else raw
        self.leaves[key] = {"kind": "numpy", "nbytes": int(raw.nbytes)}
        self._to_hash.append((key, raw))
        return {"t": "numpy", "key": key, "dtype": a.dtype.name, "shape": list(a.shape)}

    def checksums(self) -> None:
        """Give every leaf its checksum, largest first across the cores."""
        jobs = sorted(self._to_hash, key=lambda job: -job[1].nbytes)
        digests = _in_parallel(lambda job: _checksum(np.asarray(job[1])), jobs, sum(job[1].nbytes for job in jobs))
        for (key, _), digest in zip(jobs, digests):
            self.leaves[key][_CHECKSUM] = digest
        self._to_hash = []

    def object(self, obj: Any, where: str) -> dict[str, Any]:
        if isinstance(obj, PagedKVHandle):
            raise CheckpointError(
                f"{where} is a PagedKVHandle: its K/V lives in an engine's pool, which a session checkpoint does "
                f"not own. Evict it before saving (it is recomputed on resume), or pass object_hooks with an "
                f"export that gathers its K/V and an import that writes it into the engine's new blocks."
            )
        name = type(obj).__name__
        if _TYPES.get(name) is not type(obj):
            raise CheckpointError(
                f"{where} is a {type(obj).__qualname__}, not a registered checkpoint type; call "
                f"`functional_state.checkpoint.register_checkpoint_type({name})` first."
            )
        parked = obj.status == PARKED
        if parked:  # encoded from its host copy as the resident object it stands for; parked again on load
            obj = self._unparked_view(obj)
        fields, static = {}, {}
        meta = set(getattr(type(obj), "_static_fields", ()))
        for f in _fields(type(obj)):
            value = getattr(obj, f)
            if f in meta:
                static[f] = _encode_static(value, f"{where}.{f}")
            elif f != "host_copy":
                fields[f] = self.value(value, f"{where}.{f}")
        return {"t": "obj", "type": name, "static": static, "fields": fields, "parked": parked}

    def _unparked_view(self, obj: Any) -> Any:
        """``obj`` as the resident object its host copy stands for, its leaves views of that copy: rebuilt by
        parking's own `rebuild_leaf` over each storage's own bytes (`host_storage`), as a restore would."""
        parked = obj.host_copy
        leaves: list[Any] = []
        for leaf in parked.leaves:
            if isinstance(leaf, TorchLeaf):
                plain = TorchLeaf(
                    leaf.storage,
                    leaf.dtype,
                    leaf.shape,
                    leaf.stride,
                    leaf.offset,
                    leaf.conj,
                    leaf.neg,
                    None,
                    leaf.requires_grad,  # saved as a resident leaf's flag is, so the load sets it again
                )
                t = rebuild_leaf(plain, host_storage(parked, leaf.storage))
                self._device_of[id(t)] = parked.storages[leaf.storage].device
                leaves.append(t if leaf.jax_owner_type is None else _AliasLeaf(t, leaf.jax_owner_type))
            elif isinstance(leaf, JaxLeaf):
                self._sharding_of[id(leaf.host)] = leaf.sharding
                leaves.append(leaf.host)
            else:
                leaves.append(leaf)
        values = jax.tree_util.tree_unflatten(parked.treedef, leaves)
        self.keep.append(values)
        return obj._replace(status=RESIDENT, host_copy=None, **values)

    def session(self, session: SessionState, sid: str) -> dict[str, Any]:
        objects = {}
        for name, obj in session.objects.items():
            where = f"session {sid!r}: object {name!r}"
            if name in self.object_hooks:  # an object the model exports itself (engine-owned KV, say)
                objects[name] = {"t": "hooked", "value": self.value(self.object_hooks[name][0](obj), where)}
            else:
                objects[name] = self.object(obj, where)
        attrs, hooked = {}, []
        for key, value in session.attrs.items():
            where = f"session {sid!r}: attr {key!r}"
            if key in self.hooks:
                value = self.hooks[key][0](value)
                hooked.append(key)
            attrs[key] = self.value(value, where)
        return {"id": sid, "objects": objects, "attrs": attrs, "hooked": hooked, "policies": dict(session._policies)}


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _encode_static(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return {"t": "v", "v": value}
    if isinstance(value, float):
        return {"t": "f", "v": repr(value)}
    if isinstance(value, tuple):
        return {"t": "tuple", "items": [_encode_static(v, where) for v in value]}
    if isinstance(value, np.dtype):
        return {"t": "dtype", "v": value.name}
    raise CheckpointError(f"{where}: static field value {value!r} cannot be checkpointed.")


def _encode_sharding(s: Any) -> dict[str, Any]:
    memory_kind = getattr(s, "memory_kind", None)
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        device: Any = next(iter(s.device_set))
        return {"kind": "single", "device": device.id, "platform": device.platform, "memory_kind": memory_kind}
    if isinstance(s, jax.sharding.NamedSharding):
        return {
            "kind": "named",
            "mesh_shape": list(s.mesh.devices.shape),
            "axis_names": list(s.mesh.axis_names),
            "device_ids": [d.id for d in s.mesh.devices.flat],
            "spec": [list(p) if isinstance(p, tuple) else p for p in s.spec],
            "memory_kind": memory_kind,
        }
    return {"kind": "other"}


# --- decoding: (JSON nodes, arrays) -> state --------------------------------------------------------------


def _decode_sharding(info: dict[str, Any]) -> Any:
    devices = {d.id: d for d in jax.devices()}
    if info["kind"] == "single" and info["device"] in devices:
        return jax.sharding.SingleDeviceSharding(devices[info["device"]])
    if info["kind"] == "named" and all(i in devices for i in info["device_ids"]):
        mesh_devices = np.array([devices[i] for i in info["device_ids"]]).reshape(info["mesh_shape"])
        mesh = jax.sharding.Mesh(mesh_devices, tuple(info["axis_names"]))
        spec = jax.sharding.PartitionSpec(*[tuple(p) if isinstance(p, list) else p for p in info["spec"]])
        return jax.sharding.NamedSharding(mesh, spec)
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


class _Reader:
    def __init__(
        self,
        arrays: Mapping[str, Any],
        hooks: AttrHooks | None,
        torch_device: Any,
        object_hooks: AttrHooks | None = None,
    ):
        self.object_hooks = dict(object_hooks or {})
        self.arrays = arrays
        self.hooks = dict(hooks or {})
        self.torch_device = torch_device
        self.storages: dict[tuple[str, str], Any] = {}

    def value(self, node: dict[str, Any]) -> Any:
        t = node["t"]
        if t == "v":
            return node["v"]
        if t == "f":
            return float(node["v"])
        if t == "b":
            return base64.b64decode(node["v"])
        if t == "np":
            return np.dtype(node["dtype"]).type(node["v"] if isinstance(node["v"], int) else float(node["v"]))
        if t in ("list", "tuple"):
            items = [self.value(v) for v in node["items"]]
            return items if t == "list" else tuple(items)
        if t == "dict":
            return {k: self.value(v) for k, v in node["items"]}
        if t == "torch":
            return self._tensor(node)
        if t == "jax":
            return self.arrays[node["key"]]
        if t == "jax_alias":
            return jax_alias(self._tensor(node["tensor"]), _owner_type(node.get("owner")))
        if t == "numpy":
            raw = np.asarray(self.arrays[node["key"]])
            return raw.view(np.dtype(node["dtype"])).reshape(node["shape"]).copy()
        if t == "obj":
            return self.object(node)
        raise CheckpointError(f"unknown node kind {t!r} in the manifest")

    def _tensor(self, node: dict[str, Any]) -> Any:
        torch = _torch()
        if torch is None:
            import torch  # a checkpoint holding tensors needs torch to load them
        device = torch.device(self.torch_device if self.torch_device is not None else node["device"])
        skey = (node["storage"], str(device))
        storage = self.storages.get(skey)
        if storage is None:
            # `_read` already made each host-bound storage an aligned copy of its own (`_storages_on_cpu` picks
            # them by the same device rule as here); one bound for a GPU is copied there from orbax's buffer.
            host = torch.from_numpy(np.asarray(self.arrays[node["storage"]], dtype=np.uint8))
            storage = self.storages[skey] = host.to(device) if device.type != "cpu" else host
        dtype = getattr(torch, node["dtype"])
        out = torch.empty(0, dtype=dtype, device=device).set_(
            storage.untyped_storage(), node["offset"], node["shape"], node["stride"]
        )
        return out.requires_grad_(True) if node.get("requires_grad") else out

    def object(self, node: dict[str, Any]) -> Any:
        cls = _TYPES.get(node["type"])
        if cls is None:
            raise CheckpointError(
                f"the checkpoint holds a {node['type']!r}, which is not a registered checkpoint type here; "
                f"register it with `register_checkpoint_type` before loading."
            )
        values = {k: self.value(v) for k, v in node["fields"].items()}
        values.update({k: _decode_static(v) for k, v in node["static"].items()})
        values["host_copy"] = None
        obj: Any = cls(**values)
        return obj.park() if node.get("parked") else obj

    def session(self, node: dict[str, Any]) -> SessionState:
        objects: dict[str, Any] = {}
        try:
            return self._session(node, objects)
        except BaseException as e:
            _release_kv(objects.values(), e)  # blocks an import hook took for a session that is not built
            raise

    def _session(self, node: dict[str, Any], objects: dict[str, Any]) -> SessionState:
        for name, v in node["objects"].items():
            if v["t"] != "hooked":
                objects[name] = self.object(v)
            elif name in self.object_hooks:
                objects[name] = self.object_hooks[name][1](self.value(v["value"]))
            else:
                raise CheckpointError(
                    f"object {name!r} was saved through an export hook; pass object_hooks={{{name!r}: (export, "
                    f"import)}} to load it."
                )
        attrs = {}
        for key, v in node["attrs"].items():
            value = self.value(v)
            if key in node.get("hooked", ()):
                if key not in self.hooks:
                    raise CheckpointError(
                        f"attr {key!r} was saved through an export hook; pass attr_hooks={{{key!r}: (export, "
                        f"import)}} to load it."
                    )
                value = self.hooks[key][1](value)
            attrs[key] = value
        return SessionState(objects, attrs, node.get("policies") or {})


def _release_kv(objects: Iterable[Any], error: BaseException) -> None:
    """Hand back to their engines the blocks held by the `PagedKVHandle` among ``objects``, which import hooks
    allocated for a load that failed (``error``): a load that fails leaves the engine as it found it too.

    Every handle in a loaded session comes from an import hook (a save refuses a handle without one), so all
    of its blocks are the load's own. A failing free is noted on ``error`` rather than hiding it.
    """
    for obj in objects:
        if isinstance(obj, PagedKVHandle) and obj.resident:
            ids = tuple(sorted(set(obj.block_ids) | set(obj.staged or ())))
            if ids:
                try:
                    obj.pool.free_fn(ids)
                except Exception as free_error:
                    error.add_note(f"handing back KV blocks {ids} of the failed load also failed: {free_error!r}")


def release_sessions(sessions: Iterable[SessionState], error: BaseException) -> None:
    for session in sessions:
        _release_kv(session.objects.values(), error)


def _decode_static(node: dict[str, Any]) -> Any:
    if node["t"] == "tuple":
        return tuple(_decode_static(v) for v in node["items"])
    if node["t"] == "dtype":
        return np.dtype(node["v"])
    if node["t"] == "f":
        return float(node["v"])
    return node["v"]


# --- orbax I/O ----------------------------------------------------------------------------------------------


def _ocp() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - the checkpoint extra is missing
        raise ImportError(
            "functional_state checkpoints need orbax-checkpoint: pip install 'functional-state[checkpoint]'"
        ) from e
    return ocp


class SaveHandle:
    """A save in progress (``asynchronous=True``) or done. ``wait()`` blocks until the checkpoint is complete
    on disk (and raises what the save raised, as often as it is called); ``done()`` says whether the save has
    finished, either way.

    An asynchronous save finishes on a thread of its own, so it completes (and frees the host copies it
    holds) whether or not anyone waits; one still running when the interpreter exits is waited for then.
    """

    def __init__(self, manager: Any, keep: list[Any], path: Path, step: int, asynchronous: bool):
        self._manager = manager
        self._keep = keep  # buffers the write reads from stay alive until it is complete
        self._step = step
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._heard = False  # whether a caller was told of the error (else it is reported at exit)
        self.path = path
        if asynchronous:
            with _REGISTRY_LOCK:
                _PENDING.add(self)
            threading.Thread(target=self._finish, name=f"functional_state save {path.name}", daemon=True).start()
        else:
            self._finish()

    def _finish(self) -> None:
        try:
            self._manager.wait_until_finished()
            _drop_steps_before(self.path, self._step)
        except BaseException as e:
            self._error = e
            _log.debug("saving %s failed: %r", self.path, e)
        finally:
            try:
                self._manager.close()
            except Exception as e:
                self._error = self._error or e
            self._keep = []
            with _REGISTRY_LOCK:
                _PENDING.discard(self)
            self._finished.set()

    def wait(self) -> Path:
        self._finished.wait()
        if self._error is not None:
            self._heard = True
            raise CheckpointError(
                f"saving {self.path} failed ({type(self._error).__name__}: {self._error}); the checkpoint that was "
                f"there before, if any, is still the one there."
            ) from self._error
        return self.path

    def done(self) -> bool:
        return self._finished.is_set()

    def __repr__(self) -> str:
        return f"SaveHandle({str(self.path)!r}, {'done' if self.done() else 'pending'})"


# One writer per checkpoint directory: orbax numbers a new step after the ones it finds and deletes the older
# ones once it is complete, so two saves into one directory at once would both write one step, or one would
# delete the other's. `_write` holds the directory's lock while it writes (and, for an asynchronous save, the
# next save to the directory first waits for it). Within one process; one process writes a directory at a time.
_REGISTRY_LOCK = threading.Lock()
_PATH_LOCKS: dict[str, threading.Lock] = {}
_IN_FLIGHT: dict[str, SaveHandle] = {}  # resolved directory -> its asynchronous save, until the next save there
_PENDING: set[SaveHandle] = set()  # asynchronous saves not finished yet, waited for at exit
_AT_EXIT: list[bool] = []  # whether `_finish_pending_saves` is registered


def _path_lock(key: str) -> threading.Lock:
    with _REGISTRY_LOCK:
        return _PATH_LOCKS.setdefault(key, threading.Lock())


def _finish_pending_saves() -> None:
    """At exit, let every asynchronous save finish, and say on stderr which failed unheard.

    Registered with ``threading._register_atexit``: Python runs those before it shuts down the thread pools
    that orbax's background commit submits to (`concurrent.futures` registers its shutdown the same way, at
    import, and they run last in first out), and before it joins threads. A plain ``atexit`` hook runs after
    both, when the commit has already failed with "cannot schedule new futures after shutdown".
    """
    with _REGISTRY_LOCK:
        pending = list(_PENDING)
    for handle in pending:
        handle._finished.wait()
        if handle._error is not None and not handle._heard:
            print(
                f"functional_state: the asynchronous save to {handle.path} failed before exit "
                f"({type(handle._error).__name__}: {handle._error}); the checkpoint there is the previous one.",
                file=sys.stderr,
            )


def _wait_at_exit() -> bool:
    """Make sure pending saves are waited for at exit; False when the interpreter is already exiting."""
    with _REGISTRY_LOCK:
        if _AT_EXIT:
            return True
        try:
            threading._register_atexit(_finish_pending_saves)  # type: ignore[attr-defined]
        except RuntimeError:  # shutting down already: too late for a background write
            return False
        _AT_EXIT.append(True)
        return True


def _write(path: Any, manifest: dict[str, Any], writer: _Writer, asynchronous: bool) -> SaveHandle:
    ocp = _ocp()
    root = Path(os.fspath(path)).absolute()
    writer.checksums()
    manifest["leaves"] = writer.leaves
    _seal(manifest)
    if asynchronous and not _wait_at_exit():
        asynchronous = False  # a save asked for while the interpreter exits finishes before it returns
    key = os.path.realpath(root)
    with _path_lock(key):
        earlier = _IN_FLIGHT.pop(key, None)
        if earlier is not None:
            earlier._finished.wait()  # its outcome is for its own caller's wait()
        step = _prepare_directory(root)
        # Orbax keeps every step: `_drop_steps_before` removes the old ones itself, in a way a kill cannot
        # leave half done.
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=asynchronous, create=True)
        manager = None
        try:
            manager = _manager(ocp, root, options)
            args = ocp.args.Composite(arrays=ocp.args.PyTreeSave(writer.arrays), manifest=ocp.args.JsonSave(manifest))
            if not manager.save(step, args=args):
                raise RuntimeError(f"orbax declined to write step {step}")
        except Exception as e:
            if manager is not None:
                try:
                    manager.close()
                except Exception as close_error:
                    e.add_note(f"closing the orbax manager also failed: {close_error!r}")
            raise CheckpointError(
                f"saving {root} failed ({type(e).__name__}: {str(e)[:300]}); the checkpoint that was there before, "
                f"if any, is still the one there."
            ) from e
        handle = SaveHandle(manager, writer.keep, root, step, asynchronous)
        if asynchronous:
            _IN_FLIGHT[key] = handle
        else:
            handle.wait()
    return handle


_MARKER = "_FUNCTIONAL_STATE"  # in a checkpoint directory: written by functional_state, before its first step
_STEP_NAME = re.compile(r"(0|[1-9][0-9]*)")  # the step directories orbax finds
_DROPPED = ".functional-state-dropped"  # an old step renamed out of the way, about to be deleted


def _drop_steps_before(root: Path, step: int) -> None:
    """Delete the steps of ours older than ``step`` (complete now). Each is first renamed out of the step
    namespace, in one atomic step, so a process killed part-way leaves a whole step or a renamed remnant that
    the next save clears; never a step with half its files."""
    for old in sorted(s for s, manifest in _steps(root).items() if s < step and manifest is not None):
        dropped = root / f"{old}{_DROPPED}"
        try:
            os.replace(root / str(old), dropped)
            shutil.rmtree(dropped)
        except OSError as e:  # the new checkpoint is complete and found first; the old one only takes space
            _log.warning("checkpoint %s: removing old step %d failed: %r", root, old, e)


def _prepare_directory(root: Path) -> int:
    """The step a save writes into ``root``, made ready for it; refuses a directory it might damage.

    A save writes only into a directory that does not exist, is empty, or is a checkpoint directory: marked
    as ours, or holding a step with our manifest (as earlier versions left them). Every step directory in it
    must hold our manifest, since orbax deletes the old steps once the new one is complete.
    """
    try:
        if os.path.lexists(root) and not root.is_dir():
            what = "a symlink that leads to no directory" if root.is_symlink() else "not a directory"
            raise CheckpointError(f"{root} exists and is {what}; a checkpoint is a directory.")
        steps = _steps(root)
        if root.is_dir():
            foreign = sorted(step for step, manifest in steps.items() if manifest is None)
            if foreign:
                raise CheckpointError(
                    f"{root / str(foreign[0])} looks like a checkpoint step but holds no functional_state "
                    f"manifest; a save there would delete it, so nothing was written. Save elsewhere, or remove it."
                )
            marked = _is_marked(root)
            if not marked and not steps and any(root.iterdir()):
                raise CheckpointError(
                    f"{root} is a non-empty directory that holds no checkpoint; refusing to write into it."
                )
        else:
            root.mkdir(parents=True)
            marked = False
        if marked:  # what an earlier save here renamed away and did not finish deleting
            for p in root.glob(f"*{_DROPPED}"):
                shutil.rmtree(p, ignore_errors=True)
        else:
            tmp = root / f"{_MARKER}.tmp"
            tmp.write_text(json.dumps({"format": FORMAT}))
            os.replace(tmp, root / _MARKER)
    except OSError as e:
        raise CheckpointError(f"{root} cannot be used as a checkpoint directory ({type(e).__name__}: {e}).") from e
    return max(steps, default=-1) + 1


def _is_marked(root: Path) -> bool:
    try:
        return json.loads((root / _MARKER).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _steps(root: Path) -> dict[int, dict[str, Any] | None]:
    """Each complete step directory in ``root`` (what orbax counts as one), with its manifest when that is a
    functional_state manifest (else None: damaged, or another tool's directory)."""
    if not root.is_dir():
        return {}
    out: dict[int, dict[str, Any] | None] = {}
    for p in root.iterdir():
        if _STEP_NAME.fullmatch(p.name) and p.is_dir():
            out[int(p.name)] = _step_manifest(p)
    return out


def _step_manifest(step_dir: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((step_dir / "manifest" / "metadata").read_bytes())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def _manager(ocp: Any, root: Path, options: Any) -> Any:
    """An orbax manager for our two items, with the arrays written uncompressed.

    Orbax compresses arrays with zstd by default. Latents, feature maps and KV are near-random bytes that do
    not shrink, and on 600 MiB the compression took 3.1 s of CPU where the uncompressed write took 0.3 s.
    During an asynchronous save that CPU is taken from the model step. Checkpoints written compressed by an
    earlier version still read, because tensorstore takes the codec from each array's metadata.
    """
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    arrays = ocp.handlers.PyTreeCheckpointHandler(use_compression=False)
    registry.add("arrays", ocp.args.PyTreeSave, arrays)
    registry.add("arrays", ocp.args.PyTreeRestore, arrays)
    manifest = ocp.handlers.JsonCheckpointHandler()
    registry.add("manifest", ocp.args.JsonSave, manifest)
    registry.add("manifest", ocp.args.JsonRestore, manifest)
    return ocp.CheckpointManager(root, options=options, handler_registry=registry)


def _latest_step(root: Path) -> int | None:
    """The newest step in ``root``, if its manifest is ours."""
    try:
        steps = _steps(root)
    except OSError:
        return None
    return max(steps) if steps and steps[max(steps)] is not None else None


def has_checkpoint(path: Any) -> bool:
    """Whether ``path`` holds a complete checkpoint (a save still being written does not count).

    A loader in another process can poll this to wait for a migrating session: orbax writes each step into a
    temporary directory and renames it into place only once every array and the manifest are on disk. Another
    tool's directory that merely looks like a step (no functional_state manifest in it) does not count.

    Example:
        >>> import tempfile
        >>> has_checkpoint(tempfile.mkdtemp())
        False
    """
    return _latest_step(Path(os.fspath(path)).absolute()) is not None


def _read(path: Any, placement: Any, torch_device: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    root = Path(os.fspath(path)).absolute()
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
    ocp = _ocp()
    steps = _steps(root)
    if not steps:
        what = "does not exist" if not root.exists() else "holds no complete checkpoint"
        raise CheckpointError(f"{root} {what} (expected a directory written by functional_state's save).")
    step = max(steps)
    manifest = steps[step]
    if manifest is None:
        raise CheckpointError(
            f"{root / str(step)}: its manifest is missing, unreadable or not functional_state's; the checkpoint is "
            f"damaged or another tool wrote this directory."
        )
    _check_manifest(manifest, root)
    manager = _manager(ocp, root, ocp.CheckpointManagerOptions(create=False))
    try:
        abstract: dict[str, Any] = {}
        for key, info in manifest["leaves"].items():
            if info["kind"] == "jax":
                sharding = _placement_for(placement, key, info)
                abstract[key] = jax.ShapeDtypeStruct(tuple(info["shape"]), np.dtype(info["dtype"]), sharding=sharding)
            else:
                abstract[key] = np.empty(info["nbytes"], np.uint8)
        try:
            restore = ocp.args.PyTreeRestore(
                abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
            )
            arrays = manager.restore(step, args=ocp.args.Composite(arrays=restore))["arrays"]
        except Exception as e:
            raise CheckpointError(
                f"{root}: reading the arrays failed, the checkpoint is damaged or truncated ({type(e).__name__}: "
                f"{str(e)[:300]})."
            ) from e
    finally:
        manager.close()
    leaves = manifest["leaves"]
    missing = [key for key in leaves if arrays.get(key) is None]
    if missing:
        raise CheckpointError(f"{root}: leaf {missing[0]!r} is missing from the arrays.")

    on_cpu = _storages_on_cpu(manifest, torch_device)

    def verify(key: str) -> tuple[Any, bool]:
        got, info = arrays[key], leaves[key]
        if key in on_cpu:  # copied out once, aligned, and the copy is what gets checked
            got = _aligned_copy(np.asarray(got, dtype=np.uint8))
        for algorithm in (_CHECKSUM, "sha256"):
            if algorithm in info:
                return got, _checksum(np.asarray(got), algorithm) == info[algorithm]
        return got, True  # a leaf no process could read whole (sharded over several hosts) has none

    keys = sorted(leaves, key=lambda k: -_leaf_nbytes(leaves[k]))  # largest first, so the cores finish together
    results = _in_parallel(verify, keys, sum(_leaf_nbytes(info) for info in leaves.values()))
    for key, (got, ok) in zip(keys, results):
        if not ok:
            info = leaves[key]
            raise CheckpointError(
                f"{root}: leaf {key!r} ({info['kind']}, {info.get('dtype', 'bytes')}) fails its checksum: the "
                f"checkpoint is corrupted."
            )
        arrays[key] = got
    return manifest, arrays


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


def _leaf_nbytes(info: dict[str, Any]) -> int:
    if "nbytes" in info:
        return int(info["nbytes"])
    return int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(info["dtype"]).itemsize


# The manifest's own checksum, over its canonical JSON without this field. Versions before it wrote manifests
# with exactly the `_UNSEALED_FIELDS`; such a manifest still loads (unverified, as it always did), while one
# with any other field and no checksum (a checksum field with its name damaged, say) is refused.
_SEAL = "manifest_xxh3_128"
_UNSEALED_FIELDS = frozenset({"format", "layout", "library_version", "kind", "sessions", "leaves", "table"})
_LEAF_KINDS = frozenset({"jax", "torch_storage", "numpy"})
_COUNTERS = 5  # hits, misses, evictions, parks, restores


def _canonical(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != _SEAL}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _seal(manifest: dict[str, Any]) -> None:
    manifest[_SEAL] = _xxhash().xxh3_128(_canonical(manifest)).hexdigest()


def _check_manifest(manifest: Any, root: Path) -> None:
    """Refuse a manifest that is not ours, of another layout, fails its checksum, or lacks what a load reads,
    before anything is built from it."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{root} is an orbax checkpoint, but not one functional_state wrote.")
    if manifest.get("layout") != LAYOUT:
        raise CheckpointError(
            f"{root} has checkpoint layout {manifest.get('layout')!r} (written by functional-state "
            f"{manifest.get('library_version')}); this version ({__version__}) reads layout {LAYOUT}."
        )
    if _SEAL in manifest:
        if manifest[_SEAL] != _xxhash().xxh3_128(_canonical(manifest)).hexdigest():
            raise CheckpointError(f"{root}: the manifest fails its checksum: the checkpoint is corrupted.")
    elif not set(manifest) <= _UNSEALED_FIELDS:
        extra = sorted(set(manifest) - _UNSEALED_FIELDS)
        raise CheckpointError(
            f"{root}: the manifest has no checksum but has fields {extra} no unchecksummed (earlier) manifest has: "
            f"the checkpoint is corrupted."
        )
    _check_fields(manifest, root)


def _check_fields(manifest: dict[str, Any], root: Path) -> None:
    def bad(what: str, expected: str) -> CheckpointError:
        return CheckpointError(f"{root}: the manifest's {what} is not {expected}; the checkpoint is damaged.")

    def count(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if manifest.get("kind") not in ("session", "table"):
        raise bad("kind", "'session' or 'table'")
    sessions, leaves = manifest.get("sessions"), manifest.get("leaves")
    if not isinstance(sessions, list) or not all(
        isinstance(e, dict)
        and isinstance(e.get("id"), str)
        and isinstance(e.get("objects"), dict)
        and isinstance(e.get("attrs"), dict)
        for e in sessions
    ):
        raise bad("'sessions'", "a list of sessions (each with an id, objects and attrs)")
    if not isinstance(leaves, dict) or not all(
        isinstance(info, dict) and info.get("kind") in _LEAF_KINDS for info in leaves.values()
    ):
        raise bad("'leaves'", f"a mapping of leaf keys to leaves of kinds {sorted(_LEAF_KINDS)}")
    for key, info in leaves.items():
        if info["kind"] == "jax":
            if not (isinstance(info.get("shape"), list) and all(map(count, info["shape"]))):
                raise bad(f"leaf {key!r} shape", "a list of sizes")
            if not isinstance(info.get("dtype"), str) or not isinstance(info.get("sharding"), dict):
                raise bad(f"leaf {key!r}", "a JAX array with a dtype and a sharding")
        elif not count(info.get("nbytes")):
            raise bad(f"leaf {key!r} nbytes", "a byte count")
    if manifest["kind"] == "table":
        table = manifest.get("table")
        if not isinstance(table, dict) or not {"max_sessions", "byte_budget", "evict_when_full"} <= set(table):
            raise bad("'table'", "the table's configuration and counters")
        counters = table.get("counters")
        if not (isinstance(counters, list) and len(counters) == _COUNTERS and all(map(count, counters))):
            raise bad("table counters", f"{_COUNTERS} counts (hits, misses, evictions, parks, restores)")


def _placement_for(placement: Any, key: str, info: dict[str, Any]) -> Any:
    """Where JAX leaf ``key`` goes: the caller's placement, else the sharding it was saved with (``info``)."""
    if placement is None:
        return _decode_sharding(info["sharding"])
    if callable(placement) and not isinstance(placement, (jax.Device, jax.sharding.Sharding)):
        placement = placement(key)
    if isinstance(placement, jax.Device):
        return jax.sharding.SingleDeviceSharding(placement)
    if isinstance(placement, jax.sharding.Sharding):
        return placement
    raise CheckpointError(
        f"placement must be a jax.Device, a jax.sharding.Sharding, or a callable giving one; got {placement!r}."
    )


# --- the public functions -----------------------------------------------------------------------------------


def save_session(
    state: ManagerState,
    session_id: str | None,
    path: Any,
    *,
    asynchronous: bool = False,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
) -> SaveHandle:
    """Write session ``session_id`` of ``state`` to the checkpoint directory ``path`` (replacing an earlier
    checkpoint there only once the new one is complete).

    Args:
      asynchronous: return once the values are captured; the write completes in the background
        (``handle.wait()``), even if nobody waits: at exit, Python waits for it. Host buffers a model could
        change in place are copied first. A save to a path with a save in flight waits for that one first.
      attr_hooks: ``{attr: (export, import)}`` for attrs of other types: ``export(value)`` returns a
        checkpointable value, and `load_session` calls ``import`` on it.
      object_hooks: the same for objects by name (an engine-owned `PagedKVHandle`: export its K/V, import it
        into the new engine's blocks).

    Returns:
      A `SaveHandle` (already complete unless ``asynchronous``).

    Raises:
      CheckpointError: an object or attr that cannot be checkpointed (named, before anything is written),
        ``path`` is something other than a checkpoint directory (a file, a broken link, another tool's
        directory), or the write failed (out of space, say); the previous checkpoint at ``path`` stays.
      SessionStateLostError: no such session.
    """
    sid, node = ms.locate(state, session_id, "save_session")
    writer = _Writer(attr_hooks, asynchronous, object_hooks)
    manifest = _manifest("session", [writer.session(ms.node_session(node), sid)])
    return _write(path, manifest, writer, asynchronous)


def read_session(
    session_id: str | None,
    path: Any,
    *,
    placement: Any = None,
    torch_device: Any = None,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
) -> SessionState:
    """The `SessionState` of ``session_id`` in the checkpoint at ``path`` (what `load_session` installs).

    Raises:
      CheckpointError: see `load_session`.
    """
    sid = ms.resolve_id(session_id, "read_session")
    manifest, arrays = _read(path, placement, torch_device)
    entries = {e["id"]: e for e in manifest["sessions"]}
    if sid not in entries:
        raise CheckpointError(f"{path}: holds sessions {sorted(entries)[:8]}, not {sid!r}.")
    try:
        return _Reader(arrays, attr_hooks, torch_device, object_hooks).session(entries[sid])
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: session {sid!r} cannot be rebuilt ({type(e).__name__}: {e}).") from e


def load_session(
    state: ManagerState,
    session_id: str | None,
    path: Any,
    *,
    placement: Any = None,
    torch_device: Any = None,
    as_id: str | None = None,
    replace: bool = False,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
) -> ManagerState:
    """``state`` with session ``session_id`` loaded from the checkpoint at ``path`` (under ``as_id`` if given),
    as the most recently used session.

    Args:
      placement: where JAX leaves go: None (the devices and sharding they were saved with, when present),
        a ``jax.Device``, a ``jax.sharding.Sharding``, or a callable from leaf key to one of those.
      torch_device: where torch tensors go (default: the device each was saved from).
      replace: load over a session of that id (default: refuse; the caller decides what a clash means).
      attr_hooks, object_hooks: the import halves of the hooks the save used.

    Raises:
      CheckpointError: ``path`` is not a checkpoint, is damaged (the leaf is named), was written with another
        layout, or does not hold ``session_id``. SessionExistsError: the id is taken and not ``replace``.
      Nothing changes unless the load fully succeeds (this is a pure function), and a load that fails hands
      the KV blocks its import hooks took back to their engines.
    """
    target = ms.resolve_id(as_id if as_id is not None else session_id, "load_session")
    check_free(state, target, replace)
    session = read_session(
        session_id,
        path,
        placement=placement,
        torch_device=torch_device,
        attr_hooks=attr_hooks,
        object_hooks=object_hooks,
    )
    try:
        return install_session(state, target, session, replace=replace)
    except BaseException as e:
        release_sessions([session], e)
        raise


def check_free(state: ManagerState, sid: str, replace: bool) -> None:
    if type(state) is not ManagerState:
        ms.check_state(state, "load_session")
    if sid in state and not replace:
        raise SessionExistsError(
            f"`load_session`: session {sid!r} is already in the table; drop it first, load under another id "
            f"(as_id=...), or pass replace=True."
        )


def install_session(state: ManagerState, sid: str, session: SessionState, *, replace: bool = False) -> ManagerState:
    """``state`` holding ``session`` under ``sid`` as its most recent session (a loaded one, say)."""
    check_free(state, sid, replace)
    if sid in state:
        state, _ = ms.drop_session(state, sid)
    state, _ = ms.get_or_create(state, sid)

    def install(_: SessionState) -> SessionState:
        return session

    return ms.update_session(state, sid, install)


def save(
    state: ManagerState,
    path: Any,
    *,
    asynchronous: bool = False,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
) -> SaveHandle:
    """Write the whole table: every session, their recency order, the counters and the configuration.

    See `save_session` for the arguments and errors.
    """
    if type(state) is not ManagerState:
        ms.check_state(state, "save")
    writer = _Writer(attr_hooks, asynchronous, object_hooks)
    sessions = [writer.session(session, sid) for sid, session in ms.sessions(state).items()]
    manifest = _manifest("table", sessions)
    manifest["table"] = {
        "max_sessions": state.max_sessions,
        "byte_budget": state.byte_budget,
        "evict_when_full": state.evict_when_full,
        "counters": list(state.counters),
    }
    return _write(path, manifest, writer, asynchronous)


def load(
    path: Any,
    *,
    placement: Any = None,
    torch_device: Any = None,
    attr_hooks: AttrHooks | None = None,
    object_hooks: AttrHooks | None = None,
) -> ManagerState:
    """The table a `save` wrote: sessions in their recency order, counters and configuration as they were.

    Raises:
      CheckpointError: see `load_session`; also a checkpoint of one session (use `load_session`).
    """
    manifest, arrays = _read(path, placement, torch_device)
    table = manifest.get("table")
    if manifest["kind"] != "table" or table is None:
        raise CheckpointError(f"{path} holds a session checkpoint, not a table; use load_session.")
    reader = _Reader(arrays, attr_hooks, torch_device, object_hooks)
    try:
        state = ManagerState.create(table["max_sessions"], table["byte_budget"], table["evict_when_full"])
    except SessionStateError as e:
        raise CheckpointError(f"{path}: the table's configuration is not one a table can have ({e}).") from e
    try:
        for entry in manifest["sessions"]:  # least recently used first: each insertion is the most recent
            state = install_session(state, entry["id"], reader.session(entry))
    except BaseException as e:
        release_sessions(ms.sessions(state).values(), e)
        if isinstance(e, (SessionStateError, KeyboardInterrupt)) or not isinstance(e, Exception):
            raise
        raise CheckpointError(f"{path}: a session cannot be rebuilt ({type(e).__name__}: {e}).") from e
    return ms.with_counters(state, table["counters"])


def _manifest(kind: str, sessions: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": FORMAT, "layout": LAYOUT, "library_version": __version__, "kind": kind, "sessions": sessions}
