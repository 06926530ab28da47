"""Engine-owned paged KV in the accounting: bytes by block, shared blocks once, frees exactly once."""

from __future__ import annotations

import gc
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import functional_state as fs
from functional_state import (
    InvalidArgumentError,
    InvalidTypeError,
    KVFreeError,
    ManagerState,
    PagedKVHandle,
    PagedKVPool,
    PoolChangedError,
    SessionStateManager,
)
from functional_state.table.engine_blocks import free_acquired
from helpers import assert_unchanged, snapshot
from torch_bridge.harness.paged_engine import EngineError, ReferenceKVEngine

BLOCK = 16 * 2 * 8 * 2  # block_size 16 x heads 2 x head_dim 8 x bf16, per pool tensor
LAYER_BLOCK = 2 * BLOCK  # a K and a V pool per layer


def _engine(num_blocks=32, **kw) -> ReferenceKVEngine:
    return ReferenceKVEngine(num_blocks=num_blocks, block_size=16, heads=2, head_dim=8, **kw)


def _held_by_handles(state: ManagerState) -> set[int]:
    """The hand count: every block any handle in the table holds."""
    out: set[int] = set()
    for session in fs.sessions(state).values():
        for obj in session.objects.values():
            if isinstance(obj, PagedKVHandle):
                out.update(obj.held_blocks())
    return out


# --- accounting by block --------------------------------------------------------------------------------


def test_three_sessions_sharing_a_prefix_count_their_blocks_and_the_prefix_once():
    engine = _engine()
    prefix = engine.allocate(2)  # a shared system prompt
    manager = SessionStateManager()
    own = {}
    for sid in ("a", "b", "c"):
        own[sid] = engine.allocate(1 + len(own))  # 1, 2 and 3 blocks of their own
        manager.get_or_create_session(sid).put("kv", PagedKVHandle.create(engine.pool, prefix + own[sid]))
    for sid in ("a", "b", "c"):
        per_session = manager.get_session(sid).state.nbytes_by_device()
        assert per_session == {"cpu": (2 + len(own[sid])) * LAYER_BLOCK}  # its blocks, not the pool
    s = manager.stats()
    assert s["nbytes:cpu"] == (2 + 1 + 2 + 3) * LAYER_BLOCK  # the prefix once across the table
    assert s["nbytes:cpu"] == manager.stats(exact=True)["nbytes:cpu"]
    assert s["kv_pool:engine-kv:held_nbytes"] == 8 * LAYER_BLOCK
    assert s["kv_pool:engine-kv:total_nbytes"] == 32 * LAYER_BLOCK
    assert s["kv_pool:engine-kv:free_nbytes"] == (32 - 8) * LAYER_BLOCK


def test_a_narrow_view_into_the_pool_counts_the_blocks_it_spans_once():
    engine = _engine()
    ids = engine.allocate(3)
    manager = SessionStateManager()
    h = manager.get_or_create_session("a")
    h.put("kv", PagedKVHandle.create(engine.pool, ids))
    h.set_attr("last_k", engine.k[0][ids[-1], :4])  # a narrow view of a block the handle holds
    assert manager.stats()["nbytes:cpu"] == 3 * LAYER_BLOCK
    assert manager.stats(exact=True)["nbytes:cpu"] == 3 * LAYER_BLOCK
    h.set_attr("other", engine.k[0][20:22])  # a view of two blocks no handle holds: counted, by block
    assert manager.stats()["nbytes:cpu"] == 3 * LAYER_BLOCK + 2 * BLOCK
    h.put("ring", fs.LatentBuffer.create(maxlen=2).commit(engine.v[0][ids[0]]))  # a buffer holding a view
    assert manager.stats(exact=True)["nbytes:cpu"] == 3 * LAYER_BLOCK + 2 * BLOCK
    assert fs.nbytes_by_device(engine.k[0]) == {"cpu": 32 * BLOCK}  # the whole pool tensor: every block


