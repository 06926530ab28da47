"""Pricing release actions: the ledger of extents a plan frees, so that shared buffers are counted once."""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from collections.abc import Iterable
from typing import Any

import jax

from ..memory import accounting, parking
from ..memory.extents import Extent, Loose
from ..memory.overlaps import PoolIndex
from ..memory.pools import HOST, PINNED_HOST, UNPINNED_HOST, Pool
from ..memory.usage import pools_by_name


class Ledger:
    """Who holds each extent as the plan's actions so far would leave it; every action is priced here.

    An action is a change of holders: the objects it replaces (``remove``) by what they become (``add``), and
    the attrs that leave with a dropped session. Its price is measured, not estimated: the extents that stop
    being held (bytes freed) and those that start (bytes a park fills a host pool with), per pool. Parks,
    evictions and drops all go through `change`, so "what does this free" has one answer in the planner.
    """

    def __init__(self, refs: Any, attr_holders: Any, overlaps: Any = None):
        self.refs = refs  # extent -> objects holding it (the table's accounting)
        # Pools whose extents may overlap without being equal (a `Loose` one held): priced by their union.
        self.overlaps = overlaps or {}
        self.objects: Counter[Extent] = Counter()  # change in object holders made by the plan so far
        self.attrs: Counter[Extent] = Counter()
        self.taken: dict[str, set[Extent]] = {}  # pool -> extents the plan so far made held that the table did not
        self._next_virtual = -(1 << 62)  # host copies a park would make: fresh addresses no buffer has
        self._sorted: dict[tuple[str, str], tuple[list[Extent], int]] = {}  # (what, pool) -> extents, longest
        self.set_attr_holders(attr_holders)

    def set_attr_holders(self, attr_holders: Any) -> None:
        """Price against ``attr_holders`` (extent -> attr holders of it: a Counter, or the index's `AttrHolders`)."""
        self.attr_holders = attr_holders
        if hasattr(attr_holders, "closed"):  # the index's kept mark: a plan must not read every attr extent
            marked, scanned = attr_holders.loose, attr_holders.open
        else:
            marked, scanned = (), attr_holders
        self.loose_pools = {*self.overlaps, *marked, *(e.pool for e in scanned if type(e) is Loose)}
        self._sorted = {k: v for k, v in self._sorted.items() if k[0] != "attrs"}

    def held(self, e: Extent, d_objects: int = 0, d_attrs: int = 0) -> bool:
        objects = self.refs.get(e, 0) + self.objects[e] + d_objects
        return objects > 0 or self.attr_holders[e] + self.attrs[e] + d_attrs > 0

    def virtual(self, pool: Pool, nbytes: int) -> Extent:
        """An extent for a host copy that does not exist yet (a park's), disjoint from every real buffer."""
        start = self._next_virtual
        self._next_virtual += nbytes
        return Extent(str(pool), start, start + nbytes)

    def change(
        self, remove: Iterable[frozenset[Extent]], add: Iterable[frozenset[Extent]] = (), attrs: Iterable[Extent] = ()
    ) -> Change:
        """The effect of objects ``remove`` becoming ``add`` (and sessions' ``attrs`` letting go), not yet taken."""
        d: Counter[Extent] = Counter()
        for extents in remove:
            for e in extents:
                d[e] -= 1
        for extents in add:
            for e in extents:
                d[e] += 1
        d_attrs: Counter[Extent] = Counter()
        for e in attrs:
            d_attrs[e] -= 1
        return self.price(d, d_attrs)

    def undo(self, change: Change) -> Change:
        """The effect of taking back ``change`` (taken before): its holders hold again. Holder counts add up,
        so an action taken anywhere in a plan can be taken back alone, whatever was taken after it."""
        return self.price(
            Counter({e: -n for e, n in change.objects.items()}), Counter({e: -n for e, n in change.attrs.items()})
        )

    def price(self, d: Counter[Extent], d_attrs: Counter[Extent]) -> Change:
        """The effect of the holder changes ``d`` (objects) and ``d_attrs`` (attrs) on what the plan so far
        leaves: the extents that stop and start being held, and the bytes per pool that leave (or arrive)."""
        left, came = [], []
        for e in d.keys() | d_attrs.keys():
            before, after = self.held(e), self.held(e, d[e], d_attrs[e])
            if before and not after:
                left.append(e)
            elif after and not before:
                came.append(e)
        frees = by_pool(left)
        for pool, n in by_pool(came).items():
            frees[pool] = frees.get(pool, 0) - n
        unions = {e.pool for e in (*left, *came) if e.pool in self.loose_pools or type(e) is Loose}
        for name in unions:
            frees[Pool.of(name)] = self._union_frees(name, d, d_attrs)
        if came or unions:
            frees = dict(sorted(frees.items(), key=_by_name))
        return Change({p: n for p, n in frees.items() if n}, frozenset(left), d, d_attrs)

    def _union_frees(self, pool: str, d: Counter[Extent], d_attrs: Counter[Extent]) -> int:
        """Bytes ``pool`` frees under the change ``d`` (objects) and ``d_attrs``, where an extent there may
        overlap another without being it: the union of what it holds before, less the union after.

        Only bytes under the extents whose holders change can change hands: an extent that shares no byte
        with them is held (or not) alike before and after, so the two unions are taken over those extents
        and the ones overlapping them alone, found by bisection in the pool's sorted extents (the ledger's
        index for objects; the attrs' sorted once per plan). O(log n + the extents near the change).
        """
        changed = sorted({e for keys in (d, d_attrs) for e in keys if e.pool == pool})
        if not changed:
            return 0
        spans = [[changed[0][1], changed[0][2]]]  # the bytes under the changed extents, merged
        for _, start, end in changed[1:]:
            if start <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([start, end])
        objects = self.overlaps.get(pool) or self._pool_sorted("objects", pool)
        attrs, taken = self._pool_sorted("attrs", pool), self.taken.get(pool, ())
        near: set[Extent] = set(changed)
        for lo, hi in spans:
            near.update(_overlapping(objects, lo, hi, pool))
            near.update(_overlapping(attrs, lo, hi, pool))
            near.update(e for e in taken if e.start < hi and lo < e.end)
        before = [e for e in near if self.held(e)]
        after = [e for e in near if self.held(e, d[e], d_attrs[e])]
        return accounting.union_by_device(before).get(pool, 0) - accounting.union_by_device(after).get(pool, 0)

    def _pool_sorted(self, what: str, pool: str) -> tuple[list[Extent], int]:
        """The extents of ``pool`` the table's objects (``"objects"``, for a pool the ledger does not index)
        or attrs (``"attrs"``) hold, sorted, with the longest one's length: read once per plan and pool."""
        found = self._sorted.get((what, pool))
        if found is None:
            if what == "objects":
                keys: Iterable[Extent] = self.refs
            else:
                holders = self.attr_holders
                closed = getattr(holders, "closed", holders)
                totals = getattr(holders, "pools", None)  # the attr index's per-pool totals: a pool no closed
                keys = [  # attr value holds is not read at all
                    *(closed if totals is None or pool in totals else ()),
                    *getattr(holders, "open", ()),
                ]
            extents = sorted({e for e in keys if e.pool == pool})
            found = self._sorted[(what, pool)] = (extents, max((e.end - e.start for e in extents), default=0))
        return found

    def take(self, change: Change) -> None:
        self.objects.update(change.objects)
        self.attrs.update(change.attrs)
        for e in change.objects:  # (the table's own extents are found through its index: only new ones here)
            if e not in self.refs and not self.attr_holders[e]:
                self.taken.setdefault(e.pool, set()).add(e)


