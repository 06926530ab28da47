"""Private: incremental, exact byte accounting of the state objects a table holds.

Each state object's buffers are a set of extents ``(pool, start, end)``, computed once per object (objects
are immutable) and cached on it. The table keeps, persistently, how many objects across all its sessions
hold each extent, and the bytes per pool of the extents held at least once. Committing, evicting, parking,
forking and dropping adjust those counts by the extents of the objects they add and remove, so the totals
never need a walk: a buffer shared by two forks is counted once and leaves only when its last holder does.

Allocations are equal or disjoint: torch tensors count their whole storage, numpy arrays their base, JAX
arrays their shard buffers, and a bridge alias its torch owner's storage (its own bytes lie inside it); their
bytes add up. Memory a holder did not allocate (`Loose`: ``torch.from_numpy(X[:5])`` beside
``torch.from_numpy(X)``) may overlap without being equal: while a pool holds such an extent, the ledger keeps
that pool's extents sorted (``overlaps``) and its total is their union, each change priced by the bytes it
covers or uncovers (O(log n + the extents near it)); a pool without one stays on the additive path.
The counts also answer the holder questions of `memory.holders` in O(size of the object): ``leaves``
counts the array leaves the byte accounting leaves out (ring positions: a donation could delete them),
``attrs`` indexes the attr values (recorded on write), ``parked`` keeps the host copies held, for `stats`
without a walk. No JAX array is registered for a deletion check: the table's own donations never delete
what it still holds, and a check of every array would make `stats` O(arrays held) (``exact=True`` walks).

A step of one object (a ring commit: `Acct.swap` priced by `StateObject.ledger_step`) on additive pools is
deferred: the new accounting keeps the counts of the one it came from and a `Deferred` record of the extents
the step added and removed, linked to the steps deferred before it, with an upper bound on the bytes they
added (`Deferred.added_bytes`: every extent added counted at its size, nothing removed subtracted; holding an
extent twice, or letting one go, can only lower the exact figure). The budget decides a write by that bound
(`kept_totals` plus it); the exact counts are the deferred steps folded into the kept ones, in one pass that
cancels what came and went (a ring's items), computed when first read (`refs`, `totals`, `attr_only`: what
`stats`, the planner, a park, a fork, a checkpoint read) and kept on the accounting, or when the bound comes
near a budget (`exact`), or every `FOLD_EVERY` steps. Every accounting reads the same whenever read: the fold
is a function of what it holds.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable
from operator import attrgetter
from typing import Any, Final, NamedTuple

import immutables

from ..core.state_object import value_extents as value_extents  # (re-exported: the step reads it here)
from ..engine.paged_kv import POOLS
from ..memory.extents import Extent, Loose
from ..memory.holders import (
    EMPTY_ATTRS,
    AttrIndex,
    attr_only_flipped,
    attr_only_moved,
    changed_since_recorded,
    count_change,
)
from ..memory.overlaps import pool_changed, pool_index
from ..memory.parked_copies import NO_COPIES, ParkedCopies
from .buffer_record import seed_extents

_EMPTY: immutables.Map = immutables.Map()
_new = object.__new__
_ABSENT = object()
LOG_CUT = object()  # where a release log was cut short (kept to _LOG_DEPTH entries)
_LOG_DEPTH = 4096
FOLD_EVERY = 64  # deferred steps folded into the exact counts at the latest after this many
NO_POOLS: frozenset[str] = frozenset()
_POOLS_OF: dict[str, frozenset[str]] = {}  # pool -> frozenset({pool}), one per pool: compared by identity


# Each state object reports its own figures (the `StateObject.ledger_*` protocol): the ledger names no type.
def object_extents(obj: Any) -> frozenset[Extent]:
    """The extents a state object holds (committed, staged and parked), computed once and cached on it."""
    return obj.ledger_extents()


def leaf_extents(obj: Any) -> frozenset[Extent]:
    """The extents of the array leaves of ``obj`` that its byte accounting leaves out (ring positions)."""
    return obj.ledger_leaf_extents()


def _host(obj: Any) -> tuple[Any, ...]:
    return () if obj.host_copy is None else (obj.host_copy,)


def held_by(obj: Any) -> frozenset[Extent]:
    """Every extent ``obj`` holds as a holder: `object_extents` and `leaf_extents`."""
    extra = obj.ledger_leaf_extents()
    return obj.ledger_extents() | extra if extra else obj.ledger_extents()


def _moved(overlaps: Any, refs: Any, totals: Any, moves: dict[str, tuple[list[Extent], list[Extent]]]) -> Any:
    """``(overlap indexes, {pool: new union total})`` once the extents ``moves`` names (pool -> (arrived,
    left)) came to and left pools whose totals are unions; only the totals that changed. `change` and `swap`
    both apply their moves here. A pool entering the index is indexed from ``refs`` (its extents before)."""
    ov = overlaps.mutate()
    unions: dict[str, int] = {}
    for pool, (arrived, left) in moves.items():
        index = ov.get(pool) or pool_index(refs.keys(), pool)
        kept, union = pool_changed(index, totals.get(pool, 0), arrived, left)
        if union != totals.get(pool, 0):
            unions[pool] = union
        if kept is not None:
            ov[pool] = kept
        elif pool in ov:
            del ov[pool]
    return ov.finish(), unions


class ReleaseLog:
    """One change of the engine blocks an `Acct` holds, in a persistent list of them, newest first: the block
    keys whose last handle let go, and the change before (None at the start of a lineage, `LOG_CUT` where the
    list was cut short)."""

    __slots__ = ("depth", "previous", "released")
    depth: Final[int]  # changes before this one, up to the cut
    released: Final[tuple[tuple[int, int], ...]]  # (pool uid, block id) of each block no handle holds now
    previous: Final[Any]  # ReleaseLog | None | LOG_CUT

    def __init__(self, depth: int, released: tuple[tuple[int, int], ...], previous: Any) -> None:
        self.depth = depth
        self.released = released
        self.previous = previous


class Deferred(NamedTuple):
    """One deferred step of an `Acct` (see the module): the extents it added and removed, the steps deferred
    before it, and an upper bound on the bytes all of them added, on the pools they added to."""

    added: Collection[Extent]
    removed: Collection[Extent]
    previous: Deferred | None  # the step deferred before this one on the same kept counts (None: the first)
    serial: int  # this step's number, never reused (the steps of all accountings are numbered as made)
    follows: int  # the ``serial`` of the step this one came after, folded or not (-1: none)
    depth: int  # steps deferred, this one included
    added_bytes: int  # the bytes of every extent they added, each time added: >= what they added
    pools: frozenset[str]  # the pools they added to (the bound applies to each of them)


_new_deferred = tuple.__new__  # (a step per commit: built without the NamedTuple's Python-level ``__new__``)
# Numbers, not references, link a step to the one it came after: a reference would keep every step of a
# lineage alive. (`next` on a count is atomic under the GIL.)
_serials = itertools.count()


class _Rest:
    """The fields of an `Acct` a step leaves alone, held together so that a step copies one reference."""

    __slots__ = ("attr_only", "attrs", "held", "kv", "leaves", "log", "overlaps", "parked", "root")

    def __init__(
        self,
        kv: Any,
        held: Any,
        log: Any,
        root: Any,
        leaves: Any,
        attrs: Any,
        parked: Any,
        overlaps: Any,
        attr_only: Any,
    ):
        # Engine KV blocks: (pool uid, block id) -> number of handles holding it; `held`: pool uid -> distinct
        # blocks held. `log`: the `ReleaseLog` of the changes of the held blocks; `root` identifies the
        # lineage (accountings derived from one build), within which logs can be compared.
        self.kv = kv
        self.held = held
        self.log = log
        self.root = root
        self.leaves = leaves  # extent -> objects holding it as a leaf the accounting leaves out (0 bytes)
        self.attrs = attrs  # the attr values' holder index
        self.parked = parked  # the host copies held, with their bytes: what `parked_nbytes` reads
        self.overlaps = overlaps  # pool -> `PoolIndex`, for each pool holding a `Loose` extent
        # pool -> bytes of the extents fixed attr values hold and no object does, summed (`attrs.refs` keys
        # absent from the object counts): moved whenever either count of such an extent starts or stops, so
        # that `stats` adds the attrs in O(pools), not O(attr values). A sum: exact where extents are
        # allocations (equal or disjoint); a pool holding a `Loose` extent is read as a union instead.
        self.attr_only = attr_only


def _with_attr_only(r: _Rest, attr_only: Any) -> _Rest:
    return _Rest(r.kv, r.held, r.log, r.root, r.leaves, r.attrs, r.parked, r.overlaps, attr_only)


def _stepped(refs: immutables.Map, totals: immutables.Map, rest: _Rest, deferred: Deferred | None = None) -> Acct:
    """An accounting of the counts given (exact once ``deferred`` is folded into them), built by its slots (a
    step leaves the other fields alone, and `Acct.__init__` would rebuild them)."""
    acct = _new(Acct)
    acct._refs, acct.kept_totals, acct._rest, acct.deferred, acct._folded = refs, totals, rest, deferred, None
    return acct


class Acct:
    """Holder counts per extent and bytes per pool; immutable (every change returns a new one)."""

    __slots__ = ("_folded", "_refs", "_rest", "deferred", "kept_totals")

    def __init__(
        self,
        refs: immutables.Map,
        totals: immutables.Map,
        kv: immutables.Map = _EMPTY,
        held: immutables.Map = _EMPTY,
        log: Any = None,
        root: Any = None,
        leaves: immutables.Map = _EMPTY,
        attrs: AttrIndex = EMPTY_ATTRS,
        parked: ParkedCopies = NO_COPIES,
        overlaps: immutables.Map = _EMPTY,
        attr_only: immutables.Map = _EMPTY,
    ):
        self._refs = refs  # extent -> number of objects holding it, over all sessions (once folded)
        # The totals of the kept counts: pool -> bytes of the union of the extents held at least once. Exact
        # where `deferred` is None (or a step of ``depth`` 0); else exact once its steps are folded (`totals`),
        # and below them plus `Deferred.added_bytes` on each of its pools: an upper bound of the exact ones.
        self.kept_totals: immutables.Map = totals
        root = root if root is not None else object()
        self._rest = _Rest(kv, held, log, root, leaves, attrs, parked, overlaps, attr_only)
        self.deferred: Deferred | None = None  # the newest step not folded into the counts (see the module)
        self._folded: Acct | None = None  # this accounting with its deferred steps folded, once computed

    # (read through `rest`: a step, the hot path, builds an Acct of five slots, not eleven fields; a deferred
    # step changes none of these)
    kv = property(attrgetter("_rest.kv"))
    held = property(attrgetter("_rest.held"))
    log = property(attrgetter("_rest.log"))
    root = property(attrgetter("_rest.root"))
    leaves = property(attrgetter("_rest.leaves"))
    attrs = property(attrgetter("_rest.attrs"))
    parked = property(attrgetter("_rest.parked"))
    overlaps = property(attrgetter("_rest.overlaps"))

    # (exact: the deferred steps folded; untyped like the fields above, which `memory.holders.HolderCounts`
    # names as plain attributes)
    refs = property(lambda acct: acct.exact()._refs)  # extent -> number of objects holding it, over all sessions
    totals = property(lambda acct: acct.exact().kept_totals)  # pool -> bytes of the union of the extents held
    rest = property(lambda acct: acct.exact()._rest)
    attr_only = property(lambda acct: acct.exact()._rest.attr_only)

    def exact(self) -> Acct:
        """This accounting with its deferred steps folded into the counts (itself when none is), computed once.

        Example:
          >>> acct = Acct.build([])
          >>> acct.exact() is acct
          True
        """
        step = self.deferred
        if step is None or not step.depth:
            return self
        folded = self._folded
        if folded is None:
            folded = self._folded = self._fold()
        return folded

    def _fold(self) -> Acct:
        """The deferred steps applied to the kept counts: each extent moved once by its net count (what came
        and went within them moves nothing), a pool total where an extent starts or stops being held."""
        net: dict[Extent, int] = {}
        step = self.deferred
        while step is not None:
            for e in step.added:
                net[e] = net.get(e, 0) + 1
            for e in step.removed:
                net[e] = net.get(e, 0) - 1
            step = step.previous
        rest = self._rest
        arefs = rest.attrs.refs
        refs = self._refs
        changed = refs.mutate()
        came: dict[str, int] = {}
        flips: list[tuple[Extent, int]] = []
        for e, d in net.items():
            if not d:
                continue
            n = changed.get(e, 0)
            m = n + d
            if m:
                changed[e] = m
            else:
                del changed[e]
            if n and m:
                continue
            size = e.end - e.start if m else e.start - e.end  # (bytes that came, or left)
            came[e.pool] = came.get(e.pool, 0) + size
            if arefs and e in arefs:
                flips.append((e, -1 if m else 1))
        totals = self.kept_totals
        for pool, d in came.items():
            if d:  # (an item of the size of the one it replaced moves no total: the map stays the same)
                totals = totals.set(pool, totals.get(pool, 0) + d)
        if flips:
            rest = _with_attr_only(rest, attr_only_flipped(rest.attr_only, flips))
        return _stepped(changed.finish() if net else refs, totals, rest)

    def _deferred_step(self, add: Collection[Extent], remove: Collection[Extent]) -> Acct | None:
        """The accounting after a step of one object that added ``add`` and removed ``remove`` (each extent
        once), deferred; None where it cannot be (a `Loose` extent: its pool's total is a union)."""
        last = self.deferred
        base = self if self._folded is None else self._folded  # (folded near a budget: start from it)
        step = base.deferred
        count, nbytes, pools = (step.depth, step.added_bytes, step.pools) if step is not None else (0, 0, NO_POOLS)
        for e in add:
            if type(e) is Loose:
                return None
            pool, start, end = e
            nbytes += end - start
            if pool not in pools:
                pools = pools | {pool} if pools else _POOLS_OF.setdefault(pool, frozenset((pool,)))
        count += 1
        follows = -1 if last is None else last.serial
        fields = (add, remove, step if count > 1 else None, next(_serials), follows, count, nbytes, pools)
        acct = _stepped(base._refs, base.kept_totals, base._rest, _new_deferred(Deferred, fields))
        if count < FOLD_EVERY:
            return acct
        # Folded; the lineage goes on from the folded counts (a shell's memo follows it across the fold): the
        # step stands as one with nothing deferred, on the pools it was on.
        exact, folded = acct.exact(), ((), (), None, next(_serials), follows, 0, 0, pools)
        return _stepped(exact._refs, exact.kept_totals, exact._rest, _new_deferred(Deferred, folded))

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
            add=[o.ledger_extents() for o in add],
            remove=[o.ledger_extents() for o in remove],
            kv_add=[o.ledger_blocks() for o in add],
            kv_remove=[o.ledger_blocks() for o in remove],
            leaves_add=[o.ledger_leaf_extents() for o in add],
            leaves_remove=[o.ledger_leaf_extents() for o in remove],
            attrs_add=attrs_add,
            attrs_remove=attrs_remove,
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
        parked_add: Iterable[tuple[Any, ...]] = (),
        parked_remove: Iterable[tuple[Any, ...]] = (),
    ) -> Acct:
        """The counts after the objects with extents ``remove`` left and those with ``add`` arrived (and the
        handles holding KV blocks ``kv_remove`` / ``kv_add``, the objects' unaccounted leaves, the attr
        values)."""
        refs = self.refs.mutate()
        totals = self.totals.mutate()
        add, remove = list(add), list(remove)
        # Pools whose totals are a union (see the module): those holding a loose extent, or receiving one.
        slow = {e.pool for extents in add for e in extents if type(e) is Loose}.union(self.overlaps.keys())
        moves: dict[str, tuple[list[Extent], list[Extent]]] = {}  # slow pool -> (extents arrived, left)
        for extents in remove:
            for e in extents:
                n = refs[e] - 1
                if n:
                    refs[e] = n
                else:
                    del refs[e]
                    if slow and e.pool in slow:
                        moves.setdefault(e.pool, ([], []))[1].append(e)
                    else:
                        totals[e.pool] = totals[e.pool] - (e.end - e.start)
        for extents in add:
            for e in extents:
                n = refs.get(e, 0)
                refs[e] = n + 1
                if not n:
                    if slow and e.pool in slow:
                        moves.setdefault(e.pool, ([], []))[0].append(e)
                    else:
                        totals[e.pool] = totals.get(e.pool, 0) + (e.end - e.start)
        overlaps = self.overlaps
        if moves:
            overlaps, unions = _moved(overlaps, self.refs, totals, moves)
            for pool, union in unions.items():
                totals[pool] = union
        leaves = count_change(self.leaves, leaves_add, leaves_remove)
        parked = self.parked.change(parked_add, parked_remove)
        attrs_add, attrs_remove = list(attrs_add), list(attrs_remove)
        attrs = self.attrs.change(attrs_add, attrs_remove) if attrs_add or attrs_remove else self.attrs
        kept = refs.finish()
        attr_only = self.rest.attr_only
        if self.attrs.refs or attrs.refs:
            old_memo, new_memo = self.attrs.memo, attrs.memo
            candidates = {e for extents in (*add, *remove) for e in extents}
            for values, memo in ((attrs_remove, old_memo), (attrs_add, new_memo)):
                for value in values:
                    entry = memo.get(id(value))
                    if entry is not None and entry.extents:
                        candidates.update(entry.extents)
            attr_only = attr_only_moved(attr_only, self.refs, kept, self.attrs.refs, attrs.refs, candidates)
        kv, held, log = self.kv, self.held, self.log
        kv_add, kv_remove = [k for k in kv_add if k], [k for k in kv_remove if k]
        if kv_add or kv_remove:
            counts = kv.mutate()
            moved: dict[int, int] = {}  # pool uid -> change in distinct blocks held
            for keys in kv_add:
                for k in keys:
                    n = counts.get(k, 0)
                    counts[k] = n + 1
                    if not n:
                        uid, _ = k  # (a block key: pool uid, block id)
                        moved[uid] = moved.get(uid, 0) + 1
            released = []
            for keys in kv_remove:
                for k in keys:
                    n = counts[k] - 1
                    if n:
                        counts[k] = n
                    else:
                        del counts[k]
                        released.append(k)
                        uid, _ = k
                        moved[uid] = moved.get(uid, 0) - 1
            per_pool = held.mutate()
            for uid, d in moved.items():
                n = per_pool.get(uid, 0) + d
                if n:
                    per_pool[uid] = n
                else:
                    per_pool.pop(uid, None)
            kv, held = counts.finish(), per_pool.finish()
            # Every change of the held blocks is a node, even one that releases nothing: reaching
            # ``before``'s node from ``after``'s then proves ``after`` descends from ``before`` (a table
            # compared with its ancestor, or with a sibling, shares its node only if there is one per change).
            depth = 0 if log is None or log is LOG_CUT else log.depth + 1
            log = (
                ReleaseLog(depth, tuple(released), log)
                if depth < _LOG_DEPTH
                else ReleaseLog(0, tuple(released), LOG_CUT)
            )
        return Acct(kept, totals.finish(), kv, held, log, self.root, leaves, attrs, parked, overlaps, attr_only)

    def swap(self, old: Any, new: Any) -> Acct:
        """One object replaced by another (a commit, an eviction, a park): only the extents that differ move.

        The object's type may price the change itself (`StateObject.ledger_step`: a ring commit, by the items
        it moves); without engine blocks that delta is deferred (see the module: the hot path of every step),
        or, on a pool whose total is a union, applied to the persistent counts directly.
        """
        if old is new:
            return self
        delta = old.ledger_step(new)
        if delta is None:
            return self._difference(old, new)
        add, remove, blocks = delta.added, delta.removed, delta.blocks
        if blocks is not None:
            return self.change(add=[add], remove=[remove], kv_add=[blocks.added], kv_remove=[blocks.removed])
        if not add and not remove:
            return self
        if not self._rest.overlaps and (deferred := self._deferred_step(add, remove)) is not None:
            return deferred
        exact = self.exact()
        return exact._shifted(add, remove) or exact.change(add=[add], remove=[remove])

    def _shifted(
        self, add: Iterable[Extent], remove: Iterable[Extent], parked: ParkedCopies | None = None
    ) -> Acct | None:
        """The counts after an object holding ``remove`` was replaced by one holding ``add`` (each extent once),
        applied to the persistent maps directly, and the host copies held then ``parked`` (None: unchanged); None
        where a pool starts holding a `Loose` extent (`change` indexes it)."""
        rest = self.rest
        ov = rest.overlaps  # pools whose totals are unions (see the module): their moves priced apart
        refs = self.refs
        arefs = rest.attrs.refs  # (an extent an attr holds too moves the attr-only sum when its last object goes)
        flips: list[tuple[Extent, int]] | None = None
        came: dict[str, int] = {}  # bytes that came (or left: negative), per additive pool
        moves: dict[str, tuple[list[Extent], list[Extent]]] | None = None
        for e in remove:
            n = refs[e] - 1
            if n:
                refs = refs.set(e, n)
                continue
            refs = refs.delete(e)
            if arefs and e in arefs:
                flips = flips or []
                flips.append((e, 1))
            if ov and e.pool in ov:
                moves = moves or {}
                moves.setdefault(e.pool, ([], []))[1].append(e)
            else:
                came[e.pool] = came.get(e.pool, 0) - (e.end - e.start)
        for e in add:
            indexed = ov and e.pool in ov
            if type(e) is Loose and not indexed:  # a pool starts being indexed (the maps are persistent)
                return None
            n = refs.get(e, 0)
            refs = refs.set(e, n + 1)
            if n:
                continue
            if arefs and e in arefs:
                flips = flips or []
                flips.append((e, -1))
            if indexed:
                moves = moves or {}
                moves.setdefault(e.pool, ([], []))[0].append(e)
            else:
                came[e.pool] = came.get(e.pool, 0) + (e.end - e.start)
        totals = self.totals
        for p, d in came.items():
            if d:  # (an item of the size of the one it replaces moves no total)
                totals = totals.set(p, totals.get(p, 0) + d)
        if moves:
            indexes, unions = _moved(ov, self.refs, totals, moves)
            for p, union in unions.items():  # (only those that changed: the budget's memo recognises the same map)
                totals = totals.set(p, union)
            r = rest
            rest = _Rest(r.kv, r.held, r.log, r.root, r.leaves, r.attrs, r.parked, indexes, r.attr_only)
        if flips:
            rest = _with_attr_only(rest, attr_only_flipped(rest.attr_only, flips))
        if parked is not None:
            r = rest
            rest = _Rest(r.kv, r.held, r.log, r.root, r.leaves, r.attrs, parked, r.overlaps, r.attr_only)
        return _stepped(refs, totals, rest)

    def _difference(self, old: Any, new: Any) -> Acct:
        """`swap` by the difference of the two objects' figures."""
        seed_extents(new)  # (a commit's or a restore's new object: its figures read from its leaves, not walked)
        a, b = old.ledger_extents(), new.ledger_extents()
        la, lb = old.ledger_leaf_extents(), new.ledger_leaf_extents()
        ka, kb = old.ledger_blocks(), new.ledger_blocks()
        if a == b and la == lb and ka == kb and old.host_copy is new.host_copy:
            return self
        if not ka and not kb and la == lb:  # (a park, a restore, a commit of new tensors: the extents move)
            host_old, host_new = old.host_copy, new.host_copy
            parked = None if host_old is host_new else self.parked.change([_host(new)], [_host(old)])
            shifted = self._shifted(b - a, a - b, parked)
            if shifted is not None:
                return shifted
        sa, sb = (set(ka), set(kb)) if ka or kb else (set(), set())
        return self.change(
            add=[b - a],
            remove=[a - b],
            kv_add=[sb - sa],
            kv_remove=[sa - sb],
            leaves_add=[lb - la],
            leaves_remove=[la - lb],
            parked_add=[_host(new)],
            parked_remove=[_host(old)],
        )

    def swap_session(self, old: Any, new: Any) -> Acct:
        """A session replaced by another: the objects and attr values that changed identity move."""
        same_objects, same_attrs = old._objects is new._objects, old._attrs is new._attrs
        if same_objects and same_attrs:
            return self
        if same_attrs and len(new._objects) == len(old._objects):
            # Objects replaced under the same names (a step, a commit): each pair priced by `swap`, which moves
            # only the extents that differ (none, for a step that wrote its object's buffers in place).
            pairs: list[tuple[Any, Any]] = []
            renamed = False
            for name, obj in new._objects.items():
                prev = old._objects.get(name)
                if prev is None:  # (a name added, so another removed: priced below)
                    renamed = True
                    break
                if prev is not obj:
                    pairs.append((prev, obj))
            if not renamed:
                acct = self
                for prev, obj in pairs:
                    acct = acct.swap(prev, obj)
                return acct
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
                elif (e := self.attrs.memo.get(id(value))) is not None and e.stamp and changed_since_recorded(e):
                    attrs_added.append(value)  # (set again after a resize in place: recorded anew)
                    attrs_removed.append(value)
            attrs_removed.extend(value for key, value in old._attrs.items() if key not in new._attrs)
        return self.change_objects(added, removed, attrs_added, attrs_removed)

    def kv_held(self) -> dict[int, int]:
        """``{pool uid: distinct blocks handles hold}``, for the pools still alive."""
        held = self.held
        return {uid: held[uid] for uid in list(POOLS.keys()) if uid in held}
