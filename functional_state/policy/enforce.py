"""Holding a byte budget: apply a release plan, tell what is over budget, and enforce_budget (plan, apply, verify)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import BudgetExceededError, InvalidArgumentError
from ..memory import accounting
from ..memory.budget import MAX_BYTES, format_bytes, limit_for
from ..memory.extents import Extent, Loose
from ..memory.pools import Pool
from ..table.checks import check_state
from ..table.manager_state import ManagerState, count_evictions, ledger_of
from ..table.parked import park
from ..table.session_edits import evict
from ..table.session_verbs import drop_session
from ..table.usage import pool_bytes
from .planner import LEVERS, ReleasePlan, plan_release, protect_ids
from .pricing import by_pool, extents_of

_log = logging.getLogger("functional_state")

__all__ = ["apply_plan", "enforce_budget"]

# A spill lever (`apply_plan`): offered a session before it is dropped; True once it has it elsewhere.
Spill = Callable[[ManagerState, str], Any]


def apply_plan(state: ManagerState, plan: ReleasePlan, *, spill: Spill | None = None) -> ManagerState:
    """Carry out ``plan`` on the state it was made for; returns the new state (the input is unchanged).

    Args:
      spill: called as ``spill(state, session_id)`` before each drop, with the table still holding the
        session: it may hand the session elsewhere (a peer replica, the object store: `export_session`) and
        returns True once it has. A spilled session leaves the table without counting as an eviction; one
        whose spill returned anything else or raised (logged) stays in the table, so the plan may then free
        less than it promised: `enforce_budget` plans again around it and drops it only as a last resort.

    Raises:
      InvalidArgumentError: the plan was made for another state (plan again on the state you apply).
    """
    return _carry_out(state, plan, spill, frozenset())[0]


def _carry_out(
    state: ManagerState, plan: ReleasePlan, spill: Spill | None, refused: frozenset[str]
) -> tuple[ManagerState, list[str]]:
    """`apply_plan`, also returning the sessions whose spill failed (kept). A drop of one in ``refused``
    (a spill failed before, and the budget cannot be met without it) is not offered again: it is an eviction."""
    if type(state) is not ManagerState:
        check_state(state, "apply_plan")
    if not isinstance(plan, ReleasePlan):
        raise InvalidArgumentError(f"`apply_plan`: expected a ReleasePlan, got {type(plan).__name__}.")
    if plan.made_for() is not state:
        raise InvalidArgumentError(
            "`apply_plan`: this plan was made for another state; its prices hold only there. Plan again on the "
            "state you apply it to."
        )
    kept: list[str] = []
    for action in plan.actions:
        sid = action.session_ids[0]
        # One line per action, what and why (a drop loses a session; a park or eviction under pressure costs
        # a restore or a recompute later): what a server's operator wants to see at INFO.
        _log.info("release for pool %r: %s", plan.pool, action)
        if action.kind == "park":
            state, _ = park(state, sid, action.name, with_sharers=len(action.holders) > 1)  # type: ignore[arg-type]
        elif action.kind == "evict":
            state, _ = evict(state, sid, action.name)  # type: ignore[arg-type]
        elif spill is None or sid in refused:
            state = _drop_as_eviction(state, sid)
        elif _spilled(spill, state, sid):
            state, _ = drop_session(state, sid)  # it lives on elsewhere: not lost, so not an eviction
        else:
            kept.append(sid)
    return state, kept


def _spilled(spill: Spill, state: ManagerState, sid: str) -> bool:
    try:
        done = spill(state, sid) is True
    except Exception:
        _log.warning("spilling session %r raised; it stays in the table", sid, exc_info=True)
        return False
    if not done:
        _log.info("spilling session %r was declined; it stays in the table", sid)
    return done


def _drop_as_eviction(state: ManagerState, sid: str) -> ManagerState:
    dropped, _ = drop_session(state, sid)
    return count_evictions(dropped)  # a session the planner dropped is lost to its continuations


def over_budget(state: ManagerState) -> dict[str, tuple[int, int]]:
    """``{pool: (held, budget)}`` for every pool over its budget (``"*"`` covering each device pool)."""
    return {str(pool): figures for pool, figures in _over(state).items()}


def _over(state: ManagerState) -> dict[Pool, tuple[int, int]]:
    if not state.byte_budget:
        return {}
    out = {}
    for pool, held in pool_bytes(state).items():
        limit = limit_for(state.byte_budget, pool)
        if limit is not None and held > limit:
            out[pool] = (held, limit)
    return out


# The shell's fast admission check keeps an attr surplus between writes; these three speak pool names (the
# keys of `stats()` and budgets), so that what the shell keeps is plain data.


def over_budget_objects(state: ManagerState, surplus: dict[str, int]) -> bool:
    """Whether a pool is over budget by the object totals plus a known attr ``surplus``: no walk.

    Decided first by the kept totals and the bound on what the deferred ledger steps added (an upper bound:
    within it, within the exact figure); only a write that bound puts over a budget folds the steps (once,
    kept on the accounting) and is decided by the exact totals."""
    budget = state.byte_budget
    if not budget:
        return False
    acct = ledger_of(state)
    step = acct.deferred
    if step is not None:
        if headroom(acct.kept_totals, budget, surplus, step.pools) >= step.added_bytes:
            return False
        acct = acct.exact()  # (near a budget: decided exactly)
    return headroom(acct.totals, budget, surplus, ()) < 0


_UNBOUNDED = MAX_BYTES + 1  # (more room than any pool reports: no pool named has a budget)


def headroom(totals: Mapping[str, int], budget: Mapping[str, int], surplus: dict[str, int], pools: Any) -> int:
    """The bytes ``pools`` may each still take before one of them goes over its budget, by ``totals`` plus the
    attr ``surplus``; -1 where a pool (any, named or not) is over its budget already. O(pools held)."""
    room = _UNBOUNDED
    for name, held in totals.items():  # (per write: no union of the key sets built)
        limit = limit_for(budget, Pool.of(name))
        if limit is not None:
            left = limit - held - surplus.get(name, 0)
            if left < 0:
                return -1
            if name in pools and left < room:
                room = left
    for name, extra in surplus.items():  # a pool only attrs hold is still a pool the budget covers
        if name not in totals:
            limit = limit_for(budget, Pool.of(name))
            if limit is not None:
                left = limit - extra
                if left < 0:
                    return -1
                if name in pools and left < room:
                    room = left
    for name in pools:  # a pool the deferred steps alone added to
        if name not in totals and name not in surplus:
            limit = limit_for(budget, Pool.of(name))
            if limit is not None and limit < room:
                room = limit
    return room


def attr_surplus(state: ManagerState) -> dict[str, int]:
    """Bytes per pool the attrs hold, each allocation once, counted whether or not an object holds it too.

    The bound the shell's fast check adds to the kept object totals until the next full check. It must stay
    a bound whatever the objects do meanwhile: a commit may drop an object's last hold on a buffer an attr
    aliases, which leaves the object totals but not the pool. Counting only the attr bytes beyond the
    objects' (as this once did) let such a commit pass the fast check over the budget. An alias is counted
    twice here (one fast check errs on the safe side; the full check it falls back to is exact).
    """
    index = ledger_of(state).attrs
    totals = dict(index.totals)  # (kept: the union of the fixed values' extents, per pool)
    beyond: dict[str, list[Extent]] = {}  # what containers hold beyond the fixed values, per pool
    for e in index.open_extents():
        if e not in index.refs:
            beyond.setdefault(e.pool, []).append(e)
    for pool, extents in beyond.items():
        if pool in index.loose or any(type(e) is Loose for e in extents):  # may overlap without being equal
            extents = [*extents, *(e for e in index.refs if e.pool == pool)]
            totals[pool] = accounting.union_by_device(extents)[pool]
        else:
            totals[pool] = totals.get(pool, 0) + accounting.union_by_device(extents)[pool]
    return {pool: n for pool, n in totals.items() if n}


def attr_bytes(attrs: Any) -> dict[str, int]:
    """Bytes per pool a session's attrs hold (no deduplication against the objects: an upper bound)."""
    return {str(pool): n for pool, n in by_pool(extents_of(dict(attrs))).items()} if attrs else {}


