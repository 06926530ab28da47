"""Holding a byte budget: apply a release plan, tell what is over budget, and enforce_budget (plan, apply, verify)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..errors import BudgetExceededError, InvalidArgumentError
from ..memory.budget import ANY_DEVICE, format_bytes
from ..table.manager_state import (
    ManagerState,
    check_state,
    count_evictions,
    drop_session,
    ledger_of,
)
from ..table.parked import park
from ..table.session_edits import evict
from ..table.usage import stats
from .planner import LEVERS, ReleasePlan, extents_of, plan_release, protect_ids
from .pricing import by_pool

_log = logging.getLogger("functional_state")

__all__ = ["apply_plan", "enforce_budget"]


def apply_plan(state: ManagerState, plan: ReleasePlan) -> ManagerState:
    """Carry out ``plan`` on the state it was made for; returns the new state (the input is unchanged).

    Raises:
      InvalidArgumentError: the plan was made for another state (plan again on the state you apply).
    """
    if type(state) is not ManagerState:
        check_state(state, "apply_plan")
    if not isinstance(plan, ReleasePlan):
        raise InvalidArgumentError(f"`apply_plan`: expected a ReleasePlan, got {type(plan).__name__}.")
    if plan.made_for() is not state:
        raise InvalidArgumentError(
            "`apply_plan`: this plan was made for another state; its prices hold only there. Plan again on the "
            "state you apply it to."
        )
    for action in plan.actions:
        sid = action.session_ids[0]
        # Drops lose a session (info); parks and evictions lose nothing a recompute cannot rebuild (debug).
        _log.log(logging.INFO if action.kind == "drop" else logging.DEBUG, "release plan for %r: %s", plan.pool, action)
        if action.kind == "park":
            state, _ = park(state, sid, action.name, with_sharers=len(action.holders) > 1)  # type: ignore[arg-type]
        elif action.kind == "evict":
            state, _ = evict(state, sid, action.name)  # type: ignore[arg-type]
        else:
            state = _drop_as_eviction(state, sid)
    return state


def _drop_as_eviction(state: ManagerState, sid: str) -> ManagerState:
    dropped, _ = drop_session(state, sid)
    return count_evictions(dropped)  # a session the planner dropped is lost to its continuations


def over_budget(state: ManagerState) -> dict[str, tuple[int, int]]:
    """``{pool: (held, budget)}`` for every pool over its budget (``"*"`` covering each device pool)."""
    if not state.byte_budget:
        return {}
    held = {k[len("nbytes:") :]: v for k, v in stats(state).items() if k.startswith("nbytes:")}
    return _over(state, held)


def over_budget_objects(state: ManagerState, surplus: dict[str, int]) -> bool:
    """Whether a pool is over budget by the kept object totals plus a known attr ``surplus``: no walk."""
    totals = ledger_of(state).totals
    for pool, limit in (state.byte_budget or {}).items():
        if pool == ANY_DEVICE:
            if any(held + surplus.get(p, 0) > limit for p, held in totals.items() if "/" not in p):
                return True
        elif totals.get(pool, 0) + surplus.get(pool, 0) > limit:
            return True
    return False


def attr_surplus(state: ManagerState) -> dict[str, int]:
    """Bytes per pool the attrs hold beyond what the objects hold (a walk of the attrs)."""
    objects = ledger_of(state).totals
    with_attrs = {k[len("nbytes:") :]: v for k, v in stats(state).items() if k.startswith("nbytes:")}
    return {pool: n - objects.get(pool, 0) for pool, n in with_attrs.items() if n > objects.get(pool, 0)}


def attr_bytes(attrs: Any) -> dict[str, int]:
    """Bytes per pool a session's attrs hold (no deduplication against the objects: an upper bound)."""
    return by_pool(extents_of(dict(attrs))) if attrs else {}


def _over(state: ManagerState, held: dict[str, int]) -> dict[str, tuple[int, int]]:
    budget = state.byte_budget or {}
    out = {}
    for pool, bytes_held in held.items():
        limit = budget.get(pool, budget.get(ANY_DEVICE) if "/" not in pool else None)
        if limit is not None and bytes_held > limit:
            out[pool] = (bytes_held, limit)
    return out


def enforce_budget(state: ManagerState, protect: Any = (), *, levers: Iterable[str] = LEVERS) -> ManagerState:
    """Bring every pool within the table's byte budget, releasing what `plan_release` chooses.

    Pools are planned one at a time, each on the state the plans before it left, and the result is measured
    before it is returned: a pool still over its budget is an error, never a returned state.

    Args:
      state: the table (unchanged).
      protect: a session id, or ids, never touched.
      levers: which levers may be used (see `plan_release`).

    Returns:
      The state within budget; ``state`` itself when every pool already is.

    Raises:
      BudgetExceededError: a pool cannot be brought within budget even by releasing everything allowed (say,
        a protected session alone holds more), or a plan did not free what it promised; nothing is changed.
    """
    protected = sorted(protect_ids(protect, "enforce_budget"))
    levers = tuple(levers)
    planned: dict[str, ReleasePlan] = {}
    current = state
    while True:
        over = over_budget(current)
        if not over:
            return current
        pool, (held, limit) = min(over.items())
        if pool in planned:  # measured after applying: the plan did not hold
            plan = planned[pool]
            raise BudgetExceededError(
                f"pool {pool!r} would hold {format_bytes(held)} against a budget of {format_bytes(limit)} even "
                f"after the release plan for it, which promised to free {format_bytes(plan.freed)} there:\n{plan}\n"
                f"The plan was not installed; the state is as it was.",
                pool=pool,
                budget=limit,
                held=held,
                releasable=plan.freed,
            )
        found = plan_release(current, pool, held - limit, protected, levers=levers)
        if found is None:
            releasable = _releasable(current, pool, protected, levers)
            raise BudgetExceededError(
                f"pool {pool!r} would hold {format_bytes(held)} against a budget of {format_bytes(limit)}, and releasing "
                f"everything allowed ({', '.join(levers) or 'no levers'}; protected: {protected}) frees "
                f"only {format_bytes(releasable)}. The last change was refused; the state is as it was.",
                pool=pool,
                budget=limit,
                held=held,
                releasable=releasable,
            )
        _log.debug("enforce_budget: pool %r over budget by %s\n%s", pool, format_bytes(held - limit), found)
        current = apply_plan(current, found)
        planned[pool] = found


def _releasable(state: ManagerState, pool: str, protect: list[str], levers: tuple[str, ...]) -> int:
    """The most the planner could free in ``pool``: a plan for an unreachable need, stopped at exhaustion."""
    lo, hi = 0, sum(v for k, v in stats(state).items() if k == f"nbytes:{pool}")
    while lo < hi:  # the largest need that still has a plan (plans are monotone in the need)
        mid = (lo + hi + 1) // 2
        if plan_release(state, pool, mid, protect, levers=levers) is None:
            hi = mid - 1
        else:
            lo = mid
    return lo
