"""The release planner: which bytes to release, and how, to bring a memory pool within its budget.

`plan_release` is pure and explainable: it returns a `ReleasePlan`, an ordered list of actions each with the
bytes it frees per pool, plus what it considered and skipped and why, or None when the need cannot be met
(and nothing changed). `apply_plan` carries a plan out. `enforce_budget` plans and applies for every pool
over its budget. The levers, least loss first:

1. **park** resident objects of the least recently used sessions (nothing is lost; the host pool must have
   room if it has a budget);
2. **evict** objects whose recompute source (another object of the session) is resident, the cheapest
   declared ``recompute_cost`` first;
3. **drop** whole sessions, least recently used first (counted as evictions: a continuation of one raises
   `SessionStateLostError`).

Never touched: a protected session; an attr on its own (attrs leave only with their session, and their
bytes are reported as unreleasable); bytes something else still holds. The release is priced as a set: every
action is applied to one ledger of holders (`Ledger.change`), given the actions before it, and the plan's
bytes are the union held before less the union held after the whole set: what leaves each pool, and what a
park puts into its host pools (as `park` really moves it: numpy stays, torch and JAX go to their host memory
kinds). An eviction or drop that frees nothing alone is taken tentatively (sessions over overlapping views
of one buffer free it only together), the passes go on in their order until the need is met, and then each
tentative action the rest does not need is taken back (an object a protected fork shares frees nothing, so
the plan keeps what frees something instead). Only when releasing everything allowed falls short is there no
plan. `enforce_budget` measures the result before it returns it. Each lever is one pass in recency (or cost)
order: a plan over n sessions costs O(n log n) at most, and a park pass that frees the need from the oldest
sessions reads only those (the recency log is read lazily).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal

from ..errors import InvalidArgumentError
from ..memory.budget import format_bytes, limit_for, parse_bytes
from ..memory.extents import Extent
from ..memory.pools import POOL_FORMS, Pool
from ..table.checks import check_state
from ..table.ledger import object_extents
from ..table.manager_state import ManagerState, ledger_of
from .pricing import Change, Ledger, park_effect
from .snapshot import Recency, Snapshot

_log = logging.getLogger("functional_state")

__all__ = ["LEVERS", "ReleaseAction", "ReleasePlan", "plan_release"]

Lever = Literal["park", "evict", "drop"]
LEVERS: tuple[Lever, ...] = ("park", "evict", "drop")
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class ReleaseAction:
    """One step of a plan: park or evict object ``name``, or drop the session (``name`` None)."""

    kind: Lever
    session_ids: tuple[str, ...]  # one session; a park of a shared object names every session holding it
    name: str | None
    frees: dict[str, int]  # pool -> bytes leaving it (a park also lists the host pool it fills, negative)
    reason: str
    holders: tuple[tuple[str, str], ...] = ()  # a park: every (session, name) holding the object, parked together

    def __str__(self) -> str:
        target = "+".join(self.session_ids) + (f"/{self.name}" if self.name else "")
        moved = ", ".join(f"{pool} {'+' if n < 0 else '-'}{format_bytes(abs(n))}" for pool, n in self.frees.items())
        return f"{self.kind:5s} {target}: {moved or 'nothing alone'} ({self.reason})"


@dataclasses.dataclass(frozen=True)
class ReleasePlan:
    """An ordered release that frees at least ``need`` bytes in ``pool``; print it to read the decision."""

    pool: str
    need: int
    actions: tuple[ReleaseAction, ...]
    skipped: tuple[str, ...]  # "what: why", for every candidate considered and passed over
    unreleasable: int  # bytes attrs hold in the pool (they leave only with their session)
    made_for: Any = dataclasses.field(repr=False, compare=False)  # weakref to the state planned on

    @property
    def freed(self) -> int:
        """Bytes the plan frees in ``pool``."""
        return sum(a.frees.get(self.pool, 0) for a in self.actions)

    def __str__(self) -> str:
        lines = [
            f"ReleasePlan for pool {self.pool!r}: need {format_bytes(self.need)}, frees {format_bytes(self.freed)} in "
            f"{len(self.actions)} action(s)"
        ]
        lines += [f"  {i}. {a}" for i, a in enumerate(self.actions, 1)]
        if self.skipped:
            lines.append("  skipped:")
            lines += [f"  - {s}" for s in self.skipped]
        if self.unreleasable:
            lines.append(f"  attrs hold {format_bytes(self.unreleasable)} here; they leave only with their session")
        return "\n".join(lines)


def protect_ids(protect: Any, what: str) -> set[str]:
    """The session ids ``protect`` names: one id (a str, or None for ``"default"``) or an iterable of them."""
    if protect is None or isinstance(protect, str):
        protect = (protect,)  # one id, never read character by character
    try:
        ids = list(protect)
    except TypeError:
        raise InvalidArgumentError(
            f"`{what}`: protect must be a session id or an iterable of them, got {type(protect).__name__}."
        ) from None
    bad = [p for p in ids if p is not None and (not isinstance(p, str) or not p)]
    if bad:
        raise InvalidArgumentError(
            f"`{what}`: protect must hold session ids (non-empty str, or None for 'default'); got {bad[:5]!r}."
        )
    return {p if p is not None else "default" for p in ids}


def _check_plan_args(
    state: Any, pool: Any, protect: Any, levers: Iterable[str]
) -> tuple[Pool, set[str], tuple[str, ...]]:
    if type(state) is not ManagerState:
        check_state(state, "plan_release")
    try:
        target = Pool.parse(pool)
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"`plan_release`: pool must be a pool as stats() names it ({POOL_FORMS}), got {pool!r}."
        ) from None
    protected = protect_ids(protect, "plan_release")
    unknown = sorted(p for p in protected if p not in state)
    if unknown:
        raise InvalidArgumentError(f"`plan_release`: protect names sessions that are not in the table: {unknown}.")
    levers = tuple(levers)
    bad = [lever for lever in levers if lever not in LEVERS]
    if bad:
        raise InvalidArgumentError(f"`plan_release`: unknown lever(s) {bad}; the levers are {LEVERS}.")
    return target, protected, levers


def plan_release(
    state: ManagerState,
    pool: str,
    need_bytes: Any,
    protect: Iterable[str | None] = (),
    *,
    levers: Iterable[str] = LEVERS,
) -> ReleasePlan | None:
    """Plan releasing at least ``need_bytes`` from ``pool``; None when releasing all allowed falls short.

    Args:
      state: the table (unchanged: planning is pure).
      pool: the pool to free, as `stats` names it (``"cuda:0"``, ``"cpu"``).
      need_bytes: bytes to free (an int or a size such as ``"600MiB"``).
      protect: a session id, or an iterable of ids, never touched (a session being served, a request in
        flight). A str is one id.
      levers: which levers may be used, in the fixed order park, evict, drop.

    Raises:
      InvalidArgumentError: a pool `stats` never names, a pool the table holds nothing in (with a need), a
        negative or absurd need, ids not in the table, an unknown lever.

    Example:
      >>> import torch, functional_state as fs
      >>> s = fs.ManagerState.create()
      >>> for sid in ("old", "new"):
      ...     s, _ = fs.get_or_create(s, sid)
      ...     s = fs.put(s, sid, "cache", fs.DenseValue.create([torch.zeros(256)]))
      >>> plan = plan_release(s, "cpu", 1024, protect=["new"])
      >>> print(plan)
      ReleasePlan for pool 'cpu': need 1.0 KiB, frees 1.0 KiB in 1 action(s)
        1. park  old/cache: cpu -1.0 KiB, cpu/unpinned_host +1.0 KiB (least recently used session)
        skipped:
        - new: protected
      >>> fs.stats(fs.apply_plan(s, plan))["nbytes:cpu"]
      1024
    """
    target, protected, levers = _check_plan_args(state, pool, protect, levers)
    need = parse_bytes(need_bytes, "plan_release: need_bytes")
    acct = ledger_of(state)
    lru = Recency(state)  # read lazily: a park pass that meets the need early reads only the oldest sessions
    snap = Snapshot(acct, state, lru)  # the one read of the table's usage this plan prices against
    unreleasable = snap.attr_nbytes(target)
    budget = state.byte_budget or {}
    moved: dict[Pool, int] = {}  # bytes per pool the parks so far take out (negative: put in)
    ledger = Ledger(acct.refs, snap.attr_holders, acct.overlaps)
    now: dict[tuple[str, str], frozenset[Extent]] = {}  # (session, object) -> its extents once the plan ran
    steps: list[_Step] = []  # every action taken into the ledger, in order (pending ones included)
    skipped: list[str] = []
    freed = 0  # bytes the whole set taken so far frees in the target (priced as a set, not action by action)
    released: set[tuple[str, str]] = set()  # (session, object) already parked or evicted by this plan

    def done() -> bool:
        return freed >= need

    def take(step: _Step) -> None:
        nonlocal freed
        assert step.change is not None
        ledger.take(step.change)
        steps.append(step)
        freed += step.change.frees.get(target, 0)

    skipped.extend(f"{sid}: protected" for sid in sorted(protected))
    if "park" in levers and not done():
        for sid, session in lru:
            if done():
                break
            if sid in protected:
                continue
            for name, obj in sorted(session._objects.items()):
                if done():
                    break
                if not obj.resident:
                    continue
                extents = object_extents(obj)
                if not any(e.pool == pool for e in extents):
                    continue
                holders = snap.holders(obj, sid, name, extents)
                sharers = list(dict.fromkeys(s for s, _ in holders))
                if any(s in protected for s in sharers):
                    skipped.append(
                        f"{sid}/{name}: its storage is shared with a protected session; parking frees nothing"
                    )
                    continue
                if holders[0] != (sid, name):
                    continue  # a shared object: considered once, at its least recent holder
                if not obj.parkable:
                    skipped.append(f"{sid}/{name}: {type(obj).__name__} cannot be parked (no offload)")
                    continue
                committed, parked = park_effect(obj, ledger)
                if not committed <= ledger.change([extents] * len(holders)).left:  # what `park` refuses
                    skipped.append(f"{sid}/{name}: something else holds part of its storage; parking frees nothing")
                    continue
                # Never pending (taken for what a later action would free with it): `park` refuses storage
                # something else holds when it runs, and parks run before the evictions and drops that
                # could let go of the other holder.
                change = ledger.change([extents] * len(holders), [parked] * len(holders))
                if change.frees.get(target, 0) <= 0:
                    skipped.append(f"{sid}/{name}: parking frees nothing in {pool!r} (its bytes would stay there)")
                    continue
                full = [
                    p
                    for p, n in change.frees.items()
                    if n < 0
                    and (limit := limit_for(budget, p)) is not None
                    and snap.held.get(p, 0) - moved.get(p, 0) - n > limit  # (read only for a budgeted host pool)
                ]
                if full:
                    skipped.append(f"{sid}/{name}: host pool {str(full[0])!r} has no room under its budget")
                    continue
                why = (
                    "least recently used session"
                    if len(holders) == 1
                    else f"least recently used; held as {['/'.join(h) for h in holders]}"
                )
                for p, n in change.frees.items():
                    moved[p] = moved.get(p, 0) + n
                take(
                    _Step(
                        "park",
                        tuple(sharers),
                        name,
                        [extents] * len(holders),
                        [parked] * len(holders),
                        why,
                        tuple(holders),
                        change,
                    )
                )
                now.update(dict.fromkeys(holders, parked))
                released.update(holders)
    if "evict" in levers and not done():
        candidates = []
        for rank, (sid, session) in enumerate(lru):
            if sid in protected:
                continue
            for name, obj in session._objects.items():
                if (sid, name) in released or not obj.resident or obj.recompute_source is None:
                    continue
                if session.recomputable(name) and (sid, obj.recompute_source) not in released:
                    candidates.append((obj.recompute_cost, rank, sid, name, obj))
        for cost, _, sid, name, obj in sorted(candidates, key=lambda c: c[:4]):
            if done():
                break
            if (sid, obj.recompute_source) in released:
                skipped.append(f"{sid}/{name}: its recompute source {obj.recompute_source!r} leaves in this plan")
                continue
            evicted = object_extents(obj.evict()[0])  # priced by what evicting really keeps (the staged payload)
            step = _Step(
                "evict",
                (sid,),
                name,
                [object_extents(obj)],
                [evicted],
                f"recomputable from {obj.recompute_source!r} (cost {cost:g})",
            )
            take(step.priced(ledger))
            now[(sid, name)] = evicted
            released.add((sid, name))
    if "drop" in levers and not done():
        attr_sets, attr_holders = snap.exact_attrs()  # a drop lets go of one session's attrs: count them
        ledger.set_attr_holders(attr_holders)
        for sid, session in lru:
            if done():
                break
            if sid in protected:
                continue
            # What each object holds once this plan's earlier parks and evictions ran: all of it leaves now.
            objects = [now[(sid, n)] if (sid, n) in now else object_extents(o) for n, o in session._objects.items()]
            step = _Step(
                "drop",
                (sid,),
                None,
                objects,
                [],
                "least recently used session",
                (),
                attrs=attr_sets.get(sid, _NO_EXTENTS),
            )
            take(step.priced(ledger))
    if not done():
        if not snap.held.get(target, 0):  # a pool the table holds nothing in: a wrong pool, not a short plan
            held = ", ".join(f"{p} {format_bytes(n)}" for p, n in sorted(snap.held.items(), key=str) if n) or "none"
            raise InvalidArgumentError(
                f"`plan_release`: the table holds nothing in pool {pool!r}, so there is nothing there to release "
                f"(its pools: {held}). Name a pool stats() reports as `nbytes:<pool>`."
            )
        _log.debug(
            "plan_release: no plan frees %s in pool %r (freeable: %s)", format_bytes(need), pool, format_bytes(freed)
        )
        return None
    fresh = functools.partial(Ledger, acct.refs, ledger.attr_holders, acct.overlaps)
    actions = _settle(steps, ledger, fresh, target, need, freed, skipped)
    return ReleasePlan(pool, need, actions, tuple(skipped), unreleasable, weakref.ref(state))


@dataclasses.dataclass
class _Step:
    """An action as the planner takes it: the holders it replaces (``remove``) by what they become (``add``),
    the attr extents that leave with a dropped session, and its price where it was taken."""

    kind: Lever
    sessions: tuple[str, ...]
    name: str | None
    remove: list[frozenset[Extent]]
    add: list[frozenset[Extent]]
    why: str
    holders: tuple[tuple[str, str], ...] = ()
    change: Change | None = None
    attrs: frozenset[Extent] = frozenset()

    def priced(self, ledger: Ledger) -> _Step:
        self.change = ledger.change(self.remove, self.add, self.attrs)
        return self

    @property
    def what(self) -> str:
        return self.sessions[0] + (f"/{self.name}" if self.name else "")


def _settle(
    steps: list[_Step],
    ledger: Ledger,
    fresh_ledger: Callable[[], Ledger],
    target: Pool,
    need: int,
    freed: int,
    skipped: list[str],
) -> tuple[ReleaseAction, ...]:
    """The actions of a plan whose steps free ``freed`` >= ``need`` in ``target``: the steps taken, less the
    tentative ones the set does not need, each priced again in order (their ``frees`` then add up to what
    applying them all frees).

    An eviction or drop that freed nothing in the target when it was taken stays in the ledger, tentatively:
    a later one may free bytes only with it (three sessions over overlapping views of one buffer free nothing
    alone). Once the need is met, each tentative step is taken back, latest (least preferred) first, when the
    rest still meets the need without it.
    """
    dropped_later: set[str] = set()  # sessions a kept later step drops (an eviction there cannot be taken back alone)
    kept: list[_Step] = []
    for step in reversed(steps):
        assert step.change is not None
        tentative = step.kind != "park" and step.change.frees.get(target, 0) <= 0
        if tentative and not (step.kind == "evict" and step.sessions[0] in dropped_later):
            undo = ledger.undo(step.change)
            if freed + undo.frees.get(target, 0) >= need:  # (taking it back holds its bytes again: <= 0)
                ledger.take(undo)
                freed += undo.frees.get(target, 0)
                verb = "dropping it" if step.kind == "drop" else "evicting it"
                skipped.append(
                    f"{step.what}: {verb} frees nothing in {str(target)!r} alone (its storage is held elsewhere)"
                )
                continue
        if step.kind == "drop":
            dropped_later.add(step.sessions[0])
        kept.append(step)
    kept.reverse()
    fresh = fresh_ledger() if len(kept) < len(steps) else None  # (none taken back: each price stands as taken)
    actions = []
    for step in kept:
        change = step.change
        if fresh is not None:
            change = fresh.change(step.remove, step.add, step.attrs)
            fresh.take(change)
        assert change is not None
        why = step.why
        if change.frees.get(target, 0) <= 0 and step.kind != "park":
            why += f"; its bytes in {str(target)!r} leave with the actions after it"
        frees = {str(p): n for p, n in change.frees.items()}
        actions.append(ReleaseAction(step.kind, step.sessions, step.name, frees, why, holders=step.holders))
    return tuple(actions)


_NO_EXTENTS: frozenset[Extent] = frozenset()
