"""A state machine over the pure release planner (issue 19): every plan it applies frees what it says.

Sessions hold objects of every type (LatentBuffer, ArrayRing, DenseValue of torch, JAX, numpy and mixed
torch+JAX leaves, engine-backed PagedKVHandle), with staged payloads, forks and attrs, under budgets on the
cpu device pool and both host pools. After every `enforce_budget`: each budgeted pool is at or under its
budget, or `BudgetExceededError` was raised and the input is bitwise unchanged; protected sessions are never
touched. After every `plan_release` + `apply_plan`: each action's ``frees`` add up, per pool, to the change
`stats(exact=True)` measures, and equal inputs give equal plans.
"""

import jax.numpy as jnp
import numpy as np
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

import functional_state as fs
from functional_state import (
    ArrayRing,
    BudgetExceededError,
    DenseValue,
    LatentBuffer,
    ManagerState,
    PagedKVHandle,
    apply_plan,
    plan_release,
)
from functional_state.policy.enforce import over_budget
from functional_state.table.manager_state import ledger_of
from helpers import assert_unchanged, promised_frees, snapshot
from torch_bridge.harness.paged_engine import ReferenceKVEngine

SIDS = ("a", "b", "c", "d")
NAMES = ("x", "y", "z")
KINDS = ("torch", "jax", "numpy", "mixed", "buffer", "buffer", "ring", "kv")  # buffers twice: steps, forks, evictions
POOLS = ("cpu", "cpu/unpinned_host", "cpu/pinned_host")
UNIT = 256  # bytes: every object is a few units


def _pools(state) -> dict[str, int]:
    return {k[len("nbytes:") :]: v for k, v in fs.stats(state, exact=True).items() if k.startswith("nbytes:")}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Bytes leaving each pool (negative: arriving), as a plan's ``frees`` lists them."""
    out = {p: before.get(p, 0) - after.get(p, 0) for p in {*before, *after}}
    return {p: n for p, n in sorted(out.items()) if n}


def _plan_key(plan):
    return None if plan is None else (plan.pool, plan.need, plan.actions, plan.skipped, plan.unreleasable)


