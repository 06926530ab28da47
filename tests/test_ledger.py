"""The table's ledger (`table/ledger.py`): kept figures after object swaps and session edits equal the walk,
where a mutation sample showed the suite blind (issue 34)."""

from __future__ import annotations

import numpy as np
import pytest

import functional_state as fs
from functional_state import LatentBuffer, ManagerState


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
