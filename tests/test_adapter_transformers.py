"""`torch_bridge.adapters.transformers.SessionCaches`: sessions of a real (tiny, random-init) transformers Llama.

Every session's tokens and logits equal, bit for bit, that session decoded alone by the bare model with its
own cache: interleaved greedy decode with idle sessions parked, beam forks (a StaticCache fork stays a
snapshot), a checkpoint resumed in a fresh process. Bad input is refused with a specific error, nothing changed.
"""

import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

import functional_state as fs  # noqa: E402
from functional_state.transfer import SessionBlob, export_session  # noqa: E402
from torch_bridge.adapters.transformers import (  # noqa: E402
    CacheLayoutError,
    ModelMismatchError,
    SessionCaches,
    TokenShapeError,
)
from torch_bridge.adapters.transformers_layout import BatchRows  # noqa: E402
from torch_bridge.harness.text_models import tiny_llama  # noqa: E402

MAX_LEN = 24
KINDS = ["dynamic", "static"]
PROMPTS = [
    [5, 17, 42, 8],
    [3, 9, 1, 60],
    [11, 2, 7, 7],
    [40, 41, 42, 43],
    [1, 2, 3, 4],
    [9, 9, 8, 8],
    [70, 6, 5, 4],
    [13, 31, 13, 31],
]
STEPS = 5


def llama(layers=2, seed=0):
    return tiny_llama(layers=layers, seed=seed)


MODEL = llama()


def sessions(kind, model=MODEL, manager=None):
    return SessionCaches(model, manager, cache=kind, max_cache_len=MAX_LEN if kind == "static" else None)


def bare_cache(kind, model=MODEL):
    if kind == "static":
        return transformers.StaticCache(config=model.config, max_cache_len=MAX_LEN)
    return transformers.DynamicCache(config=model.config)


@torch.no_grad()
def alone(kind, tokens, forced=()):
    """The reference: the bare model with its own cache; prompt, then ``forced`` tokens, then greedy."""
    cache = bare_cache(kind)
    logits = MODEL(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True).logits
    out = [logits]
    for i in range(STEPS):
        nxt = forced[i] if i < len(forced) else int(logits[0, -1].argmax())
        logits = MODEL(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True).logits
        out.append(logits)
    return out


def greedy(logits):
    return logits[:, -1:].argmax(-1)


@pytest.mark.parametrize("kind", KINDS)
def test_eight_interleaved_sessions_with_idle_ones_parked_equal_each_decoded_alone_bit_for_bit(kind):
    caches = sessions(kind)
    got = {i: [caches.begin(f"s{i}", torch.tensor([p]))] for i, p in enumerate(PROMPTS)}
    for step in range(STEPS):
        for i in range(len(PROMPTS)):
            sid = f"s{i}"
            got[i].append(caches.step(sid, greedy(got[i][-1])))
            if (i + step) % 3 == 0:
                caches.park(sid)  # idle until its next turn: restored by `step`
                assert caches.manager.get_session(sid).state.get("kv").parked
    for i, p in enumerate(PROMPTS):
        want = alone(kind, p)
        assert all(torch.equal(a, b) for a, b in zip(got[i], want, strict=True)), f"session {i}"
        assert caches.length(f"s{i}") == len(p) + STEPS


@pytest.mark.parametrize("kind", KINDS)
def test_the_kept_figures_equal_a_walk_after_every_step_park_restore_and_fork(kind):
    """The ledger reads a cache's figures from its tensors' storages (issue 38): after every call they equal
    `stats(exact=True)`, forks sharing storages and parked copies included."""
    caches = sessions(kind)
    m = caches.manager

    def exact():
        assert m.stats() == m.stats(exact=True)

    logits = {sid: caches.begin(sid, torch.tensor([PROMPTS[i]])) for i, sid in enumerate(("a", "b"))}
    exact()
    caches.fork("a", "c")
    logits["c"] = logits["a"]
    exact()
    for _ in range(3):
        for sid in ("a", "b", "c"):
            logits[sid] = caches.step(sid, greedy(logits[sid]))
            exact()
            caches.park(sid)  # (a step gave the fork its own tensors: nothing else holds them)
            exact()
    caches.restore("b")
    exact()
    caches.end("c")
    exact()


