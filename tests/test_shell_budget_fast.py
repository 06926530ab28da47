"""A commit under a byte budget (issue 24): within budget it is decided from the kept totals in one install,
the commit computed once and no full check; a commit that crosses the budget is still refused or makes room
exactly as before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager
from functional_state import table as ms
from functional_state.shell import admission
from functional_state.shell import slot as shell_slot


def kib() -> np.ndarray:
    return np.zeros(256, np.float32)  # 1 KiB, its own allocation (the accounting counts each buffer once)


def _counting(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    calls: list[int] = []
    fn: Callable[..., Any] = getattr(owner, name)

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return fn(*args, **kw)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _manager(budget: int, **kw: Any) -> SessionStateManager:
    m = SessionStateManager(byte_budget=budget, **kw)
    for sid in ("a", "b"):
        m.get_or_create_session(sid).put("buf", LatentBuffer.create(maxlen=4))
    return m


def test_a_commit_within_budget_is_computed_once_with_no_full_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # (While an engine pool lives anywhere in the process every write takes the full loop, which frees blocks:
    # pools other tests keep alive must not decide this test.)
    monkeypatch.setattr(shell_slot, "LIVE_POOLS", {})
    m = _manager(1 << 30)
    h = m.get_or_create_session("a").commit("buf", kib())  # (the first write under a budget checks in full)
    commits = _counting(monkeypatch, ms, "commit")
    full = _counting(monkeypatch, admission, "enforce_budget")
    walks = _counting(monkeypatch, admission, "attr_surplus")
    for _ in range(6):
        h.commit("buf", kib())
    # The base computed each commit twice (an inline attempt the budget turned away, then the retry loop).
    assert len(commits) == 6 and not full and not walks
    assert len(h.view("buf")) == 4


def _full_a_and_three_quarters_b() -> tuple[SessionStateManager, Any, Any]:
    """A 7 KiB budget holding session a's full 4-item ring and 3 items of b's (7 KiB)."""
    m = _manager(7 * 1024, release_levers=("drop",))
    a, b = m.get_or_create_session("a"), m.get_or_create_session("b")
    for _ in range(4):
        a.commit("buf", kib())
    for _ in range(3):
        b.commit("buf", kib())
    return m, a, b


def test_a_commit_that_crosses_the_budget_makes_room_by_dropping_another_session() -> None:
    m, a, b = _full_a_and_three_quarters_b()
    a.commit("buf", kib())  # a full ring drops one item for the new one: within budget, nothing released
    assert "a" in m and "b" in m
    b.commit("buf", kib())  # 8 KiB > 7 KiB: the other session is released to make room
    assert "a" not in m and len(b.view("buf")) == 4 and not a.in_table
    assert m.stats()["nbytes:cpu"] == 4 * 1024


def test_a_commit_that_cannot_fit_is_refused_and_changes_nothing() -> None:
    m, _, b = _full_a_and_three_quarters_b()
    before = m.state
    with m.pin("a"), pytest.raises(fs.BudgetExceededError):
        b.commit("buf", kib())
    assert m.state is before and len(b.view("buf")) == 3


def _aliased_then_replaced(case: str) -> tuple[SessionStateManager, int]:
    """A table within its budget where an attr aliases a buffer an object holds, and a commit then drops the
    object's hold on it (the attr keeps it alive) while adding a new buffer."""
    import torch

    n = 1 << 16  # 256 KiB per tensor
    budget = 4 * n * 3 // 2  # room for 1.5 tensors
    m = SessionStateManager(byte_budget={"cpu": budget})
    t = torch.ones(n)
    if case == "dense":
        h = m.get_or_create_session("a")
        h.put("v", fs.DenseValue.create(t))
        h.set_attr("alias", t)
    elif case == "ring":
        h = m.get_or_create_session("a")
        h.put("r", LatentBuffer.create(maxlen=1))
        h.commit("r", t)
        h.set_attr("alias", t)
    else:  # another session's attr holds the buffer the writer lets go of
        h = m.get_or_create_session("a")
        h.put("v", fs.DenseValue.create(t))
        m.get_or_create_session("b").set_attr("x", t)
    assert m.stats(exact=True)["nbytes:cpu"] <= budget
    return m, budget


