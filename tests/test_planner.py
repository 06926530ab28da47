"""Byte budgets and the release planner: sizes, plans that read like decisions, marginal bytes, enforcement."""

import contextlib
import itertools
import logging
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import functional_state as fs
from functional_state import (
    BudgetExceededError,
    DenseValue,
    InvalidArgumentError,
    LatentBuffer,
    ManagerState,
    SessionStateLostError,
    SessionStateManager,
    apply_plan,
    capacity_for,
    parse_bytes,
    plan_release,
)
from functional_state.memory.budget import normalize_budget
from helpers import assert_unchanged, promised_frees, snapshot

KIB = 1024


def _cpu(state) -> int:
    return fs.stats(state).get("nbytes:cpu", 0)


def _table(n=4, kib=4, budget=None):
    """n sessions ("s0" least recent), each with a 'cache' DenseValue of ``kib`` KiB and a small attr."""
    state = ManagerState.create(byte_budget=budget)
    for i in range(n):
        sid = f"s{i}"
        state, _ = fs.get_or_create(state, sid)
        state = fs.put(state, sid, "cache", DenseValue.create([torch.zeros(kib * 256)]))
        state = fs.set_attr(state, sid, "prompt", torch.zeros(16))
    return state


# --- sizes and budgets -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("40GiB", 40 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096), ("2k", 2048), (7, 7)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", [-1, "-5MiB", "1.5", "12 parsecs", "", True, 2.5, None, "0.5B"])
def test_parse_bytes_refuses_what_is_not_a_size(bad):
    with pytest.raises(InvalidArgumentError):
        parse_bytes(bad)


def test_budgets_name_pools_as_stats_does():
    assert normalize_budget({"cuda:0": "1GiB", "cpu/pinned_host": 5}) == {"cpu/pinned_host": 5, "cuda:0": 2**30}
    assert normalize_budget("2MiB") == {"*": 2 * 2**20} and normalize_budget(None) is None
    for bad in ({"gpu0": 1}, {"cuda:0/device": 1}, {"cuda:x": 1}, {"cpu": -1}, [1]):
        with pytest.raises(InvalidArgumentError):
            ManagerState.create(byte_budget=bad)
    assert ManagerState.create(byte_budget={"cuda:0": "40GiB"}).byte_budget == {"cuda:0": 40 * 2**30}


def test_capacity_for_gives_a_cap_a_runner_can_publish():
    assert capacity_for("8GiB", "627.5MiB") == 13 and capacity_for(10, 100) == 1
    manager = SessionStateManager(max_sessions=4)
    manager.raise_max_sessions(capacity_for("8GiB", "600MiB"))  # raises the floor ...
    assert manager.state.max_sessions == 13
    with pytest.raises(InvalidArgumentError):
        manager.raise_max_sessions(capacity_for("1GiB", "600MiB"))  # ... never lowers it
    with pytest.raises(InvalidArgumentError):
        capacity_for("1GiB", 0)


def test_resolve_session_state_config_carries_the_budget():
    config = fs.resolve_session_state_config(enable=True, byte_budget={"cpu": "1MiB"})
    assert config.byte_budget == {"cpu": 2**20} and config.enabled
    with pytest.raises(InvalidArgumentError, match="unknown pool"):
        fs.resolve_session_state_config(byte_budget={"nope": 1})


# --- plans -------------------------------------------------------------------------------------------------


def test_levers_run_least_loss_first_and_the_plan_reads_like_a_decision():
    state = _table(n=3)
    state = fs.put(state, "s2", "derived", LatentBuffer.create(recompute_source="cache").commit(torch.zeros(512)))
    plan = plan_release(state, "cpu", 8 * KIB, protect=["s2"])
    assert [a.kind for a in plan.actions] == ["park", "park"] and plan.freed == 8 * KIB
    text = str(plan)
    assert "park  s0/cache: cpu -4.0 KiB, cpu/unpinned_host +4.0 KiB (least recently used session)" in text
    assert "- s2: protected" in text and "attrs hold 192 B here" in text
    evict_plan = plan_release(state, "cpu", 2 * KIB, protect=["s0", "s1"], levers=["evict", "drop"])
    assert [(a.kind, a.name) for a in evict_plan.actions] == [("evict", "derived")]
    assert "recomputable from 'cache' (cost 1)" in str(evict_plan)
    drop_plan = plan_release(state, "cpu", 5 * KIB, levers=["drop"])
    assert [(a.kind, a.session_ids) for a in drop_plan.actions] == [("drop", ("s0",)), ("drop", ("s1",))]
    assert drop_plan.actions[0].frees == {"cpu": 4 * KIB + 64}  # the cache and its attrs leave with it


def test_evictions_go_cheapest_declared_cost_first():
    state = _table(n=1)
    for name, cost in (("pricey", 5.0), ("cheap", 0.5), ("mid", 2.0)):
        obj = LatentBuffer.create(recompute_source="cache", recompute_cost=cost).commit(torch.zeros(256))
        state = fs.put(state, "s0", name, obj)
    plan = plan_release(state, "cpu", 2 * KIB, levers=["evict"])
    assert [a.name for a in plan.actions] == ["cheap", "mid"]


