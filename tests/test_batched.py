"""`functional_state.batched.BatchedSessions` (issue 37): sessions of one model in slots of stacked state.

Every session's tokens and logits are checked bit for bit against the same session run alone on the stateful
module (a Flax NNX decoder with `nnx.MultiHeadAttention(decode=True)`, an Equinox `StateIndex` model), with
sessions joining, leaving, parked, forked and restored mid-stream, under one jit trace.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_packaging import pins_of

import functional_state as fs
from functional_state.batched import BatchedSessions
from helpers import assert_unchanged, snapshot

nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
import test_equinox  # noqa: E402
import test_nnx  # noqa: E402

from functional_state.equinox import SessionStates  # noqa: E402
from functional_state.nnx import SessionCaches  # noqa: E402

CAP = 4


# The exact step promises bit-identity to the module run alone at the tested versions (the jax pin). A newer
# JAX may compile the step's loop body and the module's own jit into XLA programs that round differently
# (jax 0.12.1: one float32 ulp in one session's first token), which XLA does not promise; there the logits
# must agree to float32 rounding, and the pinned run (make test) keeps the bitwise check.
BITWISE = jax.__version__ == pins_of("constraints.txt")["jax"]


def _same_logits(want: np.ndarray, got: np.ndarray) -> bool:
    return bool(np.array_equal(want, got) if BITWISE else np.allclose(want, got, rtol=1e-6, atol=1e-6))


def _alone_logits(tokens):
    """The stateful NNX module's own decode of ``tokens``: a fresh model, `nnx.jit`, one token per call."""
    model = test_nnx.make_model()
    decode = nnx.jit(lambda m, t: m(t))
    return [np.asarray(decode(model, test_nnx.tok(t))) for t in tokens]


@pytest.fixture(scope="module")
def nnx_batch():
    return SessionCaches(test_nnx.make_model()).batched(CAP)


def _check_accounting(batch, s):
    assert fs.stats(s) == fs.stats(s, exact=True)
    u = batch.usage(s)
    assert u.stacked_nbytes == CAP * u.row_nbytes
    assert all(v == u.row_nbytes for v in u.sessions.values())
    assert all(v == u.row_nbytes for v in u.parked.values())
    assert fs.stats(s)["total_nbytes"] == u.stacked_nbytes + sum(u.parked.values())


def test_nnx_sessions_are_bit_identical_to_the_module_alone_through_join_leave_park_fork_restore(nnx_batch):
    batch = nnx_batch
    s = batch.create(fs.ManagerState.create())
    history: dict[str, list[int]] = {}
    logits: dict[str, list[np.ndarray]] = {}
    prompt = {"a": [1, 2], "b": [3], "c": [4, 5, 6], "d": [], "e": [7]}

    def next_token(sid):
        done = len(history[sid])
        own = prompt.get(sid, [])
        if done < len(own):
            return own[done]
        return int(np.argmax(logits[sid][-1][0, -1]))

    def step(ids):
        nonlocal s
        toks = {sid: np.full((1, 1), next_token(sid), np.int32) for sid in ids}
        s, out = batch.step(s, ids, batch.inputs(s, toks))
        for sid in ids:
            history[sid].append(int(toks[sid][0, 0]))
            logits[sid].append(np.asarray(out[batch.slot(s, sid)]))
        _check_accounting(batch, s)

    def join(sid):
        nonlocal s
        s = batch.join(s, sid)
        history[sid], logits[sid] = [], []

    join("a")
    join("b")
    step(["a", "b"])
    traces = test_nnx.TRACES["n"]
    step(["b", "a"])
    join("c")
    step(["a", "b", "c"])
    s = batch.park(s, "b")  # mid-stream
    assert batch.session_state(s, "b").parked
    step(["c", "a"])
    s = batch.fork(s, "a", "d")
    history["d"], logits["d"] = list(history["a"]), list(logits["a"])
    step(["a", "c", "d"])
    s = batch.leave(s, "c")
    s = batch.restore(s, "b")  # into the slot "c" left
    join("e")
    step(["a", "b", "d", "e"])
    step(["e", "b"])
    assert test_nnx.TRACES["n"] == traces, "joins, leaves, parks, forks and restores retraced the step"
    for sid, toks in history.items():
        alone = _alone_logits(toks)
        assert len(alone) == len(logits[sid])
        for i, (want, got) in enumerate(zip(alone, logits[sid])):
            assert _same_logits(want, got), f"session {sid!r}, token {i}: batched logits differ from alone"


