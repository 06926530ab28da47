"""`SessionCaches.step` against the bare `nnx.jit` decode step of the same Flax NNX model, at 1 and at 64
sessions, and `step_many` of 8 sessions against 8 single steps.

The bare baseline is what a user without the library writes: one stateful model per session (its cache
inside it), decoded with `nnx.jit`. Both sides decode one token per call and wait for the logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import functional_state as fs
from _timing import fmt_time, interleaved_medians
from functional_state.nnx import SessionCaches

VOCAB, D, HEADS, MAX_LEN = 256, 64, 4, 128
CALLS = 64  # decode calls per timed run


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=True, keep_rngs=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + jax.nn.gelu(self.mlp(self.ln2(x)))


class Decoder(nnx.Module):
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs), Block(rngs)])
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _model() -> Decoder:
    model = Decoder()
    for b in model.blocks:
        b.attn.init_cache((1, MAX_LEN, D))
    return model


def _pair(n_sessions: int) -> dict:
    """Timed functions for ``n_sessions`` round-robin sessions: library and bare."""
    token = jnp.full((1, 1), 3, jnp.int32)
    models = [_model() for _ in range(n_sessions)]
    decode = nnx.jit(lambda m, t: m(t))
    caches = SessionCaches(_model())
    holder = {"s": fs.ManagerState.create(max_sessions=max(64, n_sessions))}
    ids = [f"s{i}" for i in range(n_sessions)]
    for sid in ids:
        holder["s"] = caches.begin(holder["s"], sid)
    reset = {"i": 0}

    def rewind() -> None:  # keep both sides inside the cache length, at the same positions
        reset["i"] += 1
        if reset["i"] * CALLS // n_sessions > MAX_LEN // 2:
            reset["i"] = 0
            for j, m in enumerate(models):
                for b in m.blocks:
                    b.attn.init_cache((1, MAX_LEN, D))
                split_caches[j] = nnx.split(m, nnx.Cache, ...)[1]
            for sid in ids:
                holder["s"] = fs.put(holder["s"], sid, caches.name, caches.initial)

    def bare() -> None:
        for i in range(CALLS):
            decode(models[i % n_sessions], token).block_until_ready()

    # The functional form a user can write by hand: split once, jit a pure step over (cache, params).
    graphdef, _, params = nnx.split(_model(), nnx.Cache, ...)
    split_caches = [nnx.split(m, nnx.Cache, ...)[1] for m in models]

    @jax.jit
    def pure_step(cache: nnx.State, params: nnx.State, t: jax.Array) -> tuple[nnx.State, jax.Array]:
        m = nnx.merge(graphdef, cache, params)
        out = m(t)
        return nnx.state(m, nnx.Cache), out

    def functional() -> None:
        for i in range(CALLS):
            j = i % n_sessions
            split_caches[j], out = pure_step(split_caches[j], params, token)
            out.block_until_ready()

    def library() -> None:
        for i in range(CALLS):
            holder["s"], out = caches.step(holder["s"], ids[i % n_sessions], token)
            out.block_until_ready()
        rewind()

    def no_donation() -> None:
        for i in range(CALLS):
            holder["s"], out = caches.step(holder["s"], ids[i % n_sessions], token, donate=False)
            out.block_until_ready()
        rewind()

    return {"bare": bare, "functional": functional, "library": library, "no_donation": no_donation}


def _many_pair() -> dict:
    token = jnp.full((1, 1), 3, jnp.int32)
    caches = SessionCaches(_model())
    ids = [f"s{i}" for i in range(8)]
    holder = {"single": fs.ManagerState.create(), "many": fs.ManagerState.create()}
    for key in holder:
        for sid in ids:
            holder[key] = caches.begin(holder[key], sid)
    stacked = jnp.stack([token] * 8)
    rounds = 8

    def single() -> None:
        for _ in range(rounds):
            for sid in ids:
                holder["single"], out = caches.step(holder["single"], sid, token)
            out.block_until_ready()
        for sid in ids:
            holder["single"] = fs.put(holder["single"], sid, caches.name, caches.initial)

    def many() -> None:
        for _ in range(rounds):
            holder["many"], out = caches.step_many(holder["many"], ids, stacked)
            out.block_until_ready()
        for sid in ids:
            holder["many"] = fs.put(holder["many"], sid, caches.name, caches.initial)

    return {"8 single steps": single, "step_many(8)": many, "rounds": rounds}


def _step_pair() -> dict:
    """`fs.step(donate=True)` on a `PytreeValue` of the decoder's cache against the same function as a raw
    donated `jax.jit` call on the cache itself: the decode step, and a trivial update (the worst case: the
    kernel costs almost nothing, so the bookkeeping is all there is)."""
    token = jnp.full((1, 1), 3, jnp.int32)
    graphdef, cache0, params = nnx.split(_model(), nnx.Cache, ...)

    def decode(cache: nnx.State, t: jax.Array) -> tuple[nnx.State, jax.Array]:
        m = nnx.merge(graphdef, cache, params)
        out = m(t)
        return nnx.state(m, nnx.Cache), out

    def bump(cache: nnx.State, t: jax.Array) -> tuple[nnx.State, jax.Array]:
        return jax.tree_util.tree_map(lambda a: a + t[0, 0].astype(a.dtype), cache), t

    def on_value(kernel):  # the same kernel over a PytreeValue, as `fs.step` calls it
        def fn(value: fs.PytreeValue, t: jax.Array) -> tuple[fs.PytreeValue, jax.Array]:
            new, out = kernel(value.view(), t)
            return value.commit(new), out

        return fn

    fns, holders = {}, {}
    for name, kernel in (("decode", decode), ("bump", bump)):
        raw = jax.jit(kernel, donate_argnums=0)
        fn = on_value(kernel)
        state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
        holders[name] = {
            "raw": jax.tree_util.tree_map(jnp.copy, cache0),
            "s": fs.put(state, "a", "kv", fs.PytreeValue.create(jax.tree_util.tree_map(jnp.copy, cache0))),
        }

        def raw_run(h=holders[name], raw=raw) -> None:
            for _ in range(CALLS):
                h["raw"], out = raw(h["raw"], token)
                out.block_until_ready()
            h["raw"] = jax.tree_util.tree_map(jnp.copy, cache0)  # (back inside the cache length)

        def lib_run(h=holders[name], fn=fn) -> None:
            for _ in range(CALLS):
                h["s"], out = fs.step(h["s"], "a", "kv", fn, token, donate=True, has_aux=True)
                out.block_until_ready()
            h["s"] = fs.put(h["s"], "a", "kv", fs.PytreeValue.create(jax.tree_util.tree_map(jnp.copy, cache0)))

        fns[f"{name} raw"], fns[f"{name} lib"] = raw_run, lib_run
    return fns


def run() -> dict:
    rows, figures = [], {}
    for n in (1, 64):
        t = interleaved_medians(_pair(n), repeats=9)
        per_bare, per_fn, per_lib, per_nd = (t[k] / CALLS for k in ("bare", "functional", "library", "no_donation"))
        figures[f"{n}"] = {
            "bare_s": per_bare,
            "functional_s": per_fn,
            "vs_functional": per_lib / per_fn,
            "library_s": per_lib,
            "no_donation_s": per_nd,
            "ratio": per_lib / per_bare,
        }
        rows.append((f"{n} session(s): bare `nnx.jit` decode", fmt_time(per_bare), ""))
        rows.append(
            (f"{n} session(s): hand-written `jax.jit` over `nnx.split`", fmt_time(per_fn), f"{per_fn / per_bare:.2f}x")
        )
        rows.append((f"{n} session(s): `SessionCaches.step`", fmt_time(per_lib), f"{per_lib / per_bare:.2f}x"))
        rows.append((f"{n} session(s): `step(donate=False)`", fmt_time(per_nd), f"{per_nd / per_bare:.2f}x"))
    t = interleaved_medians(_step_pair(), repeats=9)
    for name, what in (("decode", "the decode step"), ("bump", "a trivial update of the cache")):
        raw, lib = t[f"{name} raw"] / CALLS, t[f"{name} lib"] / CALLS
        figures[f"step_{name}"] = {"raw_s": raw, "lib_s": lib, "ratio": lib / raw}
        rows.append((f"{what}: raw donated `jax.jit` on the cache", fmt_time(raw), ""))
        rows.append((f"{what}: `fs.step(donate=True)` on a PytreeValue", fmt_time(lib), f"{lib / raw:.2f}x"))
    pair = _many_pair()
    rounds = pair.pop("rounds")
    t = interleaved_medians(pair, repeats=9)
    single, many = t["8 single steps"] / rounds, t["step_many(8)"] / rounds
    figures["many"] = {"single_s": single, "many_s": many, "ratio": many / single}
    rows.append(("8 sessions: 8 × `step`", fmt_time(single), ""))
    rows.append(("8 sessions: `step_many`", fmt_time(many), f"{many / single:.2f}x"))
    return {
        "title": "Flax NNX decode per session: `SessionCaches` against the bare `nnx.jit` step",
        "header": ("what (one token per session)", "median time per call", "vs baseline"),
        "rows": rows,
        "ratio": ("SessionCaches.step / bare nnx.jit step, 1 session", figures["1"]["ratio"]),
        "extra_ratios": [
            ("SessionCaches.step / bare nnx.jit step, 64 sessions", figures["64"]["ratio"]),
            (
                "SessionCaches.step / hand-written split+jit step, 1 session (goal <= 1.2)",
                figures["1"]["vs_functional"],
            ),
            (
                "SessionCaches.step / hand-written split+jit step, 64 sessions (goal <= 1.2)",
                figures["64"]["vs_functional"],
            ),
            ("step_many(8) / 8 single steps", figures["many"]["ratio"]),
            ("fs.step(donate=True) / raw donated jit, decode step (goal <= 1.2)", figures["step_decode"]["ratio"]),
            ("fs.step(donate=True) / raw donated jit, trivial update (goal <= 1.2)", figures["step_bump"]["ratio"]),
        ],
        "notes": (
            f"A 2-layer decoder (d={D}, {HEADS} heads, cache of {MAX_LEN} positions, vocabulary {VOCAB}), one "
            f"token per call, {CALLS} calls per run, round robin over the sessions; the bare side holds one "
            "stateful model per session. `step` donates the cache (the default): to donate safely it asks the "
            "table's holder index whether anything else holds the cache's buffers (kept counts per buffer, so "
            "the cost does not grow with the sessions); `donate=False` skips the check (and copies nothing "
            "either: XLA writes a new cache). The hand-written baseline does not donate. `fs.step(donate=True)` "
            "rows: a `PytreeValue` of the cache stepped by the same kernel as a raw donated `jax.jit` on the cache "
            "(the decode step, and a trivial update where the kernel costs almost nothing); a step over a "
            "structure and buffers already seen reads its leaves' extents from a record instead of walking them "
            "(issue 37). Medians of 9 interleaved runs."
        ),
        "figures": figures,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1, default=str))