def enforce_budget(
    state: ManagerState, protect: Any = (), *, levers: Iterable[str] = LEVERS, spill: Spill | None = None
) -> ManagerState:
    """Bring every pool within the table's byte budget, releasing what `plan_release` chooses.

    Pools are planned one at a time, each on the state the plans before it left, and the result is measured
    before it is returned: a pool still over its budget is an error, never a returned state.

    Args:
      state: the table (unchanged).
      protect: a session id, or ids, never touched.
      levers: which levers may be used (see `plan_release`).
      spill: offered each session a plan drops, before it is dropped (see `apply_plan`). A session whose spill
        raised or declined stays: the pool is planned again with it protected, so anything else that can be
        parked, evicted, dropped or spilled goes first; only if the budget cannot be met that way is it dropped,
        as an eviction (logged as a warning), without being offered again. A spill is a side effect: if a
        pool cannot be brought within budget, the error leaves this table as it was while the spilled
        sessions live on where they went too (claim them there: the copy here is then stale).

    Returns:
      The state within budget; ``state`` itself when every pool already is.

    Raises:
      BudgetExceededError: a pool cannot be brought within budget even by releasing everything allowed (say,
        a protected session alone holds more), or a plan did not free what it promised; nothing is changed.
    """
    protected = sorted(protect_ids(protect, "enforce_budget"))
    levers = tuple(levers)
    planned: dict[Pool, ReleasePlan] = {}
    refused: set[str] = set()  # sessions whose spill failed: kept while the budget can be met without them
    current = state
    while True:
        over = _over(current)
        if not over:
            return current
        pool = min(over, key=str)
        held, limit = over[pool]
        if pool in planned:  # measured after applying: the plan did not hold
            plan = planned[pool]
            raise BudgetExceededError(
                f"pool {str(pool)!r} would hold {format_bytes(held)} against a budget of {format_bytes(limit)} even "
                f"after the release plan for it, which promised to free {format_bytes(plan.freed)} there:\n{plan}\n"
                f"The plan was not installed; the state is as it was.",
                pool=str(pool),
                budget=limit,
                held=held,
                releasable=plan.freed,
            )
        found = plan_release(current, str(pool), held - limit, [*protected, *sorted(refused)], levers=levers)
        if found is None and refused:
            found = plan_release(current, str(pool), held - limit, protected, levers=levers)
            if found is not None:
                _log.warning(
                    "the byte budget cannot be met without dropping session(s) %s, whose spill failed: dropped",
                    sorted(
                        sid for sid in refused if any(a.kind == "drop" and sid in a.session_ids for a in found.actions)
                    ),
                )
        if found is None:
            releasable = _releasable(current, pool, protected, levers)
            raise BudgetExceededError(
                f"pool {str(pool)!r} would hold {format_bytes(held)} against a budget of {format_bytes(limit)}, and "
                f"releasing everything allowed ({', '.join(levers) or 'no levers'}; protected: {protected}) frees "
                f"only {format_bytes(releasable)}. The last change was refused; the state is as it was.",
                pool=str(pool),
                budget=limit,
                held=held,
                releasable=releasable,
            )
        _log.debug(
            "enforce_budget: pool %r over its budget by %s; %d action(s) free %s",
            str(pool),
            format_bytes(held - limit),
            len(found.actions),
            format_bytes(found.freed),
        )
        current, kept = _carry_out(current, found, spill, frozenset(refused))
        if kept:  # their spill failed: the pool is planned again with them protected (new ids each time: ends)
            refused.update(kept)
        else:
            planned[pool] = found


def _releasable(state: ManagerState, pool: Pool, protect: list[str], levers: tuple[str, ...]) -> int:
    """The most the planner could free in ``pool``: a plan for an unreachable need, stopped at exhaustion."""
    lo, hi = 0, pool_bytes(state).get(pool, 0)
    while lo < hi:  # the largest need that still has a plan (plans are monotone in the need)
        mid = (lo + hi + 1) // 2
        if plan_release(state, str(pool), mid, protect, levers=levers) is None:
            hi = mid - 1
        else:
            lo = mid
    return lo
