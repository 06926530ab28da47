"""Private: incremental, exact byte accounting of the state objects a table holds.

Each state object's buffers are a set of extents ``(pool, start, end)``, computed once per object (objects
are immutable) and cached on it. The table keeps, persistently, how many objects across all its sessions
hold each extent, and the bytes per pool of the extents held at least once. Committing, evicting, parking,
forking and dropping adjust those counts by the extents of the objects they add and remove, so the totals
never need a walk: a buffer shared by two forks is counted once and leaves only when its last holder does.

Extents are identical or disjoint: torch tensors count their whole storage, numpy arrays their base, JAX
arrays their shard buffers, and a bridge alias its torch owner's storage (its own bytes lie inside it).
The counts also answer the holder questions of `memory.holders` in O(size of the object): ``leaves``
counts the array leaves the byte accounting leaves out (ring positions: a donation could delete them),
``attrs`` indexes the attr values (recorded on write), ``arrays`` and ``parked`` keep the JAX arrays and
host copies held, for `stats` without a walk.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import immutables
import jax

from ..core.latent_buffer import LatentBuffer
from ..core.state_object import StateObject
from ..engine.kv_handle import PagedKVHandle, kv_keys
from ..engine.paged_kv import POOLS
from ..memory import accounting
from ..memory.holders import EMPTY_ATTRS, AttrIndex, count_arrays, count_change, jax_arrays

_CACHE_SLOT = StateObject.__dict__["_acct_cache"]

Extent = tuple[str, int, int]
_EMPTY: immutables.Map = immutables.Map()
_ABSENT = object()
LOG_CUT = object()  # where a release log was cut short (kept to _LOG_DEPTH entries)
_LOG_DEPTH = 4096


def value_extents(value: Any) -> list[Extent]:
    """The extents one value holds: a direct read for a tensor or an array, a walk for anything else."""
    out: accounting.Extents = []
    torch = accounting.torch_module()
    if torch is not None and type(value) is torch.Tensor:
        accounting.torch_extents(value, out)
    else:
        accounting.collect_extents(value, out, {}, accounting.WalkReport())
    return out


def _buffer_cache(buf: LatentBuffer) -> tuple[immutables.Map, tuple[tuple[Extent, ...], ...]]:
    """A buffer's extents with how many of its values (items, staged, parked copy) hold each, and each item's
    own extents (so a commit that drops an item need not look at it again), computed once and cached."""
    cached = getattr(buf, "_acct_cache", None)
    if type(cached) is tuple:
        return cached
    counts: Any = immutables.Map().mutate()
    per_item = tuple(_distinct(value_extents(value)) for value in buf.items)
    for extents in per_item:
        for e in extents:
            counts[e] = counts.get(e, 0) + 1
    for value in (buf.staged, buf.host_copy):
        if value is not None:
            for e in _distinct(value_extents(value)):
                counts[e] = counts.get(e, 0) + 1
    cached = (counts.finish(), per_item)
    _CACHE_SLOT.__set__(buf, cached)
    return cached


class _Extents(frozenset):
    """An object's extents, with ``extra``: those of its array leaves the byte accounting leaves out."""

    __slots__ = ("arrays", "extra")
    extra: frozenset[Extent]
    arrays: tuple[Any, ...]  # its JAX arrays (each leaf), for the deleted-array check


_NO_EXTRA: frozenset[Extent] = frozenset()


def _object_cache(obj: Any) -> _Extents:
    cached = getattr(obj, "_acct_cache", None)
    if cached is None:
        out: accounting.Extents = []
        seen: dict[int, Any] = {}
        report = accounting.WalkReport()
        accounting.collect_extents(obj, out, seen, report)
        cached = _Extents(out)
        extra: accounting.Extents = []
        leaves = jax.tree_util.tree_leaves(obj)
        cached.arrays = tuple(x for x in leaves if isinstance(x, jax.Array))
        for leaf in leaves:
            if id(leaf) not in seen:
                accounting.collect_extents(leaf, extra, seen, report)
        cached.extra = frozenset(e for e in extra if e not in cached) if extra else _NO_EXTRA
        _CACHE_SLOT.__set__(obj, cached)  # past the frozen dataclass's __setattr__: a memo, not state
    return cached


def object_extents(obj: Any) -> frozenset[Extent]:
    """The extents a state object holds (committed, staged and parked), computed once and cached on it."""
    if type(obj) is LatentBuffer:
        return frozenset(_buffer_cache(obj)[0].keys())
    return _object_cache(obj)