def test_flat_allocation_split_into_layers_and_numpy_pools():
    flat = torch.zeros(2, 8, 4, 4)  # one allocation, two layers of 8 blocks
    layers = [flat[0], flat[1]]  # the engine keeps its layer tensors (the pool holds them weakly)
    pool = PagedKVPool(layers, free=lambda ids: None, name="flat")
    h = PagedKVHandle.create(pool, [1, 2])
    assert fs.nbytes_by_device(h) == {"cpu": 2 * 2 * 4 * 4 * 4}
    assert fs.nbytes_by_device(h, flat[1, 2]) == fs.nbytes_by_device(h)  # a view of layer 1, block 2
    arr = np.zeros((6, 2, 3), np.float32)
    npool = PagedKVPool(arr, free=lambda ids: None)
    assert fs.nbytes_by_device(PagedKVHandle.create(npool, [0, 5]), arr[5]) == {"cpu": 2 * 24}


# --- frees: exactly once, when the last holder lets go -----------------------------------------------------


def test_frees_go_to_the_engine_when_the_last_holder_lets_go_in_order():
    engine = _engine()
    prefix = engine.allocate(2)
    manager = SessionStateManager(max_sessions=3)
    for sid in ("a", "b"):
        manager.get_or_create_session(sid).put("kv", PagedKVHandle.create(engine.pool, prefix + engine.allocate(1)))
    manager.fork_session("a", "a2")
    manager.drop_session("a")
    assert engine.freed_log == []  # the fork still holds a's blocks
    manager.get_session("b").evict("kv")
    assert engine.freed_log == [(3,)]  # b's own block; the prefix is a2's too
    manager.get_or_create_session("d")  # a2, b, d: nothing leaves
    manager.get_or_create_session("e")  # the cap evicts a2 (least recent): its blocks go back
    assert engine.freed_log == [(3,), (0, 1, 2)]
    assert engine.allocated == set()
    assert engine.free_block_count() == 32


def test_a_detached_handle_does_not_keep_reading_freed_blocks():
    engine = _engine()
    manager = SessionStateManager()
    h = manager.get_or_create_session("a")
    h.put("kv", PagedKVHandle.create(engine.pool, engine.allocate(2)))
    manager.drop_session("a")
    assert engine.freed_log == [(0, 1)]
    assert h.state.objects["kv"].evicted  # its copy lets go too: the engine may hand the blocks out again


def test_a_failing_free_leaves_the_manager_as_it_was():
    engine = _engine()
    manager = SessionStateManager(max_sessions=1)
    a = manager.get_or_create_session("a")
    a.put("kv", PagedKVHandle.create(engine.pool, engine.allocate(2)))
    before = snapshot(manager.state)
    engine.fail_next_free = True
    with pytest.raises(KVFreeError, match="engine-kv.*injected"):
        manager.drop_session("a")
    assert_unchanged(manager.state, before)
    assert "a" in manager and a.get("kv").block_ids == (0, 1)  # the handle still reads the table
    engine.fail_next_free = True
    with pytest.raises(KVFreeError):
        manager.get_or_create_session("b")  # the cap would evict "a": refused the same way
    assert_unchanged(manager.state, before)
    manager.drop_session("a")
    assert engine.freed_log == [(0, 1)]


def test_pure_functions_never_call_the_engine_and_released_blocks_says_what_to_free():
    engine = _engine()
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "kv", PagedKVHandle.create(engine.pool, engine.allocate(3)))
    snap = snapshot(s)
    evicted, _ = fs.evict(s, "a", "kv")
    assert engine.freed_log == [] and engine.allocated == {0, 1, 2}
    assert_unchanged(s, snap)
    released = fs.released_blocks(s, evicted)
    assert released == {engine.pool: (0, 1, 2)}
    fs.free_released(s, evicted)
    assert engine.freed_log == [(0, 1, 2)]
    with pytest.raises(KVFreeError, match="double free"):
        fs.free_released(s, evicted)  # the same transition twice: the engine catches the double free


