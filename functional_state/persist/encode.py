"""Encoding a session for a checkpoint: the registered object types, and the writer that turns objects, attrs and
leaves into manifest nodes plus the buffers orbax writes."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from ..core.codec import codec_for
from ..core.session import SessionState
from ..core.state_object import PARKED, RESIDENT
from ..errors import CheckpointError
from ..memory import accounting
from ..memory.parking import JaxLeaf, TorchLeaf, host_storage, rebuild_leaf
from ..memory.shardings import is_single_device
from .manifest import (
    CHECKSUM,
    checksum,
    copy_checksum,
    import_torch,
    in_parallel,
)

_COPY_CHUNK = 64 << 20  # `own_copies` shares one large storage's copy out across the cores in pieces this size

AttrHooks = Mapping[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]]


@dataclasses.dataclass(frozen=True)
class _AliasLeaf:
    """Inside the writer only: a parked bridge alias, as the host tensor it will be saved from."""

    tensor: Any
    owner_type: type | None


def _owner_name(owner_type: type | None) -> str | None:
    return None if owner_type is None else f"{owner_type.__module__}:{owner_type.__qualname__}"


class Writer:
    def __init__(self, hooks: AttrHooks | None, copy_host: bool, object_hooks: AttrHooks | None = None):
        self.object_hooks = dict(object_hooks or {})
        self.arrays: dict[str, Any] = {}
        self.leaves: dict[str, dict[str, Any]] = {}
        self.storages: dict[tuple[str, int, int], str] = {}  # (device, storage pointer, bytes) -> leaf key
        self.hooks = dict(hooks or {})
        self.copy_host = copy_host  # an asynchronous save copies host buffers a model might change in place
        self.keep: list[Any] = []  # objects whose memory the saved arrays view, kept alive until written
        # (leaf key, its data, whether to copy it first): copied and checksummed together in `checksums`
        self._to_hash: list[tuple[str, Any, bool]] = []
        # Parked leaves are encoded from views of their host copies: where each really belongs.
        self._device_of: dict[int, Any] = {}
        self._sharding_of: dict[int, Any] = {}

    def _key(self) -> str:
        return f"leaf{len(self.leaves)}"

    def value(self, x: Any, where: str) -> dict[str, Any]:
        torch = import_torch()
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
        torch = import_torch()
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
            # A CPU storage is read through DLPack, not ``.numpy()``: that marks the storage non-resizable for good,
            # and a model growing its tensor with ``resize_`` after a save then raised.
            host = raw.cpu().numpy() if raw.device.type != "cpu" else np.from_dlpack(raw)
            self.keep.append(raw)
            self.arrays[key] = host
            self.leaves[key] = {"kind": "torch_storage", "nbytes": int(host.nbytes)}
            # A device storage's host copy is the save's own already.
            self._to_hash.append((key, host, self.copy_host and raw.device.type == "cpu"))
        node = {
            "t": "torch",
            "storage": key,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
            "device": str(device),
            "requires_grad": bool(t.requires_grad),
        }
        if isinstance(t, torch.nn.Parameter):  # (an optimizer steps parameters: a load keeps the type)
            node["parameter"] = True
        return node

    def _alias(self, t: Any, owner_type: type | None, where: str, device: Any) -> dict[str, Any]:
        return {"t": "jax_alias", "tensor": self._tensor(t, where, device), "owner": _owner_name(owner_type)}

    def _jax(self, a: Any, where: str, sharding: Any) -> dict[str, Any]:
        if a.is_deleted():
            raise CheckpointError(f"{where}: a deleted (donated) JAX array; its values are gone.")
        key = self._key()
        sharding = sharding if sharding is not None else a.sharding
        if getattr(a.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host"):
            a = jax.device_put(a, a.sharding.with_memory_kind("device"))  # orbax writes device arrays
        self.arrays[key] = a  # immutable: never copied
        info: dict[str, Any] = {
            "kind": "jax",
            "dtype": a.dtype.name,
            "shape": list(a.shape),
            "sharding": _encode_sharding(sharding),
        }
        self.leaves[key] = info
        if a.is_fully_addressable:
            self._to_hash.append((key, a, False))
        return {"t": "jax", "key": key}

    def _numpy(self, a: np.ndarray, where: str) -> dict[str, Any]:
        if a.dtype.hasobject:
            raise CheckpointError(f"{where}: a numpy array of Python objects cannot be checkpointed.")
        key = self._key()
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        self.arrays[key] = raw
        self.leaves[key] = {"kind": "numpy", "nbytes": int(raw.nbytes)}
        self._to_hash.append((key, raw, self.copy_host and raw.base is not None))
        return {"t": "numpy", "key": key, "dtype": a.dtype.name, "shape": list(a.shape)}

    def own_copies(self) -> None:
        """Copy, now, every host buffer the model may change in place during an asynchronous write (its CPU
        torch storages and numpy views); the copies are what is written and hashed. One plain copy, split
        across the cores, and nothing else: this is all an asynchronous save's caller waits for (JAX arrays are
        immutable and only referenced; the checksums are computed later, off the caller's thread)."""
        owned: list[tuple[str, np.ndarray, np.ndarray]] = []
        chunks: list[tuple[np.ndarray, np.ndarray]] = []
        for key, data, copy in self._to_hash:
            if not copy:
                continue
            src = np.asarray(data).reshape(-1).view(np.uint8)
            out = np.empty_like(src)
            owned.append((key, src, out))
            chunks += [(out[i : i + _COPY_CHUNK], src[i : i + _COPY_CHUNK]) for i in range(0, src.nbytes, _COPY_CHUNK)]
        in_parallel(lambda pair: np.copyto(*pair), chunks, sum(src.nbytes for _, src, _ in owned))
        copied = {key: out for key, _, out in owned}
        self.arrays.update(copied)
        self._to_hash = [(key, copied.get(key, data), False) for key, data, _ in self._to_hash]

    def checksums(self) -> None:
        """Give every leaf its checksum, largest first across the cores; a buffer the save must own (the
        model may change it during an asynchronous write, and `own_copies` has not copied it) is copied in the
        same pass, each chunk hashed from cache right after it is copied, and the copy is what is written."""

        def run(job: tuple[str, Any, bool]) -> tuple[str, Any]:
            _, data, copy = job
            if not copy:
                return checksum(np.asarray(data)), data
            src = np.asarray(data).reshape(-1).view(np.uint8)
            out = np.empty_like(src)
            return copy_checksum(src, out), out

        jobs = sorted(self._to_hash, key=lambda job: -job[1].nbytes)
        results = in_parallel(run, jobs, sum(job[1].nbytes for job in jobs))
        for (key, _, copy), (digest, data) in zip(jobs, results):
            self.leaves[key][CHECKSUM] = digest
            if copy:
                self.arrays[key] = data
        self._to_hash = []

    def object(self, obj: Any, where: str) -> dict[str, Any]:
        registered = codec_for(type(obj))
        if registered is None:
            raise CheckpointError(
                f"{where} is a {type(obj).__qualname__}, not a registered checkpoint type; call "
                f"`functional_state.register_checkpoint_type({type(obj).__name__})` first (with a codec if its "
                f"fields are not all checkpointable)."
            )
        name, codec = registered
        parked = obj.status == PARKED
        if parked:  # encoded from its host copy as the resident object it stands for; parked again on load
            obj = self._unparked_view(obj)
        static, fields = codec.encode(obj, where)
        return {
            "t": "obj",
            "type": name,
            "static": {k: _encode_static(v, f"{where}.{k}") for k, v in static.items()},
            "fields": {k: self.value(v, f"{where}.{k}") for k, v in fields.items()},
            "parked": parked,
        }

    def _unparked_view(self, obj: Any) -> Any:
        """``obj`` as the resident object its host copy stands for, its leaves views of that copy: rebuilt by
        parking's own `rebuild_leaf` over each storage's own bytes (`host_storage`), as a restore would."""
        parked = obj.host_copy
        leaves: list[Any] = []
        for leaf in parked.leaves:
            if isinstance(leaf, TorchLeaf):
                # As the resident leaf it stands for (its flag, its subclass), minus the bridge alias.
                plain = dataclasses.replace(leaf, jax_owner_type=None)
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
    if is_single_device(s):
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