@pytest.mark.parametrize("case", ["dense", "ring", "other_session"])
def test_a_commit_that_leaves_an_attr_aliased_buffer_to_the_attr_never_exceeds_the_budget(case: str) -> None:
    torch = pytest.importorskip("torch", reason="the attr aliases a torch tensor's buffer (needs torch)")

    m, budget = _aliased_then_replaced(case)
    handle = m.get_session("a")
    before = m.stats(exact=True)
    name = "r" if case == "ring" else "v"
    try:
        handle.commit(name, torch.zeros(1 << 16))
    except fs.BudgetExceededError:
        assert m.stats(exact=True) == before  # refused: nothing changed
    after = m.stats(exact=True)
    assert after["nbytes:cpu"] <= budget, (after["nbytes:cpu"], budget)
    assert m.stats() == after


def test_a_set_attr_under_a_budget_reads_only_the_value_it_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fast check once re-read every attr of the session on each `set_attr` (a DreamZero step sets small
    # counters beside large conditioning tensors): the values kept are in the bound already.
    monkeypatch.setattr(shell_slot, "LIVE_POOLS", {})
    m = _manager(1 << 30)
    h = m.get_or_create_session("a").set_attr("cond", kib()).set_attr("count", 0)
    read: list[set[str]] = []
    real = admission.attr_bytes
    monkeypatch.setattr(admission, "attr_bytes", lambda attrs: read.append(set(attrs)) or real(attrs))
    h.set_attr("count", 1).set_attr("new", kib())
    assert read == [{"new"}]  # (the counter, a plain int, holds no buffer: not read at all)


def test_an_attr_set_under_a_budget_still_counts_against_it() -> None:
    # Only the values a write sets are read, and each is counted: attrs set one by one past the budget make
    # room (the least recent session goes) exactly as a write of them all at once would.
    for how in ("one by one", "at once"):
        m = _manager(4096 + 1024)
        m.get_or_create_session("b").set_attr("big", np.zeros(1024, np.float32))  # 4 KiB
        h = m.get_or_create_session("a").set_attr("small", kib())
        if how == "one by one":
            h.set_attr("count", 1).set_attr("more", kib())
        else:
            h.transact(lambda s: s.set_attr("count", 1).set_attr("more", kib()))
        assert "b" not in m and "a" in m, how
        assert m.stats(exact=True)["nbytes:cpu"] <= 4096 + 1024, how


def test_the_attr_bound_stays_a_bound_over_random_attr_writes() -> None:
    # After every write that the fast check decided, the bound it kept is at least the attr bytes the table
    # holds in each pool (`attr_surplus`, exact), whichever attrs the writes set, re-set, replaced or removed.
    import random

    from functional_state.policy.enforce import attr_surplus

    rng = random.Random(7)
    m = _manager(1 << 30)
    handles = [m.get_or_create_session(sid) for sid in ("a", "b")]
    arrays = [np.zeros(64 * (i + 1), np.float32) for i in range(4)]
    for _ in range(200):
        h, key = rng.choice(handles), rng.choice(["x", "y", "z", "n"])
        kind = rng.randrange(4)
        if kind == 0:
            h.set_attr(key, rng.choice(arrays))  # (an array another attr or session may carry too)
        elif kind == 1:
            h.set_attr(key, rng.randrange(10))
        elif kind == 2:
            h.del_attr(key)
        else:
            h.transact(lambda s: s.set_attr("x", rng.choice(arrays)).set_attr("y", [rng.choice(arrays)]))
        bound = m._slot.surplus
        if bound is not None:
            exact = attr_surplus(m.state)
            assert all(bound.get(pool, 0) >= n for pool, n in exact.items()), (bound, exact)
