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
bytes are reported as unreleasable); bytes something else still holds. Every action's freed bytes are
marginal and deduplicated: what really leaves the pool, given the actions before it, so an object a
protected fork shares frees nothing and the planner moves on to a candidate that frees something. Each
lever is one pass in recency (or cost) order: a plan over n sessions costs O(n log n).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import Any, Literal

from . import accounting
from ._acct import Extent, object_extents
from .budget import _POOL, ANY_DEVICE, format_bytes, parse_bytes
from .errors import BudgetExceededError, InvalidArgumentError
from .manager_state import (
    _S,
    ManagerState,
    _check_state,
    _state,
    _track,
    drop_session,
    evict,
    park,
    stats,
)
from .paged_kv import PagedKVHandle

__all__ = ["LEVERS", "ReleaseAction", "ReleasePlan", "apply_plan", "enforce_budget", "plan_release"]

Lever = Literal["park", "evict", "drop"]
LEVERS: tuple[Lever, ...] = ("park", "evict", "drop")
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class ReleaseAction:
    """One step of a plan: park or evict object ``name``, or drop the session (``name`` None)."""

    kind: Lever
    session_ids: tuple[str, ...]  # one session; a park of an object forks share names all of them
    name: str | None
    frees: dict[str, int]  # pool -> bytes leaving it (a park also lists the host pool it fills, negative)
    reason: str

    def __str__(self) -> str:
        target = "+".join(self.session_ids) + (f"/{self.name}" if self.name else "")
        moved = ", ".join(f"{pool} {'+' if n < 0 else '-'}{format_bytes(abs(n))}" for pool, n in self.frees.items())
        return f"{self.kind:5s} {target}: {moved} ({self.reason})"


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


class _Ledger:
    """Holder counts as the plan's earlier actions would leave them, to price each next action."""

    def __init__(self, refs: Any, attr_holders: Counter[Extent]):
        self.refs = refs  # extent -> objects holding it (the table's accounting)
        self.attr_holders = attr_holders  # extent -> sessions whose attrs hold it
        self.gone: Counter[Extent] = Counter()  # holder objects released so far
        self.attrs_gone: Counter[Extent] = Counter()

    def freed(self, objects: Iterable[frozenset[Extent]], attrs: Iterable[Extent] = ()) -> set[Extent]:
        """The extents that no holder would keep once ``objects`` (and sessions' ``attrs``) let go."""
        less = Counter(e for extents in objects for e in extents)
        less_attrs = Counter(attrs)
        out = set()
        for e in set(less) | set(less_attrs):
            objects_left = self.refs.get(e, 0) - self.gone[e] - less[e]
            attrs_left = self.attr_holders[e] - self.attrs_gone[e] - less_attrs[e]
            if objects_left <= 0 and attrs_left <= 0:
                out.add(e)
        return out

    def release(self, objects: Iterable[frozenset[Extent]], attrs: Iterable[Extent] = ()) -> None:
        for extents in objects:
            self.gone.update(extents)
        self.attrs_gone.update(attrs)


def _by_pool(extents: Iterable[Extent]) -> dict[str, int]:
    return accounting._union_by_device(list(extents))


def _check_plan_args(
    state: Any, pool: Any, protect: Iterable[str | None], levers: Iterable[str]
) -> tuple[set[str], tuple[str, ...]]:
    if type(state) is not ManagerState:
        _check_state(state, "plan_release")
    if not isinstance(pool, str) or not _POOL.match(pool):
        raise InvalidArgumentError(
            f"`plan_release`: pool must be a pool as stats() names it ('cuda:0', 'cpu', 'cpu/pinned_host'), got {pool!r}."
        )
    protected = {p if p is not None else "default" for p in protect}
    unknown = sorted(p for p in protected if p not in state)
    if unknown:
        raise InvalidArgumentError(f"`plan_release`: protect names sessions that are not in the table: {unknown}.")
    levers = tuple(levers)
    bad = [lever for lever in levers if lever not in LEVERS]
    if bad:
        raise InvalidArgumentError(f"`plan_release`: unknown lever(s) {bad}; the levers are {LEVERS}.")
    return protected, levers