def test_nnx_session_state_reads_the_same_batched_or_not(nnx_batch):
    caches = SessionCaches(test_nnx.make_model())
    alone = caches.begin(fs.ManagerState.create(), "a")
    s = nnx_batch.join(nnx_batch.create(fs.ManagerState.create()), "a")
    for t in (3, 1, 4):
        alone, _ = caches.step(alone, "a", test_nnx.tok(t))
        s, _ = nnx_batch.step(s, ["a"], nnx_batch.inputs(s, {"a": np.full((1, 1), t, np.int32)}))
    batched, single = nnx_batch.session_state(s, "a"), fs.lookup(alone, "a").get("kv")
    assert (batched.structure, batched.avals) == (single.structure, single.avals)
    assert all(np.array_equal(x, y) for x, y in zip(batched.leaves, single.leaves))


def test_equinox_sessions_are_bit_identical_to_the_model_alone():
    batch = SessionStates(*test_equinox.make()).batched(CAP)
    s = batch.create(fs.ManagerState.create())
    inputs = {sid: test_equinox.xs(i, 6) for i, sid in enumerate("abc")}
    outs: dict[str, list[np.ndarray]] = {sid: [] for sid in inputs}
    fed: dict[str, int] = dict.fromkeys(inputs, 0)

    def step(ids):
        nonlocal s
        s, out = batch.step(s, ids, batch.inputs(s, {sid: inputs[sid][fed[sid]] for sid in ids}))
        for sid in ids:
            outs[sid].append(np.asarray(out[batch.slot(s, sid)]))
            fed[sid] += 1

    s = batch.join(batch.join(s, "a"), "b")
    step(["a", "b"])
    traces = test_equinox.TRACES["n"]
    s = batch.park(s, "a")
    s = batch.join(s, "c")
    step(["b", "c"])
    s = batch.restore(s, "a")
    step(["a", "b", "c"])
    s = batch.leave(s, "b")
    step(["c", "a"])
    assert test_equinox.TRACES["n"] == traces
    for sid, got in outs.items():
        want = test_equinox.reference(inputs[sid][: len(got)])
        assert all(np.array_equal(w, g) for w, g in zip(want, got)), sid


# --- a toy model: fast enough for the error paths and the state machine ---------------------------------
W = jax.random.normal(jax.random.key(1), (4, 4))


def cell(h, w, x):
    new = jnp.tanh(w @ h + x)
    return new, new.sum()


def toy(capacity=CAP, exact=True, batch_id="batch"):
    return BatchedSessions(jnp.zeros(4), W, cell, capacity, name="h", batch_id=batch_id, exact=exact)


def _row(x):
    return np.full((4,), x, np.float32)


@pytest.mark.parametrize("exact", [True, False])
def test_step_traces_once_whatever_the_slots(exact):
    calls = {"n": 0}

    def counted(h, w, x):
        calls["n"] += 1  # Python runs only while tracing
        return cell(h, w, x)

    batch = BatchedSessions(jnp.zeros(4), W, counted, 8, name="h", exact=exact)
    s = batch.create(fs.ManagerState.create())
    ids = []
    for i in range(8):
        s = batch.join(s, f"s{i}")
        ids.append(f"s{i}")
        s, _ = batch.step(s, ids, np.ones((8, 4), np.float32))
        if i == 0:
            first = calls["n"]
    for sid in ("s3", "s5"):
        s = batch.leave(s, sid)
    s = batch.park(s, "s0")
    s = batch.fork(s, "s1", "f")
    s, _ = batch.step(s, ["f", "s7"], np.ones((8, 4), np.float32))
    assert calls["n"] == first


def test_vmap_step_agrees_with_exact_to_the_last_few_bits():
    outs = []
    for exact in (True, False):
        batch = toy(exact=exact)
        s = batch.join(batch.join(batch.create(fs.ManagerState.create()), "a"), "b")
        for i in range(3):
            s, out = batch.step(s, ["a", "b"], np.stack([_row(i), _row(-i), _row(0), _row(0)]))
        outs.append(np.asarray(out))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5)


