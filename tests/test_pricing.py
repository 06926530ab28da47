"""Pricing a park (`policy/pricing.py`): a plan's promise equals what the park moves, where a mutation sample
showed the suite blind (issue 34)."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_state as fs
from functional_state import DenseValue, ManagerState, apply_plan, plan_release
from functional_state.memory.accounting import union_by_device
from functional_state.memory.extents import Extent, Loose
from functional_state.memory.overlaps import pool_index
from functional_state.policy.pricing import Ledger, park_effect
from functional_state.policy.snapshot import AttrHolders
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


def _naive(ledger, d, d_attrs, pools):
    """Bytes per pool a change frees: the union of every extent held before less that of every one after."""
    keys = {*ledger.refs, *ledger.attr_holders.closed, *ledger.attr_holders.open, *ledger.objects, *d, *d_attrs}
    before = [e for e in keys if ledger.held(e)]
    after = [e for e in keys if ledger.held(e, d[e], d_attrs[e])]
    ub, ua = union_by_device(before), union_by_device(after)
    return {p: ub.get(p, 0) - ua.get(p, 0) for p in pools}


extent = st.tuples(st.sampled_from(["cpu", "cuda:0"]), st.integers(0, 200), st.integers(1, 60), st.booleans())


def _key(pool, start, size, loose):
    e = Extent(pool, start, start + size)
    return Loose(*e) if loose else e


class _Unreadable:
    """A closed attr map that must not be read (its pool holds none of the change's extents)."""

    def __iter__(self):
        raise AssertionError("the pricing read every closed attr extent")

    def get(self, e, default=0):
        return default

    def __contains__(self, e):
        return False


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    objects=st.lists(st.tuples(extent, st.integers(1, 2)), max_size=30),
    attrs=st.lists(extent, max_size=10),
    steps=st.lists(
        st.lists(st.tuples(st.integers(0, 40), st.sampled_from([-1, 1, -2])), min_size=1, max_size=4),
        min_size=1,
        max_size=4,
    ),
)
def test_property_a_change_is_priced_as_the_union_of_everything_held(objects, attrs, steps):
    refs: dict = {Loose(p, 1000, 1001): 1 for p in ("cpu", "cuda:0")}  # (both pools hold a loose extent)
    for spec, n in objects:
        k = _key(*spec)
        refs[k] = refs.get(k, 0) + n
    closed = Counter(_key(*a) for a in attrs)
    overlaps = {p: pool_index(refs, p) for p in ("cpu", "cuda:0")}
    holders = AttrHolders(closed, Counter(), {})
    holders.pools = {e[0] for e in closed}
    ledger = Ledger(refs, holders, overlaps)
    held = sorted(refs)
    for step in steps:  # successive changes, each taken: the ledger's own deltas are priced too
        d: Counter = Counter()
        for i, n in step:
            if held:
                e = held[i % len(held)]
                if refs[e] + ledger.objects[e] + d[e] + n >= 0:
                    d[e] += n
        d_attrs: Counter = Counter()
        change = ledger.price(d, d_attrs)
        want = _naive(ledger, d, d_attrs, ("cpu", "cuda:0"))
        assert {str(p): n for p, n in change.frees.items()} == {p: n for p, n in want.items() if n}, (refs, d)
        ledger.take(change)


def test_a_change_reads_no_attr_extent_of_a_pool_no_closed_attr_holds():
    refs = {Loose("cpu", 0, 40): 1, Extent("cpu", 20, 60): 1}
    holders = AttrHolders(_Unreadable(), Counter(), {})
    holders.pools = {"cuda:0"}  # the attr index's per-pool totals: closed attrs hold cuda:0 alone
    ledger = Ledger(refs, holders, {"cpu": pool_index(refs, "cpu")})
    change = ledger.change([frozenset({Extent("cpu", 20, 60)})])
    assert {str(p): n for p, n in change.frees.items()} == {"cpu": 20}