def plan_release(
    state: ManagerState,
    pool: str,
    need_bytes: Any,
    protect: Iterable[str | None] = (),
    *,
    levers: Iterable[str] = LEVERS,
) -> ReleasePlan | None:
    """Plan releasing at least ``need_bytes`` from ``pool``; None when that is impossible (nothing changes).

    Args:
      state: the table (unchanged: planning is pure).
      pool: the pool to free, as `stats` names it (``"cuda:0"``, ``"cpu"``).
      need_bytes: bytes to free (an int or a size such as ``"600MiB"``).
      protect: session ids never touched (a session being served, a request in flight).
      levers: which levers may be used, in the fixed order park, evict, drop.

    Raises:
      InvalidArgumentError: an unknown pool name, a negative need, ids not in the table, an unknown lever.

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
      >>> fs.stats(apply_plan(s, plan))["nbytes:cpu"]
      1024
    """
    protected, levers = _check_plan_args(state, pool, protect, levers)
    need = parse_bytes(need_bytes, "plan_release: need_bytes")
    acct = _track(state)
    sids, objs = _sessions_lru(state)
    attr_sets: dict[str, frozenset[Extent]] = {}
    attr_holders: Counter[Extent] = Counter()
    for sid, session in zip(sids, objs):
        out: accounting.Extents = []
        for value in session._attrs.values():
            accounting._collect(value, out, {}, accounting.WalkReport())
        if out:  # (one container per session would trigger full garbage collections at 100k sessions)
            attr_sets[sid] = extents = frozenset(out)
            for e in extents:  # (not Counter.update: its Mapping check costs more than the loop)
                attr_holders[e] += 1
    unreleasable = _by_pool(e for extents in attr_sets.values() for e in extents).get(pool, 0)
    first_holder: dict[int, str] = {}  # id(object) -> least recent session holding that very object
    more_holders: dict[int, list[str]] = {}  # ... and the others (forks share objects), only where any
    for sid, session in zip(sids, objs):
        for obj in session._objects.values():
            if first_holder.setdefault(id(obj), sid) is not sid:
                more_holders.setdefault(id(obj), []).append(sid)
    budget = state.byte_budget or {}
    host_used = {k: v for k, v in acct.totals.items() if "/" in k}
    ledger = _Ledger(acct.refs, attr_holders)
    actions: list[ReleaseAction] = []
    skipped: list[str] = []
    freed = 0
    released: set[tuple[str, str]] = set()  # (session, object) already parked or evicted by this plan

    def done() -> bool:
        return freed >= need

    def take(action: ReleaseAction, objects: list[frozenset[Extent]], attrs: Iterable[Extent] = ()) -> None:
        nonlocal freed
        ledger.release(objects, attrs)
        actions.append(action)
        freed += action.frees.get(pool, 0)

    for sid in protected:
        skipped.append(f"{sid}: protected")
    if "park" in levers and not done():
        for sid, session in zip(sids, objs):
            if sid in protected or done():
                continue
            for name, obj in sorted(session._objects.items()):
                if done():
                    break
                if not obj.resident:
                    continue
                extents = object_extents(obj)
                if not any(e[0] == pool for e in extents):
                    continue
                sharers = [first_holder[id(obj)], *more_holders.get(id(obj), ())]
                if any(s in protected for s in sharers):
                    skipped.append(
                        f"{sid}/{name}: its storage is shared with a protected session; parking frees nothing"
                    )
                    continue
                if sharers[0] != sid:
                    continue  # a fork's object: considered once, at its least recent holder
                if type(obj) is PagedKVHandle:
                    if not obj.parkable:
                        skipped.append(f"{sid}/{name}: engine pool {obj.pool.name!r} offers no offload")
                        continue
                    committed = frozenset(obj.pool.extents(obj.block_ids))
                    staged = frozenset(obj.pool.extents(obj.staged or ()))
                else:
                    committed, staged = _extents_of(obj._committed_roots()), _extents_of(obj.staged)
                gone = ledger.freed([committed] * len(sharers)) - staged
                if gone != committed:
                    skipped.append(f"{sid}/{name}: something else holds part of its storage; parking frees nothing")
                    continue
                moves = _by_pool(committed)
                if pool not in moves:
                    continue
                host = _host_pool_of(obj)
                if host == pool:
                    skipped.append(f"{sid}/{name}: parking would move its bytes within {pool!r}")
                    continue
                if host in budget and host_used.get(host, 0) + sum(moves.values()) > budget[host]:
                    skipped.append(f"{sid}/{name}: host pool {host!r} has no room under its budget")
                    continue
                host_used[host] = host_used.get(host, 0) + sum(moves.values())
                frees = {**moves, host: -sum(moves.values())}
                why = "least recently used session" if len(sharers) == 1 else f"least recently used; forks {sharers}"
                take(ReleaseAction("park", tuple(sharers), name, frees, why), [committed] * len(sharers))
                released.update((s, name) for s in sharers)
    if "evict" in levers and not done():
        candidates = []
        for rank, (sid, session) in enumerate(zip(sids, objs)):
            if sid in protected:
                continue
            for name, obj in session._objects.items():
                if obj.resident and obj.recompute_source is not None and session.recomputable(name):
                    candidates.append((obj.recompute_cost, rank, sid, name, obj))
        for cost, _, sid, name, obj in sorted(candidates, key=lambda c: c[:4]):
            if done():
                break
            extents = object_extents(obj)
            frees = _by_pool(ledger.freed([extents]))
            if not frees.get(pool):
                skipped.append(f"{sid}/{name}: evicting frees nothing in {pool!r} (storage held elsewhere)")
                continue
            reason = f"recomputable from {obj.recompute_source!r} (cost {cost:g})"
            take(ReleaseAction("evict", (sid,), name, frees, reason), [extents])
            released.add((sid, name))
    if "drop" in levers and not done():
        # Two passes: a session whose storage a later session shares frees nothing at first, and its bytes
        # once that one is dropped too (forks). Each pass is linear in the sessions.
        dropped: set[str] = set()
        for sid, session in itertools.chain(zip(sids, objs), zip(sids, objs)):
            if sid in protected or sid in dropped or done():
                continue
            # Objects this plan already parked or evicted were priced then; the rest leave with the session.
            objects = [object_extents(o) for n, o in session._objects.items() if (sid, n) not in released]
            frees = _by_pool(ledger.freed(objects, attr_sets.get(sid, _NO_EXTENTS)))
            if not frees.get(pool):
                note = f"{sid}: dropping it frees nothing in {pool!r} (its storage is held elsewhere)"
                if note not in skipped:
                    skipped.append(note)
                continue
            take(
                ReleaseAction("drop", (sid,), None, frees, "least recently used session"),
                objects,
                attr_sets.get(sid, _NO_EXTENTS),
            )
            dropped.add(sid)
    if not done():
        return None
    return ReleasePlan(pool, need, tuple(actions), tuple(skipped), unreleasable, weakref.ref(state))


