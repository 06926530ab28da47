"""Attr values whose size can change without a write (issue 24): a torch tensor resized in place
(``resize_``, ``untyped_storage().resize_``, ``set_``).

Inside a list, dict or tuple attr it is seen by every kept figure (containers are read again). A bare tensor
attr is recorded when it is set, like an object when it is committed (reading every tensor attr of the table
on every `stats()`, plan or donating step would make each O(table)): the next budgeted write of its session
compares it with its record (one storage read) and records it anew before it decides (released per the
policy, or refused, never admitted over the budget); setting the attr again records it too. After either,
`stats()`, the holder index and the pure `enforce_budget` count it; ``stats(exact=True)`` tells the truth
throughout. A tensor inside a committed state object resized
in place is outside the contract (objects are immutable): ``stats(exact=True)`` still tells the truth."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager
from functional_state.memory import accounting, holders
from functional_state.table.manager_state import ledger_of
from helpers import assert_unchanged, snapshot

KIB = 1024
BUDGET = 8 * KIB
BIG = 64 * KIB


def kib() -> np.ndarray:
    return np.zeros(256, np.float32)


def _grow(t: torch.Tensor, how: str) -> None:
    if how == "resize_":
        t.resize_(BIG)
    elif how == "storage":
        t.untyped_storage().resize_(BIG)
    else:
        t.set_(torch.zeros(BIG, dtype=torch.uint8))


HOLDERS: dict[str, Callable[[torch.Tensor], Any]] = {
    "tensor": lambda t: t,
    "list": lambda t: [t],
    "dict": lambda t: {"k": t},
    "tuple": lambda t: (t, 3),
}


def _manager(levers: tuple[str, ...]) -> tuple[SessionStateManager, Any, torch.Tensor, Any]:
    m = SessionStateManager(byte_budget=BUDGET, release_levers=levers)
    h = m.get_or_create_session("a")
    h.put("buf", LatentBuffer.create(maxlen=4))
    h.commit("buf", kib())
    t = torch.zeros(256, dtype=torch.uint8)
    return m, h, t, None


@pytest.mark.parametrize("how", ["resize_", "storage", "set_"])
@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_a_resized_attr_tensor_makes_the_next_commit_refused(how: str, holder: str) -> None:
    # (a single session may release nothing but itself, which it never does: the write is refused)
    m, h, t, _ = _manager(("drop",))
    h.set_attr("x", HOLDERS[holder](t))
    h.commit("buf", kib())
    _grow(t, how)
    with pytest.raises(fs.BudgetExceededError):
        h.commit("buf", kib())
    assert len(h.view("buf")) == 2  # the refused commit changed nothing
    _exact_or_recorded(m.stats(), m.stats(exact=True), holder)


def _exact_or_recorded(kept: dict, exact: dict, holder: str) -> None:
    """Kept figures equal the exact walk for a container; a bare tensor counts as recorded until set again
    (walked like a container while an engine KV pool is alive: its storages are read through the pool's)."""
    if holder == "tensor" and not accounting.POOL_STORAGES:
        assert exact["nbytes:cpu"] - kept["nbytes:cpu"] == BIG - 256
    else:
        assert kept == exact


@pytest.mark.parametrize("how", ["resize_", "storage", "set_"])
@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_a_resized_attr_tensor_makes_the_next_write_of_its_session_release_per_the_policy(
    how: str, holder: str
) -> None:
    m, h, t, _ = _manager(("drop",))
    other = m.get_or_create_session("b")
    other.put("buf", LatentBuffer.create(maxlen=4))
    other.commit("buf", kib())
    h.set_attr("x", HOLDERS[holder](t))
    h.commit("buf", kib())  # 3 KiB of items and 256 bytes of attr: within the 8 KiB budget
    _grow(t, how)  # 64 KiB now: a alone is over the budget, b can be released but that is not enough
    with pytest.raises(fs.BudgetExceededError):
        h.commit("buf", kib())
    _exact_or_recorded(m.stats(), m.stats(exact=True), holder)
    if how == "set_":
        t.set_(torch.zeros(5 * KIB, dtype=torch.uint8))
    else:  # (a tensor's resize_ never shrinks its storage)
        t.resize_(5 * KIB)
        t.untyped_storage().resize_(5 * KIB)
    h.set_attr("y", 1)  # a plain attr write of a: the table (5 KiB attr, 3 KiB items) is at the budget
    h.commit("buf", kib())  # 9 KiB: b, the other session, is released to make room
    assert "b" not in m and "a" in m
    assert m.stats() == m.stats(exact=True)
    assert m.stats(exact=True)["nbytes:cpu"] <= BUDGET


@pytest.mark.parametrize("how", ["resize_", "storage", "set_"])
@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_stats_counts_a_resized_attr_tensor_in_a_container_at_once_and_a_bare_one_once_set_again(
    how: str, holder: str
) -> None:
    state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    t = torch.zeros(256, dtype=torch.uint8)
    value = HOLDERS[holder](t)
    state = fs.set_attr(state, "a", "x", value)
    assert fs.stats(state) == fs.stats(state, exact=True)
    _grow(t, how)
    assert fs.stats(state, exact=True)["nbytes:cpu"] == BIG
    _exact_or_recorded(fs.stats(state), fs.stats(state, exact=True), holder)
    before = snapshot(state)
    again = fs.set_attr(state, "a", "x", value)  # the same value, set again: recorded anew
    assert fs.stats(again)["nbytes:cpu"] == BIG
    assert fs.stats(again) == fs.stats(again, exact=True)
    assert_unchanged(state, before)
    _exact_or_recorded(fs.stats(state), fs.stats(state, exact=True), holder)  # (the old table keeps its record)


def test_the_holder_index_sees_the_storage_a_resized_attr_tensor_holds_now() -> None:
    # A donation asks whether anything else holds a buffer: the resized tensor's new storage is held.
    state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    t = torch.zeros(256, dtype=torch.uint8)
    state = fs.set_attr(state, "a", "x", t)
    ledger_of(state)  # (the ledger is built on first use: built here, it has recorded the attr before the resize)
    s = t.untyped_storage()
    old = ("cpu", s.data_ptr(), s.data_ptr() + s.nbytes())
    t.resize_(BIG)
    s = t.untyped_storage()
    new = ("cpu", s.data_ptr(), s.data_ptr() + s.nbytes())
    state = fs.set_attr(state, "a", "x", t)  # set again: recorded anew
    assert holders.held_elsewhere(ledger_of(state), [new, old]) == {new}


def test_the_pure_enforce_budget_sees_a_resized_attr_tensor() -> None:
    state = fs.ManagerState.create(byte_budget=BUDGET)
    for sid in ("a", "b"):
        state, _ = fs.get_or_create(state, sid)
        state = fs.put(state, sid, "buf", LatentBuffer.create(maxlen=4))
        state = fs.commit(state, sid, "buf", kib())
    t = torch.zeros(256, dtype=torch.uint8)
    state = fs.set_attr(state, "a", "x", t)
    t.resize_(BIG // 8)  # 8 KiB in a's attr: over the budget with the two items
    state = fs.set_attr(state, "a", "x", t)  # set again: recorded anew
    out = fs.enforce_budget(state, protect="b")
    assert "a" not in out and fs.stats(out, exact=True)["nbytes:cpu"] <= BUDGET


def test_a_tensor_resized_inside_a_committed_object_is_outside_the_contract_but_exact_tells_the_truth() -> None:
    # Objects are immutable by contract: their bytes are kept from their arrival. A resize behind the table's
    # back is not seen by the kept totals (no per-write walk of every object), but the exact walk sees it.
    state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    t = torch.zeros(256, dtype=torch.uint8)
    state = fs.put(state, "a", "cache", fs.DenseValue.create([t]))
    held = fs.stats(state)["nbytes:cpu"]
    fs.view(state, "a", "cache")[0].resize_(BIG)
    assert fs.stats(state)["nbytes:cpu"] == held  # kept: outside the contract
    assert fs.stats(state, exact=True)["nbytes:cpu"] >= BIG  # the check walk tells the truth


def test_the_bound_a_full_check_leaves_covers_a_mutable_value_at_its_recorded_size() -> None:
    # The fast check skips a mutable value that holds what the index recorded on its arrival: so the bound a
    # full check leaves must cover that size even if the value held less at the check (shrunk, to grow back).
    from functional_state.shell import admission

    state, _ = fs.get_or_create(fs.ManagerState.create(byte_budget=BUDGET), "a")
    t = torch.zeros(4 * KIB, dtype=torch.uint8)
    state = fs.set_attr(state, "a", "x", t)
    ledger_of(state)
    t.untyped_storage().resize_(16)
    assert admission._full_bound(state)["cpu"] >= 4 * KIB


@pytest.mark.parametrize("how", ["resize_", "storage", "set_"])
def test_a_budgeted_commit_after_an_attr_tensor_grew_records_it_and_kept_stats_are_exact_again(how: str) -> None:
    m = SessionStateManager(byte_budget=BIG * 4)
    h = m.get_or_create_session("a")
    h.put("buf", LatentBuffer.create(maxlen=4))
    t = torch.zeros(256, dtype=torch.uint8)
    h.set_attr("x", t)
    h.commit("buf", kib())
    _grow(t, how)
    h.commit("buf", kib())  # within the budget even at the new size: admitted, the tensor recorded anew
    assert m.stats()["nbytes:cpu"] == m.stats(exact=True)["nbytes:cpu"] == BIG + 2 * KIB
    assert m.stats() == m.stats(exact=True)


def test_a_jax_attr_over_a_torch_tensor_resized_in_place_is_recorded_anew_at_its_sessions_next_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A JAX array the bridge imported from a torch tensor holds that tensor's storage: it is stamped by it
    # (not walked on every write), and a resize of the tensor is seen like one of a bare tensor attr.
    from torch_bridge import to_jax

    monkeypatch.setattr(accounting, "POOL_STORAGES", {})  # (engine pools other tests left: stamps are off then)

    m = SessionStateManager(byte_budget=BIG * 4)
    h = m.get_or_create_session("a")
    h.put("buf", LatentBuffer.create(maxlen=4))
    t = torch.zeros(256, dtype=torch.uint8)
    j = to_jax(t)
    h.set_attr("x", j)
    entry = ledger_of(m.state).attrs.memo[id(j)]
    assert entry.stamp is not None and entry.extents is not None  # (counted per extent, not walked)
    assert not holders.changed_since_recorded(entry)
    h.commit("buf", kib())
    t.resize_(BIG)
    assert holders.changed_since_recorded(ledger_of(m.state).attrs.memo[id(j)])
    h.commit("buf", kib())
    assert m.stats() == m.stats(exact=True)
    assert m.stats()["nbytes:cpu"] == BIG + 2 * KIB


@pytest.mark.parametrize("how", ["resize_", "storage", "set_"])
def test_a_tensor_attr_shared_by_a_fork_is_recorded_anew_for_every_session_holding_it(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fork shares the prompt (one tensor, two holders). Recording it anew once dropped one holder and added it
    # back, so the entry kept its old extents: the fork's commit was admitted over the budget by the stale
    # size, and every later commit of it took the full check again.
    monkeypatch.setattr(accounting, "POOL_STORAGES", {})  # (engine pools other tests left: stamps are off then)
    m = SessionStateManager(byte_budget=BIG * 4, release_levers=("drop",))
    a = m.get_or_create_session("a")
    a.put("buf", LatentBuffer.create(maxlen=2))
    t = torch.zeros(64, dtype=torch.uint8)
    a.set_attr("prompt", t)
    a.commit("buf", kib())
    b = m.fork_session("a", "b")
    _grow(t, how)
    b.commit("buf", kib())  # within the budget at the new size: admitted, recorded anew for a and b alike
    assert m.stats() == m.stats(exact=True)
    assert m.stats()["nbytes:cpu"] == BIG + 2 * KIB
    entry = ledger_of(m.state).attrs.memo[id(t)]
    assert entry.holders == 2 and not holders.changed_since_recorded(entry)
    before = m.state
    t.resize_(BIG * 8)  # past the budget, and shared: dropping the other session frees none of it
    with pytest.raises(fs.BudgetExceededError):
        b.commit("buf", kib())
    assert m.state is before  # (refused: nothing installed)
