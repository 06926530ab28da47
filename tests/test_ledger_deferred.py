"""The ledger's deferred steps (issue 39): a ring commit's ledger step is kept as a `Deferred` record and
folded into the exact holder counts in batches. What must hold at every moment: the kept totals plus the
bytes the deferred steps added bound the exact totals from above (so the budget is never exceeded), `stats()`
reads what `stats(exact=True)` measures whenever it is read, every old table reads the same, the steps are
folded at the latest every `FOLD_EVERY`, and a write the exact figure puts over the budget is refused or
spilled as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import LatentBuffer, ManagerState, SessionStateManager
from functional_state.memory import accounting
from functional_state.policy.enforce import over_budget_objects
from functional_state.shell import slot as slot_module
from functional_state.table.ledger import FOLD_EVERY, Acct
from functional_state.table.manager_state import ledger_of
from helpers import recheck_answers

KIB = 1024


@pytest.fixture(autouse=True)
def _no_engine_pools(monkeypatch):
    """No engine pool of another test in sight (as in tests/test_budget_recheck.py): these managers hold none."""
    monkeypatch.setattr(accounting, "POOL_STORAGES", {})
    monkeypatch.setattr(slot_module, "LIVE_POOLS", {})


def _nbytes(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k.startswith("nbytes:")}


def _ring(budget: int | None = 1 << 30, maxlen: int = 4) -> ManagerState:
    state, _ = fs.get_or_create(ManagerState.create(byte_budget=budget), "a")
    state, _ = fs.get_or_create(state, "b")
    state = fs.put(state, "a", "ring", LatentBuffer.create(maxlen=maxlen))
    return fs.put(state, "b", "ring", LatentBuffer.create(maxlen=maxlen))


def _exact_totals(state: ManagerState) -> dict[str, int]:
    """The object totals of a ledger built from scratch over the table's sessions."""
    return dict(Acct.build(fs.lookup(state, sid) for sid in state.session_ids).totals)


def test_a_ring_commit_is_deferred_and_its_bound_covers_the_exact_totals() -> None:
    state = _ring()
    items = [torch.zeros(256 * (1 + k % 3)) for k in range(8)]  # (sizes differ: the totals move)
    for k in range(3 * FOLD_EVERY):
        state = fs.commit(state, "ab"[k % 2], "ring", items[k % 8] if k % 5 else torch.zeros(64))
        acct = ledger_of(state)
        step = acct.deferred
        assert step is not None and step.depth < FOLD_EVERY  # deferred, and folded at the latest every FOLD_EVERY
        exact = _exact_totals(state)
        for pool, held in exact.items():
            bound = acct.kept_totals.get(pool, 0) + (step.added_bytes if pool in step.pools else 0)
            assert held <= bound, (k, pool, held, bound)


def test_the_deferred_steps_are_folded_in_batches() -> None:
    # A steady ring: without the batched fold the chain of deferred steps (and the bound) would grow forever.
    state = _ring()
    depths, chain = [], 0
    for _ in range(2 * FOLD_EVERY + 3):
        state = fs.commit(state, "a", "ring", torch.zeros(256))
        step = ledger_of(state).deferred
        depths.append(step.depth)
        chain = 0
        while step is not None:
            chain, step = chain + 1, step.previous
        assert chain <= FOLD_EVERY
    assert depths[FOLD_EVERY - 1] == 0 and depths[2 * FOLD_EVERY - 1] == 0  # (folded at those steps)
    assert max(depths) == FOLD_EVERY - 1
    assert ledger_of(state).deferred.added_bytes == 3 * KIB  # (the bound restarts at each fold)