_NO_EXTENTS: frozenset[Extent] = frozenset()


def _sessions_lru(state: ManagerState) -> tuple[list[str], list[Any]]:
    """Session ids and sessions, least recently used first.

    Two flat lists rather than a list of pairs: 100k new tuples would trigger full garbage collections over
    the whole (large) heap, which cost more than the walk itself."""
    sids, objs = [], []
    nodes, sid = state._nodes, state.least_recent
    while sid is not None:
        node = nodes[sid]
        sids.append(sid)
        objs.append(node[_S])
        sid = node[2]
    return sids, objs


def _extents_of(tree: Any) -> frozenset[Extent]:
    out: accounting.Extents = []
    accounting._collect(tree, out, {}, accounting.WalkReport())
    return frozenset(out)


def _host_pool_of(obj: Any) -> str:
    """Where parking ``obj`` puts its bytes: pinned host memory for JAX arrays and GPU tensors, pageable
    host memory for CPU torch tensors (torch pins only with CUDA)."""
    import sys

    if type(obj) is PagedKVHandle:
        return "cpu"  # the engine's offload copy: host memory it manages
    torch = sys.modules.get("torch")
    for leaf in _leaves(obj._committed_roots()):
        if torch is not None and isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
            return "cpu/unpinned_host"
    return "cpu/pinned_host"


def _leaves(tree: Any) -> list[Any]:
    import jax

    try:
        return jax.tree_util.tree_leaves(tree)
    except Exception:
        return []


def apply_plan(state: ManagerState, plan: ReleasePlan) -> ManagerState:
    """Carry out ``plan`` on the state it was made for; returns the new state (the input is unchanged).

    Raises:
      InvalidArgumentError: the plan was made for another state (plan again on the state you apply).
    """
    if type(state) is not ManagerState:
        _check_state(state, "apply_plan")
    if not isinstance(plan, ReleasePlan):
        raise InvalidArgumentError(f"`apply_plan`: expected a ReleasePlan, got {type(plan).__name__}.")
    if plan.made_for() is not state:
        raise InvalidArgumentError(
            "`apply_plan`: this plan was made for another state; its prices hold only there. Plan again on the "
            "state you apply it to."
        )
    for action in plan.actions:
        sid = action.session_ids[0]
        if action.kind == "park":
            state, _ = park(state, sid, action.name, with_sharers=len(action.session_ids) > 1)  # type: ignore[arg-type]
        elif action.kind == "evict":
            state, _ = evict(state, sid, action.name)  # type: ignore[arg-type]
        else:
            state = _drop_as_eviction(state, sid)
    return state


