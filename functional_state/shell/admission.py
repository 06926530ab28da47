"""Admission: what a write must become to be installed, decided by a pure function.

`admit(before, after, ...)` takes the table before and after a write and returns a `Decision`: the table to
install (``after`` brought within the byte budget, or `BudgetExceededError`), the sessions that leave it
(their handles are detached), the engine blocks that go back (freed after the install, outside the lock),
and the bound on attr bytes the next fast check starts from. It reads nothing but its arguments, so the
shell computes it outside its lock and installs it only if the table did not change meanwhile. A budgeted
commit is first put to the shell's `Recheck` (what the last passing commit of its session left to re-read).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterable, Mapping
from typing import Any, NamedTuple

from .. import table as ms
from ..core.session import SessionState
from ..engine.paged_kv import POOLS, PagedKVPool
from ..errors import InvalidArgumentError
from ..memory import accounting
from ..memory.accounting import union_by_device
from ..memory.holders import AttrEntry, StorageStamp, changed_since_recorded, holder_extents, storage_moved
from ..memory.values import NO_BUFFER_TYPES
from ..policy.enforce import attr_bytes, attr_surplus, enforce_budget, headroom, over_budget_objects
from ..policy.planner import LEVERS
from ..policy.pricing import by_pool
from ..table.engine_blocks import released_blocks
from ..table.ledger import NO_POOLS
from ..table.lru import recorded_anew
from ..table.manager_state import ManagerState, in_place, ledger_of
from ..table.session_edits import update_session
from .cells import Departure, departures

__all__ = [
    "LIVE_POOLS",
    "Decision",
    "LastPass",
    "Recheck",
    "admit",
    "checked_levers",
    "rebase",
    "trivial",
    "within_budget_fast",
    "within_budget_in_place",
]

# Every live engine pool (weakly): while one lives, a write may release blocks, which only the retry loop frees.
# Its truthiness is read on every write: the weak dictionary's own dict, not its ``__len__`` (a Python call).
LIVE_POOLS: dict[int, Any] = POOLS.data  # type: ignore[attr-defined]

Surplus = dict[str, int]  # attr bytes per pool, aliases of objects included: a bound whatever the objects do next


class Decision(NamedTuple):
    """What the shell must do to install a write (see `admit`)."""

    final: ManagerState  # the table to install
    surplus: Surplus | None  # the attr bound after this write (None: the next write checks in full)
    left: list[Departure]  # incarnations that leave the table: their handles keep their own copy
    released: dict[PagedKVPool, tuple[int, ...]]  # engine blocks no state holds any more: free them, once
    # Sessions the budget drops whose value was not handed to the spill lever yet: while any is named, the
    # decision is not installable (offer them, then decide again: `spill`).
    spill: tuple[str, ...] = ()


def within_budget_fast(
    before: ManagerState,
    after: ManagerState,
    writer: str | None,
    attrs_unchanged: bool,
    surplus: Surplus | None,
    reread: list[AttrEntry] | None = None,
    last: LastPass | None = None,
) -> Surplus | None:
    """The attr bound after the write if the write stays within the budget by the kept object totals plus
    the bound, else None (a full check is needed). ``reread``: a list the attr index's entries of the
    writer's values it re-reads are appended to (what `Recheck.passed` keeps). ``last``: the shell's
    memo of the last object check that passed (`LastPass`), asked before the check and told after it.

    The bound counts every attr value as it was when it was set and at the last full check (a bound may
    exceed: a value removed or replaced stays counted). A write that sets attr values adds their bytes to
    it; the arrays it kept are in it already. A value that may change without a write (`values.mutable`: a
    list a model appends to, a torch tensor it resizes in place) may hold more now than it was counted
    with: the writer's own mutable values are compared, on every write (a commit included), with what the
    attr index recorded on their arrival (a bare tensor: one storage read), and one that changed adds its
    bytes now to the bound returned, not to this check alone: a later write of another session decides by
    that bound without reading the value, so the bound must go on covering it (one that forgot it admitted
    such a write over the budget). It is added again at each write of its session: an upper bound that
    grows until the full check it leads to re-reads every attr. A bare tensor that changed sends the write
    to `admit`, which records it anew first (kept figures then count it; see `functional_state.memory.values`);
    a value the write set, or recorded anew, counts as set by it. A plain number or string is not read.
    Another session's value changed in place is seen at that session's next write (a container also at the
    next full check and by `stats()`): reading every mutable value of the table on every write would make a
    write O(table)."""
    if surplus is None:
        return None
    bound = surplus
    acct = ledger_of(after)
    session = ms.lookup(after, writer, None) if writer is not None else None
    if session is not None and (attrs := session.attrs):
        memo = acct.attrs.memo
        new: dict[str, Any] = _NOTHING_SET
        if not attrs_unchanged:  # (a commit sets none: its check is the loop below alone)
            old = ms.lookup(before, writer).attrs if writer in before else None
            was = ledger_of(before).attrs.memo if old is not None else memo
            new = {
                k: v  # set (or recorded anew) by this write: counted from now on
                for k, v in attrs.items()
                if type(v) not in NO_BUFFER_TYPES
                and (
                    old is None
                    or old.get(k, _ABSENT) is not v
                    or (was is not memo and was.get(id(v)) is not memo.get(id(v)))
                )
            }
        changing: list[Any] | None = None  # (what the changed containers hold now: each walked once)
        for k, v in attrs.items():
            if type(v) in NO_BUFFER_TYPES or (new and k in new):
                continue
            if (entry := memo.get(id(v))) is not None and entry.value is v:
                if reread is not None:
                    reread.append(entry)
                if entry.stamp is not None:
                    if changed_since_recorded(entry):  # (a bare tensor: `admit` records it anew, then decides)
                        return None
                elif entry.extents is None and (held := holder_extents(v)) != entry.recorded:
                    changing = changing or []
                    changing.extend(held)
        if new and (extra := attr_bytes(new)):
            bound = _plus(bound, extra)
        if changing:
            bound = _plus(bound, {str(pool): n for pool, n in by_pool(changing).items()})
    if last is None:
        return None if over_budget_objects(after, bound) else bound
    return bound if last.within(after, bound) else None


class Recheck:
    """What a budgeted commit must re-read when it follows `within_budget_fast`'s pass of a commit of the same
    session, one ledger step later: only the writer's attr tensors, each by one storage read.

    Such a commit changes no attr, no attr index, no budget and no attr bound, and its ledger step is deferred
    on the counts the last one was (`Acct.deferred`; its bytes bounded by `Deferred.added_bytes`):
    `within_budget_fast` would decide it by the same walk of the writer's attrs and the same `LastPass` memo.
    That it follows the last pass is read from the ledger: the commit's deferred step comes right after the
    one kept (``steps``; across a fold too, `Deferred.follows`), so the table it was made on holds the very
    accounting the last pass installed, and any write in between that moved a byte, an attr or the session
    (each makes another accounting) is a miss; the kept totals and pools are those the room was priced on. Kept by the shell, one per manager, read and written under its lock. It keeps the
    deferred step (extents and counts) and weak references to the tensors, made once per pass, not per
    commit: nothing it keeps holds a table or a buffer alive, and a tensor that died is a miss. A session
    holding a container (walked by every check) or a value whose stamp cannot be referenced weakly is not
    kept; nor while an engine pool's storage is registered (its stamps are not read then). Kept from the
    second pass of a session in a row: at the first, the shell only notes the writer and clears ``table``
    (two stores: a round robin of sessions pays no call).
    """

    __slots__ = ("bound", "budget", "pools", "room", "stamps", "steps", "totals", "writer")

    def __init__(self) -> None:
        self.steps = -1  # the number of the ledger step of the table the last pass installed (`Deferred.serial`)
        self.writer: str | None = None  # the session of the last pass
        self.budget: Any = None  # that table's budget
        self.totals: Any = None  # its ledger's kept totals (`Acct.kept_totals`)
        self.pools: Any = None  # and the pools its deferred steps added to
        self.room = -1  # the bytes the deferred steps may add to them, from those totals, within that budget
        self.bound: Surplus | None = None  # the attr bound it returned
        self.stamps: tuple[tuple[Any, StorageStamp], ...] = ()  # (tensor, weakly; its recorded stamp)

    @property
    def table(self) -> None:
        """Always None: what the last pass installed is known by its ledger step (``steps``), not kept."""
        return None

    @table.setter
    def table(self, value: None) -> None:
        """Forget the last pass (the shell's reset, when a pass keeps nothing to re-read)."""
        self.steps = -1

    def within(self, base: ManagerState, after: ManagerState, writer: str, surplus: Surplus | None) -> bool:
        """Whether the commit ``base`` -> ``after`` of session ``writer`` stays within the budget with the attr
        bound ``surplus``, answered from the last pass (True: it does, and the next commit may be answered
        from this one; False: ask `within_budget_fast`, then `passed`)."""
        kept = self.steps
        acct = ledger_of(after)
        step = acct.deferred
        if (
            kept < 0
            or step is None
            or step.follows != kept
            or acct.kept_totals is not self.totals
            or step.pools is not self.pools
            or step.added_bytes > self.room
            or self.writer != writer
            or self.bound is not surplus
            or after.byte_budget is not self.budget
            or accounting.POOL_STORAGES
        ):
            return False
        for ref, stamp in self.stamps:
            tensor = ref()
            if tensor is None or storage_moved(tensor, stamp):  # (resized in place: the full check decides)
                return False
        self.steps = step.serial
        return True

    def passed(self, after: ManagerState, writer: str, bound: Surplus, reread: list[AttrEntry]) -> None:
        """Keep what a commit of ``writer`` on ``after`` re-reads, after `within_budget_fast` passed the commit
        that installs ``after`` with the attr bound ``bound``, re-reading the entries ``reread``."""
        self.steps, self.writer = -1, writer
        acct = ledger_of(after)
        step, budget = acct.deferred, after.byte_budget
        if accounting.POOL_STORAGES or step is None or not budget:  # (no step to follow: the next pass keeps one)
            return
        stamps = []
        for entry in reread:
            if entry.stamp is None:
                if entry.extents is None:
                    return  # a container: walked at every check, by `within_budget_fast`
                continue  # a fixed value: nothing to re-read
            try:
                stamps.append((weakref.ref(entry.stamped), entry.stamp))
            except TypeError:  # (a tensor type without weak references)
                return
        self.stamps, self.bound, self.budget = tuple(stamps), bound, budget
        self.totals, self.pools = acct.kept_totals, step.pools
        self.room = headroom(self.totals, budget, bound, self.pools)
        self.steps = step.serial


def _full_bound(state: ManagerState) -> Surplus:
    """The attr bound a full check leaves: what the attrs hold now (`attr_surplus`), plus what their mutable
    values held when recorded (what the fast check compares them with, so one back at its recorded size is
    covered whatever it held at this check)."""
    bound = attr_surplus(state)
    recorded = ledger_of(state).attrs.recorded_extents()
    return _plus(bound, union_by_device(list(recorded))) if recorded else bound


def _grown_names(state: ManagerState, writer: str | None) -> list[str]:
    """The attrs of session ``writer`` that are torch tensors resized or re-stored in place since they were
    set (the attr index's stamp differs): O(that session's attrs)."""
    session = ms.lookup(state, writer, None) if writer is not None else None
    if session is None or not session.attrs:
        return []
    memo = ledger_of(state).attrs.memo
    return [
        k
        for k, v in session.attrs.items()
        if (e := memo.get(id(v))) is not None and e.stamp is not None and e.value is v and changed_since_recorded(e)
    ]


def _plus(bound: Surplus, extra: Surplus) -> Surplus:
    return {p: bound.get(p, 0) + extra.get(p, 0) for p in bound.keys() | extra.keys()}


_ABSENT = object()  # (an attr the session did not carry before the write)
_NOTHING_SET: dict[str, Any] = {}  # (the attrs a commit sets: never written to)


class LastPass:
    """The last (kept object totals, attr bound, budget, pools the deferred ledger steps added to) that
    `over_budget_objects` found within budget, and the room it left on those pools; kept by the shell, one
    per manager.

    Its answer is a function of the four alone, each immutable, and the bytes the deferred steps added
    (`Deferred.added_bytes`, an upper bound): a ledger step is deferred on the very totals map it came with, so
    a run of ring commits is decided by four identity tests and one comparison, until the steps are folded
    (a fold that moves no total keeps the map too). Held strongly, so no id can be reused meanwhile; replaced
    whole, so a reader in another thread never sees a torn entry (it is read and written with or without the
    shell's lock).
    """

    __slots__ = ("key",)

    def __init__(self) -> None:
        self.key: tuple[Any, Any, Any, Any, int] = (None, None, None, None, -1)

    def within(self, after: ManagerState, bound: Surplus) -> bool:
        """Whether ``after``'s object totals plus ``bound`` stay within its budget (`over_budget_objects`)."""
        acct, budget = ledger_of(after), after.byte_budget
        step = acct.deferred
        totals, pools, added = (
            (acct.kept_totals, step.pools, step.added_bytes) if step is not None else (acct.totals, NO_POOLS, 0)
        )
        key = self.key
        if key[0] is totals and key[1] is bound and key[2] is budget and key[3] is pools and added <= key[4]:
            return True
        if over_budget_objects(after, bound):
            return False
        self.key = (totals, bound, budget, pools, headroom(totals, budget, bound, pools) if budget else -1)
        return True


def within_budget_in_place(
    before: ManagerState,
    after: ManagerState,
    writer: str,
    surplus: Surplus | None,
    attrs_unchanged: bool,
    last: LastPass | None = None,
) -> Surplus | None:
    """For a write under a budget: the attr bound after it if it changed sessions in place (none added or
    removed) and stays within the budget by the kept totals (`within_budget_fast`, O(pools), as `admit` would
    decide with nothing to release); else None (take `admit`)."""
    if not in_place(before, after, False):
        return None
    return within_budget_fast(before, after, writer, attrs_unchanged, surplus, last=last)


def trivial(before: ManagerState, after: ManagerState, budget: bool = True) -> bool:
    """Whether admission has nothing to do for ``before`` -> ``after``: no session leaves, no budget to
    check, no engine pool whose blocks could be released (the common write: one session changed)."""
    return not LIVE_POOLS and in_place(before, after, budget)


def admit(
    before: ManagerState,
    after: ManagerState,
    writer: str | None,
    *,
    pinned: Collection[str] = (),
    levers: tuple[str, ...],
    surplus: Surplus | None,
    attrs_unchanged: bool = False,
    budget: bool = True,
    dropped: Mapping[str, str] | None = None,
    last: LastPass | None = None,
    spilled: Mapping[str, SessionState | None] | None = None,
    evicted: Iterable[tuple[str, int, SessionState]] | None = None,
) -> Decision:
    """Decide how the write ``before`` -> ``after`` is installed.

    The common case is a write within budget: decided from the kept object totals plus ``surplus`` (an
    upper bound on the attr bytes beyond them), with no walk of the table. When that sum crosses a budget,
    a full check re-reads every attr and, for a pool over its budget, releases what `plan_release` chooses
    (never ``writer`` or a ``pinned`` session), making the bound exact again. An attr a model grows in place
    is seen at the next write of its session (`within_budget_fast` reads the writer's mutable values again);
    a container also at the next full check and by `stats()`. An attr tensor of ``writer`` resized in place
    since it was set is recorded anew first, so the table installed counts it at its size now.

    Args:
      before, after: the table before and after the write (``after`` derived from ``before``, or a table
        that replaces it).
      writer: the session written, never released to make room.
      pinned: sessions the budget must not touch (requests in flight).
      levers: the release levers the budget may use.
      surplus: the attr bound kept since the last full check (None: check in full).
      attrs_unchanged: the write changed no attrs (a commit).
      budget: False for a write that adds no bytes (a miss inserts an empty session).
      dropped: ids the op removes at a caller's request, with why (see `departures`).
      last: the shell's memo of the last object check that passed (`LastPass`), if it keeps one.
      spilled: with a spill lever (None: none), what was handed to it for this write: ``{id: the session
        value handed over}``, or None for a session whose spill failed. A session the budget drops leaves
        as spilled (not an eviction; its handles refuse writes) if this very value (``after``'s) was
        handed over; kept if its spill failed (dropped as an eviction only as `enforce_budget`'s last resort); otherwise it is named in `Decision.spill`.
      evicted: for an insertion, the sessions the table reported evicting (`lru.get_or_insert`; see
        `departures`).

    Raises:
      BudgetExceededError: the write cannot fit even so.
    """
    if not dropped and trivial(before, after, budget):
        return Decision(after, surplus, [], {})  # the common write: one session changed, no budget, no KV pools
    final, bound = after, surplus
    if budget and after is not before and after.byte_budget is not None:
        grown = _grown_names(after, writer)
        for name in grown:  # (an attr tensor resized in place since it was set: recorded anew, then counted)
            after = recorded_anew(after, ms.lookup(after, writer).attrs[name])
        attrs_unchanged, final = attrs_unchanged and not grown, after
        # A write with no writer that adds sessions (`load`: a table replaced, into an empty manager too) brings
        # attrs the bound never counted (the fast check adds only the writer's): it is checked in full, and the
        # bound is then the installed table's (issue 24, review9).
        gone = sum(sid in before for sid in dropped) if dropped else 0
        replaced = writer is None and len(after) + gone > len(before)
        bound = None if replaced else within_budget_fast(before, after, writer, attrs_unchanged, surplus, last=last)
        if bound is None:
            protect = {sid for sid in pinned if sid in after}
            if writer is not None and writer in after:
                protect.add(writer)
            lever = None if spilled is None else _SpillLever(after, spilled)
            final = enforce_budget(after, protect, levers=levers, spill=lever)
            bound = _full_bound(final)
            if lever is not None and lever.wanted:
                return Decision(final, bound, [], {}, tuple(lever.wanted))
    if final is before:
        return Decision(final, bound, [], {})
    left = departures(before, after, final, dropped or {}, evicted)
    if spilled:
        left = [d._replace(reason=SPILLED, closed=True) if spilled.get(d.sid) is d.session else d for d in left]
    # (A state a donating step consumed held no fewer blocks than its successor: a step changes one object's
    # arrays, never which handles the table holds.)
    released = released_blocks(before, final) if LIVE_POOLS and type(before) is ManagerState else {}
    return Decision(final, bound, left, released)


SPILLED = "spilled (handed to the manager's `spill` callback under budget pressure; it lives on where it went)"


class _SpillLever:
    """The spill lever `admit` hands `enforce_budget`: pure, it only says what was handed over already.

    A session whose value in ``after`` is the very one handed over leaves as spilled; one whose spill failed
    is refused (`enforce_budget` keeps it, dropping it as an eviction only as a last resort); any other is noted in ``wanted`` (and counted as spilled here: a decision that
    names one is never installed)."""

    __slots__ = ("after", "spilled", "wanted")

    def __init__(self, after: ManagerState, spilled: Mapping[str, SessionState | None]):
        self.after, self.spilled, self.wanted = after, spilled, list[str]()

    def __call__(self, state: ManagerState, sid: str) -> bool:
        if sid in self.spilled:
            handed = self.spilled[sid]
            if handed is None:
                return False  # its spill failed: `enforce_budget` keeps it unless the budget needs it dropped
            if handed is ms.lookup(self.after, sid, None):
                return True
        self.wanted.append(sid)
        return True


def checked_levers(levers: Iterable[str]) -> tuple[str, ...]:
    """``levers`` as a tuple, each one of `LEVERS`, or an `InvalidArgumentError` naming those that are not."""
    out = tuple(levers)
    bad = [lever for lever in out if lever not in LEVERS]
    if bad:
        raise InvalidArgumentError(f"`SessionStateManager`: unknown release lever(s) {bad}; choose from {LEVERS}.")
    return out


def rebase(base: ManagerState, after: ManagerState, current: ManagerState, sid: str) -> ManagerState | None:
    """A write ``base`` -> ``after`` that changed only session ``sid`` (and counters), replayed on
    ``current``, a later table in which ``sid`` is unchanged; None if ``sid`` changed (compute it again).

    So a write whose plan was slow (an engine ``offload``, user code) lands although other sessions were
    written meanwhile, without running its callbacks again."""
    if after is base:
        return current
    mine = ms.lookup(base, sid, None)
    if mine is None or ms.lookup(current, sid, None) is not mine:
        return None
    if ms.incarnation(current, sid) != ms.incarnation(base, sid):
        return None
    new = ms.lookup(after, sid)
    moved = update_session(current, sid, lambda _: new)
    counted = [c + a - b for c, a, b in zip(current.counters, after.counters, base.counters)]
    return ms.with_counters(moved, tuple(counted)) if counted != list(current.counters) else moved
