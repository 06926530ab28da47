"""Which buffers a value holds, for the questions "may a donation delete this?" and "does parking free it?".

`step` must never donate, and `park` never parks, a buffer that something else still reads. Both compare
the extents the byte accounting uses (so views, aliases through the bridge and forks all meet there) plus
every array leaf the accounting leaves out (ring positions: buffers a donation could delete too).

The table answers these questions from its ledger (`functional_state.table.ledger`), which keeps holder
counts per extent; `buffer_keys` and `holders_except` are the full walk it is checked against in tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import immutables
import jax

from . import accounting
from .aliases import alias_owner
from .extents import Extent, Loose
from .overlaps import overlapped
from .values import fixed, holds_no_buffer


def holder_extents(tree: Any) -> set[Extent]:
    """Every extent reachable from ``tree``: those the byte accounting counts, and those of every array leaf
    of its pytrees (ring positions and other small leaves the accounting leaves out are buffers a donation
    could delete too)."""
    extents: accounting.Extents = []
    seen: dict[int, Any] = {}
    report = accounting.WalkReport()
    accounting.collect_extents(tree, extents, seen, report)
    try:
        leaves = jax.tree_util.tree_leaves(tree)
    except Exception:  # an attr JAX cannot flatten: its arrays were found by the walk above
        leaves = []
    for leaf in leaves:
        if id(leaf) not in seen:
            accounting.collect_extents(leaf, extents, seen, report)
    return set(extents)


def buffer_keys(tree: Any) -> set[tuple[str, int]]:
    """Every (pool, start address) of the buffers reachable from ``tree`` (see `holder_extents`)."""
    return {(key, start) for key, start, _ in holder_extents(tree)}


def holders_except(sessions: dict[str, Any], excluded: dict[str, Any]) -> dict[str, list[Any]]:
    """Per session id, everything the session holds except objects ``excluded[sid]`` (a name or names): the
    reference answer (a walk of the whole table) the ledger's holder counts are tested against."""
    out: dict[str, list[Any]] = {}
    for sid, session in sessions.items():
        names = excluded.get(sid)
        if names is None:
            out[sid] = [session]
        else:
            names = {names} if isinstance(names, str) else set(names)
            out[sid] = [o for n, o in session._objects.items() if n not in names] + list(session._attrs.values())
    return out


def count_change(
    counts: immutables.Map, add: Iterable[frozenset[Extent]], remove: Iterable[frozenset[Extent]]
) -> immutables.Map:
    """``counts`` (key -> holders) after holders of the keys ``remove`` left and of ``add`` arrived."""
    add, remove = [a for a in add if a], [r for r in remove if r]
    if not add and not remove:
        return counts
    m = counts.mutate()
    for extents in remove:
        for e in extents:
            n = m[e] - 1
            if n:
                m[e] = n
            else:
                del m[e]
    for extents in add:
        for e in extents:
            m[e] = m.get(e, 0) + 1
    return m.finish()


class StorageStamp(NamedTuple):
    """What one read of a torch tensor's storage gave: where it is, how large, and on which side of the host
    line. A tensor resized (``resize_``) or given other storage (``set_``) in place no longer matches it."""

    address: int  # the storage's data pointer
    nbytes: int
    is_cpu: bool


class AttrEntry(NamedTuple):
    """One attr value the index holds: how many sessions hold it, and (fixed values) what it holds."""

    value: Any
    holders: int
    extents: frozenset[Extent] | None  # None: a container (re-read on every question); else counted per extent
    recorded: frozenset[Extent] | None = None  # a container: what it held when the index recorded it
    stamp: StorageStamp | None = None  # a value whose buffers are one torch storage: that storage as recorded
    stamped: Any = None  # with ``stamp``: the tensor whose storage it records (the value, or its alias owner's)


def changed_since_recorded(entry: AttrEntry) -> bool:
    """Whether the mutable attr value of ``entry`` holds other extents now than when the index recorded it
    (a list appended to, a tensor resized or given other storage). A bare torch tensor in one storage, or a
    JAX array the torch bridge imported from one, is compared by its stamp (one storage read of the
    tensor): what the shell's budget check pays per such attr of the session it writes. ``resize_`` and
    ``set_`` change the storage's address, size or device (two live CUDA storages of two devices at one
    address and size: the one case a stamp cannot tell apart)."""
    stamp = entry.stamp
    if stamp is not None and not accounting.POOL_STORAGES:
        return storage_moved(entry.stamped, stamp)
    return frozenset(holder_extents(entry.value)) != (entry.recorded if entry.extents is None else entry.extents)