def leaf_extents(obj: Any) -> frozenset[Extent]:
    """The extents of the array leaves of ``obj`` that its byte accounting leaves out (ring positions); a
    buffer ring's accounting reaches every leaf."""
    if type(obj) is LatentBuffer:
        return _NO_EXTRA
    return _object_cache(obj).extra


def object_arrays(obj: Any) -> tuple[Any, ...]:
    """The JAX arrays among ``obj``'s leaves (cached, but for a buffer ring: read from its items)."""
    if type(obj) is LatentBuffer:
        return jax_arrays((obj.items, obj.staged, obj.host_copy))
    return _object_cache(obj).arrays


def _host(obj: Any) -> tuple[Any, ...]:
    return () if obj.host_copy is None else (obj.host_copy,)


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def held_by(obj: Any) -> frozenset[Extent]:
    """Every extent ``obj`` holds as a holder: `object_extents` and `leaf_extents`."""
    extra = leaf_extents(obj)
    return object_extents(obj) | extra if extra else object_extents(obj)


def _distinct(extents: list[Extent]) -> tuple[Extent, ...]:
    return tuple(extents) if len(extents) < 2 else tuple(set(extents))


class Acct:
    """Holder counts per extent and bytes per pool; immutable (every change returns a new one)."""

    __slots__ = ("arrays", "attrs", "kv", "leaves", "log", "parked", "refs", "root", "totals")

    def __init__(
        self,
        refs: immutables.Map,
        totals: immutables.Map,
        kv: immutables.Map = _EMPTY,
        log: Any = None,
        root: Any = None,
        leaves: immutables.Map = _EMPTY,
        attrs: AttrIndex = EMPTY_ATTRS,
        arrays: immutables.Map = _EMPTY,
        parked: immutables.Map = _EMPTY,
    ):
        self.refs = refs  # extent -> number of objects holding it, over all sessions
        self.totals = totals  # pool -> bytes of the extents held at least once
        # Engine KV blocks: (pool uid, block id) -> number of handles holding it. `log` is a persistent list of
        # the changes of the held blocks, newest first, (depth, keys whose last handle let go, previous);
        # `root` identifies the lineage (accountings derived from one build), within which logs can be compared.
        self.kv = kv
        self.log = log
        self.root = root if root is not None else object()
        self.leaves = leaves  # extent -> objects holding it as a leaf the accounting leaves out (0 bytes)
        self.attrs = attrs  # the attr values' holder index
        self.arrays = arrays  # id(JAX array) -> (array, objects holding it): what `deleted_count` checks
        self.parked = parked  # id(host copy) -> (host copy, objects holding it): what `parked_nbytes` reads

    @classmethod
    def build(cls, sessions: Iterable[Any]) -> Acct:
        acct = cls(_EMPTY, _EMPTY)
        for session in sessions:
            acct = acct.add_session(session)
        return acct

    def add_session(self, session: Any) -> Acct:
        return self.change_objects(session._objects.values(), (), session._attrs.values())

    def remove_session(self, session: Any) -> Acct:
        return self.change_objects((), session._objects.values(), (), session._attrs.values())

    def change_objects(
        self, add: Iterable[Any], remove: Iterable[Any], attrs_add: Iterable[Any] = (), attrs_remove: Iterable[Any] = ()
    ) -> Acct:
        """The counts after objects ``remove`` left and ``add`` arrived (and attr values likewise)."""
        add, remove = list(add), list(remove)
        return self.change(
            add=[object_extents(o) for o in add],
            remove=[object_extents(o) for o in remove],
            kv_add=[kv_keys(o) for o in add],
            kv_remove=[kv_keys(o) for o in remove],
            leaves_add=[leaf_extents(o) for o in add],
            leaves_remove=[leaf_extents(o) for o in remove],
            attrs_add=attrs_add,
            attrs_remove=attrs_remove,
            arrays_add=[object_arrays(o) for o in add],
            arrays_remove=[object_arrays(o) for o in remove],
            parked_add=[_host(o) for o in add],
            parked_remove=[_host(o) for o in remove],
        )

    def change(
        self,
        add: Iterable[frozenset[Extent]] = (),
        remove: Iterable[frozenset[Extent]] = (),
        kv_add: Iterable[Iterable[tuple[int, int]]] = (),
        kv_remove: Iterable[Iterable[tuple[int, int]]] = (),
        leaves_add: Iterable[frozenset[Extent]] = (),
        leaves_remove: Iterable[frozenset[Extent]] = (),
        attrs_add: Iterable[Any] = (),
        attrs_remove: Iterable[Any] = (),
        arrays_add: Iterable[tuple[Any, ...]] = (),
        arrays_remove: Iterable[tuple[Any, ...]] = (),
        parked_add: Iterable[tuple[Any, ...]] = (),
        parked_remove: Iterable[tuple[Any, ...]] = (),
    ) -> Acct:
        """The counts after the objects with extents ``remove`` left and those with ``add`` arrived (and the
        handles holding KV blocks ``kv_remove`` / ``kv_add``, the objects' unaccounted leaves, the attr
        values)."""
        refs = self.refs.mutate()
        totals = self.totals.mutate()
        for extents in remove:
            for e in extents:
                n = refs[e] - 1
                if n:
                    refs[e] = n
                else:
                    del refs[e]
                    totals[e[0]] = totals[e[0]] - (e[2] - e[1])
        for extents in add:
            for e in extents:
                n = refs.get(e, 0)
                refs[e] = n + 1
                if not n:
                    totals[e[0]] = totals.get(e[0], 0) + (e[2] - e[1])
        leaves = count_change(self.leaves, leaves_add, leaves_remove)
        arrays = count_arrays(self.arrays, arrays_add, arrays_remove)
        parked = count_arrays(self.parked, parked_add, parked_remove)
        attrs_add, attrs_remove = list(attrs_add), list(attrs_remove)
        attrs = self.attrs.change(attrs_add, attrs_remove) if attrs_add or attrs_remove else self.attrs
        kv, log = self.kv, self.log
        kv_add, kv_remove = [k for k in kv_add if k], [k for k in kv_remove if k]
        if kv_add or kv_remove:
            counts = kv.mutate()
            held: dict[int, int] = {}  # pool uid -> change in distinct blocks held
            for keys in kv_add:
                for k in keys:
                    n = counts.get(k, 0)
                    counts[k] = n + 1
                    if not n:
                        held[k[0]] = held.get(k[0], 0) + 1
            released = []
            for keys in kv_remove:
                for k in keys:
                    n = counts[k] - 1
                    if n:
                        counts[k] = n
                    else:
                        del counts[k]
                        released.append(k)
                        held[k[0]] = held.get(k[0], 0) - 1
            for uid, d in held.items():
                n = counts.get(("held", uid), 0) + d
                if n:
                    counts[("held", uid)] = n
                else:
                    counts.pop(("held", uid), None)
            kv = counts.finish()
            # Every change of the held blocks is a node, even one that releases nothing: reaching
            # ``before``'s node from ``after``'s then proves ``after`` descends from ``before`` (a table
            # compared with its ancestor, or with a sibling, shares its node only if there is one per change).
            depth = 0 if log is None or log is LOG_CUT else log[0] + 1
            log = (depth, tuple(released), log) if depth < _LOG_DEPTH else (0, tuple(released), LOG_CUT)
        return Acct(refs.finish(), totals.finish(), kv, log, self.root, leaves, attrs, arrays, parked)

    def swap(self, old: Any, new: Any) -> Acct:
        """One object replaced by another (a commit, an eviction, a park): only the extents that differ move."""
        if old is new:
            return self
        if type(old) is LatentBuffer and type(new) is LatentBuffer:
            swapped = self._ring_swap(old, new)  # the per-step commit: priced by the items it adds and drops
            if swapped is not None:
                return swapped
        if type(old) is PagedKVHandle or type(new) is PagedKVHandle:
            return self._swap_handle(old, new)
        a, b = object_extents(old), object_extents(new)
        la, lb = leaf_extents(old), leaf_extents(new)
        if a == b and la == lb and _same(object_arrays(old), object_arrays(new)) and old.host_copy is new.host_copy:
            return self
        return self.change(
            add=[b - a],
            remove=[a - b],
            leaves_add=[lb - la],
            leaves_remove=[la - lb],
            arrays_add=[object_arrays(new)],
            arrays_remove=[object_arrays(old)],
            parked_add=[_host(new)],
            parked_remove=[_host(old)],
        )

    def _ring_swap(self, old: LatentBuffer, new: LatentBuffer) -> Acct | None:
        """The counts after ring ``old`` became ``new`` by a commit (items appended, the oldest dropped), in
        one pass over the items that changed; None when ``new`` is something else.

        ``old``'s cached extent multiset gives the new ring's by difference, and only an extent whose count
        in the ring reaches zero (or leaves zero) moves the table's counts: the hot path of every step, so
        written out rather than built on `change`.
        """
        cached = getattr(old, "_acct_cache", None)
        if type(cached) is not tuple or getattr(new, "_acct_cache", None) is not None:
            return None
        if old.staged is not new.staged or old.host_copy is not None or new.host_copy is not None:
            return None
        oi, ni = old.items, new.items
        kept = len(ni) - 1
        drop = len(oi) - kept
        if kept < 0 or drop < 0 or not all(map(operator.is_, oi[drop:], ni[:kept])):
            return None
        counts, per_item = cached
        refs, totals = self.refs, self.totals
        for extents in per_item[:drop]:  # as counted when the item arrived
            for e in extents:
                n = counts[e] - 1
                if n:
                    counts = counts.set(e, n)
                    continue
                counts = counts.delete(e)
                n = refs[e] - 1  # the last of this ring's holders went: one object fewer holds it
                if n:
                    refs = refs.set(e, n)
                else:
                    refs = refs.delete(e)
                    totals = totals.set(e[0], totals[e[0]] - (e[2] - e[1]))
        added = _distinct(value_extents(ni[-1]))
        for e in added:
            n = counts.get(e, 0)
            counts = counts.set(e, n + 1)
            if n:
                continue
            n = refs.get(e, 0)
            refs = refs.set(e, n + 1)
            if not n:
                totals = totals.set(e[0], totals.get(e[0], 0) + (e[2] - e[1]))
        _CACHE_SLOT.__set__(new, (counts, (*per_item[drop:], added)))
        arrays = self.arrays
        gone, came = [jax_arrays(item) for item in oi[:drop]], jax_arrays(ni[-1])
        if came or any(gone):
            arrays = count_arrays(arrays, [came], gone)
        if refs is self.refs and arrays is self.arrays:
            return self
        return Acct(refs, totals, self.kv, self.log, self.root, self.leaves, self.attrs, arrays, self.parked)

    def _swap_handle(self, old: Any, new: Any) -> Acct:
        if (
            type(old) is PagedKVHandle
            and type(new) is PagedKVHandle
            and old.pool is new.pool
            and old.staged == new.staged
            and old.host_copy is new.host_copy  # (a restore also only adds blocks, but lets go of its host copy)
            and new.block_ids[: len(old.block_ids)] == old.block_ids
            and leaf_extents(old) == leaf_extents(new)
        ):  # a commit of new blocks: priced by those blocks alone
            tail = new.block_ids[len(old.block_ids) :]
            uid = new.pool.uid
            return self.change(
                add=[frozenset(new.pool.extents(tail))],
                kv_add=[[(uid, b) for b in tail]],
                arrays_add=[object_arrays(new)],
                arrays_remove=[object_arrays(old)],
            )
        a, b = object_extents(old), object_extents(new)
        ka, kb = set(kv_keys(old)), set(kv_keys(new))
        la, lb = leaf_extents(old), leaf_extents(new)
        return self.change(
            add=[b - a],
            remove=[a - b],
            kv_add=[kb - ka],
            kv_remove=[ka - kb],
            leaves_add=[lb - la],
            leaves_remove=[la - lb],
            arrays_add=[object_arrays(new)],
            arrays_remove=[object_arrays(old)],
            parked_add=[_host(new)],
            parked_remove=[_host(old)],
        )

    def swap_session(self, old: Any, new: Any) -> Acct:
        """A session replaced by another: the objects and attr values that changed identity move."""
        same_objects, same_attrs = old._objects is new._objects, old._attrs is new._attrs
        if same_objects and same_attrs:
            return self
        added, removed, attrs_added, attrs_removed = [], [], [], []
        if not same_objects:
            for name, obj in new._objects.items():
                prev = old._objects.get(name)
                if prev is not obj:
                    added.append(obj)
                    if prev is not None:
                        removed.append(prev)
            removed.extend(obj for name, obj in old._objects.items() if name not in new._objects)
        if not same_attrs:
            for key, value in new._attrs.items():
                prev = old._attrs.get(key, _ABSENT)
                if prev is not value:
                    attrs_added.append(value)
                    if prev is not _ABSENT:
                        attrs_removed.append(prev)
            attrs_removed.extend(value for key, value in old._attrs.items() if key not in new._attrs)
        return self.change_objects(added, removed, attrs_added, attrs_removed)

    def kv_held(self) -> dict[int, int]:
        """``{pool uid: distinct blocks handles hold}`` (kept under ``("held", uid)`` keys of ``kv``)."""
        return {uid: self.kv[("held", uid)] for uid in list(POOLS.keys()) if ("held", uid) in self.kv}