@dataclasses.dataclass(frozen=True)
class Change:
    frees: dict[Pool, int]  # pool -> bytes leaving (negative: arriving), by pool name
    left: frozenset[Extent]  # extents no holder keeps afterwards
    objects: Counter[Extent]
    attrs: Counter[Extent]


def _overlapping(extents: Any, lo: int, hi: int, pool: str) -> Iterable[Extent]:
    """The extents of one pool that share a byte with ``[lo, hi)``: ``extents`` is the ledger's `PoolIndex`
    of the pool (sorted chunks) or a ``(sorted list, longest length)`` pair. O(log n + those near it)."""
    if isinstance(extents, PoolIndex):
        key = (pool, lo - extents.maxlen)  # (an extent starting a longest length before ``lo`` ends by it)
        chunks = extents.chunks
        c = max(bisect.bisect_right(extents.firsts, key) - 1, 0)
        i = bisect.bisect_left(chunks[c], key) if chunks else 0
    else:
        key = (pool, lo - extents[1])
        chunks, c = (extents[0],), 0
        i = bisect.bisect_left(chunks[0], key)
    while c < len(chunks):
        chunk = chunks[c]
        while i < len(chunk):
            e = chunk[i]
            if e.start >= hi:
                return
            if e.end > lo:
                yield e
            i += 1
        c, i = c + 1, 0