@pytest.mark.parametrize("kind", KINDS)
def test_beams_forked_from_one_prompt_equal_each_beam_decoded_alone_and_the_parent_stays_a_snapshot(kind):
    caches = sessions(kind)
    prompt = PROMPTS[0]
    caches.begin("p", torch.tensor([prompt]))
    before = [t.clone() for t in caches.manager.get_session("p").view("kv")]
    firsts = [4, 50, 77]
    beams = {}
    for b, first in enumerate(firsts):
        caches.fork("p", f"beam{b}")
        logits = [caches.step(f"beam{b}", torch.tensor([[first]]))]
        for _ in range(STEPS - 1):
            logits.append(caches.step(f"beam{b}", greedy(logits[-1])))
        beams[b] = logits
    for b, first in enumerate(firsts):
        want = alone(kind, prompt, forced=[first])[1:]
        assert all(torch.equal(a, w) for a, w in zip(beams[b], want, strict=True)), f"beam {b}"
    after = caches.manager.get_session("p").view("kv")
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # no beam's write reached the parent
    assert caches.length("p") == len(prompt)


@pytest.mark.parametrize("kind", KINDS)
def test_several_tokens_in_one_step_equal_the_bare_model(kind):
    caches = sessions(kind)
    caches.begin("a", torch.tensor([PROMPTS[0][:2]]))
    got = caches.step("a", torch.tensor([PROMPTS[0][2:]]))
    cache = bare_cache(kind)
    with torch.no_grad():
        MODEL(input_ids=torch.tensor([PROMPTS[0][:2]]), past_key_values=cache, use_cache=True)
        want = MODEL(input_ids=torch.tensor([PROMPTS[0][2:]]), past_key_values=cache, use_cache=True).logits
    assert torch.equal(got, want) and caches.length("a") == 4


@pytest.mark.parametrize("kind", KINDS)
def test_a_filled_cache_is_adopted_a_dynamic_one_by_reference_without_a_copy(kind):
    cache = bare_cache(kind)
    with torch.no_grad():
        MODEL(input_ids=torch.tensor([PROMPTS[1]]), past_key_values=cache, use_cache=True)
    caches = sessions(kind)
    caches.begin("a", cache=cache)
    held = caches.manager.get_session("a").view("kv")
    if kind == "dynamic":  # the very tensors
        assert held[0].data_ptr() == cache.layers[0].keys.data_ptr()
        assert held[3].data_ptr() == cache.layers[1].values.data_ptr()
    else:  # stacked into the session's two tensors, once
        assert torch.equal(held[0][3], cache.layers[1].values) and held[1].tolist() == [4, 4]
    got = caches.step("a", torch.tensor([[5]]))
    assert torch.equal(got, alone(kind, PROMPTS[1], forced=[5])[1])


def test_a_static_batched_step_of_eight_sessions_gives_each_its_greedy_tokens():
    caches = sessions("static")
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    last = torch.cat([caches.begin(sid, torch.tensor([p])) for sid, p in zip(ids, PROMPTS)])
    tokens = []
    for _ in range(STEPS):
        tok = greedy(last)
        tokens.append(tok)
        logits = caches.step_many(ids, tok)
        last = logits
    for i, p in enumerate(PROMPTS):
        want = alone("static", p)
        want_tokens = [int(w[0, -1].argmax()) for w in want[:STEPS]]
        assert [int(t[i, 0]) for t in tokens] == want_tokens, f"session {i}"
        assert torch.allclose(last[i], want[STEPS][0], atol=1e-5)  # a batched matmul may round otherwise
        assert caches.length(ids[i]) == len(p) + STEPS
    # Each session's tensors are its own: a single step on one leaves the others as they were.
    others = [t.clone() for t in caches.manager.get_session("s1").view("kv")]
    caches.step("s0", torch.tensor([[1]]))
    assert all(torch.equal(a, b) for a, b in zip(others, caches.manager.get_session("s1").view("kv")))
    # The batch buffer (outside the manager's accounting): 2 layers' K and V of 8 rows, freed on request.
    assert caches.release_batch() == 4 * 8 * 2 * MAX_LEN * 16 * 4 and caches.release_batch() == 0


