"""Typed pool keys and the usage snapshot (issue 20): `Pool`, `Usage`, `fs.usage`, and `stats()` as its formatter."""

import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import DenseValue, InvalidArgumentError, ManagerState, Pool, SessionStateManager, Usage
from functional_state.memory.budget import limit_for, normalize_budget
from helpers import assert_unchanged, snapshot
from torch_bridge.harness.paged_engine import ReferenceKVEngine

KIB = 1024


@pytest.mark.parametrize(
    "text, pool",
    [
        ("cpu", Pool("cpu")),
        ("cuda:0", Pool("cuda:0")),
        ("tpu:12", Pool("tpu:12")),
        ("cpu/pinned_host", Pool("cpu", "pinned_host")),
        ("cpu/unpinned_host", Pool("cpu", "unpinned_host")),
    ],
)
def test_a_pool_reads_and_writes_the_text_stats_uses(text, pool):
    assert Pool.parse(text) == pool and str(pool) == text
    assert pool.is_device is (pool.memory_kind is None) is ("/" not in text)


@pytest.mark.parametrize("bad", ["cpu:0", "gpu:0", "cuda:0/pinned_host", "cpu/device", "", None, 3])
def test_a_pool_stats_never_names_is_refused_by_parse(bad):
    with pytest.raises(InvalidArgumentError, match="not a pool as stats"):
        Pool.parse(bad)


def test_a_star_budget_covers_device_pools_only():
    budget = normalize_budget({"*": 10, "cuda:1": 3})
    assert limit_for(budget, Pool("cuda:0")) == 10 and limit_for(budget, Pool("cuda:1")) == 3
    assert limit_for(budget, Pool("cpu", "pinned_host")) is None and limit_for(None, Pool("cpu")) is None


def _table() -> tuple[ManagerState, ReferenceKVEngine]:
    """Two sessions with torch and numpy objects, a torch attr, a fork, a parked object and engine KV blocks
    (with the engine, which must outlive the table for its pool to be reported)."""
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "cache", DenseValue.create([torch.zeros(256)]))
    state = fs.put(state, "a", "numpy", DenseValue.create([np.zeros(64, np.float32)]))
    state = fs.set_attr(state, "a", "prompt", torch.ones(32))
    state = fs.fork_session(state, "a", "b")
    state, _ = fs.park(state, "a", "numpy", with_sharers=True)
    engine = ReferenceKVEngine(num_blocks=8, block_size=2, heads=1, head_dim=4)
    state = fs.put(state, "b", "kv", fs.PagedKVHandle.create(engine.pool, engine.allocate(2)))
    return state, engine


def test_stats_is_the_usage_snapshot_formatted():
    state, _engine = _table()
    usage = fs.usage(state)
    stats = fs.stats(state)
    assert usage.as_stats() == stats and list(usage.as_stats()) == list(stats)  # same keys, same order
    assert {f"nbytes:{p}" for p in usage.by_pool} == {k for k in stats if k.startswith("nbytes:")}
    assert all(usage.nbytes(p) == stats[f"nbytes:{p}"] == usage.nbytes(str(p)) for p in usage.by_pool)
    assert usage.total_nbytes == stats["total_nbytes"] and usage.sessions == 2
    assert [kv.name for kv in usage.kv_pools] and all(
        stats[f"kv_pool:{kv.name}:held_nbytes"] == kv.held_nbytes for kv in usage.kv_pools
    )
    assert fs.usage(state, exact=True).as_stats() == fs.stats(state, exact=True)
    assert isinstance(usage, Usage) and usage.nbytes("cuda:7") == 0


def test_the_planner_and_the_manager_read_the_snapshot_not_the_keys():
    state, _engine = _table()
    usage = fs.usage(state)
    # A fork's cache is shared (the ledger counts two holders): the plan names both and parks them together.
    plan = fs.plan_release(state, "cpu", KIB)
    assert plan is not None and plan.actions[0].holders == (("a", "cache"), ("b", "cache"))
    after = fs.usage(fs.apply_plan(state, plan))
    assert {str(p): usage.nbytes(p) - after.nbytes(p) for p in usage.by_pool | after.by_pool} == {
        "cpu": KIB,
        "cpu/unpinned_host": -KIB,
    }
    assert fs.plan_release(state, "cpu", KIB, protect=["b"]) is None  # all of a is shared with b
    manager = SessionStateManager()
    manager.get_or_create_session("s").put("cache", DenseValue.create([torch.zeros(256)]))
    assert manager.nbytes_by_device() == fs.usage(manager.state).nbytes_by_pool() == {"cpu": KIB}
    assert usage.nbytes_by_pool() == {str(p): n for p, n in usage.by_pool.items()}


def test_usage_refuses_what_is_not_a_table():
    with pytest.raises(fs.InvalidTypeError, match="`usage` takes a ManagerState"):
        fs.usage({"not": "a table"})


def test_attr_bytes_in_a_pool_no_object_holds_count_against_a_star_budget():
    # Regression (issue 20): the shell's fast check read "*" budgets over the pools the objects hold only
    # (`"/" not in p` over the kept object totals), so attr bytes in a pool no object held were never checked
    # against it: a second attr took the table to 10 KiB under an 8 KiB budget, unnoticed until a full check.
    manager = SessionStateManager(byte_budget="8KiB", release_levers=["drop"])
    h = manager.get_or_create_session("a")
    h.set_attr("first", torch.zeros(KIB))  # 4 KiB: a full check, which makes the kept attr bound exact
    before = snapshot(manager.state)
    with pytest.raises(fs.BudgetExceededError, match="8.0 KiB"):
        h.set_attr("second", torch.zeros(1536))  # 6 KiB more: 10 KiB of attrs, over the budget
    assert_unchanged(manager.state, before)
    assert manager.stats(exact=True)["nbytes:cpu"] == 4 * KIB
