"""The planner reads only what a plan needs (issue 24): a park pass that frees its need from the oldest
sessions reads those alone from the recency log, and a table whose attrs hold no buffer costs no attr walk;
with attrs, parks are priced from the ledger's attr index and the promise still equals what the plan frees."""

import numpy as np
import pytest
import torch

import functional_state as fs
import functional_state.table.manager_state as table_state


@pytest.fixture
def reads(monkeypatch):
    """The session ids the planner reads from the recency log, in order."""
    real = table_state.entries_lru
    seen: list[str] = []

    def counting(state):
        for entry in real(state):
            seen.append(entry[0])
            yield entry

    monkeypatch.setattr(table_state, "entries_lru", counting)
    try:
        import functional_state.policy.snapshot as snapshot

        monkeypatch.setattr(snapshot, "entries_lru", counting)
    except ImportError:  # (the planner before issue 24 read the log through table.state alone)
        pass
    return seen


def _table(n: int, attrs: bool = False) -> fs.ManagerState:
    s = fs.ManagerState.create(max_sessions=n)
    for i in range(n):
        s, _ = fs.get_or_create(s, f"s{i}")
        s = fs.put(s, f"s{i}", "cache", fs.DenseValue.create([torch.zeros(64)]))
        if attrs:
            s = fs.set_attr(s, f"s{i}", "prompt", torch.zeros(8))
    return s


def test_a_park_plan_reads_only_the_oldest_sessions(reads):
    # Regression: every plan read the whole table in recency order (and walked every session's attrs), so
    # parking one ring at 100k sessions cost 563 ns per session, 59.9 ms a plan.
    s = _table(200)
    plan = fs.plan_release(s, "cpu", 2 * 256, levers=["park"])
    assert [a.session_ids for a in plan.actions] == [("s0",), ("s1",)]
    assert len(reads) <= 3, f"the plan read {len(reads)} of 200 sessions to park the 2 oldest"


def test_a_plan_that_needs_every_session_reads_each_once(reads):
    s = _table(50)
    plan = fs.plan_release(s, "cpu", 49 * 256, protect="s7", levers=["park", "evict", "drop"])
    assert [a.session_ids[0] for a in plan.actions] == [f"s{i}" for i in range(50) if i != 7]
    assert reads == [f"s{i}" for i in range(50)]  # in recency order, once, however many passes ask


def test_the_drop_pass_reads_on_from_where_the_park_pass_stopped(reads):
    s = _table(50)
    plan = fs.plan_release(s, "cpu", 3 * 256, levers=["drop"])
    assert [(a.kind, a.session_ids) for a in plan.actions] == [("drop", (f"s{i}",)) for i in range(3)]
    assert len(reads) <= 4


@pytest.mark.parametrize("levers", [["park"], ["drop"], ["park", "drop"]])
def test_with_attrs_the_promise_is_what_the_plan_frees(levers):
    s = _table(30, attrs=True)
    alias = fs.lookup(s, "s3").objects["cache"].view()[0]  # an attr viewing s3's cache: parking it frees nothing
    s = fs.set_attr(s, "s3", "view", alias)
    before = fs.stats(s)
    plan = fs.plan_release(s, "cpu", 5 * 256, protect="s0", levers=levers)
    assert plan is not None
    after = fs.stats(fs.apply_plan(s, plan))
    assert before["nbytes:cpu"] - after["nbytes:cpu"] == plan.freed >= 5 * 256
    assert all("s3" not in a.session_ids for a in plan.actions if a.kind == "park")
    assert plan.unreleasable == 30 * 32 + 256  # every prompt attr, and the view of s3's cache


def test_unreleasable_counts_attr_bytes_an_object_also_holds():
    s = _table(2)
    s = fs.set_attr(s, "s1", "view", fs.lookup(s, "s1").objects["cache"].view()[0])
    plan = fs.plan_release(s, "cpu", 256, levers=["park"])
    assert plan.unreleasable == 256


def test_the_bytes_attrs_hold_come_from_the_kept_totals_and_equal_a_walk_of_every_attr():
    # What no park or eviction frees (the plan's `unreleasable`): the attr index keeps it per pool for closed
    # values, and only containers are read per plan. Aliases of objects, values shared by forks, containers
    # holding a closed value's tensor again, drops and attr removals must all leave it equal to the walk.
    from functional_state.memory import accounting
    from functional_state.memory.pools import Pool
    from functional_state.policy.snapshot import Recency, Snapshot
    from functional_state.table.manager_state import ledger_of, session_map

    def walked(state) -> int:
        out: list = []
        for session in session_map(state).values():
            for value in session._attrs.values():
                accounting.collect_extents(value, out, {}, accounting.WalkReport())
        return accounting.union_by_device(out).get("cpu", 0)

    def kept(state) -> int:
        return Snapshot(ledger_of(state), state, Recency(state)).attr_nbytes(Pool("cpu"))

    s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    fs.stats(s)  # the table is tracked from here: every change below updates the kept totals
    shared, obj_t = torch.zeros(1000), torch.zeros(300)
    s = fs.put(s, "a", "v", fs.DenseValue.create(obj_t))
    s = fs.set_attr(s, "a", "alias", obj_t[10:])  # an attr aliasing the object's storage
    s = fs.set_attr(s, "a", "shared", shared)
    s = fs.set_attr(s, "a", "np", np.zeros(64, np.float32))
    s = fs.fork_session(s, "a", "b")  # every closed value now held by two sessions
    s = fs.set_attr(s, "b", "box", [shared[:5], torch.zeros(7)])  # a container: the closed tensor again
    checks = [s]
    s = fs.del_attr(s, "a", "shared")
    checks.append(s)
    s, _ = fs.drop_session(s, "b")  # the container and the holds of b leave
    checks.append(s)
    for state in checks:
        assert kept(state) == walked(state) > 0
