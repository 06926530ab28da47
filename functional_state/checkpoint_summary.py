"""What a checkpoint holds, read from its manifest without loading it into a manager: `functional-state inspect`.

`summarize` reads the newest complete step's manifest (refused as `load` refuses it: not ours, another layout,
a failed manifest checksum, missing fields) and reports its sessions, their objects and bytes, the bytes per
pool a load places them in, and the metadata; `verify` reads every leaf and checks its checksum (what `load`
checks before it builds anything), still without a manager. Neither needs torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from .errors import CheckpointError
from .memory.budget import format_bytes
from .persist.directory import list_steps
from .persist.manifest import check_manifest, leaf_nbytes

__all__ = ["CheckpointSummary", "ObjectSummary", "SessionSummary", "render", "summarize", "verify"]

_COUNTER_NAMES = ("hits", "misses", "evictions", "parks", "restores")


class ObjectSummary(NamedTuple):
    name: str
    type: str  # the state object's type name (`ArrayRing`, `PytreeValue`, ...)
    status: str  # resident, parked, evicted or unallocated, as saved
    nbytes: int  # bytes of its leaves (a leaf shared with another object counted in each)


class SessionSummary(NamedTuple):
    id: str
    objects: tuple[ObjectSummary, ...]
    attrs: tuple[str, ...]  # the carried attrs' names
    nbytes: int  # bytes of the session's leaves, each leaf once


class CheckpointSummary(NamedTuple):
    path: Path
    step: int
    metadata: dict[str, Any]  # format, layout, library_version, kind, and the table's config and counters
    sessions: tuple[SessionSummary, ...]
    pools: dict[str, int]  # pool (as `stats()` names it) -> bytes a load places there
    leaves: int
    nbytes: int  # every leaf once


def _leaf_keys(encoded: Any) -> Iterator[str]:
    """The leaf keys an encoded value refers to (``{"t": "jax", "key": ...}``, a torch storage's ``storage``)."""
    stack = [encoded]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            for field in ("key", "storage"):
                if isinstance(x.get(field), str) and x.get("t") in ("jax", "numpy", "torch"):
                    yield x[field]
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def _torch_devices(sessions: list[dict[str, Any]]) -> dict[str, str]:
    """Torch storage key -> the device its tensors were saved from."""
    out = {}
    stack: list[Any] = [sessions]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if x.get("t") == "torch" and isinstance(x.get("storage"), str):
                out[x["storage"]] = str(x.get("device", "cpu"))
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return out


def _pool(info: dict[str, Any], torch_device: str | None) -> str:
    """The pool a leaf is placed in on load, named as `stats()` names pools."""
    if info["kind"] == "torch_storage":
        device = torch_device or "cpu"
        return "cpu" if device.split(":")[0] == "cpu" else device
    if info["kind"] == "numpy":
        return "cpu"
    sharding = info["sharding"]
    if sharding.get("memory_kind") in ("pinned_host", "unpinned_host"):
        return f"cpu/{sharding['memory_kind']}"
    if sharding.get("kind") != "single":
        return f"{sharding.get('platform', 'device')} mesh of {len(sharding.get('device_ids', []))}"
    platform = sharding.get("platform", "cpu")
    if platform == "cpu":
        return "cpu"
    return f"cuda:{sharding['device']}" if platform in ("gpu", "cuda") else f"{platform}:{sharding['device']}"


def _status(obj: dict[str, Any]) -> str:
    status = obj.get("static", {}).get("status", {}).get("v")
    return "parked" if obj.get("parked") else str(status or "resident")


def summarize(path: str | os.PathLike[str]) -> CheckpointSummary:
    """What the checkpoint at ``path`` holds, from its newest complete step's manifest (no array is read).

    Raises:
      CheckpointError: ``path`` holds no complete checkpoint, or its manifest is not one this version reads.

    Example:
      >>> import tempfile, functional_state as fs
      >>> s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
      >>> s = fs.put(s, "a", "ring", fs.ArrayRing.create(2, (3,)))
      >>> d = tempfile.mkdtemp()
      >>> _ = fs.save(s, d)
      >>> info = summarize(d)
      >>> [(x.id, [o.name for o in x.objects]) for x in info.sessions], info.pools
      ([('a', ['ring'])], {'cpu': 32})
    """
    root = Path(os.fspath(path)).absolute()
    try:
        steps = list_steps(root)
    except OSError as e:
        raise CheckpointError(f"{root} cannot be read ({type(e).__name__}: {e}).") from e
    if not steps:
        what = "does not exist" if not root.exists() else "holds no complete checkpoint"
        raise CheckpointError(f"{root} {what} (expected a directory written by functional_state's save).")
    step = max(steps)
    manifest = steps[step]
    if manifest is None:
        raise CheckpointError(f"{root / str(step)}: its manifest is missing, unreadable or not functional_state's.")
    check_manifest(manifest, root)
    leaves: dict[str, dict[str, Any]] = manifest["leaves"]
    sizes = {key: leaf_nbytes(info) for key, info in leaves.items()}
    devices = _torch_devices(manifest["sessions"])
    pools: dict[str, int] = {}
    for key, info in leaves.items():
        pool = _pool(info, devices.get(key))
        pools[pool] = pools.get(pool, 0) + sizes[key]
    sessions = []
    for entry in manifest["sessions"]:
        objects = tuple(
            ObjectSummary(
                name, str(obj.get("type", "?")), _status(obj), sum(sizes.get(k, 0) for k in set(_leaf_keys(obj)))
            )
            for name, obj in sorted(entry["objects"].items())
        )
        keys = set(_leaf_keys(entry["objects"])) | set(_leaf_keys(entry["attrs"]))
        sessions.append(
            SessionSummary(entry["id"], objects, tuple(sorted(entry["attrs"])), sum(sizes.get(k, 0) for k in keys))
        )
    metadata: dict[str, Any] = {
        k: manifest[k] for k in ("format", "layout", "library_version", "kind") if k in manifest
    }
    if "table" in manifest:
        table = dict(manifest["table"])
        table["counters"] = dict(zip(_COUNTER_NAMES, table.get("counters", [])))
        metadata["table"] = table
    return CheckpointSummary(root, step, metadata, tuple(sessions), pools, len(leaves), sum(sizes.values()))


def verify(path: str | os.PathLike[str]) -> int:
    """Read every leaf of the checkpoint at ``path`` and check its checksum; returns how many leaves were checked.

    The arrays are read into host or device memory and dropped; nothing is installed in a manager.

    Raises:
      CheckpointError: a leaf is missing or fails its checksum (the message names it), or see `summarize`.
    """
    from .persist.read import read_checkpoint  # orbax's import: only when verifying

    manifest, _arrays = read_checkpoint(path, None)
    return len(manifest["leaves"])


def render(summary: CheckpointSummary) -> str:
    """The summary as the lines `functional-state inspect` prints (no line wider than 100 characters)."""
    meta = summary.metadata
    lines = [
        f"checkpoint {summary.path} (step {summary.step})",
        f"  written by functional-state {meta.get('library_version')}, layout {meta.get('layout')}, "
        f"a {meta.get('kind')} checkpoint",
    ]
    table = meta.get("table")
    if table:
        budget = table.get("byte_budget")
        lines.append(
            f"  table: max_sessions {table.get('max_sessions')}, byte_budget {budget or 'none'}, "
            f"evict_when_full {table.get('evict_when_full')}"
        )
        lines.append("  counters: " + ", ".join(f"{k} {v}" for k, v in table["counters"].items()))
    lines.append(
        f"  {len(summary.sessions)} session(s), {summary.leaves} leaves, {format_bytes(summary.nbytes)} in all"
    )
    lines.append("  bytes per pool: " + (", ".join(f"{p} {format_bytes(n)}" for p, n in sorted(summary.pools.items()))))
    for s in summary.sessions:
        attrs = f", attrs {', '.join(s.attrs)}" if s.attrs else ""
        lines.append(f"session {s.id!r}: {len(s.objects)} object(s), {format_bytes(s.nbytes)}{attrs}")
        width = max((len(o.name) for o in s.objects), default=0)
        for o in s.objects:
            lines.append(f"  {o.name:<{width}}  {o.type:<14} {o.status:<11} {format_bytes(o.nbytes):>10}")
    return "\n".join(lines)