def _table():
    batch = toy()
    s = batch.create(fs.ManagerState.create(max_sessions=8))
    for sid in "abc":
        s = batch.join(s, sid)
    s, _ = batch.step(s, ["a", "b", "c"], np.ones((CAP, 4), np.float32))
    return batch, batch.park(s, "c")


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda b, s: b.step(s, ["zz"], np.ones((CAP, 4), np.float32)), fs.SessionStateLostError, "join"),
        (lambda b, s: b.step(s, ["c"], np.ones((CAP, 4), np.float32)), fs.ObjectParkedError, "restore"),
        (lambda b, s: b.step(s, ["a", "a"], np.ones((CAP, 4), np.float32)), fs.InvalidArgumentError, "repeat"),
        (lambda b, s: b.step(s, ["a"], np.ones((3, 4), np.float32)), fs.StateShapeError, "leading axis"),
        (lambda b, s: b.join(s, "a"), fs.SessionExistsError, "already"),
        (lambda b, s: b.join(s, "c"), fs.SessionExistsError, "restore"),
        (lambda b, s: b.fork(s, "c", "x"), fs.ObjectParkedError, "parked"),
        (lambda b, s: b.leave(s, "zz"), fs.SessionStateLostError, "join"),
        (lambda b, s: b.park(s, "zz"), fs.SessionStateLostError, "join"),
        (lambda b, s: b.restore(s, "a"), fs.SessionExistsError, "already"),
        (lambda b, s: b.restore(s, "zz"), fs.SessionStateLostError, "zz"),
        (lambda b, s: toy(capacity=2).step(s, ["a"], np.ones((2, 4))), fs.InvalidArgumentError, "another model"),
    ],
)
def test_bad_input_raises_a_specific_error_and_changes_nothing(call, error, words):
    batch, s = _table()
    before = snapshot(s)
    with pytest.raises(error, match=words):
        call(batch, s)
    assert_unchanged(s, before)
    s, _ = batch.step(s, ["a", "b"], np.ones((CAP, 4), np.float32))  # still usable: nothing was consumed


def test_a_full_batch_refuses_join_fork_and_restore_and_changes_nothing():
    batch, s = _table()
    s = batch.join(s, "d")
    s = batch.join(s, "e")  # all 4 slots taken (c is parked)
    before = snapshot(s)
    for call in (lambda: batch.join(s, "f"), lambda: batch.fork(s, "a", "f"), lambda: batch.restore(s, "c")):
        with pytest.raises(fs.SessionAdmissionError, match="full"):
            call()
        assert_unchanged(s, before)


def test_restore_refuses_a_session_of_another_cache_shape():
    batch, s = _table()
    other = BatchedSessions(jnp.zeros(5), W, cell, CAP, name="h", batch_id="other")
    s, _ = fs.get_or_create(s, "alien")
    s = fs.put(s, "alien", "h", other.initial)
    before = snapshot(s)
    with pytest.raises(fs.InvalidArgumentError, match="layout"):
        batch.restore(s, "alien")
    assert_unchanged(s, before)


def test_park_refuses_when_the_table_is_full_rather_than_evict():
    batch = toy()
    s = batch.create(fs.ManagerState.create(max_sessions=1))
    s = batch.join(s, "a")
    before = snapshot(s)
    with pytest.raises(fs.SessionAdmissionError, match="full"):
        batch.park(s, "a")
    assert_unchanged(s, before)


def test_a_parked_session_checkpoints_and_exports_its_rows_only_and_comes_back_bit_identical(tmp_path):
    from functional_state.transfer import export_session, import_session

    batch, s = _table()
    s, _ = batch.step(s, ["a", "b"], np.stack([_row(0.5), _row(-2), _row(0), _row(0)]))
    want = [np.asarray(x) for x in batch.session_state(s, "a").leaves]
    s = batch.park(s, "a")
    fs.save_session(s, "a", tmp_path / "a")
    blob = export_session(s, "a")
    assert sum(memoryview(b).nbytes for b in blob.buffers) == batch.row_nbytes  # its rows, not the batch
    for how in ("checkpoint", "transfer"):
        other = toy().create(fs.ManagerState.create())
        other = toy().join(other, "x")  # slot 0 taken: "a" comes back into another slot
        if how == "checkpoint":
            other = fs.load_session(other, "a", tmp_path / "a")
        else:
            other = import_session(other, blob)
        other = batch.restore(other, "a")
        assert batch.slot(other, "a") == 1
        got = [np.asarray(x) for x in batch.session_state(other, "a").leaves]
        assert all(np.array_equal(w, g) for w, g in zip(want, got)), how
        assert "a" not in [sid for sid in other.session_ids if sid != "batch"]


def test_fit_parks_the_earliest_sessions_until_the_rows_fit():
    batch, s = _table()  # a and b in slots, c parked
    s, parked = batch.fit(s, batch.row_nbytes)
    assert parked == ["a"] and list(batch.slot_map(s).slots) == ["b"]
    assert set(batch.usage(s).parked) == {"a", "c"}
    assert fs.stats(s) == fs.stats(s, exact=True)
    before = snapshot(s)
    with pytest.raises(fs.InvalidArgumentError, match="max_nbytes"):
        batch.fit(s, "a lot")
    assert_unchanged(s, before)