def test_released_blocks_spans_several_steps_and_unrelated_tables():
    engine = _engine()
    ids = engine.allocate(3)
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "kv", PagedKVHandle.create(engine.pool, ids))
    back, _ = fs.evict(s, "a", "kv")
    back = fs.put(back, "a", "kv", PagedKVHandle.create(engine.pool, ids))  # let go, then held again
    assert fs.released_blocks(s, back) == {}
    moved, _ = fs.drop_session(s, "a")
    moved, _ = fs.get_or_create(moved, "b")
    moved = fs.put(moved, "b", "kv", PagedKVHandle.create(engine.pool, ids[1:2]))
    assert fs.released_blocks(s, moved) == {engine.pool: (ids[0], ids[2])}
    other, _ = fs.get_or_create(ManagerState.create(), "c")  # built apart: compared block by block
    other = fs.put(other, "c", "kv", PagedKVHandle.create(engine.pool, ids[1:2]))
    assert fs.released_blocks(s, other) == {engine.pool: (ids[0], ids[2])}


# --- the state machine against the reference allocator ------------------------------------------------


class KVMachine(RuleBasedStateMachine):
    """Sessions fork, share prefixes, commit, evict, reset and drop through a manager with a small cap; after
    every step the engine's allocated blocks are exactly those some handle in the table holds (never freed
    earlier, never twice: the engine raises on a double free)."""

    @initialize(cap=st.integers(2, 5))
    def init(self, cap):
        self.engine = _engine(num_blocks=64)
        self.manager = SessionStateManager(max_sessions=cap)
        self.n = 0

    def _sids(self):
        return list(self.manager.state.session_ids)

    @precondition(lambda self: self.engine.free_block_count() >= 4)
    @rule(k=st.integers(1, 3), share=st.booleans())
    def new_session(self, k, share):
        sids = self._sids()
        prefix: tuple[int, ...] = ()
        if share and sids:
            donor = self.manager.state
            kv = fs.lookup(donor, sids[-1]).objects.get("kv")  # the most recent: the cap never evicts it now
            if kv is not None and kv.resident:
                prefix = kv.block_ids[:2]
        self.n += 1
        sid = f"s{self.n}"
        ids = prefix + self.engine.allocate(k)
        self.manager.get_or_create_session(sid).put("kv", PagedKVHandle.create(self.engine.pool, ids))

    @precondition(lambda self: self.manager.state.session_ids and self.engine.free_block_count() >= 2)
    @rule(i=st.integers(0, 10))
    def commit(self, i):
        sids = self._sids()
        h = self.manager.get_session(sids[i % len(sids)])
        kv = h.state.objects.get("kv")
        if kv is not None and kv.resident:
            h.commit("kv", list(self.engine.allocate(1)))

    @precondition(lambda self: self.manager.state.session_ids)
    @rule(i=st.integers(0, 10))
    def fork(self, i):
        sids = self._sids()
        self.n += 1
        self.manager.fork_session(sids[i % len(sids)], f"s{self.n}")

    @precondition(lambda self: self.manager.state.session_ids)
    @rule(i=st.integers(0, 10), how=st.sampled_from(["evict", "drop", "reset", "replace"]))
    def let_go(self, i, how):
        sids = self._sids()
        sid = sids[i % len(sids)]
        if how == "drop":
            self.manager.drop_session(sid)
        elif how == "reset":
            self.manager.get_session(sid).reset()
        elif how == "evict" and "kv" in self.manager.get_session(sid).state.objects:
            self.manager.get_session(sid).evict("kv")
        elif how == "replace" and self.engine.free_block_count():
            self.manager.get_session(sid).put("kv", PagedKVHandle.create(self.engine.pool, self.engine.allocate(1)))

    @invariant()
    def engine_holds_exactly_what_handles_hold(self):
        if not hasattr(self, "manager"):
            return
        held = _held_by_handles(self.manager.state)
        assert self.engine.allocated == held
        assert self.manager.stats().get("kv_pool:engine-kv:held_nbytes", 0) == len(held) * LAYER_BLOCK
        assert self.manager.stats().get("nbytes:cpu", 0) == self.manager.stats(exact=True).get("nbytes:cpu", 0)


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)


# --- JAX pools ------------------------------------------------------------------------------------------