@torch.no_grad()
def fed(kind, prompt, tokens):
    """The bare model's logits after ``prompt`` then ``tokens``, one by one, with its own cache."""
    cache = bare_cache(kind)
    logits = MODEL(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
    for t in tokens:
        logits = MODEL(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits
    return logits


def test_batched_rows_are_copied_again_after_a_single_step_a_fork_or_a_new_session_under_the_same_id():
    """`step_many` keeps a batch buffer whose rows mirror the sessions; a row must be refreshed whenever its
    session's cache changed otherwise (here: single steps, a restore, a session ended and begun anew)."""
    caches = sessions("static")
    ids = ["s0", "s1", "s2", "s3"]
    prompts = {sid: PROMPTS[i] for i, sid in enumerate(ids)}
    fed_tokens = {sid: [] for sid in ids}
    for sid in ids:
        caches.begin(sid, torch.tensor([prompts[sid]]))

    def batched(tokens):
        logits = caches.step_many(ids, torch.tensor([[t] for t in tokens]))
        for sid, t in zip(ids, tokens):
            fed_tokens[sid].append(t)
        return logits

    batched([1, 2, 3, 4])
    batched([5, 6, 7, 8])
    for sid, t in zip(ids, [9, 10, 11, 12]):  # single steps: every row is stale now
        caches.step(sid, torch.tensor([[t]]))
        fed_tokens[sid].append(t)
    caches.park("s0")  # restored at the next step: new tensors
    caches.end("s3")  # begun anew under the same id, at the same length: a row naming "s3" must not be reused
    prompts["s3"], fed_tokens["s3"] = PROMPTS[5] + [1, 2, 3], []
    caches.begin("s3", torch.tensor([prompts["s3"]]))
    caches.fork("s1", "s1-beam")  # s1's next write copies its shared tensors first
    batched([13, 14, 15, 16])
    logits = batched([17, 18, 19, 20])
    for row, sid in enumerate(ids):
        want = fed("static", prompts[sid], fed_tokens[sid])
        torch.testing.assert_close(logits[row], want[0], rtol=0, atol=1e-5)
        assert int(logits[row, -1].argmax()) == int(want[0, -1].argmax())


def test_a_batch_row_is_copied_again_for_other_tensors_of_the_same_session_id_and_write_counts():
    """A session's tensors replaced by others (begun anew, their address maybe reused) written as often:
    only the row's weak references tell them apart."""
    layout = sessions("static").layout
    rows = BatchRows(layout, 1)
    old = layout.empty()
    old[0].fill_(1.0)
    rows.gather(["b"], [old], 2)  # the row now holds the old tensors' ones
    rows.scatter(["b"], [old], 2, 0)
    new = layout.empty()
    for t_new, t_old in zip(new, old):
        while t_new._version < t_old._version:
            t_new.add_(0)
    assert [t._version for t in new] == [t._version for t in old]
    cache = rows.gather(["b"], [new], 2)
    assert not cache.layers[0].keys[0, :, :2].any()  # the new session's zeros, not the old row


def test_a_session_begun_anew_under_the_same_id_with_the_same_write_count_gets_its_own_row():
    """The old session's tensors are gone (maybe their addresses reused): its row is not reused."""
    caches = sessions("static")
    ids = ["a", "b"]
    for sid, p in zip(ids, PROMPTS):
        caches.begin(sid, torch.tensor([p]))
    caches.step_many(ids, torch.tensor([[1], [2]]))
    caches.end("b")
    caches.begin("b", torch.tensor([PROMPTS[4]]))
    caches.step("b", torch.tensor([[6]]))
    logits = caches.step_many(ids, torch.tensor([[3], [4]]))
    want = fed("static", PROMPTS[4], [6, 4])
    torch.testing.assert_close(logits[1], want[0], rtol=0, atol=1e-5)


RESUME = """
import sys, torch
sys.path[:0] = {path!r}
from test_adapter_transformers import MODEL, sessions
caches = sessions({kind!r})
caches.load("a", {ckpt!r})
logits = caches.step("a", torch.tensor([[{token}]]))
torch.save(logits, {out!r})
"""


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_resumed_in_a_fresh_process_continues_bit_for_bit(kind, tmp_path):
    caches = sessions(kind)
    caches.begin("a", torch.tensor([PROMPTS[2]]))
    caches.step("a", torch.tensor([[7]]))
    caches.save("a", tmp_path / "a")
    want = caches.step("a", torch.tensor([[9]]))
    script = RESUME.format(
        path=[".", "tests"], kind=kind, ckpt=str(tmp_path / "a"), token=9, out=str(tmp_path / "l.pt")
    )
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True, timeout=300)
    assert torch.equal(torch.load(tmp_path / "l.pt"), want)


MOVED = """
import sys, torch
import numpy as np
sys.path[:0] = {path!r}
from test_adapter_transformers import MODEL, greedy, sessions
from functional_state.transfer import SessionBlob
buffers = [np.fromfile(f, np.uint8) for f in {buffers!r}]
blob = SessionBlob.from_parts(open({manifest!r}, "rb").read(), buffers)
caches = sessions({kind!r})
assert caches.import_session(blob) == "a"
assert caches.manager.get_session("a").state.get("kv").parked  # it travelled parked
logits = [caches.step("a", torch.tensor([[{token}]]))]
for _ in range(3):
    logits.append(caches.step("a", greedy(logits[-1])))
torch.save(logits, {out!r})
"""


@pytest.mark.parametrize("kind", KINDS)
def test_a_session_moved_to_a_fresh_process_continues_bit_for_bit_as_the_one_left_in_place(kind, tmp_path):
    caches = sessions(kind)
    caches.begin("a", torch.tensor([PROMPTS[2]]))
    caches.step("a", torch.tensor([[7]]))
    caches.park("a")  # a parked session moves as it is
    blob = caches.export_session("a")
    (tmp_path / "m.json").write_bytes(blob.manifest_bytes())
    files = []
    for i, buf in enumerate(blob.buffers):
        files.append(str(tmp_path / f"b{i}.bin"))
        buf.tofile(files[-1])
    want = [caches.step("a", torch.tensor([[9]]))]  # continued in place, after the export
    for _ in range(3):
        want.append(caches.step("a", greedy(want[-1])))
    script = MOVED.format(
        path=[".", "tests"],
        buffers=files,
        manifest=str(tmp_path / "m.json"),
        kind=kind,
        token=9,
        out=str(tmp_path / "l.pt"),
    )
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True, timeout=300)
    got = torch.load(tmp_path / "l.pt")
    assert [int(greedy(g)) for g in got] == [int(greedy(w)) for w in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_an_exported_session_is_a_snapshot_the_steps_after_the_export_do_not_reach(kind):
    """A StaticCache is written in place by the next step: its blob must not be a view of it (the import
    failed its checksum when it was)."""
    here, there = sessions(kind), sessions(kind)
    here.begin("a", torch.tensor([PROMPTS[3]]))
    blob = here.export_session("a")
    for t in (4, 5):
        here.step("a", torch.tensor([[t]]))
    assert there.import_session(blob, as_id="b") == "b" and there.length("b") == len(PROMPTS[3])
    got = there.step("b", torch.tensor([[6]]))
    assert torch.equal(got, fed(kind, PROMPTS[3], [6]))
    assert here.length("a") == len(PROMPTS[3]) + 2


# --- bad input: a specific error, nothing changed ----------------------------------------------------------


def counts(manager):
    """The manager's figures, less its lookup counters (a refused call still looked the session up)."""
    return {k: v for k, v in manager.stats().items() if k not in ("hits", "misses")}


def snap(caches, sid):
    return [t.clone() for t in caches.manager.get_session(sid).view("kv")], counts(caches.manager)


def assert_same(caches, sid, before):
    tensors, stats = before
    assert all(torch.equal(a, b) for a, b in zip(tensors, caches.manager.get_session(sid).view("kv"), strict=True))
    assert counts(caches.manager) == stats


@pytest.mark.parametrize("kind", KINDS)
def test_a_cache_of_another_layer_count_is_refused_and_no_session_is_created(kind):
    other = llama(layers=3)
    cache = bare_cache(kind, other)
    with torch.no_grad():
        other(input_ids=torch.tensor([PROMPTS[0]]), past_key_values=cache, use_cache=True)
    caches = sessions(kind)
    with pytest.raises(CacheLayoutError, match="3 layers, this model 2"):
        caches.begin("a", cache=cache)
    assert "a" not in caches.manager
    with pytest.raises(CacheLayoutError, match="expected a transformers"):
        caches.begin("a", cache=bare_cache("static" if kind == "dynamic" else "dynamic"))
    assert "a" not in caches.manager


@pytest.mark.parametrize("kind", KINDS)
def test_a_cache_of_a_batch_of_two_is_refused_and_no_session_is_created(kind):
    cache = bare_cache(kind)
    with torch.no_grad():
        MODEL(input_ids=torch.tensor(PROMPTS[:2]), past_key_values=cache, use_cache=True)
    caches = sessions(kind)
    with pytest.raises(CacheLayoutError, match="this model's are float32\\[" + ("4, 1," if kind == "static" else "1,")):
        caches.begin("a", cache=cache)
    assert "a" not in caches.manager


def test_a_cache_of_another_model_with_other_heads_is_refused():
    other = tiny_llama(kv_heads=4)
    cache = transformers.DynamicCache(config=other.config)
    with torch.no_grad():
        other(input_ids=torch.tensor([PROMPTS[0]]), past_key_values=cache, use_cache=True)
    with pytest.raises(CacheLayoutError, match="layer 0's keys are float32\\[1, 4, 4, 16\\]"):
        sessions("dynamic").begin("a", cache=cache)


@pytest.mark.parametrize("kind", KINDS)
def test_a_session_of_another_model_is_refused_unchanged(kind):
    manager = fs.SessionStateManager()
    mine = sessions(kind, manager=manager)
    theirs = sessions(kind, model=llama(layers=3), manager=manager)
    theirs.begin("t", torch.tensor([PROMPTS[0]]))
    before = snap(theirs, "t")
    with pytest.raises(ModelMismatchError, match="3 layers"):
        mine.step("t", torch.tensor([[1]]))
    with pytest.raises(ModelMismatchError):
        sessions("static" if kind == "dynamic" else "dynamic", manager=manager).step("t", torch.tensor([[1]]))
    assert_same(theirs, "t", before)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "tokens, match",
    [
        (torch.tensor([1]), "shape \\[1, n >= 1\\]"),
        (torch.tensor([[1], [2]]), "got torch.int64 \\[2, 1\\]"),
        (torch.zeros(1, 1), "int64 or int32 tokens"),
        (torch.ones(1, 1, dtype=torch.int16), "got torch.int16"),  # (reached the embedding, which refused it)
        (torch.ones(1, 1, dtype=torch.bool), "got torch.bool"),
        (torch.zeros(1, 0, dtype=torch.long), "n >= 1"),
        ([[1]], "got list"),
    ],
)
def test_a_token_batch_of_the_wrong_shape_is_refused_unchanged(kind, tokens, match):
    caches = sessions(kind)
    caches.begin("a", torch.tensor([PROMPTS[0]]))
    before = snap(caches, "a")
    with pytest.raises(TokenShapeError, match=match):
        caches.step("a", tokens)
    assert_same(caches, "a", before)


