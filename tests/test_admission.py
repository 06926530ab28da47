"""Tests of `shell/admission.py` (the budget check a write is admitted by).

Attr values whose size can change without a write (issue 24): a torch tensor resized in place
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
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager
from functional_state.memory import accounting, holders
from functional_state.table.manager_state import ledger_of
from helpers import assert_unchanged, grow_in_place, snapshot

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


def test_a_list_attr_grown_in_place_is_counted_at_the_sessions_next_attr_write():
    """The fast budget check once added only the values a write set: a list attr the model had grown in place
    (kept by identity) stayed at the bytes it was counted with, and the write was admitted over the budget."""
    m = SessionStateManager(byte_budget=8192)
    h = m.get_or_create_session("a")
    h.set_attr("frames", [np.zeros(256, np.float32)])  # 1 KiB in a list (a container: it may grow)
    h.set_attr("step", np.zeros(16, np.float32))  # the bound now holds that 1 KiB
    frames = h.get_attr("frames")
    for _ in range(8):
        frames.append(np.zeros(256, np.float32))  # 9 KiB in all now, in place
    assert m.stats(exact=True)["nbytes:cpu"] > 8192
    with pytest.raises(fs.BudgetExceededError):  # the session's own attrs are over: nothing to release
        h.set_attr("step2", np.zeros(16, np.float32))


def _cpu(stats: dict) -> int:
    return stats.get("nbytes:cpu", 0)


def _attr_table(budget: int, sids: str, attr_bytes: int) -> fs.ManagerState:
    """A pure table (pure verbs do not enforce the budget) whose sessions' attrs together exceed ``budget``."""
    s = fs.ManagerState.create(byte_budget={"cpu": budget})
    for sid in sids:
        s, _ = fs.get_or_create(s, sid)
        s = fs.set_attr(s, sid, "prompt", np.ones(attr_bytes, np.uint8))
    return s


@pytest.mark.parametrize("empty", [False, True], ids=["over a session", "into an empty manager"])
@pytest.mark.parametrize("levers", [fs.LEVERS, ("park", "evict")])
def test_a_load_is_checked_against_the_budget_with_the_loaded_tables_attrs(tmp_path: Path, levers, empty) -> None:
    # `load` replaces the table with no writer: the fast check added nothing for the loaded sessions' attrs
    # (it adds only the writer's) and decided by the old table's attr bound, so a table whose attrs alone hold
    # 4x the budget was installed as it was.
    saved = _attr_table(8 * KIB, "ab", 16 * KIB)
    fs.save(saved, tmp_path / "t")
    m = fs.SessionStateManager(byte_budget={"cpu": 8 * KIB}, release_levers=levers)
    m.get_or_create_session("x").set_attr("k", np.ones(KIB, np.uint8))
    if empty:
        m.drop_session("x")  # (the bound stays the one the set_attr left)
    try:
        m.load(tmp_path / "t")
    except fs.BudgetExceededError:  # (no lever may release an attr's session: refused, the table kept)
        assert "drop" not in levers
        assert m.state.session_ids == (() if empty else ("x",))
    else:
        assert "drop" in levers
    assert _cpu(m.stats(exact=True)) <= 8 * KIB
    assert m.stats() == m.stats(exact=True)
    # The bound the fast check starts from is the installed table's: a write after it is checked too.
    h = m.get_or_create_session("y")
    with pytest.raises(fs.BudgetExceededError):
        h.set_attr("big", np.ones(16 * KIB, np.uint8))
    assert _cpu(m.stats(exact=True)) <= 8 * KIB


@pytest.mark.parametrize("how", ["resize_", "storage", "set_"])
def test_an_attr_grown_in_place_stays_counted_after_its_sessions_write(how: str) -> None:
    # The writer's grown attr was added to the fast check of its own write only ("never kept"): the next
    # write, of another session, decided by the bound without it, and was admitted over the budget.
    m = fs.SessionStateManager(byte_budget={"cpu": 8 * KIB}, release_levers=("park", "evict"))
    a, b = m.get_or_create_session("a"), m.get_or_create_session("b")
    for h in (a, b):
        h.put("buf", fs.LatentBuffer.create(maxlen=1))
        h.commit("buf", np.zeros(256, np.uint8))
    t = torch.zeros(256, dtype=torch.uint8)
    a.set_attr("t", t)
    grow_in_place(t, how, 6 * KIB)
    a.commit("buf", np.zeros(256, np.uint8))  # seen here, and within the budget: 6.75 KiB
    assert _cpu(m.stats(exact=True)) <= 8 * KIB
    with pytest.raises(fs.BudgetExceededError):  # 6 KiB + 3 KiB: over even with a's buffer parked
        b.commit("buf", np.zeros(3 * KIB, np.uint8))
    assert _cpu(m.stats(exact=True)) <= 8 * KIB


@pytest.mark.parametrize("budget", [None, "1MiB"])
def test_an_insertions_reported_evictions_decide_as_the_walk_of_the_least_recent_end_does(budget: Any) -> None:
    """`admit` told an insertion's evictions by the table (`get_or_insert`, as the shell's miss does) leaves
    the same sessions, for the same reason, as when it finds them by comparing the tables."""
    from functional_state.shell.admission import admit
    from functional_state.table.lru import get_or_insert

    state = fs.ManagerState.create(max_sessions=3, byte_budget=budget)
    for sid in ("a", "b", "c"):
        state, _ = fs.get_or_create(state, sid)
        state = fs.put(state, sid, "x", LatentBuffer.create(maxlen=2))
    state, _ = fs.get_or_create(state, "a")  # "b" is now the least recent: the log's first entry is stale
    after, _, evicted = get_or_insert(state, "d")
    assert evicted is not None and [e[0] for e in evicted] == ["b"]
    told = admit(state, after, "d", levers=("evict",), surplus=None, budget=False, evicted=evicted)
    found = admit(state, after, "d", levers=("evict",), surplus=None, budget=False)
    assert told.final is found.final is after
    assert [(d.sid, d.uid, d.session, d.reason, d.closed) for d in told.left] == [
        (d.sid, d.uid, d.session, d.reason, d.closed) for d in found.left
    ]
    assert [d.sid for d in told.left] == ["b"] and "evicted (LRU" in told.left[0].reason