def test_jax_pool_gather_is_jittable_and_follows_pool_updates():
    layer = jnp.arange(8 * 4 * 2, dtype=jnp.float32).reshape(8, 4, 2)
    freed = []
    pool = PagedKVPool(layer, free=freed.append, name="jax-kv")
    h = PagedKVHandle.create(pool, [5, 1])
    gather = jax.jit(fs.paged_gather)
    with jax.log_compiles(False):
        np.testing.assert_array_equal(np.asarray(gather(layer, jnp.array([5, 1]))), np.asarray(h.view()))
    assert h.view()[0, 0] == layer[5, 0, 0] and h.view().shape == (8, 2)
    new = layer.at[5].set(-1.0)  # the engine writes: a new array
    pool.update(new)
    assert float(h.view()[0, 0]) == -1.0  # the handle reads the pool's current version
    assert fs.nbytes_by_device(h) == {"cpu": 2 * 4 * 2 * 4}  # blocks keep their extents across versions
    assert fs.nbytes_by_device(h, new) == {"cpu": 8 * 4 * 2 * 4}  # the pool array itself: every block, once
    with pytest.raises(PoolChangedError, match="another geometry"):
        pool.update(jnp.zeros((16, 4, 2)))
    del layer


def test_jax_pool_under_jit_and_donation_is_detected():
    layer = jnp.zeros((4, 2, 2))
    pool = PagedKVPool(layer, free=lambda ids: None, name="donated")
    h = PagedKVHandle.create(pool, [0])
    layer.delete()  # the engine donated or freed it without telling the pool
    with pytest.raises(PoolChangedError, match="freed"):
        h.view()


# --- the planner --------------------------------------------------------------------------------------------


def test_the_budget_evicts_recomputable_kv_and_the_engine_gets_its_blocks_back():
    engine = _engine()
    manager = SessionStateManager(byte_budget={"cpu": 6 * LAYER_BLOCK}, release_levers=["evict"])
    for sid in ("a", "b"):
        h = manager.get_or_create_session(sid)
        h.put("tokens", fs.DenseValue.create(torch.zeros(4, dtype=torch.int32)))
        h.put("kv", PagedKVHandle.create(engine.pool, engine.allocate(3), recompute_source="tokens"))
    assert manager.stats()["nbytes:cpu"] == 3 * LAYER_BLOCK + 2 * 16  # 6 blocks and the tokens: over by 32 B
    assert engine.freed_log == [(0, 1, 2)]  # a's KV (least recently used) evicted to fit b's: freed
    assert manager.get_session("a").state.objects["kv"].evicted


def test_the_budget_parks_kv_through_the_engine_offload_and_restore_reloads_it():
    engine = _engine(offload=True)
    ids = engine.allocate(2)
    engine.write(ids[0], 0, torch.ones(2, 8), torch.full((2, 8), 2.0))
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "kv", PagedKVHandle.create(engine.pool, ids))
    before = fs.lookup(s, "a").objects["kv"].view()
    parked, moved = fs.park(s, "a", "kv")
    assert moved.get("cpu", 0) == 0  # a CPU pool offloaded to CPU memory: the bytes move within "cpu"
    fs.free_released(s, parked)
    assert engine.allocated == set()
    restored, _ = fs.restore(parked, "a", "kv")
    h = fs.lookup(restored, "a").objects["kv"]
    assert h.resident and len(h.block_ids) == 2
    for x, y in zip(before, h.view()):
        assert torch.equal(x, y)


# --- bad input -----------------------------------------------------------------------------------------------


def test_bad_block_ids_raise_specific_errors_and_change_nothing():
    engine = _engine(num_blocks=8)
    manager = SessionStateManager()
    h = manager.get_or_create_session("a")
    h.put("kv", PagedKVHandle.create(engine.pool, [0, 1]))
    before = snapshot(manager.state)
    with pytest.raises(InvalidArgumentError, match=r"out of range for pool 'engine-kv' of 8 blocks"):
        h.commit("kv", [8])
    with pytest.raises(InvalidArgumentError, match=r"block ids \[3\] repeat"):
        h.commit("kv", [3, 3])
    with pytest.raises(InvalidArgumentError, match="already in this handle"):
        h.commit("kv", [1])
    with pytest.raises(InvalidTypeError, match="block ids are ints"):
        h.commit("kv", [1.5])
    assert_unchanged(manager.state, before)


