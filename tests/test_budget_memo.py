"""The budgeted commit's O(1) object check (issue 24): `admission.within_budget_in_place` answers a commit from
the last (object totals, attr bound, budget) the object check passed (`admission.LastPass`, one per manager). That memo must answer exactly what the
check answers, for every commit, and never for a question it was not asked (another bound, another budget).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_state as fs
from functional_state import LatentBuffer, ManagerState, SessionStateManager
from functional_state.policy.enforce import over_budget_objects
from functional_state.shell import admission
from functional_state.table.manager_state import ledger_of, make_state

KIB = 1024


def _ring_state(budget: int, n: int = 4) -> ManagerState:
    state, _ = fs.get_or_create(ManagerState.create(byte_budget={"cpu": budget}), "a")
    state = fs.put(state, "a", "ring", LatentBuffer.create(maxlen=4))
    for _ in range(n):
        state = fs.commit(state, "a", "ring", np.zeros(KIB // 4, np.float32))
    return state


def _with_budget(state: ManagerState, budget: int) -> ManagerState:
    """``state`` (its very accounting) under another budget."""
    config = dataclasses.replace(state._config, byte_budget={"cpu": budget})
    return make_state(state._nodes, state._recency, state._hits, state._totals, config, state._acct)


def test_a_ring_step_is_deferred_on_the_kept_totals_map_and_bounded_by_its_bytes() -> None:
    # What the memo relies on to answer a ring in O(1): a step is deferred on the very totals map it came
    # with (the memo's key), and the bytes the deferred steps added bound what they moved.
    state = _ring_state(64 * KIB)
    same = fs.commit(state, "a", "ring", np.zeros(KIB // 4, np.float32))
    before, acct = ledger_of(state), ledger_of(same)
    assert acct.kept_totals is before.kept_totals
    assert acct.deferred.previous is before.deferred
    assert acct.deferred.added_bytes == before.deferred.added_bytes + KIB
    bigger = fs.commit(same, "a", "ring", np.zeros(KIB // 2, np.float32))
    big = ledger_of(bigger)
    assert dict(big.totals) == {"cpu": 5 * KIB}
    assert big.kept_totals.get("cpu", 0) + big.deferred.added_bytes >= 5 * KIB


def test_a_passed_check_is_never_reused_for_another_bound_or_budget() -> None:
    state = _ring_state(8 * KIB)  # 4 KiB held
    after = fs.commit(state, "a", "ring", np.zeros(KIB // 4, np.float32))
    assert ledger_of(after).kept_totals is ledger_of(state).kept_totals
    bound, last = {"cpu": 0}, admission.LastPass()
    assert admission.within_budget_in_place(state, after, "a", bound, True, last) is bound  # (the memo now holds it)
    assert last.key[1] is bound
    assert admission.within_budget_in_place(state, after, "a", bound, True, last) is bound  # (answered by the memo)
    # The same totals with a bound that crosses the budget (4 + 5 > 8 KiB), or under a smaller budget.
    assert admission.within_budget_in_place(state, after, "a", {"cpu": 5 * KIB}, True, last) is None
    tight_before, tight_after = _with_budget(state, 3 * KIB), _with_budget(after, 3 * KIB)
    assert ledger_of(tight_after).kept_totals is ledger_of(after).kept_totals
    assert admission.within_budget_in_place(tight_before, tight_after, "a", bound, True, last) is None
    # ... and the first answer still stands (the memo is replaced only by a check that passed).
    assert admission.within_budget_in_place(state, after, "a", bound, True, last) is bound


@settings(max_examples=30, deadline=None)
@given(
    budget_kib=st.integers(2, 10),
    slack=st.sampled_from([0, KIB, 3 * KIB]),
    sizes=st.lists(st.sampled_from([1, 1, 1, 2, 4]), min_size=1, max_size=30),
)
def test_the_fast_check_answers_what_the_object_check_answers(budget_kib: int, slack: int, sizes: list[int]) -> None:
    # Rings of same-size steps (the memo's case) mixed with size changes that cross the budget both ways.
    state, _ = fs.get_or_create(ManagerState.create(byte_budget={"cpu": budget_kib * KIB}), "a")
    state = fs.put(state, "a", "ring", LatentBuffer.create(maxlen=4))
    bound, last = {"cpu": slack}, admission.LastPass()
    for k in sizes:
        after = fs.commit(state, "a", "ring", np.zeros(k * KIB // 4, np.float32))
        expected = None if over_budget_objects(after, bound) else bound
        assert admission.within_budget_in_place(state, after, "a", bound, True, last) is expected
        state = after


@pytest.mark.parametrize("budget", [None, 1 << 30])
def test_a_budgeted_commit_reports_what_a_walk_reports(budget: int | None) -> None:
    m = fs.SessionStateManager(byte_budget=budget)
    h = m.get_or_create_session("a")
    h.put("ring", LatentBuffer.create(maxlen=4))
    base = np.zeros(1024, np.float32)
    for i in range(12):  # own storage, views of one base, a repeat: the plain ring's flat cache and its exits
        h.commit("ring", np.zeros(256, np.float32) if i % 3 else base[i * 16 : i * 16 + 16])
        kept, walked = m.stats(), m.stats(exact=True)
        assert {k: v for k, v in kept.items() if k.startswith("nbytes:")} == {
            k: v for k, v in walked.items() if k.startswith("nbytes:")
        }


def test_a_tables_budget_refuses_to_be_changed_in_place() -> None:
    """The budget `stats()` hands out is the table's own: changing it in place would change an immutable
    state and leave the memoized check answering for the old budget. It refuses, and the budget still holds."""
    import copy
    import json
    import pickle

    m = SessionStateManager(byte_budget={"cpu": 10_000})
    h = m.get_or_create_session("a").put("buf", LatentBuffer.create(maxlen=2))
    for _ in range(4):
        h.commit("buf", np.zeros(1000, np.uint8))
    budget = m.stats()["byte_budget"]
    for change in (
        lambda b: b.__setitem__("cpu", 1500),
        lambda b: b.update(cpu=1500),
        lambda b: b.pop("cpu"),
        lambda b: b.clear(),
        lambda b: b.setdefault("cuda:0", 1),
        lambda b: b.__delitem__("cpu"),
    ):
        with pytest.raises(fs.InvalidTypeError, match="cannot be changed in place"):
            change(budget)
    assert m.state.byte_budget == {"cpu": 10_000}
    assert pickle.loads(pickle.dumps(budget)) == budget and json.loads(json.dumps(budget)) == budget
    assert copy.deepcopy(budget) is budget
    mine = dict(budget)
    mine["cpu"] = 1500  # a copy is the user's own
    assert m.state.byte_budget == {"cpu": 10_000}
