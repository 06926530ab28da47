"""The ledger protocol (issue 20): each state object type reports its own figures (`StateObject.ledger_*`),
so a type the library has never seen is counted right with no edit to `table/ledger.py`, which names none
of the shipped types."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from functional_state.core.state_object import LedgerDelta
from functional_state.engine.paged_kv import PagedKVPool

PKG = Path(fs.__file__).resolve().parent
LEDGER = PKG / "table" / "ledger.py"
SHIPPED = {"LatentBuffer", "PagedKVHandle", "ArrayRing", "DenseValue", "PytreeValue"}
# The modules that decide for every type: they ask the object (its ledger_* methods, parkable, park_extents,
# its codec), so a new StateObject type needs no edit in any of them.
DECIDERS = [LEDGER, *sorted((PKG / "policy").glob("*.py")), *sorted((PKG / "shell").glob("*.py"))]


@pytest.mark.parametrize("path", DECIDERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_modules_that_decide_for_every_type_name_no_state_object_type(path):
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            named.add(node.id)
        elif isinstance(node, ast.Attribute):
            named.add(node.attr)
        elif isinstance(node, ast.alias):
            named.update({node.name.rsplit(".", 1)[-1], node.asname or ""})
    assert not named & SHIPPED, sorted(named & SHIPPED)


@fs.pytree_dataclass(static=("status", "recompute_source", "recompute_cost"))
class Pair(fs.StateObject):
    """A user's type: the latest payload and the one before (so a commit keeps one array and drops one)."""

    latest: Any
    previous: Any
    staged: Any
    host_copy: Any
    status: str
    recompute_source: str | None
    recompute_cost: float

    @classmethod
    def create(cls) -> Pair:
        return cls(None, None, None, None, "resident", None, 1.0)

    def _commit_payload(self, payload: Any) -> Pair:
        return self._replace(latest=payload, previous=self.latest)

    def _committed_view(self) -> Any:
        return (self.previous, self.latest)

    def _view_with(self, payload: Any) -> Any:
        return (self.latest, payload)

    def _allocated_storage(self) -> dict:
        return {"latest": None, "previous": None}

    def _released_storage(self) -> dict:
        return {"latest": None, "previous": None}

    def _committed_roots(self) -> Any:
        return (self.latest, self.previous)

    def _parkable_fields(self) -> dict:
        return {"latest": self.latest, "previous": self.previous}


def _agree(state: fs.ManagerState) -> dict:
    kept, walked = fs.stats(state), fs.stats(state, exact=True)
    assert kept == walked
    return kept


def test_a_user_type_is_counted_right_through_commit_fork_park_and_drop():
    arrays = [np.full((256,), i, np.float32) for i in range(5)]  # 1 KiB each
    state, _ = fs.get_or_create(fs.ManagerState.create(byte_budget={"cpu": 2**30}), "a")
    state = fs.put(state, "a", "pair", Pair.create())
    state = fs.commit(fs.commit(state, "a", "pair", arrays[0]), "a", "pair", arrays[1])
    assert _agree(state)["nbytes:cpu"] == 2048
    state = fs.fork_session(state, "a", "b")  # the fork shares both arrays: counted once
    assert _agree(state)["nbytes:cpu"] == 2048
    state = fs.commit(state, "b", "pair", arrays[2])  # b keeps arrays[1], drops arrays[0] (still a's)
    assert _agree(state)["nbytes:cpu"] == 3072
    state = fs.commit(state, "a", "pair", arrays[3])  # a drops arrays[0]: now nobody holds it
    assert _agree(state)["nbytes:cpu"] == 3072
    state = fs.commit(state, "b", "pair", arrays[4])  # b lets go of arrays[1] (a's): b shares nothing now
    assert _agree(state)["nbytes:cpu"] == 4096
    state, _ = fs.park(state, "b", "pair")
    parked = _agree(state)
    assert parked["parked_nbytes"] == 2048
    state, _ = fs.restore(state, "b", "pair")
    _agree(state)
    state, _ = fs.evict(state, "a", "pair")
    assert _agree(state)["nbytes:cpu"] == 2048
    state, _ = fs.drop_session(state, "b")
    assert _agree(state).get("nbytes:cpu", 0) == 0


