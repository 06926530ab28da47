"""The budgeted commit answered from the last pass (`admission.Recheck`): a commit of the session the last
budgeted commit wrote, on the table that commit installed, re-reads only the writer's attr tensors. Each test
sets it up by committing several times in a row (the recheck is kept from the second pass of a session on),
then changes one thing the recheck must not answer for: an attr tensor resized in place, the object totals,
the session written. It must also keep nothing alive: the table and the tensors are held weakly."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import LatentBuffer, SessionStateManager
from functional_state.memory import accounting
from functional_state.shell import slot as slot_module
from functional_state.table.manager_state import make_state
from helpers import grow_in_place, recheck_answers

KIB = 1024
BUDGET = 8 * KIB


@pytest.fixture(autouse=True)
def _no_engine_pools(monkeypatch):
    """No engine pool in sight, whatever pools earlier tests of the run left alive (jit caches keep traced
    ones): while a pool lives every write takes the retry loop, and while its storage is registered the stamps
    (and the recheck that re-reads them) are off (`test_no_recheck_while_an_engine_pool_storage_is_registered`).
    This file's managers hold no engine blocks, so hiding another test's pools changes nothing they decide."""
    monkeypatch.setattr(accounting, "POOL_STORAGES", {})
    monkeypatch.setattr(slot_module, "LIVE_POOLS", {})


def kib(n: int = 1) -> np.ndarray:
    return np.zeros(256 * n, np.float32)


def _steady(
    levers: tuple[str, ...] = ("drop",), m: SessionStateManager | None = None, sid: str = "a", commits: int = 4
) -> tuple[SessionStateManager, fs.SessionHandle, torch.Tensor]:
    """A budgeted manager (``m``, or a new one) whose session ``sid`` (a ring of 2, a torch prompt) committed
    until it is answered from its recheck: the ring is full and the last commits were of ``sid``."""
    m = SessionStateManager(byte_budget=BUDGET, release_levers=levers) if m is None else m
    h = m.get_or_create_session(sid)
    h.put("buf", LatentBuffer.create(maxlen=2))
    prompt = torch.zeros(256, dtype=torch.uint8)
    h.set_attr("prompt", prompt)
    for _ in range(commits):
        h.commit("buf", kib())
    return m, h, prompt


def test_a_steady_commit_is_answered_by_the_recheck() -> None:
    # (the premise of the tests below: without it they would test the full check again)
    m, h, _ = _steady()
    seen = recheck_answers(m)
    h.commit("buf", kib())
    h.commit("buf", kib())
    assert seen == [True, True]
    assert m.stats() == m.stats(exact=True)


@pytest.mark.parametrize("how", ["resize_", "storage", "set_"])
def test_an_attr_tensor_resized_in_place_is_caught_by_the_next_commit(how: str) -> None:
    m, h, prompt = _steady()
    seen = recheck_answers(m)
    grow_in_place(prompt, how, 64 * KIB)
    with pytest.raises(fs.BudgetExceededError):  # (64 KiB of prompt: over the 8 KiB budget)
        h.commit("buf", kib())
    assert seen[0] is False  # the recheck sent it to the full check
    assert len(h.view("buf")) == 2
    kept, exact = m.stats(), m.stats(exact=True)  # (a bare tensor counts as recorded until set again)
    assert exact["nbytes:cpu"] - kept["nbytes:cpu"] == 64 * KIB - 256


def test_a_session_holding_a_container_is_walked_at_every_commit() -> None:
    # (a list a model appends to in place: no stamp tells it changed, so no recheck may answer for it)
    m, h, _ = _steady()
    held = [torch.zeros(256, dtype=torch.uint8)]
    h.set_attr("cache", held)
    for _ in range(3):
        h.commit("buf", kib())
    seen = recheck_answers(m)
    held.append(torch.zeros(64 * KIB, dtype=torch.uint8))
    with pytest.raises(fs.BudgetExceededError):
        h.commit("buf", kib())
    assert True not in seen
    assert m.stats() == m.stats(exact=True)


def test_a_commit_that_moves_the_object_totals_is_checked_in_full() -> None:
    # A ring of 1 KiB items, steady: the totals map is the same object from commit to commit. An item of
    # 7 KiB moves it, and with it over the budget (the prompt's 256 bytes and the kept 1 KiB item).
    m, h, _ = _steady()
    seen = recheck_answers(m)
    with pytest.raises(fs.BudgetExceededError):
        h.commit("buf", kib(7))
    assert seen == [False]
    assert m.stats() == m.stats(exact=True)
    assert m.stats()["nbytes:cpu"] <= BUDGET


def test_a_commit_of_another_session_reads_its_own_attrs() -> None:
    # "b" steady too (a full ring of equal items: the totals map does not move), then "a" kept by the recheck;
    # "b"'s prompt resized in place must be caught at "b"'s next commit, which the recheck of "a" cannot answer.
    m, h, _ = _steady()
    _, other, theirs = _steady(m=m, sid="b", commits=3)
    h.set_attr("prompt", torch.zeros(256, dtype=torch.uint8))  # ("a"'s attrs change: its recheck is built anew)
    for _ in range(3):
        h.commit("buf", kib())
    assert m._ops.slot.recheck.writer == "a"  # (the premise: what "b" commits next is not "a"'s to answer)
    seen = recheck_answers(m)
    theirs.resize_(64 * KIB)
    with pytest.raises(fs.BudgetExceededError):  # (b alone is over the budget; a is the only other)
        other.commit("buf", kib())
    assert True not in seen  # (not answered by the recheck: the writer differs)
    h.commit("buf", kib())  # ("a" is within the budget again once "b"'s write was refused: a full check)
    assert m.stats(exact=True)["nbytes:cpu"] - m.stats()["nbytes:cpu"] == 64 * KIB - 256


def test_a_commit_after_another_write_of_its_session_is_checked_in_full() -> None:
    # The prompt replaced by an empty tensor (no bytes: the attr bound does not move, and the index walks it
    # as a container), which then grows in place: the recheck kept for the old prompt must not answer.
    m, h, old = _steady()
    empty = torch.zeros(0, dtype=torch.uint8)
    h.set_attr("prompt", empty)
    empty.resize_(64 * KIB)
    with pytest.raises(fs.BudgetExceededError):
        h.commit("buf", kib())
    assert old.untyped_storage().nbytes() == 256  # (the old prompt, alive and unchanged: what a recheck reads)
    assert m.stats() == m.stats(exact=True)


def test_the_recheck_answers_only_a_commit_on_the_ledger_and_bound_it_kept() -> None:
    # The recheck knows the table the last pass installed by its ledger step: a commit made on a table one
    # write further (another commit in between: its step follows another) is not answered, nor one with
    # another bound (though equal) or under another budget (the same ledger). A hit changes no byte and keeps
    # the ledger: a commit on it is answered (what it decides depends on the bytes, the bound and the budget).
    m, _, _ = _steady()
    slot = m._ops.slot
    kept = slot.table
    between = fs.commit(kept, "a", "buf", kib())
    assert not slot.recheck.within(between, fs.commit(between, "a", "buf", kib()), "a", slot.surplus)
    after = fs.commit(kept, "a", "buf", kib())
    assert not slot.recheck.within(kept, after, "a", dict(slot.surplus))  # (another bound, though equal)
    config = dataclasses.replace(after._config, byte_budget={"cpu": BUDGET})  # (equal, not the same)
    elsewhere = make_state(after._nodes, after._recency, after._hits, after._totals, config, after._acct)
    assert not slot.recheck.within(kept, elsewhere, "a", slot.surplus)
    touched, _ = fs.get_or_create(kept, "a")
    assert slot.recheck.within(touched, fs.commit(touched, "a", "buf", kib()), "a", slot.surplus)
    assert not slot.recheck.within(kept, after, "a", slot.surplus)  # (answered: it now follows that commit)


def test_no_recheck_while_an_engine_pool_storage_is_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    # (stamps are not read then: `holders.changed_since_recorded` walks the value, which a recheck cannot)
    m, _, _ = _steady()
    slot = m._ops.slot
    monkeypatch.setitem(accounting.POOL_STORAGES, ("cpu", 1), ())
    assert not slot.recheck.within(slot.table, fs.commit(slot.table, "a", "buf", kib()), "a", slot.surplus)


def test_the_recheck_keeps_no_tensor_and_no_table_alive() -> None:
    m, h, prompt = _steady()
    recheck = m._ops.slot.recheck
    assert recheck.stamps and recheck.steps >= 0  # (it is kept: the premise)
    gone, table = weakref.ref(prompt), weakref.ref(m._ops.slot.table)
    h.set_attr("prompt", torch.zeros(256, dtype=torch.uint8))  # (the old prompt leaves the table)
    del prompt
    gc.collect()
    assert gone() is None
    assert table() is None
    h.commit("buf", kib())  # (a dead recheck is a miss, then kept anew)
    assert m.stats() == m.stats(exact=True)