def _drop_as_eviction(state: ManagerState, sid: str) -> ManagerState:
    dropped, _ = drop_session(state, sid)
    meta = list(dropped._meta)
    meta[6] += 1  # evictions: a session the planner dropped is lost to its continuations
    return _state(dropped._nodes, tuple(meta), dropped._acct)


def over_budget(state: ManagerState) -> dict[str, tuple[int, int]]:
    """``{pool: (held, budget)}`` for every pool over its budget (``"*"`` covering each device pool)."""
    if not state.byte_budget:
        return {}
    held = {k[len("nbytes:") :]: v for k, v in stats(state).items() if k.startswith("nbytes:")}
    return _over(state, held)


def over_budget_objects(state: ManagerState, surplus: dict[str, int]) -> bool:
    """Whether a pool is over budget by the kept object totals plus a known attr ``surplus``: no walk."""
    totals = _track(state).totals
    for pool, limit in (state.byte_budget or {}).items():
        if pool == ANY_DEVICE:
            if any(held + surplus.get(p, 0) > limit for p, held in totals.items() if "/" not in p):
                return True
        elif totals.get(pool, 0) + surplus.get(pool, 0) > limit:
            return True
    return False


def attr_surplus(state: ManagerState) -> dict[str, int]:
    """Bytes per pool the attrs hold beyond what the objects hold (a walk of the attrs)."""
    objects = _track(state).totals
    with_attrs = {k[len("nbytes:") :]: v for k, v in stats(state).items() if k.startswith("nbytes:")}
    return {pool: n - objects.get(pool, 0) for pool, n in with_attrs.items() if n > objects.get(pool, 0)}


def _attr_bytes(attrs: Any) -> dict[str, int]:
    """Bytes per pool a session's attrs hold (no deduplication against the objects: an upper bound)."""
    return _by_pool(_extents_of(dict(attrs))) if attrs else {}


def _over(state: ManagerState, held: dict[str, int]) -> dict[str, tuple[int, int]]:
    budget = state.byte_budget or {}
    out = {}
    for pool, bytes_held in held.items():
        limit = budget.get(pool, budget.get(ANY_DEVICE) if "/" not in pool else None)
        if limit is not None and bytes_held > limit:
            out[pool] = (bytes_held, limit)
    return out


def enforce_budget(
    state: ManagerState, protect: Iterable[str | None] = (), *, levers: Iterable[str] = LEVERS
) -> ManagerState:
    """Bring every pool within the table's byte budget, releasing what `plan_release` chooses.

    Returns the state unchanged when every pool is within budget.

    Raises:
      BudgetExceededError: a pool cannot be brought within budget even by releasing everything allowed (say,
        a protected session alone holds more); nothing is changed then.
    """
    levers = tuple(levers)
    for pool, (held, limit) in over_budget(state).items():
        plan = plan_release(state, pool, held - limit, protect, levers=levers)
        if plan is None:
            releasable = _releasable(state, pool, protect, levers)
            raise BudgetExceededError(
                f"pool {pool!r} would hold {format_bytes(held)} against a budget of {format_bytes(limit)}, and releasing "
                f"everything allowed ({', '.join(levers) or 'no levers'}; protected: {sorted(map(str, protect))}) frees "
                f"only {format_bytes(releasable)}. The last change was refused; the state is as it was.",
                pool=pool,
                budget=limit,
                held=held,
                releasable=releasable,
            )
        state = apply_plan(state, plan)
    return state


def _releasable(state: ManagerState, pool: str, protect: Iterable[str | None], levers: tuple[str, ...]) -> int:
    """The most the planner could free in ``pool``: a plan for an unreachable need, stopped at exhaustion."""
    lo, hi = 0, sum(v for k, v in stats(state).items() if k == f"nbytes:{pool}")
    while lo < hi:  # the largest need that still has a plan (plans are monotone in the need)
        mid = (lo + hi + 1) // 2
        if plan_release(state, pool, mid, protect, levers=levers) is None:
            hi = mid - 1
        else:
            lo = mid
    return lo
