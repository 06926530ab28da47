"""`free_acquired` (`table/engine_blocks.py`): a KV restore the byte budget refuses keeps the K/V restorable
with an engine whose ``reload`` consumes its offload token (engine-managed host memory: issue 34, item 5)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import functional_state as fs
from functional_state import ManagerState, PagedKVHandle, PagedKVPool, SessionStateManager
from functional_state.table.engine_blocks import free_acquired

BLOCK = 4 * 8 * 4  # block_size 4 x 8 floats, float32


class ConsumingEngine:
    """A paged pool whose offloaded blocks live in the engine's own host store, keyed by an int token that
    ``reload`` takes out (a second reload of one token is the engine's ``KeyError``)."""

    def __init__(self, num_blocks: int = 8) -> None:
        self.layer = np.zeros((num_blocks, 4, 8), np.float32)
        self.free_ids = list(range(num_blocks))
        self.host: dict[int, np.ndarray] = {}
        self.tokens = itertools.count()
        self.pool = PagedKVPool(self.layer, free=self.free, offload=self.offload, reload=self.reload, name="kv")

    def allocate(self, n: int) -> tuple[int, ...]:
        ids, self.free_ids = tuple(self.free_ids[:n]), self.free_ids[n:]
        return ids

    def free(self, ids: tuple[int, ...]) -> None:
        self.free_ids = sorted(set(self.free_ids) | set(ids))

    def offload(self, ids: tuple[int, ...]) -> int:
        token = next(self.tokens)
        self.host[token] = self.layer[list(ids)].copy()
        return token

    def reload(self, token: int) -> tuple[int, ...]:
        data = self.host.pop(token)
        ids = self.allocate(len(data))
        self.layer[list(ids)] = data
        return ids


def _parked_beside_a_pinned_session():
    engine = ConsumingEngine()
    ids = engine.allocate(2)
    engine.layer[list(ids)] = np.arange(2 * 32, dtype=np.float32).reshape(2, 4, 8)
    m = SessionStateManager(byte_budget={"cpu": 3 * BLOCK})
    a = m.get_or_create_session("a").put("kv", PagedKVHandle.create(engine.pool, ids))
    want = np.asarray(a.view("kv")).copy()
    m.park("a", "kv")
    m.get_or_create_session("b").put("kv", PagedKVHandle.create(engine.pool, engine.allocate(2)))
    return engine, m, a, want


def test_a_refused_restore_keeps_the_kv_of_an_engine_whose_reload_consumes_its_token():
    # The refused restore reloaded (the engine took the token out), handed the blocks back, and kept the
    # spent token: the next restore raised the engine's KeyError and the K/V was gone.
    engine, m, a, want = _parked_beside_a_pinned_session()
    with m.pin("b"):  # b cannot make room: a's two blocks beside b's two are over the budget
        for restore in (lambda: m.restore("a", "kv"), lambda: a.view("kv"), lambda: a.restore("kv")):
            with pytest.raises(fs.BudgetExceededError):
                restore()
            assert fs.lookup(m.state, "a").get("kv").parked
            assert len(engine.free_ids) == 6 and len(engine.host) == 1  # blocks back, K/V still offloaded
    m.drop_session("b")
    np.testing.assert_array_equal(np.asarray(a.view("kv")), want)
    assert m.stats()["nbytes:cpu"] == m.stats(exact=True)["nbytes:cpu"] == 2 * BLOCK


def test_free_acquired_puts_the_reloaded_blocks_back_through_offload():
    engine = ConsumingEngine()
    ids = engine.allocate(2)
    engine.layer[list(ids)] = 7.0
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    resident = fs.put(s, "a", "kv", PagedKVHandle.create(engine.pool, ids))
    parked, _ = fs.park(resident, "a", "kv")
    fs.free_released(resident, parked)
    for _ in range(2):  # refused twice: each time the K/V goes back to the engine's host store
        restored, _ = fs.restore(parked, "a", "kv")
        free_acquired(parked, restored)
        assert len(engine.free_ids) == 8 and len(engine.host) == 1
    restored, _ = fs.restore(parked, "a", "kv")
    np.testing.assert_array_equal(np.asarray(fs.view(restored, "a", "kv")), np.full((8, 8), 7.0))