def test_pools_declared_on_another_device_or_resized_or_freed_are_refused():
    with pytest.raises(InvalidArgumentError, match="device='cuda:0': the layers lie on 'cpu'"):
        PagedKVPool(torch.zeros(4, 2), free=lambda ids: None, device="cuda:0")
    with pytest.raises(InvalidArgumentError, match="disagree on num_blocks"):
        PagedKVPool([torch.zeros(4, 2), torch.zeros(5, 2)], free=lambda ids: None)
    with pytest.raises(InvalidArgumentError, match="not contiguous"):
        PagedKVPool(torch.zeros(4, 6)[:, ::2], free=lambda ids: None)
    with pytest.raises(InvalidTypeError, match="free must be callable"):
        PagedKVPool(torch.zeros(4, 2), free=3)  # type: ignore[arg-type]
    layer = torch.zeros(4, 2)
    pool = PagedKVPool(layer, free=lambda ids: None, name="r")
    h = PagedKVHandle.create(pool, [1])
    layer.resize_(8, 2)  # the engine grew its pool in place
    with pytest.raises(PoolChangedError, match="changed since the pool was declared"):
        h.view()
    layer2 = torch.zeros(4, 2)
    pool2 = PagedKVPool(layer2, free=lambda ids: None, name="f")
    h2 = PagedKVHandle.create(pool2, [1])
    del layer2
    gc.collect()
    with pytest.raises(PoolChangedError, match="freed by its engine"):
        h2.view()
    with pytest.raises(EngineError, match="double free"):
        _engine().free((0,))


def test_pure_functions_with_handles_leave_their_input_unchanged():
    engine = _engine()
    s, _ = fs.get_or_create(ManagerState.create(byte_budget="1GiB"), "a")
    s = fs.put(s, "a", "kv", PagedKVHandle.create(engine.pool, engine.allocate(2)))
    snap = snapshot(s)
    fs.commit(s, "a", "kv", list(engine.allocate(1)))
    fs.evict(s, "a", "kv")
    fs.fork_session(s, "a", "b")
    fs.drop_session(s, "a")
    fs.reset_session(s, "a")
    fs.stats(s)
    fs.released_blocks(s, fs.drop_session(s, "a")[0])
    assert_unchanged(s, snap)


def test_a_freed_pool_layer_leaves_the_accounting_so_reused_memory_counts_as_itself():
    layer = torch.zeros(64, 1024)
    pool = PagedKVPool(layer, free=lambda ids: None, name="gone")
    ptr = layer.untyped_storage().data_ptr()
    del layer
    gc.collect()
    again = torch.empty(64, 1024)  # the allocator may hand the same memory out again
    assert fs.nbytes_by_device(again) == {"cpu": 64 * 1024 * 4}
    assert pool.uid not in fs.memory.accounting.POOL_LIVE
    del ptr


# --- issue 19: frees across several pools, exit, and undoing a refused restore ---------------------------


def _two_pool_session() -> tuple[ReferenceKVEngine, ReferenceKVEngine, SessionStateManager]:
    """A manager whose session "a" holds blocks of two engines (reference engines raise on a double free)."""
    e1, e2 = _engine(name="kv1"), _engine(name="kv2")
    manager = SessionStateManager()
    a = manager.get_or_create_session("a")
    a.put("kv1", PagedKVHandle.create(e1.pool, e1.allocate(2)))
    a.put("kv2", PagedKVHandle.create(e2.pool, e2.allocate(3)))
    return e1, e2, manager


@pytest.mark.parametrize("failing", [0, 1])
def test_a_retry_after_one_of_two_pools_failed_to_free_frees_each_block_once(failing):
    # Regression (issue 19): the retry freed the other pool's blocks a second time; a real engine refuses a
    # double free, so the session could then never be dropped. Both orders: whichever pool is freed first.
    e1, e2, manager = _two_pool_session()
    engines = (e1, e2)
    engines[failing].fail_next_free = True
    with pytest.raises(KVFreeError, match="injected"):
        manager.drop_session("a")
    assert "a" in manager
    manager.drop_session("a")  # the retry hands back only what the engines were still owed
    assert e1.freed_log == [(0, 1)] and e2.freed_log == [(0, 1, 2)]
    assert e1.allocated == set() and e2.allocated == set()
    assert e1.free_block_count() == e2.free_block_count() == 32