@pytest.mark.parametrize("reads", ["stats", "stats_exact", "plan", "park", "fork"])
def test_a_read_of_the_table_sees_the_folded_counts(reads: str) -> None:
    # Whatever reads the counts (`stats`, the planner, a park, a fork) reads them exact, deferred steps folded.
    state = _ring()
    for k in range(FOLD_EVERY // 2 + 1):  # (not at a fold)
        state = fs.commit(state, "a", "ring", torch.zeros(256 * (1 + k % 2)))
    assert ledger_of(state).deferred.depth > 1
    if reads == "stats":
        assert _nbytes(fs.stats(state)) == _nbytes(fs.stats(state, exact=True))
    elif reads == "stats_exact":
        assert dict(ledger_of(state).totals) == _exact_totals(state)
    elif reads == "plan":
        plan = fs.plan_release(state, "cpu", 1, levers=["park"])
        assert plan.actions
        assert dict(ledger_of(state).totals) == _exact_totals(state)
    elif reads == "park":
        parked, _ = fs.park(state, "a", "ring")
        assert _nbytes(fs.stats(parked)) == _nbytes(fs.stats(parked, exact=True))
    else:
        forked = fs.fork_session(state, "a", "c")
        assert _nbytes(fs.stats(forked)) == _nbytes(fs.stats(forked, exact=True))
        assert dict(ledger_of(forked).totals) == _exact_totals(forked)


def test_every_old_table_reads_the_same_after_later_steps_and_folds() -> None:
    state = _ring()
    versions = []
    for k in range(FOLD_EVERY + 10):
        state = fs.commit(state, "ab"[k % 3 == 0], "ring", torch.zeros(256 * (1 + k % 4)))
        versions.append((state, _exact_totals(state)))
    for old, totals in versions:  # (read after every later step and the fold among them)
        assert dict(ledger_of(old).totals) == totals
        assert _nbytes(fs.stats(old)) == _nbytes(fs.stats(old, exact=True))


def test_a_write_near_the_budget_is_decided_by_the_exact_figure() -> None:
    # The bound counts every item added (here 8 x 1 KiB since the last fold); the exact figure holds the ring's
    # 4 KiB. A commit the bound alone would refuse is decided exactly, and passes.
    budget = 6 * KIB
    state = _ring(budget={"cpu": budget})
    for _ in range(FOLD_EVERY + 8):
        state = fs.commit(state, "a", "ring", torch.zeros(256))
    acct = ledger_of(state)
    assert acct.kept_totals["cpu"] + acct.deferred.added_bytes > budget  # (the bound alone would be over)
    assert not over_budget_objects(state, {"cpu": KIB})  # 4 KiB held + 1 KiB of attrs: within
    assert over_budget_objects(state, {"cpu": 3 * KIB})  # 4 + 3 > 6: over


def _manager(budget: int, levers: tuple[str, ...] = (), spill=None) -> tuple[SessionStateManager, fs.SessionHandle]:
    m = SessionStateManager(byte_budget={"cpu": budget}, release_levers=levers, spill=spill)
    h = m.get_or_create_session("a")
    h.put("buf", LatentBuffer.create(maxlen=4))
    h.set_attr("prompt", torch.zeros(64, dtype=torch.uint8))
    return m, h


@pytest.mark.parametrize("steady", [3, FOLD_EVERY - 2, FOLD_EVERY + 5])
def test_a_commit_over_the_budget_is_refused_whatever_the_deferred_steps(steady: int) -> None:
    # A steady ring of 1 KiB items (the commits answered by the shell's recheck and memo from the bound), then
    # one item that puts the exact figure over the budget: refused, the table unchanged.
    m, h = _manager(4 * KIB + 512)
    for _ in range(steady):
        h.commit("buf", torch.zeros(256))
    before = m.stats()
    with pytest.raises(fs.BudgetExceededError):
        h.commit("buf", torch.zeros(512))  # (2 KiB in, 1 KiB out: 5 KiB + the prompt)
    assert m.stats() == before == m.stats(exact=True)
    assert m.stats()["nbytes:cpu"] <= 4 * KIB + 512


def test_a_commit_over_the_budget_spills_another_session_as_before() -> None:
    handed: list[str] = []

    def spill(table: ManagerState, sid: str) -> bool:
        handed.append(sid)
        return True

    m, h = _manager(6 * KIB, levers=("drop",), spill=spill)
    other = m.get_or_create_session("b")
    other.put("buf", LatentBuffer.create(maxlen=4))
    other.commit("buf", torch.zeros(512))  # 2 KiB
    for _ in range(FOLD_EVERY + 3):
        h.commit("buf", torch.zeros(256))  # "a": 4 KiB, steady
    h.commit("buf", torch.zeros(512))  # 5 KiB + 2 KiB + the prompt: over; "b" goes
    assert handed == ["b"]
    assert "b" not in m
    assert m.stats() == m.stats(exact=True)
    assert m.stats()["nbytes:cpu"] <= 6 * KIB


def test_a_steady_commit_is_answered_by_the_recheck_across_folds() -> None:
    # The recheck follows the ledger's steps (`Deferred.follows`), across a fold too: a steady ring of one
    # session is answered by it every commit once it is kept (once the ring is full: a fold that moves a total,
    # as while it fills, makes a new totals map, and the next commit is checked in full).
    m, h = _manager(1 << 20)
    for _ in range(FOLD_EVERY + 3):
        h.commit("buf", torch.zeros(256))
    seen = recheck_answers(m)
    for _ in range(2 * FOLD_EVERY + 1):
        h.commit("buf", torch.zeros(256))
    assert seen == [True] * (2 * FOLD_EVERY + 1)
    assert m.stats() == m.stats(exact=True)


def test_numpy_items_are_deferred_too() -> None:
    # (numpy bases are allocations as torch storages are: additive, deferred)
    state = _ring()
    for _ in range(6):
        state = fs.commit(state, "a", "ring", np.zeros(256, np.float32))
    assert ledger_of(state).deferred.depth == 6 - 1 + 1  # (the ring's put is no step)
    assert dict(ledger_of(state).totals) == _exact_totals(state)
