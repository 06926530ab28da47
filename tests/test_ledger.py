"""The table's ledger (`table/ledger.py`): kept figures after object swaps and session edits equal the walk,
where a mutation sample showed the suite blind (issue 34)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant
from test_accounting_incremental import IncrementalAccounting

import functional_state as fs
from functional_state import LatentBuffer, ManagerState
from functional_state.memory import accounting, holders
from functional_state.policy.enforce import attr_surplus
from functional_state.table.manager_state import ledger_of
from helpers import table_with_attrs


def _arrays(n):
    return [np.full(64 * (i + 1), i, np.float32) for i in range(n)]


def _assert_kept_equals_walk(state, nbytes):
    assert fs.stats(state) == fs.stats(state, exact=True)
    assert fs.stats(state)["nbytes:cpu"] == nbytes


def _ring_of_pairs(x, y):
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "buf", LatentBuffer.create(maxlen=1))
    return fs.commit(state, "a", "buf", (x, y))  # an item of two arrays: `swap`'s general path, not the ring step


def test_an_attr_extent_whose_last_object_holder_leaves_is_counted_by_the_attr():
    x, y, z, w = _arrays(4)
    state = fs.set_attr(_ring_of_pairs(x, y), "a", "keep", x)  # held by the ring's item and an attr
    _assert_kept_equals_walk(state, x.nbytes + y.nbytes)
    state = fs.commit(state, "a", "buf", (z, w))  # the ring lets go of x: the attr alone holds it now
    _assert_kept_equals_walk(state, x.nbytes + z.nbytes + w.nbytes)


def test_an_attr_extent_an_object_starts_holding_is_counted_once():
    x, y, z, w = _arrays(4)
    state = fs.set_attr(_ring_of_pairs(x, y), "a", "next", z)  # an attr alone holds z
    _assert_kept_equals_walk(state, x.nbytes + y.nbytes + z.nbytes)
    state = fs.commit(state, "a", "buf", (z, w))  # the ring takes z too: counted once, not per holder kind
    _assert_kept_equals_walk(state, z.nbytes + w.nbytes)


@pytest.mark.parametrize("edit", ["remove", "remove-and-put"])
def test_an_object_removed_through_update_session_leaves_the_kept_figures(edit):
    # `swap_session` must take out the objects the new session no longer names; asserted before only through
    # the KV blocks a removed handle released.
    x, y, z = _arrays(3)
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(fs.put(state, "a", "x", fs.DenseValue.create(x)), "a", "y", fs.DenseValue.create(y))
    _assert_kept_equals_walk(state, x.nbytes + y.nbytes)
    if edit == "remove":
        state = fs.update_session(state, "a", lambda s: s.remove("x"))
        _assert_kept_equals_walk(state, y.nbytes)
    else:
        state = fs.update_session(state, "a", lambda s: s.remove("x").put("z", fs.DenseValue.create(z)))
        _assert_kept_equals_walk(state, y.nbytes + z.nbytes)


def _recount(acct) -> dict[str, int]:
    """Bytes per pool of the fixed attr extents no object holds, counted from the two holder maps."""
    out: dict[str, int] = {}
    for e in acct.attrs.refs:
        if e not in acct.refs:
            out[e[0]] = out.get(e[0], 0) + (e[2] - e[1])
    return {k: v for k, v in out.items() if v}


class KeptAttrBytes(IncrementalAccounting):
    """The incremental-accounting machine (forks, views, bridge aliases, parks, attrs aliasing objects),
    checking the kept attr-only sums and the budget's attr bound as well."""

    @invariant()
    def attr_only_equals_a_recount(self):
        if not hasattr(self, "state"):
            return
        acct = ledger_of(self.state)
        assert dict(acct.attr_only) == _recount(acct)

    @invariant()
    def attr_bound_equals_a_union_of_every_attr(self):
        if not hasattr(self, "state"):
            return
        values = [v for s in fs.sessions(self.state).values() for v in s._attrs.values()]
        walked = accounting.union_by_device(list(holders.holder_extents(values))) if values else {}
        assert attr_surplus(self.state) == {k: v for k, v in walked.items() if v}

    @invariant()
    def parked_bytes_equal_a_walk_of_the_copies(self):
        if not hasattr(self, "state"):
            return
        assert fs.stats(self.state)["parked_nbytes"] == fs.stats(self.state, exact=True)["parked_nbytes"]