def test_free_released_after_a_partial_failure_frees_only_what_is_still_owed():
    e1, e2 = _engine(name="kv1"), _engine(name="kv2")
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "kv1", PagedKVHandle.create(e1.pool, e1.allocate(2)))
    s = fs.put(s, "a", "kv2", PagedKVHandle.create(e2.pool, e2.allocate(2)))
    after, _ = fs.drop_session(s, "a")
    order = list(fs.released_blocks(s, after))  # the order free_released calls the engines in
    second = e1 if order[1] is e1.pool else e2
    second.fail_next_free = True
    with pytest.raises(KVFreeError, match=rf"pools already freed: \['{order[0].name}'\]"):
        fs.free_released(s, after)
    assert fs.free_released(s, after) == {e1.pool: (0, 1), e2.pool: (0, 1)}  # what the change released
    assert e1.freed_log == [(0, 1)] and e2.freed_log == [(0, 1)]  # each engine called once per block
    with pytest.raises(KVFreeError, match="double free"):
        fs.free_released(s, after)  # a completed transition replayed is still the caller's double free


def test_a_process_that_made_pools_exits_without_errors_on_stderr():
    # Regression (issue 19): the layer weakref callback ran during interpreter shutdown, after module globals
    # were cleared, and every such process printed "Exception ignored in ... _layer_died ... AttributeError".
    script = textwrap.dedent(
        """
        import jax.numpy as jnp, torch
        import functional_state as fs
        from torch_bridge.harness.paged_engine import ReferenceKVEngine
        layer = torch.zeros(4, 2)
        pool = fs.PagedKVPool(layer, free=lambda ids: None)
        jlayer = jnp.zeros((4, 2))
        jpool = fs.PagedKVPool(jlayer, free=lambda ids: None)
        engine = ReferenceKVEngine(num_blocks=4, block_size=2, heads=1, head_dim=2)
        h = fs.PagedKVHandle.create(engine.pool, engine.allocate(1))
        print("ok")
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert out.stderr == ""


def test_a_block_the_engine_hands_out_again_after_a_partial_failure_is_owed_again():
    e1, e2 = _engine(num_blocks=2, name="kv1"), _engine(num_blocks=2, name="kv2")
    manager = SessionStateManager()
    a = manager.get_or_create_session("a")
    a.put("kv1", PagedKVHandle.create(e1.pool, e1.allocate(2)))
    a.put("kv2", PagedKVHandle.create(e2.pool, e2.allocate(2)))
    order = list(fs.released_blocks(manager.state, fs.drop_session(manager.state, "a")[0]))
    first, second = (e1, e2) if order[0] is e1.pool else (e2, e1)
    second.fail_next_free = True
    with pytest.raises(KVFreeError):
        manager.drop_session("a")
    assert first.freed_log == [(0, 1)] and "a" in manager
    reused = first.allocate(1)  # the engine hands block 0 out again, to another session
    manager.get_or_create_session("c").put("kv", PagedKVHandle.create(first.pool, reused))
    manager.drop_session("a")  # block 1 was already handed back; block 0 is c's now
    manager.drop_session("c")
    assert first.freed_log == [(0, 1), (0,)] and first.allocated == set() and first.free_block_count() == 2
    assert second.freed_log == [(0, 1)] and second.allocated == set()


def test_free_acquired_undoes_a_restore_keeping_the_parked_copy():
    # Issue 19: a restore the byte budget refuses must hand its reloaded blocks back; `free_acquired` does,
    # and the parked state it falls back to still restores the same K/V, bit for bit.
    engine = _engine(offload=True)
    ids = engine.allocate(2)
    engine.write(ids[0], 0, torch.randn(2, 8).to(torch.bfloat16), torch.randn(2, 8).to(torch.bfloat16))
    engine.write(ids[1], 3, torch.randn(2, 8).to(torch.bfloat16), torch.randn(2, 8).to(torch.bfloat16))
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "kv", PagedKVHandle.create(engine.pool, ids))
    original = [t.clone() for t in fs.lookup(s, "a").objects["kv"].view()]
    parked, _ = fs.park(s, "a", "kv")
    fs.free_released(s, parked)
    free_before = engine.free_block_count()
    snap = snapshot(parked)
    restored, _ = fs.restore(parked, "a", "kv")
    reloaded = fs.lookup(restored, "a").objects["kv"].block_ids
    assert engine.free_block_count() == free_before - 2
    assert free_acquired(parked, restored) == {engine.pool: tuple(sorted(reloaded))}
    assert engine.free_block_count() == free_before and engine.allocated == set()
    assert_unchanged(parked, snap)  # the parked handle and its host copy, bit for bit
    token = fs.lookup(parked, "a").objects["kv"].host_copy
    assert token is not None
    again, _ = fs.restore(parked, "a", "kv")
    for x, y in zip(original, fs.lookup(again, "a").objects["kv"].view()):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_released_blocks_between_a_table_and_its_ancestor_or_sibling():
    # Regression (issue 19): a change that only added blocks left the release log as it was, so a table
    # compared with its ancestor (a refused restore undone) or a sibling looked released-nothing.
    engine = _engine(offload=True)
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "kv", PagedKVHandle.create(engine.pool, engine.allocate(2)))
    fs.released_blocks(s, s)  # s's accounting is built now: the tables below derive theirs from it
    grown = fs.commit(s, "a", "kv", list(engine.allocate(1)))
    assert fs.released_blocks(grown, s) == {engine.pool: (2,)}  # grown holds block 2, its ancestor does not
    shrunk, _ = fs.evict(s, "a", "kv")
    assert fs.released_blocks(grown, shrunk) == {engine.pool: (0, 1, 2)}  # siblings
    assert fs.released_blocks(s, grown) == {} and fs.released_blocks(s, shrunk) == {engine.pool: (0, 1)}


def test_jit_over_sessions_traces_once_across_block_commits_and_stages():
    """Regression (issue 20): `block_ids` (and staged ids) were static aux data, so a jitted function over
    sessions traced again on every block commit (5 traces for 5 commits)."""
    pool = PagedKVPool(jnp.zeros((16, 4, 2)), free=lambda ids: None, name="traced")
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "kv", PagedKVHandle.create(pool))
    s = fs.put(s, "a", "x", fs.DenseValue.create(jnp.zeros(3)))
    traces = []

    @jax.jit
    def bump(sessions):
        traces.append(1)
        return jax.tree_util.tree_map(lambda a: a + 1 if a.dtype == jnp.float32 else a, sessions)

    for i in range(5):
        s = fs.commit(s, "a", "kv", [2 * i, 2 * i + 1])
        out = bump(fs.sessions(s))
    assert len(traces) == 1
    handle = out["a"].get("kv")  # what comes back out of the trace is the host tuple again
    assert handle.block_ids == tuple(range(10)) and handle.num_tokens == 40
    assert handle.block_ids == fs.lookup(s, "a").get("kv").block_ids
    for i in range(3):  # staging a window and committing it: one more structure (staged or not), no more
        s = fs.stage(s, "a", "kv", [10 + i])
        bump(fs.sessions(s))
        s = fs.commit(s, "a", "kv")
        bump(fs.sessions(s))
    assert len(traces) == 2
    assert fs.lookup(s, "a").get("kv").block_ids == tuple(range(13))


def test_a_handles_block_ids_read_as_a_tuple_inside_a_trace_raise_and_the_padded_ids_work():
    layer = jnp.arange(32.0).reshape(8, 2, 2)  # the engine's pool array (a pool holds it weakly)
    pool = PagedKVPool(layer, free=lambda ids: None, name="inside")
    h = PagedKVHandle.create(pool, [3, 1])

    @jax.jit
    def first_row(layer, h):
        return layer[h.block_ids.ids[0]], h.block_ids.count

    row, n = first_row(layer, h)
    np.testing.assert_array_equal(np.asarray(row), np.asarray(layer[3]))
    assert int(n) == 2
    with pytest.raises(fs.InvalidArgumentError, match=r"inside a jitted function.*block_ids.ids"):
        jax.jit(lambda h: len(h.block_ids))(h)