def test_applied_plans_free_exactly_what_they_say():
    state = _table(n=4)
    for need, levers in ((4 * KIB, ["park"]), (9 * KIB, ["drop"]), (6 * KIB, ["park", "drop"])):
        plan = plan_release(state, "cpu", need, levers=levers)
        after = apply_plan(state, plan)
        assert _cpu(state) - _cpu(after) == plan.freed >= need


def test_a_fork_shared_with_a_protected_session_frees_nothing_and_the_planner_moves_on():
    state = fs.fork_session(_table(n=2), "s0", "f0")  # f0 shares s0's cache
    state, _ = fs.get_session(state, "s1")  # recency, least first: s0, f0, s1
    plan = plan_release(state, "cpu", 4 * KIB, protect=["f0"])
    assert [a.session_ids for a in plan.actions] == [("s1",)]
    assert any("s0/cache: its storage is shared with a protected session" in s for s in plan.skipped)
    after = apply_plan(state, plan)
    assert _cpu(state) - _cpu(after) == 4 * KIB
    both = plan_release(state, "cpu", 4 * KIB, levers=["park"])  # unprotected forks park together
    assert both.actions[0].session_ids == ("s0", "f0") and both.freed == 4 * KIB
    # The forks share the cache and the prompt attr, so dropping either alone frees nothing of those; the
    # pair frees them (the release is priced as a set, in recency order: s0 first, its bytes leave with f0).
    pair = plan_release(state, "cpu", 4 * KIB, protect=["s1"], levers=["drop"])
    assert [a.session_ids for a in pair.actions] == [("s0",), ("f0",)]
    assert pair.actions[0].frees == {} and pair.actions[1].frees == {"cpu": 4 * KIB + 64}
    assert _cpu(state) - _cpu(apply_plan(state, pair)) == 4 * KIB + 64
    state = fs.put(state, "f0", "own", DenseValue.create([torch.zeros(256)]))
    drops = plan_release(state, "cpu", 5 * KIB, protect=["s1"], levers=["drop"])
    assert [a.session_ids for a in drops.actions] == [("s0",), ("f0",)]
    assert drops.actions[0].frees == {} and drops.actions[1].frees == {"cpu": 5 * KIB + 64}
    assert _cpu(state) - _cpu(apply_plan(state, drops)) == 5 * KIB + 64


def test_an_attr_is_never_released_on_its_own():
    state = _table(n=1)
    cache = fs.lookup(state, "s0").get("cache").value[0]
    state = fs.set_attr(state, "s0", "view", cache[10:])  # an attr holds the cache's storage too
    assert plan_release(state, "cpu", KIB, levers=["park", "evict"]) is None
    plan = plan_release(state, "cpu", KIB, levers=["drop"])
    assert plan.actions[0].kind == "drop"


def test_an_impossible_need_gives_none_and_changes_nothing():
    state = _table(n=2)
    snap = snapshot(state)
    assert plan_release(state, "cpu", 1 << 30) is None
    assert plan_release(state, "cpu", 4 * KIB, protect=["s0", "s1"]) is None
    assert_unchanged(state, snap)