class PlannerMachine(RuleBasedStateMachine):
    @initialize(
        cpu=st.integers(3, 20),
        unpinned=st.one_of(st.none(), st.integers(0, 8)),
        pinned=st.one_of(st.none(), st.integers(0, 8)),
        star=st.booleans(),
    )
    def init(self, cpu, unpinned, pinned, star):
        budget = {"*" if star else "cpu": cpu * UNIT}  # "*": every device pool, here the one "cpu"
        if unpinned is not None:
            budget["cpu/unpinned_host"] = unpinned * UNIT
        if pinned is not None:
            budget["cpu/pinned_host"] = pinned * UNIT
        self.budget = budget
        self.state = ManagerState.create(max_sessions=8, byte_budget=budget)
        self.protected: set[str] = set()
        self.engine = ReferenceKVEngine(num_blocks=64, block_size=2, heads=2, head_dim=8, offload=True)
        self.blocks = 0  # block ids handed out (never reused: the pure table does not free engine blocks)

    # --- building blocks -----------------------------------------------------------------------------------

    def _make(self, kind: str, units: int):
        n = units * UNIT
        if kind == "torch":
            return DenseValue.create([torch.ones(n // 4)])
        if kind == "jax":
            return DenseValue.create([jnp.ones(n // 4, jnp.float32)])
        if kind == "numpy":
            return DenseValue.create([np.ones(n // 8)])
        if kind == "mixed":  # half in torch (pageable host when parked), half in JAX (pinned host)
            return DenseValue.create([torch.ones(n // 8), jnp.ones(n // 8, jnp.float32)])
        if kind == "buffer":
            return LatentBuffer.create(recompute_source="src", recompute_cost=float(units)).commit(torch.ones(n // 4))
        if kind == "ring":
            return ArrayRing.create(units, (UNIT // 4,), recompute_source="src", recompute_cost=float(units))
        blocks = min(units, 64 - self.blocks)
        ids = tuple(range(self.blocks, self.blocks + blocks))
        self.blocks += blocks
        self.engine.allocated.update(ids)
        return PagedKVHandle.create(self.engine.pool, ids, recompute_source="src")

    def _live(self):
        return [s for s in SIDS if s in self.state]

    def _object(self, sid, name):
        return fs.lookup(self.state, sid).objects.get(name) if sid in self.state else None

    def _enforce(self, candidate, writer=None):
        """`enforce_budget` on ``candidate``: within budget, or refused with nothing changed."""
        protect = (self.protected | {writer}) & set(candidate.session_ids) if writer else self.protected
        snap = snapshot(candidate)
        kept = {s: snapshot(fs.lookup(candidate, s)) for s in protect if s in candidate}
        for pool, (held, limit) in sorted(over_budget(candidate).items()):
            self._check_plan(candidate, pool, held - limit, sorted(protect), fs.LEVERS)  # what enforcing plans first
        try:
            enforced = fs.enforce_budget(candidate, protect=sorted(protect))
        except BudgetExceededError:
            assert_unchanged(candidate, snap)
            event("enforce_budget refused")
            return None
        event("enforce_budget released" if enforced is not candidate else "enforce_budget: within budget")
        assert_unchanged(candidate, snap)  # pure: the input is untouched either way
        held = _pools(enforced)
        for pool, limit in self.budget.items():
            assert held.get("cpu" if pool == "*" else pool, 0) <= limit, (pool, held, self.budget)
        for sid, s_snap in kept.items():
            assert sid in enforced
            assert_unchanged(fs.lookup(enforced, sid), s_snap)
        return enforced

    def _write(self, sid, fn, create=True):
        state = self.state
        if create:
            state, _ = fs.get_or_create(state, sid)
        candidate = fn(state)
        enforced = self._enforce(candidate, writer=sid)
        if enforced is not None:
            self.state = enforced
        self.protected &= set(self.state.session_ids)

    # --- rules ---------------------------------------------------------------------------------------------

    @rule(sid=st.sampled_from(SIDS), name=st.sampled_from(NAMES), kind=st.sampled_from(KINDS), units=st.integers(1, 6))
    def put(self, sid, name, kind, units):
        obj = self._make(kind, units)

        def fn(state):
            if obj.recompute_source is not None and "src" not in fs.lookup(state, sid).objects:
                state = fs.put(state, sid, "src", DenseValue.create([torch.ones(UNIT // 4)]))
            return fs.put(state, sid, name, obj)

        self._write(sid, fn)

    @rule(sid=st.sampled_from(SIDS), name=st.sampled_from(NAMES), units=st.integers(1, 3))
    def stage(self, sid, name, units):
        obj = self._object(sid, name)
        if obj is None or not obj.resident or isinstance(obj, (PagedKVHandle, ArrayRing)):
            return
        payload = [torch.ones(units * UNIT // 4)] if isinstance(obj, DenseValue) else torch.ones(units * UNIT // 4)
        self._write(sid, lambda state: fs.stage(state, sid, name, payload))

    @rule(sid=st.sampled_from(SIDS), name=st.sampled_from(NAMES), units=st.integers(1, 3))
    def commit(self, sid, name, units):
        """A step: a buffer gains an item (forks then share the older items, not the object)."""
        obj = self._object(sid, name)
        if isinstance(obj, LatentBuffer) and obj.resident:
            self._write(sid, lambda state: fs.commit(state, sid, name, torch.ones(units * UNIT // 4)))

    @rule(pick=st.integers(0, 11), steps=st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=6))
    def lazy_commits(self, pick, steps):
        """Commits in a row with no budget check between them, each a deferred ledger step: whenever read
        between them, `stats()` reads what `stats(exact=True)` measures, and the kept totals plus the bytes
        the deferred steps added bound the exact ones (what the shell's budget decides by). The last table is
        then enforced as any write."""
        buffers = [
            (sid, name)
            for sid in self._live()
            for name in NAMES
            if isinstance(obj := self._object(sid, name), LatentBuffer) and obj.resident
        ]
        if not buffers:
            return
        sid, name = buffers[pick % len(buffers)]
        state = self.state
        for units, read in steps:
            state = fs.commit(state, sid, name, torch.ones(units * UNIT // 4))
            acct = ledger_of(state)
            step, kept = acct.deferred, dict(acct.kept_totals)  # (before any read folds the steps)
            if read:
                event("lazy_commits: read between deferred steps")
                assert fs.stats(state) == fs.stats(state, exact=True)
                for pool, held in ledger_of(state).totals.items():
                    extra = step.added_bytes if step is not None and pool in step.pools else 0
                    assert held <= kept.get(pool, 0) + extra, (pool, held, kept, step)
        enforced = self._enforce(state, writer=sid)
        if enforced is not None:
            self.state = enforced
        self.protected &= set(self.state.session_ids)

    @rule(src=st.sampled_from(SIDS), new=st.sampled_from(SIDS))
    def fork(self, src, new):
        if src not in self.state or new in self.state:
            return
        self._write(new, lambda state: fs.fork_session(state, src, new), create=False)

    @rule(
        src=st.sampled_from(SIDS),
        src_name=st.sampled_from(NAMES),
        sid=st.sampled_from(SIDS),
        name=st.sampled_from(NAMES),
    )
    def share(self, src, src_name, sid, name):
        """The very object another session holds, put here too (under the same name or another)."""
        obj = self._object(src, src_name)
        if obj is None or obj.recompute_source is not None:
            return  # its source would have to come along
        self._write(sid, lambda state: fs.put(state, sid, name, obj))

    @rule(
        src=st.sampled_from(SIDS),
        src_name=st.sampled_from(NAMES),
        sid=st.sampled_from(SIDS),
        name=st.sampled_from(NAMES),
    )
    def alias(self, src, src_name, sid, name):
        """Another object over the same storage (a view of a torch value): the ledger counts a second holder
        of its extents that is not the same object, so the planner must find that parking either frees
        nothing, never take the pair for forks of one object (issue 20: holders from the ledger's counts)."""
        obj = self._object(src, src_name)
        if not isinstance(obj, DenseValue) or not obj.resident or not isinstance(obj.value[0], torch.Tensor):
            return
        view = DenseValue.create([obj.value[0][: max(1, obj.value[0].numel() // 2)]])
        self._write(sid, lambda state: fs.put(state, sid, name, view))

    @rule(sid=st.sampled_from(SIDS))
    def attr(self, sid):
        self._write(sid, lambda state: fs.set_attr(state, sid, "prompt", torch.ones(UNIT // 8)))

    @rule(sid=st.sampled_from(SIDS))
    def toggle_protect(self, sid):
        if sid in self.state:
            self.protected ^= {sid}

    @rule(sid=st.sampled_from(SIDS), name=st.sampled_from(NAMES))
    def restore(self, sid, name):
        obj = self._object(sid, name)
        if obj is not None and obj.parked:
            self._write(sid, lambda state: fs.restore(state, sid, name)[0])

    @rule()
    def enforce(self):
        enforced = self._enforce(self.state)
        if enforced is not None:
            self.state = enforced

    @rule(
        pool=st.sampled_from(("cpu", *POOLS)),
        eighths=st.integers(1, 8),
        levers=st.sampled_from([fs.LEVERS, ("park",), ("evict",), ("drop",), ("evict", "drop")]),
    )
    def plan_and_apply(self, pool, eighths, levers):
        held = _pools(self.state).get(pool, 0)
        if not held:
            return
        need = max(1, held * eighths // 8)  # a share of what the pool holds: often feasible, sometimes not
        after = self._check_plan(self.state, pool, need, sorted(self.protected), levers)
        if after is not None:
            self.state = after
            self.protected &= set(self.state.session_ids)

    def _check_plan(self, state, pool, need, protect, levers):
        """Plan, apply, and measure: each action's ``frees`` add up to the change `stats(exact=True)` shows."""
        plan = plan_release(state, pool, need, protect=protect, levers=levers)
        again = plan_release(state, pool, need, protect=protect[::-1], levers=levers)
        assert _plan_key(plan) == _plan_key(again)  # equal inputs, equal plans
        if plan is None:
            event("plan: none")
            return None
        event("plan: " + "+".join(sorted({a.kind for a in plan.actions})))
        for action in plan.actions:
            assert not set(action.session_ids) & set(protect)
        kept = {s: snapshot(fs.lookup(state, s)) for s in protect}
        after = apply_plan(state, plan)
        assert promised_frees(plan) == _delta(_pools(state), _pools(after)), str(plan)
        assert plan.freed >= need
        for sid, s_snap in kept.items():
            assert_unchanged(fs.lookup(after, sid), s_snap)
        return after


PlannerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,  # the same 300 runs every time: CI stays deterministic
    suppress_health_check=list(HealthCheck),
)
TestPlannerMachine = PlannerMachine.TestCase