def test_a_static_overflow_and_a_batch_of_unequal_lengths_are_refused_unchanged():
    caches = sessions("static")
    caches.begin("a", torch.tensor([PROMPTS[0]]))
    caches.begin("b", torch.tensor([PROMPTS[1][:3]]))
    before = snap(caches, "a")
    with pytest.raises(TokenShapeError, match="overflow the StaticCache of 24"):
        caches.step("a", torch.ones(1, MAX_LEN, dtype=torch.long))
    with pytest.raises(TokenShapeError, match="hold \\[4, 3\\] tokens"):
        caches.step_many(["a", "b"], torch.ones(2, 1, dtype=torch.long))
    with pytest.raises(fs.InvalidArgumentError, match="distinct"):
        caches.step_many(["a", "a"], torch.ones(2, 1, dtype=torch.long))
    assert_same(caches, "a", before)
    with pytest.raises(fs.InvalidArgumentError, match="cache='static'"):
        sessions("dynamic").step_many(["a"], torch.ones(1, 1, dtype=torch.long))


@pytest.mark.parametrize("kind", KINDS)
def test_a_session_s_layout_is_checked_once_and_tensors_put_behind_the_adapter_s_back_are_checked_again(
    kind, monkeypatch
):
    caches = sessions(kind)
    calls = []
    check = caches.layout.check
    monkeypatch.setattr(
        type(caches.layout), "check", lambda self, flat, what, batch=1: calls.append(what) or check(flat, what, batch)
    )
    caches.begin("a", torch.tensor([PROMPTS[0]]))
    for t in (1, 2, 3):
        caches.step("a", torch.tensor([[t]]))
    assert len(calls) == 2  # begin's, then the first step's (the session's tensors were begin's, unseen)
    caches.park("a")
    caches.step("a", torch.tensor([[4]]))  # a CPU park took the tensors: restored as the very same, known
    assert len(calls) == 2
    caches.park("a", copy=True)
    caches.step("a", torch.tensor([[4]]))  # restored from a private copy: other tensors, checked again
    assert len(calls) == 3
    flat = caches.manager.get_session("a").view("kv")
    bad = (flat[0][:, :, :1], flat[1]) if kind == "static" else tuple(t[:, :1] for t in flat)  # one head, not 2
    caches.manager.get_session("a").commit("kv", bad)  # written past the adapter: refused at the next step
    with pytest.raises(CacheLayoutError):
        caches.step("a", torch.tensor([[5]]))