def storage_moved(tensor: Any, stamp: StorageStamp) -> bool:
    """Whether torch ``tensor``'s storage is no longer the one ``stamp`` records: the stamp half of
    `changed_since_recorded`, which holds only while no engine pool storage is registered
    (``accounting.POOL_STORAGES`` empty)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr() != stamp.address or storage.nbytes() != stamp.nbytes or tensor.is_cpu is not stamp.is_cpu


def _stamp(value: Any, recorded: frozenset[Extent]) -> tuple[StorageStamp, Any] | None:
    """The `StorageStamp` of a value whose buffers are one torch storage (a bare tensor, or a JAX array
    aliasing one: its torch owner's only child), with the tensor read; else None."""
    torch = accounting.torch_module()
    if torch is None or len(recorded) != 1 or accounting.POOL_STORAGES:
        return None
    tensor = value
    if type(value) is not torch.Tensor:
        owner = alias_owner(value) if isinstance(value, jax.Array) else None
        children = getattr(owner, "_accounting_children", None)
        kids: tuple[Any, ...] = tuple(children()) if children is not None else ()
        if len(kids) != 1 or type(kids[0]) is not torch.Tensor:
            return None
        tensor = kids[0]
    storage = tensor.untyped_storage()
    return StorageStamp(storage.data_ptr(), storage.nbytes(), tensor.is_cpu), tensor


def attr_only_moved(only: Any, refs0: Any, refs1: Any, arefs0: Any, arefs1: Any, candidates: Iterable[Extent]) -> Any:
    """``only`` (the ledger's ``attr_only``: pool -> bytes of the fixed attr extents no object holds) after
    a change of the object counts ``refs0 -> refs1`` and the attr counts ``arefs0 -> arefs1``
    (``candidates``: every extent either change touched)."""
    flips = []
    for e in candidates:
        d = (e in arefs1 and e not in refs1) - (e in arefs0 and e not in refs0)
        if d:
            flips.append((e, d))
    return attr_only_flipped(only, flips) if flips else only


def attr_only_flipped(only: Any, flips: Iterable[tuple[Extent, int]]) -> Any:
    """``only`` with each extent's bytes added (+1) to or taken (-1) from its pool's attr-only sum."""
    m = only.mutate()
    for e, d in flips:
        n = m.get(e.pool, 0) + d * (e.end - e.start)
        if n:
            m[e.pool] = n
        elif e.pool in m:
            del m[e.pool]
    return m.finish()


_NO_MAP: immutables.Map = immutables.Map()


class AttrIndex:
    """Holder counts of a table's attr values, kept on write (``set_attr``, forks, resets, drops).

    A fixed value (`values.fixed`: a numpy or JAX array, a tuple of them) and a bare torch tensor in one
    storage have their extents recorded once, when they arrive, and counted per extent (``refs``, with the
    bytes per pool of the extents held, ``totals``); the tensor also keeps a stamp of its storage
    (`changed_since_recorded`), which its session's next write compares (see `values`). A container (a
    list, a dict, anything else `values.mutable`) is kept by identity and walked whenever a holder question
    is asked (``open_extents``), because a model appends to it in place. Values of
    `values.NO_BUFFER_TYPES` hold nothing and are not kept. Immutable: every change returns a new index.
    """

    __slots__ = ("loose", "memo", "opened", "refs", "totals")

    def __init__(
        self,
        memo: immutables.Map,
        refs: immutables.Map,
        opened: immutables.Map,
        totals: immutables.Map = _NO_MAP,
        loose: immutables.Map = _NO_MAP,
    ):
        self.memo = memo  # id(value) -> AttrEntry
        self.refs = refs  # extent -> fixed attr values holding it (each value once per session holding it)
        self.opened = opened  # id(value) -> value, the mutable values held: what a walk of them reads, no more
        self.totals = totals  # pool -> bytes of the union of the extents fixed values hold
        self.loose = loose  # pool -> True where ``refs`` holds a `Loose` extent (its total is then a union)

    @property
    def n_open(self) -> int:
        """Containers held (distinct values)."""
        return len(self.opened)

    def change(self, add: Iterable[Any] = (), remove: Iterable[Any] = ()) -> AttrIndex:
        """The index after attr values ``remove`` left one session and ``add`` arrived in one. A value in both
        is recorded anew (its extents and stamp read again) for every session holding it."""
        memo, refs, opened, totals = self.memo.mutate(), self.refs.mutate(), self.opened.mutate(), self.totals.mutate()
        moved: set[str] = set()  # pools where a loose extent came or left, or that hold one: a union
        add, remove = list(add), list(remove)
        # A value removed and added at once (resized in place, recorded anew): its entry goes whole, with the
        # holders it keeps beyond this change, and comes back read again. (Only decrementing a shared value's
        # holders kept its old extents: a fork's resized prompt stayed counted at its old size.)
        renew = {id(v) for v in remove}.intersection(map(id, add)) if add and remove else ()
        kept_holders: dict[int, int] = {}
        for value in remove:
            if holds_no_buffer(value):
                continue
            if id(value) in kept_holders:
                kept_holders[id(value)] -= 1
                continue
            entry = memo[id(value)]
            if id(value) in renew:
                kept_holders[id(value)] = entry.holders - 1
            elif entry.holders > 1:
                memo[id(value)] = entry._replace(holders=entry.holders - 1)
                continue
            del memo[id(value)]
            if entry.extents is None:
                del opened[id(value)]
            for e in entry.extents or ():
                n = refs[e] - 1
                if n:
                    refs[e] = n
                else:
                    del refs[e]
                    totals[e.pool] = totals[e.pool] - (e.end - e.start)
                    if type(e) is Loose or e.pool in self.loose:
                        moved.add(e.pool)
        for value in add:
            if holds_no_buffer(value):
                continue
            entry = memo.get(id(value))
            if entry is not None:
                memo[id(value)] = entry._replace(holders=entry.holders + 1)
                continue
            settled = fixed(value)
            extents = frozenset(holder_extents(value))
            stamped = None if settled else _stamp(value, extents)
            holders = 1 + kept_holders.pop(id(value), 0)
            if settled or stamped is not None:
                for e in extents:
                    n = refs.get(e, 0)
                    refs[e] = n + 1
                    if not n:
                        totals[e.pool] = totals.get(e.pool, 0) + (e.end - e.start)
                        if type(e) is Loose or e.pool in self.loose:
                            moved.add(e.pool)
                memo[id(value)] = AttrEntry(value, holders, extents, None, *(stamped or (None, None)))
            else:
                memo[id(value)] = AttrEntry(value, holders, None, extents)
                opened[id(value)] = value
        kept, loose = refs.finish(), self.loose
        if moved:  # (attr writes, not steps: such a pool's union is re-read whole, O(its attr extents))
            marks = loose.mutate()
            for pool in moved:
                held = [e for e in kept if e.pool == pool]
                totals[pool] = accounting.union_by_device(held).get(pool, 0)
                if any(type(e) is Loose for e in held):
                    marks[pool] = True
                elif pool in marks:
                    del marks[pool]
            loose = marks.finish()
        return AttrIndex(memo.finish(), kept, opened.finish(), totals.finish(), loose)

    def open_values(self) -> list[Any]:
        """The values held that are walked, not stamped (containers; each once): what a holder question re-reads.
        O(mutable values)."""
        return list(self.opened.values()) if self.opened else []

    def open_extents(self) -> set[Extent]:
        """What the containers hold now: a walk of them alone."""
        values = self.open_values()
        return holder_extents(values) if values else set()

    def closed_extents(self) -> Iterable[Extent]:
        return self.refs.keys()

    def recorded_extents(self) -> set[Extent]:
        """What the mutable values held when they were recorded (each value on its arrival)."""
        return {e for v in self.opened.values() for e in self.memo[id(v)].recorded or ()}


EMPTY_ATTRS = AttrIndex(_NO_MAP, _NO_MAP, _NO_MAP, _NO_MAP)


class HolderCounts(Protocol):
    """What the table's ledger (`functional_state.table.ledger.Acct`) keeps: holder counts per extent."""

    refs: immutables.Map  # extent -> objects holding it (bytes counted)
    leaves: immutables.Map  # extent -> objects holding it as a leaf the byte accounting leaves out
    totals: immutables.Map  # pool -> bytes of the union of the extents objects hold
    overlaps: immutables.Map  # pool -> `PoolIndex` of the extents objects hold there, where one is `Loose`
    attrs: AttrIndex
    parked: Any  # `ParkedCopies`: the host copies held, with their bytes kept
    attr_only: immutables.Map  # pool -> bytes of the fixed attr values' extents no object holds (a sum)


def held_elsewhere(acct: HolderCounts, extents: Iterable[Extent], own: frozenset[Extent] = frozenset()) -> set[Extent]:
    """Those of ``extents`` that something in the table holds besides one holder ``own`` (the `held_by` of an
    object the table holds, or nothing): another object, an unaccounted leaf of one, an attr value.

    O(len(extents)) from the kept counts, plus a walk of the mutable attr values only (they may have changed in
    place). Exact: the counts are those of every object and attr value of every session of the table.
    """
    refs, leaves, arefs = acct.refs, acct.leaves, acct.attrs.refs
    if leaves or arefs:
        out = {e for e in extents if refs.get(e, 0) + leaves.get(e, 0) + arefs.get(e, 0) - (e in own) > 0}
    else:  # (no unaccounted leaf nor attr value in the table: the objects' counts answer alone)
        out = {e for e in extents if refs.get(e, 0) > (e in own)}
    opened: set[Extent] = set()
    if acct.attrs.opened:
        opened = acct.attrs.open_extents()
        out.update(e for e in extents if e in opened)
    indexes, loose_attrs = acct.overlaps, acct.attrs.loose
    if indexes or loose_attrs or any(type(e) is Loose for e in opened):
        # A `Loose` extent may share bytes with another without being it (a storage inside a buffer another
        # object holds): held elsewhere too, whoever holds the other (this object included: its own other
        # extent reads those bytes as well).
        loose_open = {f.pool for f in opened if type(f) is Loose}
        attr_extents: list[Extent] | None = None  # (read once per call, and only if a question needs it)
        for e in extents:
            if e in out:
                continue
            index = indexes.get(e.pool)
            if index is not None and overlapped(index, e):
                out.add(e)
            elif type(e) is Loose or e.pool in loose_attrs or e.pool in loose_open:  # (else equal or disjoint)
                if attr_extents is None:
                    attr_extents = [*arefs, *opened]
                if any(f.pool == e.pool and f.start < e.end and e.start < f.end and f != e for f in attr_extents):
                    out.add(e)
    return out


def parked_nbytes(acct: HolderCounts) -> int:
    """Bytes of the parked host copies the table holds, each allocation once, kept as copies came (a copy
    need not sit in a host pool: numpy stays where it was): O(1), no walk of the table or the copies."""
    return acct.parked.total()


def pool_totals(acct: HolderCounts) -> dict[str, int]:
    """Bytes per pool of the table's objects and fixed attr values (each extent once), from the kept
    counts; mutable attr values are walked (they may change in place)."""
    return totals_with_attrs(acct)[0]


def totals_with_attrs(acct: HolderCounts) -> tuple[dict[str, int], accounting.WalkReport]:
    """Bytes per pool of everything the table holds: the tracked objects, plus the attrs' extents that no
    object holds (an attr that is a view of an object's buffer adds nothing).

    Kept totals: O(pools + what the mutable attr values hold), whatever the number of sessions or attr
    values. Objects and fixed attr values are read from the counts kept as they arrived (the ledger keeps
    the bytes of the fixed attr extents no object holds, per pool, as either count moves); only containers
    are walked (a model appends to them in place). A pool holding a `Loose` extent (memory its holder did
    not allocate, which may overlap another without being it) is the union of its object and attr extents,
    O(that pool's extents). The report is the walk's: what it could not read, and the deleted JAX arrays
    it met. No JAX array is checked for deletion otherwise (that is O(arrays held)): an array deleted
    behind the table's back (a user's own ``donate_argnums``) keeps the bytes it was counted with until
    `functional_state.stats` with ``exact=True`` walks the table.
    """
    out: accounting.Extents = []
    report = accounting.WalkReport()
    seen: dict[int, Any] = {}
    for value in acct.attrs.open_values():
        accounting.collect_extents(value, out, seen, report)
    refs, arefs, only = acct.refs, acct.attrs.refs, acct.attr_only
    totals = dict(acct.totals)
    for pool, n in only.items():
        totals[pool] = totals.get(pool, 0) + n
    opened: dict[str, set[Extent]] = {}  # per pool, what containers hold that no object or fixed value does
    unions = {*acct.overlaps.keys(), *acct.attrs.loose.keys()}
    for e in out:
        if e not in refs and e not in arefs:
            opened.setdefault(e.pool, set()).add(e)
            if type(e) is Loose:
                unions.add(e.pool)
    for pool, extents in opened.items():
        if pool not in unions:  # allocations all: equal (the set) or disjoint from everything else held
            totals[pool] = totals.get(pool, 0) + accounting.union_by_device(list(extents))[pool]
    for pool in unions:
        if not only.get(pool) and pool not in opened:
            continue  # no attr extent beyond the objects': the kept total stands
        # One may overlap an object's extent without being it: the union of both (O(the pool's extents)).
        index = acct.overlaps.get(pool)
        objects = index.extents() if index is not None else [e for e in refs if e.pool == pool]
        attr_extents = [e for e in arefs if e.pool == pool and e not in refs]
        totals[pool] = accounting.union_by_device([*objects, *attr_extents, *opened.get(pool, ())]).get(pool, 0)
    return {k: v for k, v in sorted(totals.items()) if v}, report
