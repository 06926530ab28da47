"""The ring's priced commit (`LatentBuffer.ledger_step`) and the accounting's reads it relies on (issue 24).

The step keeps each ring's extent multiset as a dict while small and a Map beyond, and writes the steady
state (a full ring, one extent out, one in) as its own branch: every branch must leave the kept totals
equal to a walk, whatever the items share, and leave the state it started from as it was.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_state as fs
from functional_state import LatentBuffer, ManagerState
from functional_state.memory import accounting
from helpers import assert_unchanged, snapshot


def _pools(s: dict) -> dict:
    return {k: v for k, v in s.items() if k.startswith("nbytes:")}


def _walked(obj) -> frozenset:
    out: accounting.Extents = []
    accounting.collect_extents(obj, out, {}, accounting.WalkReport())
    return frozenset(out)


def _ring(state: ManagerState) -> LatentBuffer:
    return fs.lookup(state, "a").get("ring")


def _items() -> list:
    """Items that share storage every way a ring meets: views of one base, a repeated array, torch views,
    a read-only array and memory numpy does not own."""
    base = np.zeros(64, np.float32)
    t = torch.zeros(32)
    return [
        base[:16],
        base[16:48],
        base,  # the whole of what the two views above hold
        np.ones(8, np.float32),
        np.frombuffer(b"\x01" * 24, np.uint8),  # read-only, memory owned by bytes
        t[:8],
        t[8:],
        torch.ones(4),
        np.arange(12.0).reshape(3, 4).T,  # not C-contiguous
    ]


# Each op: (what, item index); "fresh" commits a new array of its own storage (the steady state).
OPS = st.lists(
    st.tuples(st.sampled_from(["commit", "fresh", "stage", "commit_staged", "discard"]), st.integers(0, 8)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=40, deadline=None)
@given(maxlen=st.sampled_from([1, 2, 4, 70, None]), ops=OPS)
def test_kept_totals_equal_a_walk_after_any_ring_sequence(maxlen, ops):
    items = _items()
    state, _ = fs.get_or_create(ManagerState.create(), "a")
    state, _ = fs.get_or_create(state, "b")
    state = fs.put(state, "a", "ring", LatentBuffer.create(maxlen=maxlen))
    fs.stats(state)  # tracked from here: every step below is priced by the ring's ledger_step
    for what, i in ops:
        before, snap = state, snapshot(state)
        if what == "commit":
            state = fs.commit(state, "a", "ring", items[i])
        elif what == "fresh":
            state = fs.commit(state, "a", "ring", np.full(4 + i, float(i), np.float32))
        elif what == "stage":
            state = fs.stage(state, "a", "ring", items[i])
        elif what == "commit_staged" and _ring(state).staged is not None:
            state = fs.commit(state, "a", "ring")
        elif what == "discard":
            state = fs.discard(state, "a", "ring")
        if i == 0:  # the other session holds what this ring holds now: storage shared across objects
            state = fs.put(state, "b", f"copy{len(ops) % 3}", _ring(state))
        assert_unchanged(before, snap)
        assert _pools(fs.stats(state)) == _pools(fs.stats(state, exact=True))
        ring = _ring(state)
        assert ring.ledger_extents() == _walked(ring)
        # The ledger counts holders (objects), not items: a ring holding one storage twice holds it once.
        held = Counter(e for sid in ("a", "b") for obj in fs.lookup(state, sid).objects.values() for e in _walked(obj))
        assert dict(state._acct.refs) == dict(held)


def test_a_long_ring_crossing_the_small_multiset_size_stays_exact():
    # 70 items of their own storage: the multiset outgrows the dict and is kept as a Map from then on.
    state, _ = fs.get_or_create(ManagerState.create(byte_budget={"cpu": 1 << 30}), "a")
    state = fs.put(state, "a", "ring", LatentBuffer.create(maxlen=70))
    shared = np.zeros(16, np.float32)
    for k in range(150):
        item = shared if k % 7 == 0 else np.full(16, k, np.float32)
        state = fs.commit(state, "a", "ring", item)
        if k % 10 == 0 or k > 140:
            assert _pools(fs.stats(state)) == _pools(fs.stats(state, exact=True))
    distinct = 1 + sum(1 for k in range(80, 150) if k % 7)
    assert _pools(fs.stats(state)) == {"nbytes:cpu": 64 * distinct}


def test_the_steady_step_counts_a_dropped_item_whose_storage_another_item_still_holds():
    state, _ = fs.get_or_create(ManagerState.create(byte_budget={"cpu": 1 << 30}), "a")
    state = fs.put(state, "a", "ring", LatentBuffer.create(maxlen=2))
    x = np.zeros(16, np.float32)
    for item in (x, x, np.ones(4, np.float32), x, x[:4], np.ones(2, np.float32), np.ones(2, np.float32)):
        state = fs.commit(state, "a", "ring", item)
        assert _pools(fs.stats(state)) == _pools(fs.stats(state, exact=True))


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.zeros(16, np.float32),
        lambda: np.zeros(64, np.float32)[5:],
        lambda: np.arange(24.0).reshape(4, 6).T,
        lambda: np.arange(24.0)[::-3],
        lambda: np.frombuffer(b"abcd" * 4, np.uint8),
        lambda: np.zeros(8).view(np.recarray),
        lambda: np.ma.masked_array(np.ones(5)),
    ],
)
def test_the_address_read_is_the_array_interface_one(make):
    a = make()
    assert accounting._address(a) == a.__array_interface__["data"][0]


def test_a_step_moving_bytes_in_two_pools_moves_both_totals():
    # An item in pinned host memory replaces one in the default CPU pool (and tuples hold both): a step's
    # bytes move in two pools, each total its own.
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    state, _ = fs.get_or_create(ManagerState.create(byte_budget={"cpu": 1 << 30}), "a")
    state = fs.put(state, "a", "ring", LatentBuffer.create(maxlen=2))
    for k in range(8):
        host = jax.device_put(jnp.full(4 + k, float(k)), pinned)
        item = [np.full(8, k, np.float32), host, (np.ones(k + 1), host)][k % 3]
        state = fs.commit(state, "a", "ring", item)
        assert _pools(fs.stats(state)) == _pools(fs.stats(state, exact=True))
        assert len(_pools(fs.stats(state))) == (1 if k == 0 else 2)