def test_beginning_twice_and_stepping_a_session_never_begun_are_refused():
    caches = sessions("dynamic")
    caches.begin("a", torch.tensor([PROMPTS[0]]))
    with pytest.raises(fs.SessionExistsError, match="`end` it first"):
        caches.begin("a")
    with pytest.raises(fs.SessionStateLostError):
        caches.step("nobody", torch.tensor([[1]]))
    caches.manager.get_or_create_session("bare")
    with pytest.raises(ModelMismatchError, match="no stamp"):
        caches.step("bare", torch.tensor([[1]]))


def test_a_checkpoint_of_another_model_is_refused_and_not_left_in_the_table(tmp_path):
    theirs = sessions("dynamic", model=llama(layers=3))
    theirs.begin("t", torch.tensor([PROMPTS[0]]))
    theirs.save("t", tmp_path / "t")
    mine = sessions("dynamic")
    with pytest.raises(ModelMismatchError):
        mine.load("t", tmp_path / "t")
    assert "t" not in mine.manager


class Renamed(torch.nn.Module):
    """A causal LM whose forward takes its cache under the later spelling (``cache``)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, cache=None, use_cache=True):
        return self.inner(input_ids=input_ids, past_key_values=cache, use_cache=use_cache)


@pytest.mark.parametrize("kind", KINDS)
def test_a_forward_taking_the_cache_under_its_new_name_works_alike(kind):
    renamed = SessionCaches(Renamed(MODEL), cache=kind, max_cache_len=MAX_LEN if kind == "static" else None)
    assert renamed.cache_kwarg == "cache"
    got = renamed.begin("a", torch.tensor([PROMPTS[3]]))
    assert torch.equal(got, alone(kind, PROMPTS[3])[0])


def test_a_forward_with_no_cache_argument_and_unsupported_configs_are_refused():
    class NoCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.w = MODEL.config, torch.nn.Linear(1, 1)

        def forward(self, input_ids):
            return input_ids

    with pytest.raises(CacheLayoutError, match="no cache argument"):
        SessionCaches(NoCache())
    with pytest.raises(CacheLayoutError, match="max_cache_len"):
        SessionCaches(MODEL, cache="static")
    with pytest.raises(CacheLayoutError, match="one of"):
        SessionCaches(MODEL, cache="paged")


def exported(kind, model=MODEL):
    caches = sessions(kind, model=model)
    caches.begin("a", torch.tensor([PROMPTS[0]]))
    return caches.export_session("a")


@pytest.mark.parametrize("kind", KINDS)
def test_a_blob_of_another_model_or_cache_kind_is_refused_before_anything_changes(kind):
    caches = sessions(kind)
    caches.begin("mine", torch.tensor([PROMPTS[1]]))
    before = snap(caches, "mine")
    with pytest.raises(ModelMismatchError, match="3 layers"):
        caches.import_session(exported(kind, model=llama(layers=3)))
    with pytest.raises(ModelMismatchError, match="static" if kind == "dynamic" else "dynamic"):
        caches.import_session(exported("static" if kind == "dynamic" else "dynamic"))
    assert "a" not in caches.manager
    assert_same(caches, "mine", before)
    with pytest.raises(ModelMismatchError, match="3 layers"):  # nor exported by the wrong adapter
        sessions(kind, model=llama(layers=3), manager=caches.manager).export_session("mine")


def test_a_stamped_blob_whose_tensors_are_not_the_layout_s_is_refused():
    caches = sessions("dynamic")
    other = fs.SessionStateManager()
    h = other.get_or_create_session("a")
    h.transact(
        lambda s: s.put("kv", fs.DenseValue.create((torch.zeros(1, 2, 3, 16),) * 3)).set_attr(
            "transformers/cache", caches.layout.stamp
        )
    )
    with pytest.raises(CacheLayoutError, match="expected 4 tensors"):
        caches.import_session(export_session(other.state, "a"))
    assert "a" not in caches.manager


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: SessionBlob(b.manifest, b.buffers[:-1]), "truncated"),
        (lambda b: SessionBlob(b.manifest, (b.buffers[0][:-4], *b.buffers[1:])), "truncated"),
        (lambda b: SessionBlob(b.manifest, (flipped(b.buffers[0]), *b.buffers[1:])), "checksum"),
    ],
    ids=["a buffer missing", "a buffer cut short", "a byte flipped"],
)
def test_a_damaged_blob_gets_the_transfer_error_and_the_target_is_unchanged(kind, damage, match):
    caches = sessions(kind)
    caches.begin("mine", torch.tensor([PROMPTS[1]]))
    before = snap(caches, "mine")
    with pytest.raises(fs.TransferError, match=match):
        caches.import_session(damage(exported(kind)))
    assert "a" not in caches.manager
    assert_same(caches, "mine", before)


def flipped(buf):
    out = buf.copy()
    out[len(out) // 2] ^= 1
    return out


def test_importing_under_a_live_id_is_refused_unchanged():
    caches = sessions("dynamic")
    caches.begin("a", torch.tensor([PROMPTS[1]]))
    before = snap(caches, "a")
    with pytest.raises(fs.SessionExistsError):
        caches.import_session(exported("dynamic"))
    assert_same(caches, "a", before)


def _resized(kind, flat):
    """``flat`` after a resize in place of its first tensor to one head (a layout the model cannot take)."""
    kv = flat[0]
    shape = list(kv.shape)
    shape[-3] = 1  # heads: (1, heads, T, d) per layer, or (2 * layers, 1, heads, max, d) stacked
    kv.resize_(shape)
    return flat


@pytest.mark.parametrize("kind", KINDS)
def test_a_cache_resized_in_place_between_tokens_is_refused_with_its_layout_error_unchanged(kind):
    """A step skips the layout check for the very tensors it checked (or made) last; a resize in place keeps the
    tensor but raises its version, so the check runs again (before: the model met the resized cache)."""
    caches = sessions(kind)
    caches.begin("a", torch.tensor([PROMPTS[0]]))
    caches.step("a", torch.tensor([[1]]))  # the adapter knows these tensors now
    h = caches.manager.get_session("a")
    obj = h.state.get("kv")
    counters = obj.view()[-1].clone()  # a StaticCache's lengths; a DynamicCache's last values
    _resized(kind, h.view("kv"))
    with pytest.raises(CacheLayoutError, match="this model's are"):
        caches.step("a", torch.tensor([[2]]))
    if kind == "static":
        with pytest.raises(CacheLayoutError, match="this model's are"):
            caches.step_many(["a"], torch.tensor([[2]]))
    assert h.state.get("kv") is obj and torch.equal(obj.view()[-1], counters)  # nothing committed or advanced


@pytest.mark.parametrize("kind", KINDS)
def test_a_write_in_place_to_a_cache_a_fork_shares_is_refused_at_the_next_step_unchanged(kind):
    """A step reads its session's tensors without the read's in-place-write check: the commit (a DynamicCache)
    or `writable` (a StaticCache) that follows makes it, before anything lands."""
    caches = sessions(kind)
    caches.begin("a", torch.tensor([PROMPTS[0]]))
    caches.step("a", torch.tensor([[1]]))
    caches.fork("a", "b")
    obj = caches.manager.get_session("a").state.get("kv")
    obj.view()[0].add_(1.0)  # in place, outside `writable`: b's cache too
    calls = [lambda: caches.step("a", torch.tensor([[2]]))]
    if kind == "static":
        calls.append(lambda: caches.step_many(["a", "b"], torch.tensor([[2], [2]])))
    for call in calls:
        with pytest.raises(fs.SharedStorageWrittenError, match="'kv' of session 'a'"):
            call()
        assert caches.manager.get_session("a").state.get("kv") is obj