KeptAttrBytes.TestCase.settings = settings(
    max_examples=150, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


TestKeptAttrBytes = KeptAttrBytes.TestCase


class _CountingRefs:
    """A stand-in for an attr index's ``refs`` map that counts the extents read by iterating it."""

    def __init__(self, m):
        self.m, self.reads = m, 0

    def __iter__(self):
        for e in self.m:
            self.reads += 1
            yield e

    def keys(self):
        return iter(self)

    def __contains__(self, e):
        return e in self.m

    def __len__(self):
        return len(self.m)

    def get(self, *a):
        return self.m.get(*a)


def _attr_extents_read(state: ManagerState, run) -> int:
    """How many attr extents ``run(state)`` reads from the table's attr index (a park, a stats call)."""
    index = ledger_of(state).attrs
    real = index.refs
    index.refs = counting = _CountingRefs(real)
    try:
        run(state)
    finally:
        index.refs = real
    return counting.reads


def test_stats_and_park_read_no_attr_extent_whatever_the_sessions():
    # Regression (issue 24): stats() and park() unioned every fixed attr extent of the table with the
    # objects' on every call (O(attr values)): 290 ms and 683 ms at 100k sessions with one 32-byte prompt
    # tensor each. The ledger keeps those bytes now: neither reads one attr extent.
    for attr in (lambda i: torch.zeros(8), lambda i: np.zeros(2, np.float32)):
        state = table_with_attrs(50, attr)
        exact = {k: v for k, v in fs.stats(state, exact=True).items() if k.startswith("nbytes")}

        def stats(s, exact=exact):
            assert {k: v for k, v in fs.stats(s).items() if k.startswith("nbytes")} == exact

        def park(s):
            parked, moved = fs.park(s, "s7", "buf")
            assert moved  # the ring's item left the cpu pool for its host copy
            assert fs.stats(parked)["nbytes:cpu"] == fs.stats(parked, exact=True)["nbytes:cpu"]

        assert _attr_extents_read(state, stats) == 0
        assert _attr_extents_read(state, park) == 0


def test_an_attr_aliasing_an_object_counts_once_and_its_bytes_stay_when_the_object_goes():
    # numpy values: fixed, so recorded per extent whatever engine pools other tests left alive (torch
    # tensors are walked as containers while one is).
    t = np.zeros(16, np.float32)
    state = table_with_attrs(3, lambda i: np.zeros(2, np.float32))
    state = fs.commit(state, "s1", "buf", t)
    state = fs.set_attr(state, "s1", "view", t[4:])  # an attr over the object's buffer: no extra bytes
    before = fs.stats(state)["nbytes:cpu"]
    assert before == fs.stats(state, exact=True)["nbytes:cpu"]
    assert dict(ledger_of(state).attr_only) == {"cpu": 3 * 8}  # the three prompts; not the view
    state = fs.commit(fs.commit(state, "s1", "buf", np.ones(4)), "s1", "buf", np.ones(4))
    # The ring let go of t; the attr keeps its buffer alive: its 64 bytes move to the attr-only sum.
    assert dict(ledger_of(state).attr_only) == {"cpu": 3 * 8 + 64}
    assert fs.stats(state)["nbytes:cpu"] == fs.stats(state, exact=True)["nbytes:cpu"]
    state, _ = fs.drop_session(state, "s1")
    assert dict(ledger_of(state).attr_only) == {"cpu": 2 * 8}
    assert fs.stats(state)["nbytes:cpu"] == fs.stats(state, exact=True)["nbytes:cpu"]


@pytest.mark.parametrize("donate", [False, True])
def test_an_object_replaced_under_its_name_beside_an_attr_alias_keeps_exact_figures(donate):
    """`swap_session` prices objects replaced under the same names pair by pair (issue 37): an attr that
    shared the old object's buffer keeps its bytes once the object moves to new ones."""
    import jax.numpy as jnp

    x = jnp.ones((4, 8))
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "kv", fs.PytreeValue.create({"k": x, "n": jnp.zeros(3)}))
    state = fs.put(state, "a", "other", fs.PytreeValue.create({"k": jnp.zeros(5)}))
    state = fs.set_attr(state, "a", "alias", x)
    for i in range(3):
        state = fs.step(
            state, "a", "kv", lambda v, d: v.commit({"k": v.view()["k"] + d, "n": v.view()["n"]}), i, donate=donate
        )
        assert fs.stats(state) == fs.stats(state, exact=True)
    assert fs.stats(state)["nbytes:cpu"] == 2 * x.nbytes + 3 * 4 + 5 * 4
    np.testing.assert_array_equal(np.asarray(fs.get_attr(state, "a", "alias")), np.ones((4, 8)))