def _frozenset_step(self: Pair, new: Any) -> Any:
    """A `ledger_step` pricing a commit by its delta as frozensets (each extent once in its collection, as
    `StateObject.ledger_step` asks; `ledger_extents` returns frozensets, so their differences are natural)."""
    if type(new) is not type(self):
        return None
    before, after = self.ledger_extents(), new.ledger_extents()
    return LedgerDelta(after - before, before - after)


def test_a_user_types_own_delta_may_be_any_collection(monkeypatch):
    monkeypatch.setattr(Pair, "ledger_step", _frozenset_step)
    # (The ledger's steady-step path once indexed the delta: a frozenset of one extent in and one out raised.)
    arrays = [np.full((256,), i, np.float32) for i in range(5)]
    state, _ = fs.get_or_create(fs.ManagerState.create(byte_budget={"cpu": 2**30}), "a")
    state = fs.put(state, "a", "pair", Pair.create())
    for i, array in enumerate(arrays):  # from the third on: one array in, one out
        state = fs.commit(state, "a", "pair", array)
        assert _agree(state)["nbytes:cpu"] == 1024 * min(i + 1, 2)
    for budget in (None, "1MiB"):  # the shell's one-step commit, unbudgeted and budgeted
        m = fs.SessionStateManager(byte_budget=budget)
        h = m.get_or_create_session("a").put("pair", Pair.create())
        for array in arrays:
            h.commit("pair", array)
        assert m.stats() == m.stats(exact=True) and m.stats()["nbytes:cpu"] == 2048


@fs.pytree_dataclass(static=("pool", "pages", "status", "recompute_source", "recompute_cost"))
class Pages(fs.StateObject):
    """A user's type holding engine blocks by id: it reports them through `ledger_blocks` alone."""

    pool: Any
    pages: tuple[int, ...]
    staged: Any
    host_copy: Any
    status: str
    recompute_source: str | None
    recompute_cost: float

    def _commit_payload(self, payload: Any) -> Pages:
        return self._replace(pages=self.pages + tuple(payload))

    def _committed_view(self) -> Any:
        return self.pages

    def _view_with(self, payload: Any) -> Any:
        return self.pages + tuple(payload)

    def _allocated_storage(self) -> dict:
        return {"pages": ()}

    def _released_storage(self) -> dict:
        return {"pages": ()}

    def _committed_roots(self) -> Any:
        return ()

    def _parkable_fields(self) -> dict:
        return {"pages": self.pages}

    def _accounting_extents(self) -> list:  # the bytes: the blocks' memory in the pool
        return self.pool.extents(self.pages)

    def ledger_blocks(self) -> tuple[tuple[int, int], ...]:
        return tuple((self.pool.uid, b) for b in self.pages)


def test_a_user_type_holding_engine_blocks_is_counted_with_no_edit_to_the_ledger():
    pool = PagedKVPool(jnp.zeros((16, 4, 8)), free=lambda ids: None, name="user_pages")
    held = "kv_pool:user_pages:held_nbytes"
    state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    state = fs.put(state, "a", "kv", Pages(pool, (), None, None, "resident", None, 1.0))
    state = fs.commit(fs.commit(state, "a", "kv", [0, 1]), "a", "kv", [5])
    assert _agree(state)[held] == 3 * pool.block_nbytes
    state = fs.fork_session(state, "a", "b")
    state = fs.commit(state, "b", "kv", [7])  # a fork's blocks are held once; its own block adds one
    assert _agree(state)[held] == 4 * pool.block_nbytes
    state, _ = fs.drop_session(state, "a")
    assert _agree(state)[held] == 4 * pool.block_nbytes  # b still holds a's three
    state, _ = fs.drop_session(state, "b")
    assert held not in _agree(state)


def test_the_ring_fast_path_agrees_with_the_walk_when_items_share_storage():
    base = np.zeros((4, 256), np.float32)
    items = [base[0], base[1], np.ones(256, np.float32), base[0], base[2], np.ones(8), base[3], base[0]]
    state, _ = fs.get_or_create(fs.ManagerState.create(byte_budget={"cpu": 2**30}), "a")
    state = fs.put(state, "a", "ring", fs.LatentBuffer.create(maxlen=3))
    for i, item in enumerate(items * 2):  # views of one base count it once; it leaves with its last view
        state = fs.commit(state, "a", "ring", item if i % 5 else items[2])
        _agree(state)
    state, _ = fs.drop_session(state, "a")
    assert _agree(state).get("nbytes:cpu", 0) == 0