def test_bad_plan_arguments_raise_specific_errors_and_change_nothing():
    state = _table(n=2)
    snap = snapshot(state)
    for call, match in (
        (lambda: plan_release(state, "cpu", -1), "negative"),
        (lambda: plan_release(state, "gpu0", 1), "pool must be"),
        (lambda: plan_release(state, "cpu", 1, protect=["ghost"]), r"not in the table: \['ghost'\]"),
        (lambda: plan_release(state, "cpu", 1, levers=["burn"]), "unknown lever"),
        (
            lambda: apply_plan(fs.commit(state, "s0", "cache", [torch.ones(1)]), plan_release(state, "cpu", 1)),
            "another state",
        ),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            call()
    assert_unchanged(state, snap)


def test_planning_is_pure():
    state = _table(n=3)
    snap = snapshot(state)
    plan = plan_release(state, "cpu", 9 * KIB)
    assert_unchanged(state, snap)
    snap_after = snapshot(state)
    apply_plan(state, plan)
    assert_unchanged(state, snap_after)


def test_planner_scans_grow_as_n_log_n_at_worst():
    def calls(n):
        state = _table(n=n, kib=1)
        count = 0

        def profile(frame, event, arg):
            nonlocal count
            if event in ("call", "c_call"):
                count += 1

        fs.stats(state)  # accounting built before counting
        sys.setprofile(profile)
        try:
            plan_release(state, "cpu", n * KIB // 2, levers=["drop"])  # must walk half the sessions
        finally:
            sys.setprofile(None)
        return count

    small, large = calls(100), calls(1000)
    assert large < 10 * small * 1.5, (small, large)  # ~linear in n (quadratic would be ~100x)


# --- enforcement -------------------------------------------------------------------------------------------


def test_enforce_budget_keeps_pools_within_budget_and_refuses_what_cannot_fit():
    state = _table(n=3, budget={"cpu": 13 * KIB})
    assert fs.enforce_budget(state) is state  # 12 KiB of caches + 192 B of attrs: within budget
    over = _table(n=3, budget={"cpu": 10 * KIB})
    within = fs.enforce_budget(over)
    assert _cpu(within) <= 10 * KIB and fs.stats(within)["parks"] == 1
    tiny = _table(n=1, budget={"cpu": KIB})
    snap = snapshot(tiny)
    with pytest.raises(BudgetExceededError, match=r"pool 'cpu' would hold 4.1 KiB against a budget of 1.0 KiB") as e:
        fs.enforce_budget(tiny, protect=["s0"])
    assert (e.value.pool, e.value.budget, e.value.releasable) == ("cpu", KIB, 0)
    assert_unchanged(tiny, snap)


def test_the_shell_enforces_the_budget_after_writes_and_never_touches_the_writer():
    manager = SessionStateManager(byte_budget={"cpu": 9 * KIB})
    for i in range(3):
        manager.get_or_create_session(f"s{i}").put("cache", DenseValue.create([torch.zeros(1024)]))
        assert manager.stats()["nbytes:cpu"] <= 9 * KIB
    s = manager.stats()
    assert s["parks"] == 1 and s["nbytes:cpu/unpinned_host"] == 4 * KIB  # s0 parked to make room for s2
    assert torch.equal(manager.get_session("s0").get("cache").value[0], torch.zeros(1024))  # restored: s1 parked
    assert manager.stats()["restores"] == 1 and manager.stats()["parks"] == 2
    h = manager.get_session("s1")
    h.get("cache")  # restored on access (a parked object is restored before it is written)
    before = snapshot(manager.state)
    with pytest.raises(BudgetExceededError, match="cannot|would hold"):
        h.commit("cache", [torch.zeros(4096)])  # 16 KiB: cannot fit even alone
    assert_unchanged(manager.state, before)  # refused: nothing changed


def test_attr_writes_count_against_the_budget_without_false_refusals():
    manager = SessionStateManager(byte_budget={"cpu": 10 * KIB}, release_levers=["drop"])
    manager.get_or_create_session("old").put("cache", DenseValue.create([torch.zeros(1024)]))  # 4 KiB
    h = manager.get_or_create_session("new")
    for _ in range(50):  # the same 1 KiB attr rewritten: the kept upper bound grows, full checks reset it
        h.set_attr("prompt", torch.zeros(256))
    assert "old" in manager and manager.stats(exact=True)["nbytes:cpu"] == 5 * KIB
    h.set_attr("big", torch.zeros(1536))  # 6 KiB of attrs more: 11 KiB in all, so "old" must go
    assert "old" not in manager and manager.stats(exact=True)["nbytes:cpu"] == 7 * KIB
    before = snapshot(manager.state)
    with pytest.raises(BudgetExceededError):
        h.set_attr("huge", torch.zeros(4096))  # 16 KiB: cannot fit even alone
    assert_unchanged(manager.state, before)
    assert "huge" not in h.state.attrs


def test_pinned_sessions_are_never_released():
    manager = SessionStateManager(byte_budget={"cpu": 5 * KIB}, release_levers=["drop"])
    manager.get_or_create_session("a").put("cache", DenseValue.create([torch.zeros(1024)]))
    with manager.pin("a"), pytest.raises(BudgetExceededError):
        manager.get_or_create_session("b").put("cache", DenseValue.create([torch.zeros(1024)]))
    assert "a" in manager and "b" in manager and "cache" not in manager.get_session("b").state
    manager.get_session("b").put("cache", DenseValue.create([torch.zeros(1024)]))  # now "a" can be dropped
    assert "a" not in manager and manager.stats()["evictions"] == 1
    with pytest.raises(SessionStateLostError):
        manager.get_session("a")


class BudgetMachine(RuleBasedStateMachine):
    """After every operation each pool is within budget, or the operation raised and nothing changed; no
    protected session is ever touched; each applied plan frees exactly what stats() shows."""

    @initialize(budget_kib=st.integers(3, 12))
    def init(self, budget_kib):
        self.budget = budget_kib * KIB
        self.state = ManagerState.create(byte_budget={"cpu": self.budget})
        self.protected = set()

    def _live(self):
        return [s for s in ("a", "b", "c", "d", "e") if s in self.state]

    def _write(self, fn, writer):
        before = self.state
        snap = snapshot(before)
        protected_snaps = {s: snapshot(fs.lookup(before, s)) for s in self.protected if s in before}
        try:
            candidate = fn(before)
            self.state = fs.enforce_budget(candidate, protect=self.protected | {writer})
        except BudgetExceededError:
            assert_unchanged(before, snap)
            self.state = before
        for sid, snap_s in protected_snaps.items():
            assert sid in self.state  # a protected session is never dropped ...
            if sid != writer:
                assert_unchanged(fs.lookup(self.state, sid), snap_s)  # ... nor touched, unless it wrote

    @rule(sid=st.sampled_from("abcde"), kib=st.integers(1, 6))
    def write_cache(self, sid, kib):
        def fn(state):
            state, _ = fs.get_or_create(state, sid)
            return fs.put(state, sid, "cache", DenseValue.create([torch.zeros(kib * 256)]))

        self._write(fn, sid)

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def protect(self, data):
        sid = data.draw(st.sampled_from(self._live()))
        self.protected ^= {sid}

    @precondition(lambda self: self._live())
    @rule(
        data=st.data(),
        need_kib=st.integers(1, 8),
        levers=st.sampled_from([("park",), ("drop",), ("park", "evict", "drop")]),
    )
    def plan_and_apply(self, data, need_kib, levers):
        if need_kib and not _cpu(self.state):  # a pool that holds nothing: the call is refused, with why
            with pytest.raises(fs.InvalidArgumentError, match="holds nothing in pool 'cpu'"):
                plan_release(self.state, "cpu", need_kib * KIB, levers=levers)
            return
        plan = plan_release(
            self.state, "cpu", need_kib * KIB, protect=self.protected & set(self._live()), levers=levers
        )
        if plan is None:
            return
        for action in plan.actions:
            assert not set(action.session_ids) & self.protected
        after = apply_plan(self.state, plan)
        assert _cpu(self.state) - _cpu(after) == plan.freed
        self.state = after

    @invariant()
    def within_budget(self):
        if hasattr(self, "state"):
            assert _cpu(self.state) <= self.budget
            self.protected &= set(self._live())


BudgetMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBudgetMachine = BudgetMachine.TestCase


# --- issue 19: every plan frees what it says, measured -------------------------------------------------------


def _measured(before, after) -> dict[str, int]:
    """Bytes leaving each pool between two states (negative: arriving), as actions list them."""
    b, a = _pools(before), _pools(after)
    return {p: b.get(p, 0) - a.get(p, 0) for p in sorted({*a, *b}) if b.get(p, 0) != a.get(p, 0)}


def _one(objects: dict, protect_other: bool = True):
    """Session "s0" holding ``objects``; with ``protect_other``, a protected "keep" session beside it."""
    state = ManagerState.create()
    state, _ = fs.get_or_create(state, "s0")
    for name, obj in objects.items():
        state = fs.put(state, "s0", name, obj)
    if protect_other:
        state, _ = fs.get_or_create(state, "keep")
        state = fs.put(state, "keep", "cache", DenseValue.create([torch.zeros(256)]))
    return state


def test_the_evict_lever_never_reoffers_what_the_park_lever_took():
    # Regression (issue 19): a recomputable object was parked, then "evicted" again in the same plan, its
    # bytes promised twice.
    state = _one({"src": DenseValue.create([torch.zeros(256)]), "buf": LatentBuffer.create(recompute_source="src")})
    state = fs.commit(state, "s0", "buf", torch.zeros(256))
    # Parking src and buf frees 2 KiB; there is no third KiB to evict (the old plan promised buf twice).
    assert plan_release(state, "cpu", 3 * KIB, protect=["keep"], levers=["park", "evict"]) is None
    plan = plan_release(state, "cpu", 2 * KIB, protect=["keep"], levers=["park", "evict"])
    assert [(a.kind, a.name) for a in plan.actions] == [("park", "buf"), ("park", "src")]
    assert promised_frees(plan) == _measured(state, apply_plan(state, plan))


def test_an_eviction_is_priced_without_the_staged_payload_it_keeps():
    # Regression (issue 19): evicting was priced at the object's whole extents, staged bytes included.
    buf = LatentBuffer.create(recompute_source="src").commit(torch.zeros(256)).stage(torch.zeros(512))
    state = _one({"src": DenseValue.create([torch.zeros(8)]), "buf": buf})
    plan = plan_release(state, "cpu", 1, protect=["keep"], levers=["evict"])
    assert plan.actions[0].frees == {"cpu": KIB}  # the 2 KiB staged payload stays
    after = apply_plan(state, plan)
    assert promised_frees(plan) == _measured(state, after) and fs.lookup(after, "s0").get("buf").staged is not None
    assert plan_release(state, "cpu", KIB + 1, protect=["keep"], levers=["evict"]) is None


def test_parking_numpy_frees_nothing_and_is_not_offered():
    # Regression (issue 19): park keeps numpy arrays as they are, but the planner priced them as moved.
    state = _one({"np": DenseValue.create([np.zeros(128)])})
    assert plan_release(state, "cpu", 1, protect=["keep"], levers=["park"]) is None
    state = _one({"both": DenseValue.create([np.zeros(128), torch.zeros(256)])})
    plan = plan_release(state, "cpu", 1, protect=["keep"], levers=["park"])
    assert plan.actions[0].frees == {"cpu": KIB, "cpu/unpinned_host": -KIB}  # the torch half only
    assert promised_frees(plan) == _measured(state, apply_plan(state, plan))


def test_a_mixed_torch_and_jax_object_parks_into_both_host_pools():
    # Regression (issue 19): all its bytes were filed under cpu/unpinned_host; JAX's go to cpu/pinned_host.
    mixed = DenseValue.create([torch.zeros(256), jnp.zeros(512, jnp.float32)])
    state = _one({"mixed": mixed})
    plan = plan_release(state, "cpu", 1, protect=["keep"], levers=["park"])
    assert plan.actions[0].frees == {"cpu": 3 * KIB, "cpu/pinned_host": -2 * KIB, "cpu/unpinned_host": -KIB}
    assert promised_frees(plan) == _measured(state, apply_plan(state, plan))
    # A pinned-host budget with room for the torch half alone: the park would break it, so it is not planned.
    tight = ManagerState.create(byte_budget={"cpu": 16 * KIB, "cpu/pinned_host": KIB})
    tight, _ = fs.get_or_create(tight, "s0")
    tight = fs.put(tight, "s0", "mixed", mixed)
    assert plan_release(tight, "cpu", 1, levers=["park"]) is None
    assert "host pool 'cpu/pinned_host' has no room" in str(plan_release(tight, "cpu", 1, levers=["park", "drop"]))


def test_a_drop_lists_the_host_bytes_that_leave_with_it():
    # Regression (issue 19): a session parked earlier in the plan and then dropped took its host copy along,
    # and the drop did not say so.
    state = _one({"cache": DenseValue.create([torch.zeros(1024)]), "np": DenseValue.create([np.zeros(512)])})
    plan = plan_release(state, "cpu", 6 * KIB, protect=["keep"], levers=["park", "drop"])
    assert [a.kind for a in plan.actions] == ["park", "drop"]
    assert plan.actions[1].frees == {"cpu": 4 * KIB, "cpu/unpinned_host": 4 * KIB}
    assert promised_frees(plan) == _measured(state, apply_plan(state, plan))


def test_enforce_budget_never_installs_a_state_over_budget():
    # Regression (issue 19; found by tests/test_planner_machine.py): the park lever parked a recomputable
    # buffer and the evict lever then "evicted" it again, so the plan freed less than it promised and
    # enforce_budget returned a table holding 1152 B against a budget of 1024.
    state = ManagerState.create(byte_budget={"cpu": 1024})
    state, _ = fs.get_or_create(state, "a")
    state = fs.put(state, "a", "src", DenseValue.create([torch.ones(64)]))
    state = fs.put(state, "a", "x", LatentBuffer.create(recompute_source="src").commit(torch.ones(64)))
    state = fs.set_attr(state, "a", "prompt", torch.ones(32))
    state, _ = fs.get_or_create(state, "b")
    state = fs.put(state, "b", "x", DenseValue.create([torch.ones(256)]))
    enforced = fs.enforce_budget(state, protect=["b"])
    assert _pools(enforced)["cpu"] <= 1024


def test_enforce_budget_refuses_a_plan_that_does_not_hold(monkeypatch):
    # Regression (issue 19): enforce_budget installed whatever the applied plans left, over budget or not.
    state = _table(n=3, budget={"cpu": 10 * KIB})
    snap = snapshot(state)
    monkeypatch.setattr(
        fs.policy.enforce, "_carry_out", lambda s, plan, spill, refused: (s, [])
    )  # a plan that frees nothing it promised
    with pytest.raises(BudgetExceededError, match="even after the release plan for it") as e:
        fs.enforce_budget(state)
    assert (e.value.pool, e.value.budget, e.value.held) == ("cpu", 10 * KIB, 12 * KIB + 192)
    assert_unchanged(state, snap)


def test_a_str_protect_is_one_session_id():
    # Regression (issue 19): protect="s0" was read character by character ("s", "0": not in the table).
    state = _table(n=2)
    plan = plan_release(state, "cpu", 4 * KIB, protect="s0")
    assert [a.session_ids for a in plan.actions] == [("s1",)] and "s0: protected" in plan.skipped
    assert fs.enforce_budget(ManagerState.create(byte_budget=1), protect="s0") is not None
    with pytest.raises(InvalidArgumentError, match="protect must hold session ids"):
        plan_release(state, "cpu", 1, protect=[3])


def test_plans_are_deterministic():
    # Regression (issue 19): the protected sessions were listed in set order, which varies between runs.
    state = _table(n=9, kib=1)
    ids = [f"s{i}" for i in range(1, 9)]
    plan = plan_release(state, "cpu", KIB, protect=ids)
    assert [s for s in plan.skipped if s.endswith(": protected")] == [f"{sid}: protected" for sid in sorted(ids)]
    assert plan == plan_release(state, "cpu", KIB, protect=reversed(ids))


def test_planner_decisions_are_logged(caplog):
    # Regression (issue 19): parks, evictions and drops happened without a word in the log.
    state = _table(n=3, budget={"cpu": 10 * KIB})
    with caplog.at_level(logging.DEBUG, logger="functional_state"):
        fs.enforce_budget(state)
        fs.enforce_budget(_table(n=3, budget={"cpu": 10 * KIB}), levers=["drop"])
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "functional_state"]
    assert any(level == logging.INFO and "park  s0/cache" in msg for level, msg in records), records
    assert any(level == logging.INFO and "drop  s0" in msg for level, msg in records), records


def test_a_drop_after_an_eviction_prices_the_evicted_object_as_it_is_then():
    # The evicted buffer holds nothing; its item a fork still holds must not be counted as leaving again.
    state = _one({"src": DenseValue.create([torch.zeros(8)])}, protect_other=False)
    state = fs.put(state, "s0", "buf", LatentBuffer.create(recompute_source="src").commit(torch.zeros(256)))
    state = fs.fork_session(state, "s0", "f0")
    state = fs.commit(fs.commit(state, "f0", "buf", torch.zeros(256)), "s0", "buf", torch.zeros(256))
    assert plan_release(state, "cpu", KIB + 64, protect=["f0"], levers=["evict", "drop"]) is None
    plan = plan_release(state, "cpu", KIB, protect=["f0"], levers=["evict", "drop"])
    assert promised_frees(plan) == _measured(state, apply_plan(state, plan)) == {"cpu": KIB}


def test_the_same_object_under_two_names_is_parked_under_both_at_once():
    # Regression (issue 19; found by tests/test_planner_machine.py): the planner grouped sharers one way and
    # `park(with_sharers=True)` found them another, so enforcing a budget crashed with SharedStorageError.
    # Both now find every (session, name) holding the very object, and park it under all of them at once.
    obj = DenseValue.create([torch.ones(64)])
    state = ManagerState.create(byte_budget={"cpu": 768})
    for sid, name in (("a", "x"), ("b", "y")):
        state, _ = fs.get_or_create(state, sid)
        state = fs.put(state, sid, name, obj)
    state, _ = fs.get_or_create(state, "c")
    state = fs.put(state, "c", "x", DenseValue.create([torch.ones(192)]))
    snap = snapshot(state)
    plan = plan_release(state, "cpu", 1, levers=["park"], protect="c")
    assert plan is not None and [a.holders for a in plan.actions] == [(("a", "x"), ("b", "y"))]
    before = fs.stats(state, exact=True)
    enforced = fs.enforce_budget(state, protect=["c"], levers=["park"])
    assert_unchanged(state, snap)
    after = fs.stats(enforced, exact=True)
    assert before["nbytes:cpu"] - after["nbytes:cpu"] == plan.actions[0].frees["cpu"] == 256
    assert after["nbytes:cpu"] <= 768
    x, y = fs.lookup(enforced, "a").get("x"), fs.lookup(enforced, "b").get("y")
    assert x is y and x.parked


# --- mutation sample (issue 34): decisions the suite did not pin ------------------------------------------


def test_several_parks_in_one_plan_keep_the_host_pool_within_its_budget():
    # Each park was checked against the host pool's budget as if it were the plan's only one: three 4 KiB
    # parks into a pool with room for 5 KiB were all planned.
    state = _table(n=3, kib=4, budget={"cpu": 64 * KIB, "cpu/unpinned_host": 5 * KIB})
    assert plan_release(state, "cpu", 8 * KIB, levers=["park"]) is None  # room for one park only
    plan = plan_release(state, "cpu", 8 * KIB, levers=["park", "drop"])
    assert [a.kind for a in plan.actions].count("park") == 1  # then drops (s0's takes its host copy along)
    assert "s1/cache: host pool 'cpu/unpinned_host' has no room" in str(plan)
    after = apply_plan(state, plan)
    assert fs.stats(after, exact=True).get("nbytes:cpu/unpinned_host", 0) <= 5 * KIB


def test_an_object_is_never_evicted_together_with_its_recompute_source():
    # Candidates are chosen while every source is resident; a source evicted earlier in the same plan must
    # rule out what it would have rebuilt (nothing could recompute it then).
    state = _one(
        {
            "src": DenseValue.create([torch.zeros(256)]),
            "a": LatentBuffer.create(recompute_source="src", recompute_cost=1).commit(torch.zeros(256)),
            "b": LatentBuffer.create(recompute_source="a", recompute_cost=2).commit(torch.zeros(256)),
            "c": LatentBuffer.create(recompute_source="src", recompute_cost=3).commit(torch.zeros(256)),
        }
    )
    plan = plan_release(state, "cpu", 2 * KIB, protect=["keep"], levers=["evict"])
    assert [(a.kind, a.name) for a in plan.actions] == [("evict", "a"), ("evict", "c")]
    assert "s0/b: its recompute source 'a' leaves in this plan" in str(plan)
    after = fs.lookup(apply_plan(state, plan), "s0")
    assert after.get("b").resident and after.get("src").resident


fn = torch.from_numpy


F = 4  # bytes of a float32


def _pools(state, exact=True) -> dict[str, int]:
    return {k[len("nbytes:") :]: v for k, v in fs.stats(state, exact=exact).items() if k.startswith("nbytes:")}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    out = {p: before.get(p, 0) - after.get(p, 0) for p in {*before, *after}}
    return {p: n for p, n in sorted(out.items()) if n}


def _apply_and_measure(state, plan) -> fs.ManagerState:
    """Apply ``plan``: what it promised per pool is what the walk measures, and the kept figures agree."""
    before = snapshot(state)
    after = fs.apply_plan(state, plan)
    assert_unchanged(state, before)
    assert promised_frees(plan) == _delta(_pools(state), _pools(after)), str(plan)
    assert fs.stats(after) == fs.stats(after, exact=True)
    return after


# Each: three values over one 30-float buffer, every one covered by the other two (none frees a byte alone).
SHAPES = {
    "overlapping from_numpy ranges": lambda x, t: [fn(x[0:20]), fn(x[10:30]), fn(x)],
    "views of one storage at different sizes": lambda x, t: [t[:10], t[:20], t],
    "numpy views and from_numpy of their base": lambda x, t: [x[5:], fn(x[:25]), fn(x[3:])],
}


def _three(shape: str, budget=None, derived: bool = False) -> fs.ManagerState:
    x = np.arange(30, dtype=np.float32)
    t = torch.arange(30, dtype=torch.float32)
    s = fs.ManagerState.create(byte_budget=budget)
    for sid, v in zip("abc", SHAPES[shape](x, t)):
        s, _ = fs.get_or_create(s, sid)
        if derived:  # evictable: recomputed from a small source of its own
            s = fs.put(s, sid, "src", fs.DenseValue.create([np.zeros(1, np.float32)]))
            s = fs.put(s, sid, "r", fs.LatentBuffer.create(recompute_source="src").commit(v))
        else:
            s = fs.commit(fs.put(s, sid, "r", fs.LatentBuffer.create()), sid, "r", v)
    return s


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("levers", [fs.LEVERS, ("drop",)])
def test_three_sessions_that_free_nothing_alone_are_released_together(shape, levers):
    s = _three(shape)
    held = _pools(s)["cpu"]
    assert held == 30 * F and fs.stats(s) == fs.stats(s, exact=True)
    snap = snapshot(s)
    plan = fs.plan_release(s, "cpu", held, levers=levers)  # (the base tree: None, for any need)
    assert_unchanged(s, snap)
    assert plan is not None and [a.session_ids for a in plan.actions] == [("a",), ("b",), ("c",)]
    assert [a.kind for a in plan.actions] == ["drop"] * 3 and plan.freed == held
    assert "with the actions after it" in str(plan)
    after = _apply_and_measure(s, plan)
    assert _pools(after).get("cpu", 0) == 0
    small = fs.plan_release(s, "cpu", 1, levers=levers)  # one byte: the latest tentative drop is not needed
    one_extent = shape == "views of one storage at different sizes"  # (only all three let go of it)
    assert small is not None and len(small.actions) == (3 if one_extent else 2) and small.freed >= 1
    _apply_and_measure(s, small)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_evictions_that_free_nothing_alone_are_released_together(shape):
    s = _three(shape, derived=True)
    plan = fs.plan_release(s, "cpu", 30 * F, levers=["evict"])
    assert plan is not None and [(a.kind, a.session_ids, a.name) for a in plan.actions] == [
        ("evict", (sid,), "r") for sid in "abc"
    ]
    _apply_and_measure(s, plan)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_enforce_budget_releases_the_set_instead_of_refusing(shape):
    s = _three(shape, budget={"cpu": 8})
    snap = snapshot(s)
    enforced = fs.enforce_budget(s)  # (the base tree: BudgetExceededError, "frees only 0 B")
    assert_unchanged(s, snap)
    assert _pools(enforced).get("cpu", 0) <= 8 and fs.stats(enforced) == fs.stats(enforced, exact=True)


def test_a_release_the_set_does_not_need_is_taken_back():
    """Tentative drops that never free anything (forks of a protected session) leave the plan once the need
    is met: the plan drops only what frees bytes, and says why it passed over the rest."""
    s = fs.ManagerState.create()
    s, _ = fs.get_or_create(s, "p")
    s = fs.put(s, "p", "cache", fs.DenseValue.create([torch.zeros(256)]))
    for sid in ("f0", "f1"):
        s = fs.fork_session(s, "p", sid)  # share p's cache: dropping them frees nothing while p stays
    s, _ = fs.get_or_create(s, "own")
    s = fs.put(s, "own", "cache", fs.DenseValue.create([torch.zeros(64)]))
    s, _ = fs.get_session(s, "p")  # recency, least first: f0, f1, own, p
    plan = fs.plan_release(s, "cpu", 256, protect="p", levers=["drop"])
    assert [a.session_ids for a in plan.actions] == [("own",)] and plan.actions[0].frees == {"cpu": 256}
    assert "f0: dropping it frees nothing in 'cpu' alone (its storage is held elsewhere)" in plan.skipped
    _apply_and_measure(s, plan)
    # A tentative eviction that the set needs stays, one it does not is taken back.
    x = np.arange(30, dtype=np.float32)
    t = fs.ManagerState.create()
    for sid, v in (("a", fn(x[:10])), ("b", fn(x)), ("c", fn(x[20:]))):
        t, _ = fs.get_or_create(t, sid)
        t = fs.put(t, sid, "src", fs.DenseValue.create([np.zeros(1, np.float32)]))
        t = fs.put(t, sid, "r", fs.LatentBuffer.create(recompute_source="src").commit(v))
    plan = fs.plan_release(t, "cpu", 1, levers=["evict"])  # a frees nothing while b holds x; then b x[10:20]
    assert [a.session_ids for a in plan.actions] == [("b",)] and plan.actions[0].frees == {"cpu": 10 * F}
    assert "a/r: evicting it frees nothing in 'cpu' alone (its storage is held elsewhere)" in plan.skipped
    _apply_and_measure(t, plan)
    plan = fs.plan_release(t, "cpu", 30 * F, levers=["evict"])  # all of x: a is needed with b, and c
    assert [a.session_ids for a in plan.actions] == [("a",), ("b",), ("c",)]
    assert [a.frees for a in plan.actions] == [{}, {"cpu": 20 * F}, {"cpu": 10 * F}]
    _apply_and_measure(t, plan)


SIDS = ("s0", "s1", "s2", "s3")


N = 12


def _view(x, t, kind, lo, n):
    hi = min(lo + n, N)
    if kind == "from_numpy":
        return fn(x[lo:hi])  # loose: overlaps other from_numpy ranges without being equal
    if kind == "storage view":
        return t[lo:hi]  # one torch storage whatever the size
    if kind == "numpy view":
        return x[lo:hi]  # its base's extent
    return torch.ones(max(hi - lo, 1))  # an allocation of its own


view = st.tuples(
    st.sampled_from(["from_numpy", "storage view", "numpy view", "own"]), st.integers(0, N - 1), st.integers(1, N)
)


session = st.fixed_dictionaries(
    {
        "items": st.lists(view, min_size=1, max_size=2),
        "derived": st.one_of(st.none(), view),  # an evictable object recomputed from "r"
        "attr": st.one_of(st.none(), view),
        "park": st.booleans(),
    }
)


def _random_table(sessions):
    x = np.arange(N, dtype=np.float32)
    t = torch.arange(N, dtype=torch.float32)
    s = fs.ManagerState.create(max_sessions=8)
    for sid, spec in zip(SIDS, sessions):
        s, _ = fs.get_or_create(s, sid)
        s = fs.put(s, sid, "r", fs.LatentBuffer.create())
        for item in spec["items"]:
            s = fs.commit(s, sid, "r", _view(x, t, *item))
        if spec["derived"] is not None:
            s = fs.put(s, sid, "d", fs.LatentBuffer.create(recompute_source="r").commit(_view(x, t, *spec["derived"])))
        if spec["attr"] is not None:
            s = fs.set_attr(s, sid, "view", _view(x, t, *spec["attr"]))
        if spec["park"]:
            with contextlib.suppress(fs.SharedStorageError):  # (refused: another holder reads its storage)
                s, _ = fs.park(s, sid, "r")  # a parked object: host copies the drops let go of
    return s


def _best(state, pool, protected, levers) -> int:
    """The most any set of allowed releases frees in ``pool``, by brute force over every subset, each applied
    in the planner's precedence order and measured by the walk."""
    held = _pools(state).get(pool, 0)
    free = [sid for sid in fs.sessions(state) if sid not in protected]
    best = 0
    if "drop" in levers:
        for k in range(len(free) + 1):
            for subset in itertools.combinations(free, k):
                s = state
                for sid in subset:
                    s, _ = fs.drop_session(s, sid)
                best = max(best, held - _pools(s).get(pool, 0))
    if "evict" in levers:
        evictable = [sid for sid in free if fs.lookup(state, sid).objects.get("d") is not None]
        evictable = [sid for sid in evictable if fs.lookup(state, sid).recomputable("d")]
        for k in range(len(evictable) + 1):
            for subset in itertools.combinations(evictable, k):
                s = state
                for sid in subset:
                    s, _ = fs.evict(s, sid, "d")
                best = max(best, held - _pools(s).get(pool, 0))
    return best


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    sessions=st.lists(session, min_size=1, max_size=4),
    protect=st.sets(st.sampled_from(SIDS), max_size=2),
    levers=st.sampled_from([fs.LEVERS, ("drop",), ("evict",), ("evict", "drop")]),
    pool=st.sampled_from(["cpu", "cpu/unpinned_host"]),
    share=st.floats(0.01, 1.0),
)
def test_property_the_planner_finds_a_set_whenever_one_exists(sessions, protect, levers, pool, share):
    state = _random_table(sessions)
    protected = sorted(p for p in protect if p in state)
    held = _pools(state).get(pool, 0)
    if not held:
        return
    need = max(1, int(held * share))
    best = _best(state, pool, set(protected), levers)
    snap = snapshot(state)
    plan = fs.plan_release(state, pool, need, protect=protected, levers=levers)
    assert_unchanged(state, snap)  # pure
    if best >= need:
        assert plan is not None, f"a release set frees {best} B of the {need} B needed in {pool!r}"
    if plan is None:
        return
    assert plan.freed >= need
    assert not {sid for a in plan.actions for sid in a.session_ids} & set(protected)
    kept = {sid: snapshot(fs.lookup(state, sid)) for sid in protected}
    after = _apply_and_measure(state, plan)
    for sid, s_snap in kept.items():
        assert_unchanged(fs.lookup(after, sid), s_snap)
