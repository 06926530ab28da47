"""Decoding a checkpoint: the reader that rebuilds objects, attrs and leaves from manifest nodes and restored
buffers, and the release of what a failed load allocated."""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from ..core.codec import DecodeContext, ObjectCodec, codec_named, field_error
from ..core.pytree import MISSING
from ..core.session import SessionState
from ..core.state_object import RESIDENT
from ..engine.kv_handle import kv_keys
from ..engine.paged_kv import pool_by_uid
from ..errors import CheckpointError, InvalidArgumentError
from ..memory.parking import jax_alias
from ..memory.shardings import single_device_sharding
from .encode import AttrHooks
from .manifest import (
    import_torch,
)
from .validate import TORCH_ITEMSIZE, numeric_dtype

_DEFAULT_CODEC = ObjectCodec()  # the checks of a codec that has no `check` of its own (a duck-typed one)


def _owner_type(name: str | None) -> type | None:
    """The alias record type a checkpoint names, if its module is already imported (a checkpoint never
    imports code); else None, and the tensor itself owns the alias."""
    if not name:
        return None
    module, _, qualname = name.partition(":")
    cls = getattr(sys.modules.get(module), qualname, None)
    return cls if isinstance(cls, type) else None


def decode_sharding(info: dict[str, Any]) -> Any:
    devices = {d.id: d for d in jax.devices()}
    if info["kind"] == "single" and info["device"] in devices:
        return single_device_sharding(devices[info["device"]])
    if info["kind"] == "named" and all(i in devices for i in info["device_ids"]):
        mesh_devices = np.array([devices[i] for i in info["device_ids"]]).reshape(info["mesh_shape"])
        mesh = jax.sharding.Mesh(mesh_devices, tuple(info["axis_names"]))
        spec = jax.sharding.PartitionSpec(*[tuple(p) if isinstance(p, list) else p for p in info["spec"]])
        return jax.sharding.NamedSharding(mesh, spec)
    return single_device_sharding(jax.devices()[0])


def check_templates(templates: Any) -> dict[str, Any]:
    """``templates`` as a dict, or `InvalidArgumentError` unless it maps object names to trees."""
    if templates is not None and not (isinstance(templates, Mapping) and all(isinstance(k, str) for k in templates)):
        raise InvalidArgumentError(
            f"`templates` must map object names (str) to abstract trees, got {type(templates).__name__}."
        )
    return dict(templates or {})