def by_pool(extents: Iterable[Extent]) -> dict[Pool, int]:
    """Bytes per pool of ``extents``, overlaps counted once, by pool name."""
    return pools_by_name(accounting.union_by_device(list(extents)))


def _by_name(item: tuple[Pool, int]) -> str:
    return str(item[0])


def park_effect(obj: Any, ledger: Ledger) -> tuple[frozenset[Extent], frozenset[Extent]]:
    """``(committed, parked)``: the extents of ``obj``'s committed storage (all must be free for `park` to
    proceed), and the extents the parked object holds, its host copies as fresh extents of their host pool.

    This follows `functional_state.memory.parking.park_values` leaf by leaf: a torch storage (or the storage a bridge
    alias lives in) moves whole, to pinned host memory from a GPU and pageable memory from the CPU; a JAX array
    moves to its ``pinned_host`` memory kind; anything else (numpy arrays) stays as it is, and stays held. The
    staged payload stays too. `enforce_budget` measures the applied plan, so a drift between the two is
    refused, never installed.
    """
    own = obj.park_extents()
    if own is not None:  # the type prices its own park (an engine's offload token: host bytes of its blocks)
        committed, kept, host = own
        token = [ledger.virtual(HOST, host)] if host else []
        return frozenset(committed), frozenset(kept) | frozenset(token)
    committed = extents_of(obj._committed_roots())
    kept_values: list[Any] = [obj.staged, list(obj._parked_fields().values())]
    host_bytes: dict[Pool, int] = {}
    storages: set[tuple[Any, int]] = set()
    for i, leaf in enumerate(_leaves(obj._parkable_fields())):
        tensor, _ = parking.as_torch(leaf)
        if tensor is not None:
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr() if storage.nbytes() else -1 - i)
            if key not in storages:
                storages.add(key)
                kind = PINNED_HOST if tensor.device.type == "cuda" else UNPINNED_HOST
                host_bytes[kind] = host_bytes.get(kind, 0) + storage.nbytes()
        elif isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            n = sum(s.data.on_device_size_in_bytes() for s in leaf.addressable_shards)
            host_bytes[PINNED_HOST] = host_bytes.get(PINNED_HOST, 0) + n
        else:
            kept_values.append(leaf)
    host = frozenset(ledger.virtual(p, n) for p, n in sorted(host_bytes.items(), key=str) if n)
    return committed, extents_of(kept_values) | host


def extents_of(tree: Any) -> frozenset[Extent]:
    out: accounting.Extents = []
    accounting.collect_extents(tree, out, {}, accounting.WalkReport())
    return frozenset(out)


def _leaves(tree: Any) -> list[Any]:
    try:
        return jax.tree_util.tree_leaves(tree)
    except Exception:
        return []
