"""Pricing a park (`policy/pricing.py`): a plan's promise equals what the park moves, where a mutation sample
showed the suite blind (issue 34)."""

from __future__ import annotations

import torch

import functional_state as fs
from functional_state import DenseValue, ManagerState, apply_plan, plan_release
from functional_state.policy.pricing import Ledger, park_effect
from functional_state.table.manager_state import ledger_of
from helpers import promised_frees

KIB = 1024


def _table(obj, budget=None):
    state, _ = fs.get_or_create(ManagerState.create(byte_budget=budget), "s0")
    return fs.put(state, "s0", "views", obj)


def _pools(state):
    return {k[len("nbytes:") :]: v for k, v in fs.stats(state, exact=True).items() if k.startswith("nbytes:")}


def _views():
    """Two leaves over one 1 KiB torch storage: a park moves the storage once."""
    t = torch.zeros(256)
    return DenseValue.create([t[:128], t[128:]])


def test_a_storage_shared_by_several_leaves_is_priced_once():
    state = _table(_views())
    plan = plan_release(state, "cpu", 1, levers=["park"])
    assert plan.actions[0].frees == {"cpu": KIB, "cpu/unpinned_host": -KIB}  # charged once per leaf: -2 KiB
    after = apply_plan(state, plan)
    before, now = _pools(state), _pools(after)
    measured = {
        p: before.get(p, 0) - now.get(p, 0) for p in sorted({*before, *now}) if before.get(p, 0) != now.get(p, 0)
    }
    assert promised_frees(plan) == measured


def test_park_effect_counts_one_host_copy_per_storage():
    obj = _views()
    committed, parked = park_effect(obj, Ledger(ledger_of(_table(obj)).refs, {}))
    assert sum(e[2] - e[1] for e in committed) == KIB
    assert sum(e[2] - e[1] for e in parked) == KIB


def test_a_host_budget_with_room_for_the_storage_admits_the_park():
    # Priced per leaf, the park looked twice its size and a host pool with exactly its room refused it.
    state = _table(_views(), budget={"cpu": 16 * KIB, "cpu/unpinned_host": KIB})
    plan = plan_release(state, "cpu", 1, levers=["park"])
    assert plan is not None and [a.kind for a in plan.actions] == ["park"]