def test_join_and_restore_are_donated_writes_that_consume_the_input_state():
    batch = toy()
    s = batch.create(fs.ManagerState.create())
    s2 = batch.join(s, "a")
    with pytest.raises(fs.StateConsumedError):
        fs.stats(s)
    assert fs.stats(s2) == fs.stats(s2, exact=True)


# --- the state machine: every session's digest against its replay alone ----------------------------------
_alone = jax.jit(cell)


class BatchMachine(RuleBasedStateMachine):
    """Random join / leave / park / restore / fork / step; after every rule, every session's state in the
    batch (or parked) equals its inputs replayed alone through the unbatched, jitted cell, bit for bit."""

    def __init__(self):
        super().__init__()
        self.batch = toy()
        self.s = self.batch.create(fs.ManagerState.create())
        self.history: dict[str, list[float]] = {}  # inputs each session was stepped with, forks inherit
        self.parked: set[str] = set()
        self.n = 0

    def _active(self):
        return [sid for sid in self.history if sid not in self.parked]

    @precondition(lambda self: len(self._active()) < CAP)
    @rule()
    def join(self):
        sid = f"s{self.n}"
        self.n += 1
        self.s = self.batch.join(self.s, sid)
        self.history[sid] = []

    @precondition(lambda self: self._active())
    @rule(data=st.data())
    def leave(self, data):
        sid = data.draw(st.sampled_from(self._active()))
        self.s = self.batch.leave(self.s, sid)
        del self.history[sid]

    @precondition(lambda self: self._active())
    @rule(data=st.data())
    def park(self, data):
        sid = data.draw(st.sampled_from(self._active()))
        self.s = self.batch.park(self.s, sid)
        self.parked.add(sid)

    @precondition(lambda self: self.parked and len(self._active()) < CAP)
    @rule(data=st.data())
    def restore(self, data):
        sid = data.draw(st.sampled_from(sorted(self.parked)))
        self.s = self.batch.restore(self.s, sid)
        self.parked.discard(sid)

    @precondition(lambda self: self._active() and len(self._active()) < CAP)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(self._active()))
        sid = f"s{self.n}"
        self.n += 1
        self.s = self.batch.fork(self.s, src, sid)
        self.history[sid] = list(self.history[src])

    @precondition(lambda self: self._active())
    @rule(data=st.data(), x=st.floats(-2, 2, width=32))
    def step(self, data, x):
        ids = data.draw(st.lists(st.sampled_from(self._active()), min_size=1, unique=True))
        self.s, _ = self.batch.step(self.s, ids, self.batch.inputs(self.s, {sid: _row(x) for sid in ids}))
        for sid in ids:
            self.history[sid].append(x)

    @invariant()
    def every_session_matches_its_replay_alone(self):
        assert fs.stats(self.s) == fs.stats(self.s, exact=True)
        for sid, inputs in self.history.items():
            h = jnp.zeros(4)
            for x in inputs:
                h, _ = _alone(h, W, jnp.asarray(_row(x)))
            obj = self.batch.session_state(self.s, sid)
            got = obj.restore().leaves[0] if obj.parked else obj.leaves[0]
            assert np.asarray(got).tobytes() == np.asarray(h).tobytes(), sid


TestBatchMachine = BatchMachine.TestCase
TestBatchMachine.settings = settings(max_examples=15, stateful_step_count=12, deadline=None)


def test_the_slot_map_is_never_walked_by_the_ledger():
    """`SlotMap` is registered bufferless: the table keeps no holder entry for it, so a donating step does not
    walk it (a 256-slot map would be walked as a container on every step otherwise)."""
    from functional_state.table.manager_state import ledger_of

    batch = toy(capacity=256)
    s = batch.join(batch.create(fs.ManagerState.create()), "a")
    assert ledger_of(s).attrs.n_open == 0


def test_no_verb_makes_the_step_compile_again(caplog):
    """A restored row arrives committed to its device; were the stacked state uncommitted before, the next
    step's arguments would change placement and XLA would compile the step again (seconds for a decoder)."""
    batch = toy()
    s = batch.create(fs.ManagerState.create())
    s = batch.join(s, "b")
    x = np.ones((CAP, 4), np.float32)

    def serve(s, sid):
        s = batch.join(s, sid)
        s, _ = batch.step(s, [sid, "b"], x)
        s = batch.restore(batch.park(s, sid), sid)
        s, _ = batch.step(s, [sid, "b"], x)
        s = batch.leave(batch.fork(s, sid, "f"), sid)
        s = batch.restore(batch.park(s, "f"), "f")
        s, _ = batch.step(s, ["f", "b"], x)
        return batch.leave(s, "f")

    s = serve(s, "a")  # every kernel compiled once
    with jax.log_compiles(), caplog.at_level("WARNING"):
        s = serve(s, "c")
    compiled = [r.getMessage()[:60] for r in caplog.records if "Compiling" in r.getMessage()]
    assert not compiled, compiled