class Reader:
    def __init__(
        self,
        arrays: Mapping[str, Any],
        hooks: AttrHooks | None,
        torch_device: Any,
        object_hooks: AttrHooks | None = None,
        templates: Mapping[str, Any] | None = None,
    ):
        self.object_hooks = dict(object_hooks or {})
        if templates is not None and not (
            isinstance(templates, Mapping) and all(isinstance(k, str) for k in templates)
        ):
            raise InvalidArgumentError(
                f"templates must map object names (str) to abstract trees, got {type(templates).__name__}."
            )
        self.templates = dict(templates or {})
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
            if numeric_dtype(node["dtype"]) is None:
                raise CheckpointError(f"a scalar node has dtype {node['dtype']!r}, which is not a numeric dtype.")
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
        torch = import_torch()
        if torch is None:
            import torch  # a checkpoint holding tensors needs torch to load them
        device = torch.device(self.torch_device if self.torch_device is not None else node["device"])
        skey = (node["storage"], str(device))
        storage = self.storages.get(skey)
        if storage is None:
            # `_read` already made each host-bound storage an aligned copy of its own (`_storages_on_cpu` picks
            # them by the same device rule as here); one bound for a GPU is copied there from orbax's buffer.
            raw = self.arrays[node["storage"]]  # (a host-bound one is a tensor already: `read.host_storage`)
            host = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.asarray(raw, dtype=np.uint8))
            storage = self.storages[skey] = host.to(device) if device.type != "cpu" else host
        if node["dtype"] not in TORCH_ITEMSIZE:  # (a name looked up on torch: only its dtypes)
            raise CheckpointError(f"a tensor node names dtype {node['dtype']!r}, which is not a torch dtype.")
        dtype = getattr(torch, node["dtype"])
        shape, stride, offset = node["shape"], node["stride"], node["offset"]
        # `set_` grows a storage to fit the view it is given: a view past its storage's bytes would expose (or
        # allocate) memory the checkpoint never held.
        end = offset if 0 in shape else offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        if (
            min([offset, *shape, *stride]) < 0
            or end * TORCH_ITEMSIZE[node["dtype"]] > storage.untyped_storage().nbytes()
        ):
            raise CheckpointError(
                f"a tensor node's view (offset {offset}, shape {shape}, stride {stride}, {node['dtype']}) runs past "
                f"its storage {node['storage']!r} of {storage.untyped_storage().nbytes()} bytes."
            )
        # A view of the storage's one tensor, not `set_` on a fresh one: every tensor of a storage shares its
        # version counter, as the views saved did, so an in-place write through one is seen by all (`torch_writes`).
        whole = storage.untyped_storage().nbytes() // TORCH_ITEMSIZE[node["dtype"]] * TORCH_ITEMSIZE[node["dtype"]]
        out = storage.reshape(-1)[:whole].view(dtype).as_strided(shape, stride, offset)
        if node.get("parameter"):  # (shares ``out``'s storage, as the saved parameter shared its own)
            return torch.nn.Parameter(out, requires_grad=bool(node.get("requires_grad")))
        return out.requires_grad_(True) if node.get("requires_grad") else out

    def object(self, node: dict[str, Any], name: str = "", where: str = "an object") -> Any:
        registered = codec_named(node["type"])
        if registered is None:
            raise CheckpointError(
                f"{where}: the checkpoint holds a {node['type']!r}, which is not a registered checkpoint type "
                f"here; import the module that defines (and registers) it, or register it with "
                f"`register_checkpoint_type`, before loading."
            )
        cls, codec = registered
        fields = {k: self.value(v) for k, v in node["fields"].items()}
        static = {k: _decode_static(v) for k, v in node["static"].items()}
        obj: Any = codec.decode(cls, static, fields, DecodeContext(name, where, self.templates.get(name, MISSING)))
        # Nothing the manifest says is trusted (its seal is a checksum): the type's invariants are checked here,
        # the one place a load builds objects, before the object is parked or installed.
        (codec.check if hasattr(codec, "check") else _DEFAULT_CODEC.check)(obj, where)
        parked = node.get("parked", False)
        if not isinstance(parked, bool) or (parked and obj.status != RESIDENT):
            raise field_error(where, "parked", parked, f"a bool, true only for a resident object (it is {obj.status})")
        return obj.park() if parked else obj

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
                objects[name] = self.object(v, name, f"session {node['id']!r}: object {name!r}")
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
    by_pool: dict[int, set[int]] = {}
    for obj in objects:
        if getattr(obj, "resident", False):
            for uid, block in kv_keys(obj):
                by_pool.setdefault(uid, set()).add(block)
    for uid, blocks in by_pool.items():
        pool, ids = pool_by_uid(uid), tuple(sorted(blocks))
        if pool is None:
            continue
        try:
            pool.free_fn(ids)
        except Exception as free_error:
            error.add_note(f"handing back KV blocks {ids} of the failed load also failed: {free_error!r}")


def release_sessions(sessions: Iterable[SessionState], error: BaseException) -> None:
    for session in sessions:
        _release_kv(session.objects.values(), error)


def _decode_static(node: dict[str, Any]) -> Any:
    if node["t"] == "tuple":
        return tuple(_decode_static(v) for v in node["items"])
    if node["t"] == "dtype":
        if numeric_dtype(node["v"]) is None:
            raise CheckpointError(f"a static dtype {node['v']!r} is not a numeric dtype.")
        return np.dtype(node["v"])
    if node["t"] == "f":
        return float(node["v"])
    return node["v"]