# --- a park, a restore or a commit of a torch DenseValue moves its extents on the persistent maps (issue 38) ---


def _dense(*tensors):
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state = fs.put(state, "a", "kv", fs.DenseValue.create(list(tensors)))
    fs.stats(state)  # (the ledger is built on first use)
    return state


def test_park_restore_and_commit_of_a_dense_value_take_the_short_path(monkeypatch):
    """Seen failing before: each went through `Acct.change` (a mutation of every map) for a few extents."""
    from functional_state.table.ledger import Acct

    state = _dense(torch.zeros(2, 8), torch.zeros(3, 8))
    calls = {"n": 0}
    real = Acct.change

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Acct, "change", counted)
    parked, _ = fs.park(state, "a", "kv")
    restored, _ = fs.restore(parked, "a", "kv")
    committed = fs.commit(restored, "a", "kv", [torch.zeros(4, 8), torch.zeros(4, 8)])
    assert calls["n"] == 0
    for s, parked_nbytes in ((parked, 4 * 40), (restored, 0), (committed, 0)):
        assert fs.stats(s) == fs.stats(s, exact=True) and fs.stats(s)["parked_nbytes"] == parked_nbytes


@pytest.mark.parametrize("shared", ["attr", "fork", "loose"])
def test_the_short_path_keeps_shared_and_loose_extents_exact(shared):
    """An extent an attr or a fork also holds stays counted once while either holds it; a storage torch did
    not allocate (`Loose`: the maps start indexing its pool) takes the general path."""
    a = torch.zeros(2, 8)
    b = torch.from_numpy(np.zeros((3, 8), np.float32)) if shared == "loose" else torch.zeros(3, 8)
    state = _dense(a, b)
    if shared == "attr":
        state = fs.set_attr(state, "a", "keep", a)
    elif shared == "fork":
        state = fs.fork_session(state, "a", "b")
    steps = [
        lambda s: fs.commit(s, "a", "kv", [a, torch.zeros(5, 8)]),
        lambda s: fs.commit(s, "a", "kv", [torch.zeros(6, 8), torch.zeros(5, 8)]),
        lambda s: fs.commit(s, "a", "kv", [a, b]),
    ]
    for step in steps:
        state = step(state)
        assert fs.stats(state) == fs.stats(state, exact=True)
    if shared != "fork":  # (a fork shares the storage: parking it alone is refused, tested elsewhere)
        state = fs.commit(state, "a", "kv", [torch.zeros(7, 8), torch.zeros(1, 8)])
        parked, _ = fs.park(state, "a", "kv")
        assert fs.stats(parked) == fs.stats(parked, exact=True)
        restored, _ = fs.restore(parked, "a", "kv")
        assert fs.stats(restored) == fs.stats(restored, exact=True)