def _hlo_shape(x) -> str:
    kind = {"f": "f", "i": "s", "u": "u", "b": "pred"}[np.dtype(x.dtype).kind]
    bits = "" if kind == "pred" else str(np.dtype(x.dtype).itemsize * 8)
    return f"{kind}{bits}[{','.join(map(str, x.shape))}]"


def test_the_exact_step_writes_the_stacked_caches_in_place(nnx_batch):
    """The compiled exact step updates each slot's rows inside the donated stacked buffers: no copy of a
    stacked K/V cache, neither per call nor per loop iteration (a loop form that loses this, e.g. a scan
    unrolled by 4, copies every slot's rows for each slot stepped: about 50x slower at 256 slots)."""
    s = nnx_batch.create(fs.ManagerState.create())
    stacked, _ = nnx_batch._batch(s, "test")
    index, count = jnp.arange(CAP, dtype=jnp.int32), jnp.int32(CAP)
    tokens = np.zeros((CAP, 1, 1), np.int32)
    compiled = jax.jit(nnx_batch._kernels.step, donate_argnums=0).lower(stacked, nnx_batch.params, index, count, tokens)
    hlo = compiled.compile().as_text()
    caches = {_hlo_shape(x) for x in stacked.leaves if np.ndim(x) > 1}
    assert caches, "the decoder's stacked state has no K/V cache leaf"
    copies = [
        line.strip()[:120]
        for line in hlo.splitlines()
        if " copy(" in line and line.split("=", 1)[1].split("{", 1)[0].strip() in caches
    ]
    assert not copies, copies


def _ring(state, w, x):
    """A session that writes one row of its buffer per step at a position that runs off both ends (the
    write's start is clamped, as a cache's is), and counts its steps."""
    buf = jax.lax.dynamic_update_slice(state["buf"], (w * x)[None], (state["pos"], 0))
    # Elementwise output: a sum over the rows may round differently in two XLA programs (as it did here).
    return {"buf": buf, "pos": state["pos"] + 2, "n": state["n"] + 1}, buf[0] * buf[-1]


def test_the_exact_step_writes_back_only_the_region_a_session_wrote_bit_identical_to_it_alone():
    from functional_state.batched.kernels import _trace_row_step

    calls = {"n": 0}

    def counted(state, w, x):
        calls["n"] += 1  # Python runs only while tracing
        return _ring(state, w, x)

    initial = {"buf": jnp.zeros((6, 3)), "pos": jnp.int32(-9), "n": jnp.int32(0)}
    w = jnp.asarray([1.5, -2.0, 0.25])
    leaves, treedef = jax.tree_util.tree_flatten(initial)

    def one(row, p, x):
        new, out = _ring(jax.tree_util.tree_unflatten(treedef, row), p, x)
        return jax.tree_util.tree_leaves(new), out

    plan = _trace_row_step(one, leaves, w, (jnp.zeros(3),))
    # leaves in key order: buf (a region write), n, pos (new whole)
    assert [r is not None for r in plan.regions] == [True, False, False], plan.regions

    batch = BatchedSessions(initial, w, counted, CAP, name="ring")
    s = batch.create(fs.ManagerState.create())
    alone = {sid: initial for sid in ("a", "b")}
    alone_step = jax.jit(_ring)
    rng = np.random.default_rng(0)
    for t in range(10):  # positions -9 to 9: wrapped from the end (-5..-1), clamped below -6 and past 5
        if t == 0:
            s = batch.join(batch.join(s, "a"), "b")
        if t == 3:
            s = batch.join(s, "c")
            alone["c"] = initial
        if t == 5:
            s = batch.leave(s, "a")
            del alone["a"]
        ids = list(alone)[::-1]
        xs = {sid: rng.standard_normal(3).astype(np.float32) for sid in ids}
        s, out = batch.step(s, ids, batch.inputs(s, xs))
        if t == 0:
            traced = calls["n"]
        for sid in ids:
            alone[sid], want = alone_step(alone[sid], w, jnp.asarray(xs[sid]))
            assert np.array_equal(np.asarray(out)[batch.slot(s, sid)], np.asarray(want)), (t, sid)
            got = batch.session_state(s, sid).leaves
            assert all(np.array_equal(g, e) for g, e in zip(got, jax.tree_util.tree_leaves(alone[sid]))), (t, sid)
    assert calls["n"] == traced, "joins and leaves retraced the step"
