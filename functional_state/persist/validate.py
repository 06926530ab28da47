"""Checking an untrusted manifest before anything is built or allocated from it: its fields and every node of
every session (`check_fields`), and each leaf's declared size against what the data holds (`check_stored`).

These are functions of the parsed manifest and a `StoredLeaf` per leaf, not of a directory, so any reader of
the format (a checkpoint directory; an in-memory transfer blob) runs the same checks. Every refusal is a
`CheckpointError` naming where (``where``: the checkpoint's path) and which field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ..errors import CheckpointError

MAX_LEAVES = 1 << 20

MAX_SESSIONS = 1 << 20

MAX_NODE_DEPTH = 200

LEAF_KINDS = frozenset({"jax", "torch_storage", "numpy"})

BYTE_KINDS = frozenset({"torch_storage", "numpy"})  # raw bytes: each must carry a checksum

CHECKSUMS = ("xxh3_128", "sha256")

COUNTERS = 5  # hits, misses, evictions, parks, restores

# Compressed leaves, which saves have not written since 0.2.0 (only earlier checkpoints hold them), may declare
# in all at most this many bytes beyond `MAX_COMPRESSION_RATIO` times the bytes their chunks take: a few KB of
# zstd can otherwise claim gigabytes of zeros, allocated and decompressed before any checksum is compared.
COMPRESSED_SLACK = 32 << 20

MAX_COMPRESSION_RATIO = 64  # model data (latents, KV, weights) shrinks 1-4x under zstd

# The torch dtypes a tensor node may name, with their item sizes (a name is looked up on the torch module, so
# only these, never an arbitrary attribute).
TORCH_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}  # fmt: skip


class StoredLeaf(NamedTuple):
    """What the data holds for one leaf, as its store describes it."""

    shape: tuple[int, ...]  # the stored array's shape
    dtype: str  # its dtype, as numpy spells it
    nbytes: int | None  # the bytes stored, where uncompressed (None: compressed, so unknown until read)
    compressed_nbytes: int = 0  # where compressed, the bytes its chunks take in the data


def _bad(where: str, what: str, expected: str) -> CheckpointError:
    return CheckpointError(f"{where}: the manifest's {what} is not {expected}; the checkpoint is damaged or crafted.")


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def numeric_dtype(name: Any) -> np.dtype | None:
    """``np.dtype(name)`` where that is a plain numeric dtype (bool, ints, floats, complex, ml_dtypes' floats);
    else None (objects, strings, void, records, subarrays)."""
    if not isinstance(name, str):
        return None
    try:
        dt = np.dtype(name)
    except (TypeError, ValueError, SyntaxError):
        return None
    if dt.names is not None or dt.subdtype is not None or dt.hasobject:
        return None
    if dt.kind in "biufc" or (dt.kind == "V" and dt.type.__module__ == "ml_dtypes"):
        return dt
    return None


def _nbytes(info: dict[str, Any]) -> int:
    if info["kind"] == "jax":
        return int(np.prod(info["shape"], dtype=object)) * np.dtype(info["dtype"]).itemsize
    return int(info["nbytes"])


def check_fields(manifest: dict[str, Any], where: str) -> None:
    """Refuse a manifest whose fields, leaves, sessions or table are not what a load can build from, before
    anything is allocated: numeric dtypes only, every torch view within its storage, every numpy node's bytes
    equal to its leaf's, every byte leaf with a checksum, unique session ids, counts within bounds.

    Raises:
      CheckpointError: naming ``where`` and the field.
    """
    if manifest.get("kind") not in ("session", "table"):
        raise _bad(where, "kind", "'session' or 'table'")
    if not isinstance(manifest.get("library_version"), str):
        raise _bad(where, "library_version", "a version string")
    leaves = manifest.get("leaves")
    if not isinstance(leaves, dict) or len(leaves) > MAX_LEAVES:
        raise _bad(where, "'leaves'", f"a mapping of at most {MAX_LEAVES} leaf keys to leaves")
    for key, info in leaves.items():
        _check_leaf(key, info, where)
    sessions = manifest.get("sessions")
    if not isinstance(sessions, list) or len(sessions) > MAX_SESSIONS:
        raise _bad(where, "'sessions'", f"a list of at most {MAX_SESSIONS} sessions")
    if manifest["kind"] == "session" and len(sessions) != 1:
        raise _bad(where, "'sessions'", "one session (a session checkpoint holds exactly one)")
    ids: set[str] = set()
    for i, entry in enumerate(sessions):
        _check_session(entry, f"sessions[{i}]", leaves, where)
        if entry["id"] in ids:
            raise _bad(where, f"sessions[{i}] id {entry['id']!r}", "unique (two sessions have it)")
        ids.add(entry["id"])
    if manifest["kind"] == "table":
        _check_table(manifest.get("table"), len(sessions), where)


def _check_leaf(key: Any, info: Any, where: str) -> None:
    if not isinstance(key, str) or not isinstance(info, dict) or info.get("kind") not in LEAF_KINDS:
        raise _bad(where, f"leaf {key!r}", f"a leaf of a kind in {sorted(LEAF_KINDS)}")
    if info["kind"] == "jax":
        shape = info.get("shape")
        if not (isinstance(shape, list) and len(shape) <= 64 and all(map(_count, shape))):
            raise _bad(where, f"leaf {key!r} shape", "a list of sizes")
        if numeric_dtype(info.get("dtype")) is None:
            raise _bad(where, f"leaf {key!r} dtype", "a numeric dtype")
        if not isinstance(info.get("sharding"), dict):
            raise _bad(where, f"leaf {key!r} sharding", "a sharding")
    else:
        if not _count(info.get("nbytes")):
            raise _bad(where, f"leaf {key!r} nbytes", "a byte count")
        if not any(isinstance(info.get(a), str) for a in CHECKSUMS):
            raise _bad(where, f"leaf {key!r} checksum", f"present (a byte leaf carries one of {list(CHECKSUMS)})")
    for a in CHECKSUMS:
        if a in info and not isinstance(info[a], str):
            raise _bad(where, f"leaf {key!r} {a}", "a hex digest")


def _check_table(table: Any, sessions: int, where: str) -> None:
    if not isinstance(table, dict) or not {"max_sessions", "byte_budget", "evict_when_full", "counters"} <= set(table):
        raise _bad(where, "'table'", "the table's configuration and counters")
    if not isinstance(table["evict_when_full"], bool):
        raise _bad(where, "table evict_when_full", "true or false")
    cap = table["max_sessions"]
    if not (_count(cap) and cap >= 1):
        raise _bad(where, "table max_sessions", "a positive count")
    if sessions > cap:
        raise _bad(where, "'sessions'", f"at most max_sessions ({cap}) sessions")
    budget = table["byte_budget"]
    if not (
        budget is None
        or _count(budget)
        or (isinstance(budget, dict) and all(isinstance(k, str) and _count(v) for k, v in budget.items()))
    ):
        raise _bad(where, "table byte_budget", "null, a byte count, or pool names to byte counts")
    counters = table["counters"]
    if not (isinstance(counters, list) and len(counters) == COUNTERS and all(map(_count, counters))):
        raise _bad(where, "table counters", f"{COUNTERS} counts (hits, misses, evictions, parks, restores)")


def _check_session(entry: Any, at: str, leaves: dict[str, Any], where: str) -> None:
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get("id"), str)
        and isinstance(entry.get("objects"), dict)
        and isinstance(entry.get("attrs"), dict)
    ):
        raise _bad(where, at, "a session (with an id, objects and attrs)")
    hooked, policies = entry.get("hooked", []), entry.get("policies") or {}
    if not (isinstance(hooked, list) and all(isinstance(k, str) for k in hooked)):
        raise _bad(where, f"{at} hooked", "a list of attr names")
    if not (isinstance(policies, dict) and all(isinstance(v, str) for v in policies.values())):
        raise _bad(where, f"{at} policies", "a mapping of attr names to policy names")
    nodes = _Nodes(leaves, where)
    for name, node in entry["objects"].items():
        if isinstance(node, dict) and node.get("t") == "hooked":
            nodes.value(node.get("value"), f"{at} object {name!r} value")
        else:
            nodes.obj(node, f"{at} object {name!r}")
    for name, node in entry["attrs"].items():
        nodes.value(node, f"{at} attr {name!r}")


class _Nodes:
    """Checks value nodes against the leaves they name; depth bounded (`MAX_NODE_DEPTH`)."""

    def __init__(self, leaves: dict[str, Any], where: str) -> None:
        self.leaves, self.where, self.depth = leaves, where, 0

    def _leaf(self, node: dict[str, Any], field: str, kinds: frozenset[str] | set[str], at: str) -> dict[str, Any]:
        key = node.get(field)
        info = self.leaves.get(key) if isinstance(key, str) else None
        if info is None or info["kind"] not in kinds:
            raise _bad(self.where, f"{at} {field}", f"the key of a leaf of kind {sorted(kinds)}")
        return info

    def value(self, node: Any, at: str) -> None:
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise _bad(self.where, at, "a value node")
        self.depth += 1
        try:
            if self.depth > MAX_NODE_DEPTH:
                raise _bad(self.where, at, f"nested at most {MAX_NODE_DEPTH} deep")
            self._value(node, node["t"], at)
        finally:
            self.depth -= 1

    def _value(self, node: dict[str, Any], t: str, at: str) -> None:
        v = node.get("v")
        if t == "v":
            if not (v is None or isinstance(v, (bool, int, str))):
                raise _bad(self.where, f"{at} v", "null, a bool, an int or a str")
        elif t in ("f", "b"):
            if not isinstance(v, str):
                raise _bad(self.where, f"{at} v", "a str")
        elif t == "np":
            dt = numeric_dtype(node.get("dtype"))
            if dt is None:
                raise _bad(self.where, f"{at} dtype", "a numeric dtype")
            if (isinstance(v, bool) and dt.kind != "b") or not isinstance(v, (int, str)):
                raise _bad(self.where, f"{at} v", f"a {dt.name} scalar")
        elif t in ("list", "tuple"):
            items = node.get("items")
            if not isinstance(items, list):
                raise _bad(self.where, f"{at} items", "a list")
            for i, item in enumerate(items):
                self.value(item, f"{at}[{i}]")
        elif t == "dict":
            items = node.get("items")
            if not (isinstance(items, list) and all(isinstance(p, list) and len(p) == 2 for p in items)):
                raise _bad(self.where, f"{at} items", "a list of [key, value] pairs")
            keys = [k for k, _ in items]
            if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
                raise _bad(self.where, f"{at} items", "pairs with unique str keys")
            for k, item in items:
                self.value(item, f"{at}[{k!r}]")
        elif t == "torch":
            self.tensor(node, at)
        elif t == "jax_alias":
            self.tensor(node.get("tensor"), f"{at} tensor")
            if not (node.get("owner") is None or isinstance(node["owner"], str)):
                raise _bad(self.where, f"{at} owner", "a type name or null")
        elif t == "jax":
            self._leaf(node, "key", {"jax"}, at)
        elif t == "numpy":
            info = self._leaf(node, "key", {"numpy"}, at)
            dt, shape = numeric_dtype(node.get("dtype")), node.get("shape")
            if dt is None:
                raise _bad(self.where, f"{at} dtype", "a numeric dtype")
            if not (isinstance(shape, list) and len(shape) <= 64 and all(map(_count, shape))):
                raise _bad(self.where, f"{at} shape", "a list of sizes")
            if int(np.prod(shape, dtype=object)) * dt.itemsize != info["nbytes"]:
                raise _bad(self.where, f"{at} shape", f"one of {info['nbytes']} bytes of {dt.name} (its leaf's size)")
        elif t == "obj":
            self.obj(node, at)
        else:
            raise _bad(self.where, f"{at} t", "a known node kind")

    def obj(self, node: Any, at: str) -> None:
        if not (
            isinstance(node, dict)
            and node.get("t") == "obj"
            and isinstance(node.get("type"), str)
            and isinstance(node.get("fields"), dict)
            and isinstance(node.get("static"), dict)
            and isinstance(node.get("parked", False), bool)
        ):
            raise _bad(self.where, at, "an object node (a type name, fields and static fields)")
        for name, field in node["fields"].items():
            self.value(field, f"{at} field {name!r}")
        for name, field in node["static"].items():
            self.static(field, f"{at} static {name!r}", 0)

    def static(self, node: Any, at: str, depth: int) -> None:
        t = node.get("t") if isinstance(node, dict) else None
        v = node.get("v") if isinstance(node, dict) else None
        ok = (
            (t == "v" and (v is None or isinstance(v, (bool, int, str))))
            or (t == "f" and isinstance(v, str))
            or (t == "dtype" and numeric_dtype(v) is not None)
            or (t == "tuple" and isinstance(node.get("items"), list) and depth < MAX_NODE_DEPTH)
        )
        if not ok:
            raise _bad(self.where, at, "a static value (null, bool, int, str, float, tuple or numeric dtype)")
        if t == "tuple":
            for i, item in enumerate(node["items"]):
                self.static(item, f"{at}[{i}]", depth + 1)

    def tensor(self, node: Any, at: str) -> None:
        """A torch view: a dtype torch has, and every element it can reach within its storage's bytes."""
        if not isinstance(node, dict) or node.get("t") != "torch":
            raise _bad(self.where, at, "a torch tensor node")
        info = self._leaf(node, "storage", {"torch_storage"}, at)
        itemsize = TORCH_ITEMSIZE.get(str(node.get("dtype")))
        if itemsize is None:
            raise _bad(self.where, f"{at} dtype", f"a torch dtype of {sorted(TORCH_ITEMSIZE)}")
        shape, stride, offset = node.get("shape"), node.get("stride"), node.get("offset", -1)
        if not (
            isinstance(shape, list)
            and isinstance(stride, list)
            and len(shape) == len(stride) <= 64
            and all(map(_count, shape))
            and all(map(_count, stride))
            and isinstance(offset, int)
            and _count(offset)
        ):
            raise _bad(self.where, f"{at} shape/stride/offset", "sizes, strides of its rank and an offset")
        if not isinstance(node.get("device"), str) or not isinstance(node.get("requires_grad", False), bool):
            raise _bad(self.where, f"{at} device/requires_grad", "a device name and a bool")
        if not isinstance(node.get("parameter", False), bool):
            raise _bad(self.where, f"{at} parameter", "a bool")
        end = offset if 0 in shape else offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        if end * itemsize > info["nbytes"]:
            raise _bad(
                self.where,
                f"{at} offset/shape/stride",
                f"a view within its storage ({end * itemsize} bytes reached, the storage holds {info['nbytes']})",
            )


def check_stored(leaves: Mapping[str, Any], stored: Mapping[str, StoredLeaf], where: str) -> None:
    """Refuse a leaf whose declared size, shape or dtype is not what the data holds (``stored``, by leaf key),
    before a buffer is allocated for it. Leaves of no bytes are the manifest's alone and not looked up.

    Raises:
      CheckpointError: a leaf missing from the data, or one that disagrees with it (naming ``where`` and it);
        compressed leaves declaring more than `MAX_COMPRESSION_RATIO` times their stored bytes (plus
        `COMPRESSED_SLACK`).
    """
    inflated = compressed = 0
    for key, info in leaves.items():
        declared = _nbytes(info)
        if not declared:
            continue
        got = stored.get(key)
        if got is None:
            raise CheckpointError(f"{where}: leaf {key!r} is missing from the arrays; the checkpoint is damaged.")
        if info["kind"] == "jax":
            shape, dt = tuple(info["shape"]), np.dtype(info["dtype"])
            stored_dt = numeric_dtype(got.dtype)
            same = stored_dt is not None and stored_dt.itemsize == dt.itemsize and got.shape == shape
            enough = got.nbytes is None or got.nbytes >= declared
        else:
            shape, same = (declared,), got.shape == (declared,) and np.dtype(got.dtype) == np.uint8
            enough = got.nbytes is None or got.nbytes == declared
        if not (same and enough):
            raise CheckpointError(
                f"{where}: leaf {key!r} is declared as {declared} bytes of shape {list(shape)}, but the data holds "
                f"{got.nbytes if got.nbytes is not None else 'compressed'} bytes of shape {list(got.shape)} "
                f"({got.dtype}); the checkpoint is damaged or crafted."
            )
        if got.nbytes is None:
            inflated, compressed = inflated + declared, compressed + got.compressed_nbytes
    if inflated > COMPRESSED_SLACK + MAX_COMPRESSION_RATIO * compressed:
        raise CheckpointError(
            f"{where}: the compressed leaves declare {inflated} bytes but their chunks take {compressed}, more than "
            f"{MAX_COMPRESSION_RATIO}x (plus {COMPRESSED_SLACK >> 20} MiB) that data holds when it is genuine; it is "
            f"refused before anything is decompressed, as crafted. Saves since 0.2.0 write arrays uncompressed: a "
            f"genuine older checkpoint of mostly zeros loads once re-saved uncompressed (orbax "
            f"`PyTreeCheckpointHandler(use_compression=False)`)."
        )
