"""Checkpoint metadata without loading: what a checkpoint holds, read from its manifest alone.

A router deciding where a session resumes, or how far a replay must go back, needs a checkpoint's epoch,
its step attrs, its bytes per pool and its model, not its buffers. `checkpoint_info` reads the newest step's
manifest (checked as a load checks it: its seal and every field) and builds nothing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import CheckpointError
from ..table.ownership import MODEL_ATTR
from .directory import list_steps
from .fencing import manifest_epoch
from .manifest import check_manifest, leaf_nbytes
from .paths import is_url, local_path, remote_path
from .remote import newest_manifest

__all__ = ["CheckpointInfo", "SessionInfo", "checkpoint_info"]


class SessionInfo(NamedTuple):
    """One session of a checkpoint, as its manifest records it."""

    epoch: int  # its ownership epoch (0: never claimed)
    model: str | None  # the model identity it carries
    attrs: dict[str, Any]  # its attrs that are plain scalars (int, float, bool, str, None): the user's step attrs
    bytes_by_pool: dict[str, int]  # bytes of its leaves per pool they were saved from ("cpu", "cuda:0")


class CheckpointInfo(NamedTuple):
    """What the checkpoint at ``path`` holds."""

    path: str
    kind: str  # "session" or "table"
    library_version: str
    sessions: dict[str, SessionInfo]


def checkpoint_info(path: Any) -> CheckpointInfo:
    """The figures of the checkpoint at ``path``, from its manifest alone: no buffer is read.

    Returns:
      A `CheckpointInfo`; ``info.sessions[sid].epoch``, ``.attrs["step"]``, ``.bytes_by_pool``, ``.model``.

    Raises:
      CheckpointError: ``path`` holds no checkpoint, or its manifest is damaged.

    Example:
      >>> import tempfile, functional_state as fs
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "robot")
      >>> path = tempfile.mkdtemp() + "/robot"
      >>> _ = fs.save_session(fs.set_attr(s, "robot", "step", 16), "robot", path)
      >>> checkpoint_info(path).sessions["robot"].attrs
      {'step': 16}
    """
    root: Any
    try:
        if is_url(path):
            root = remote_path(path)
            manifest = newest_manifest(root)[1]
        else:
            root = local_path(path)
            steps = list_steps(root)
            manifest = steps.get(max(steps)) if steps else None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}).") from e
    if manifest is None:
        raise CheckpointError(f"{root} holds no readable checkpoint (no complete step with a manifest).")
    check_manifest(manifest, root)
    leaves = manifest["leaves"]
    try:
        sessions = {entry["id"]: _session(entry, leaves) for entry in manifest["sessions"]}
    except ValueError as e:  # (a sealed manifest may still be crafted: an "f" node whose str is no float)
        raise CheckpointError(f"{root}: the manifest holds a value this cannot read ({e}); it is damaged.") from e
    return CheckpointInfo(str(root), manifest["kind"], manifest["library_version"], sessions)


def _session(entry: dict[str, Any], leaves: dict[str, Any]) -> SessionInfo:
    attrs = {}
    for key, node in entry["attrs"].items():
        if key in entry.get("hooked", ()):
            continue
        if node.get("t") == "v":
            attrs[key] = node["v"]
        elif node.get("t") == "f":
            attrs[key] = float(node["v"])
    model = attrs.pop(MODEL_ATTR, None)
    return SessionInfo(
        manifest_epoch(entry), model if isinstance(model, str) else None, attrs, _bytes_by_pool(entry, leaves)
    )


def _bytes_by_pool(entry: dict[str, Any], leaves: dict[str, Any]) -> dict[str, int]:
    """Bytes per pool of the leaves the session's nodes name, each leaf once."""
    pool_of: dict[str, str] = {}
    stack: list[Any] = [entry["objects"], entry["attrs"]]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            t = x.get("t")
            if t == "torch" and isinstance(x.get("storage"), str):
                pool_of.setdefault(x["storage"], _torch_pool(x.get("device")))
            elif t in ("jax", "numpy") and isinstance(x.get("key"), str):
                info = leaves.get(x["key"], {})
                pool_of.setdefault(x["key"], _jax_pool(info.get("sharding")) if t == "jax" else "cpu")
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    out: dict[str, int] = {}
    for key, pool in pool_of.items():
        if key in leaves:
            out[pool] = out.get(pool, 0) + leaf_nbytes(leaves[key])
    return out


def _torch_pool(device: Any) -> str:
    name = str(device)
    return "cpu" if name.split(":")[0] == "cpu" else name if ":" in name else f"{name}:0"


def _jax_pool(sharding: Any) -> str:
    if not isinstance(sharding, dict) or sharding.get("kind") != "single":
        return "unknown"
    platform = str(sharding.get("platform"))
    platform = "cuda" if platform == "gpu" else platform  # (JAX's GPU platform is filed as "cuda")
    return "cpu" if platform == "cpu" else f"{platform}:{sharding.get('device')}"
