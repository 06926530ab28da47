"""`functional_state.nnx.SessionCaches` with a real 2-layer Flax NNX decoder (issue 21)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from helpers import assert_unchanged, snapshot

nnx = pytest.importorskip("flax.nnx")
from functional_state.nnx import SessionCaches  # noqa: E402

VOCAB, D, HEADS, MAX_LEN = 32, 16, 2, 16
TRACES = {"n": 0}


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=True, keep_rngs=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + jax.nn.gelu(self.mlp(self.ln2(x)))


class Decoder(nnx.Module):
    """Token in, logits out, one position per call (decode mode)."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs), Block(rngs)])
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def init_cache(self):
        for b in self.blocks:
            b.attn.init_cache((1, MAX_LEN, D))

    def __call__(self, tokens):  # i32[1, 1] -> f32[1, 1, VOCAB]
        TRACES["n"] += 1  # Python runs only while tracing
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_model():
    model = Decoder()
    model.init_cache()
    return model


PROMPTS = {"a": [1, 2, 3], "b": [4, 5], "c": [6], "d": [7, 8, 9, 10]}


def tok(t):
    return jnp.full((1, 1), t, jnp.int32)


def reference_logits(prompt, n_new):
    """The stateful module's own decode: a fresh model, `nnx.jit`, greedy continuation."""
    model = make_model()
    decode = nnx.jit(lambda m, t: m(t))
    out, t = [], None
    for p in prompt:
        out.append(np.asarray(decode(model, tok(p))))
    for _ in range(n_new):
        t = int(jnp.argmax(out[-1][0, -1]))
        out.append(np.asarray(decode(model, tok(t))))
    return out


def greedy(logits):
    return int(jnp.argmax(logits[0, -1]))


@pytest.fixture(scope="module")
def caches():
    return SessionCaches(make_model())


def begin_all(caches, ids=PROMPTS):
    s = fs.ManagerState.create()
    for sid in ids:
        s = caches.begin(s, sid)
    return s


def test_interleaved_sessions_are_bit_identical_to_the_module_decode_with_one_trace(caches):
    s = begin_all(caches)
    got = {sid: [] for sid in PROMPTS}
    longest = max(len(p) for p in PROMPTS.values())
    before = TRACES["n"]
    for i in range(longest + 2):  # round robin: prompt tokens, then two greedy tokens each
        for sid, prompt in PROMPTS.items():
            if i < len(prompt):
                t = prompt[i]
            elif i < len(prompt) + 2:
                t = greedy(got[sid][-1])
            else:
                continue
            s, logits = caches.step(s, sid, tok(t))
            got[sid].append(np.asarray(logits))
    assert TRACES["n"] - before <= 1  # one trace for every session and step (0 if an earlier test traced)
    for sid, prompt in PROMPTS.items():
        ref = reference_logits(prompt, 2)
        assert len(ref) == len(got[sid])
        for r, g in zip(ref, got[sid]):
            np.testing.assert_array_equal(g, r)


def test_park_fork_and_checkpoint_are_exact(caches, tmp_path):
    s = begin_all(caches, ["a"])
    for t in [1, 2, 3]:
        s, _ = caches.step(s, "a", tok(t))
    s = fs.fork_session(s, "a", "b")
    s, lb = caches.step(s, "b", tok(4))  # donated step: "a" still holds the shared buffers, so they are copied
    s, _ = fs.park(s, "a", caches.name)
    assert fs.lookup(s, "a").get(caches.name).parked
    s, la = caches.step(s, "a", tok(4))  # restored first
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))  # forks continue exactly alike
    s, _ = caches.step(s, "b", tok(9))
    s, la2 = caches.step(s, "a", tok(5))
    ref = reference_logits([1, 2, 3, 4, 5], 0)
    np.testing.assert_array_equal(np.asarray(la2), ref[-1])  # b's step never showed in a
    fs.save_session(s, "a", tmp_path / "ck")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, "tests")
        import jax.numpy as jnp, numpy as np
        import functional_state as fs
        from functional_state.nnx import SessionCaches
        from test_nnx import make_model, tok
        caches = SessionCaches(make_model())
        s = fs.load_session(fs.ManagerState.create(), "a", {str(tmp_path / "ck")!r})
        s, logits = caches.step(s, "a", tok(6))
        np.save({str(tmp_path / "resumed.npy")!r}, np.asarray(logits))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    s, here = caches.step(s, "a", tok(6))
    np.testing.assert_array_equal(np.load(tmp_path / "resumed.npy"), np.asarray(here))
    np.testing.assert_array_equal(np.asarray(here), reference_logits([1, 2, 3, 4, 5, 6], 0)[-1])


def test_step_many_tokens_equal_single_steps(caches):
    ids = list(PROMPTS)
    single = begin_all(caches, ids)
    batched = begin_all(caches, ids)
    for i in range(3):
        toks = [PROMPTS[sid][i % len(PROMPTS[sid])] for sid in ids]
        outs = []
        for sid, t in zip(ids, toks):
            single, logits = caches.step(single, sid, tok(t))
            outs.append(np.asarray(logits))
        batched, stacked = caches.step_many(batched, ids, jnp.stack([tok(t) for t in toks]))
        assert stacked.shape == (len(ids), 1, 1, VOCAB)
        # Batched numerics may differ in the last bits (documented): tokens agree, values are close.
        assert [greedy(o) for o in outs] == [greedy(o) for o in np.asarray(stacked)]
        np.testing.assert_allclose(np.asarray(stacked), np.stack(outs), rtol=1e-5, atol=1e-5)


def test_bad_input_gives_library_errors_and_changes_nothing(caches):
    s = begin_all(caches, ["a"])
    s = fs.put(s, "a", "other", fs.PytreeValue.create({"k": jnp.zeros(3)}))
    snap = snapshot(s)
    with pytest.raises(fs.SessionStateLostError):
        caches.step(s, "nobody", tok(1))
    with pytest.raises(fs.SessionExistsError, match="begin"):
        caches.begin(s, "a")
    wrong = SessionCaches(make_model(), name="other")
    with pytest.raises(fs.InvalidArgumentError, match="layout"):
        wrong.step(s, "a", tok(1))
    with pytest.raises(fs.InvalidArgumentError, match="distinct"):
        caches.step_many(s, ["a", "a"], jnp.stack([tok(1), tok(1)]))
    s2, _ = fs.get_or_create(s, "fresh")
    with pytest.raises(fs.ObjectNotFoundError, match="begin"):
        caches.step(s2, "fresh", tok(1))
    assert_unchanged(s, snap)


def test_a_model_without_a_cache_is_refused():
    with pytest.raises(fs.InvalidArgumentError, match="init_cache"):
        SessionCaches(Decoder())


def test_missing_flax_names_the_extra():
    script = "import sys; sys.modules['flax'] = None\ntry:\n import functional_state.nnx\nexcept ImportError as e:\n print(e)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "[flax]" in out.stdout, out.stderr[-2000:]
