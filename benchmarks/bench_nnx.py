"""`SessionCaches.step` against the bare `nnx.jit` decode step of the same Flax NNX model and against the
hand-written `jax.jit` step over `nnx.split`, at 1 and at 64 sessions; `fs.step(donate=True)` against a raw
donated `jax.jit` call; and `step_many` of 8 sessions against 8 single steps.

The bare baseline is what a user without the library writes: one stateful model per session (its cache
inside it), decoded with `nnx.jit`. Every side decodes one token per call and waits for the logits.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import functional_state as fs
from _timing import fmt_time, interleaved_medians, interleaved_rounds
from functional_state.nnx import SessionCaches

VOCAB, D, HEADS, MAX_LEN = 256, 64, 4, 128
CALLS = 64  # decode calls per timed run
REPEATS = 21  # interleaved, rotated rounds (CPU time, GC on)


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


def _when_due(reset: Callable[[], None], n_sessions: int) -> Callable[[], None]:
    """``reset``, called after a run only once the next run would pass the cache length (each side keeps its
    own count): between resets every side steps buffers it already stepped, as a server does."""
    runs = {"n": 0}

    def maybe() -> None:
        runs["n"] += 1
        if (runs["n"] + 1) * CALLS // n_sessions > MAX_LEN:
            runs["n"] = 0
            reset()

    return maybe


def _pair(n_sessions: int) -> tuple[dict, dict]:
    """Timed functions for ``n_sessions`` round-robin sessions (library, bare, hand-written with and without
    donation), and per function its reset back to the first position, run off the clock after each run."""
    token = jnp.full((1, 1), 3, jnp.int32)
    models = [_model() for _ in range(n_sessions)]
    decode = nnx.jit(lambda m, t: m(t))
    caches = SessionCaches(_model())
    ids = [f"s{i}" for i in range(n_sessions)]
    holder = {}
    for key in ("library", "no_donation"):
        holder[key] = fs.ManagerState.create(max_sessions=max(64, n_sessions))
        for sid in ids:
            holder[key] = caches.begin(holder[key], sid)

    def bare() -> None:
        for i in range(CALLS):
            decode(models[i % n_sessions], token).block_until_ready()

    # The functional form a user can write by hand: split once, jit a pure step over (cache, params); with
    # and without donating the cache (the faster of the two is the goal's baseline). And the fastest form we
    # know to write by hand, for comparison: donated, the parameters passed as their flat leaves (as
    # `SessionCaches` passes them), so jit's dispatch flattens no NNX Variable.
    graphdef, cache0, params = nnx.split(_model(), nnx.Cache, ...)
    flat_params, params_tree = jax.tree_util.tree_flatten(params)
    kinds = ("kept", "donated", "flat")
    split_caches = {k: [jax.tree_util.tree_map(jnp.copy, cache0) for _ in models] for k in kinds}

    def pure_step(cache: nnx.State, params: nnx.State, t: jax.Array) -> tuple[nnx.State, jax.Array]:
        m = nnx.merge(graphdef, cache, params)
        out = m(t)
        return nnx.state(m, nnx.Cache), out

    def flat_step(cache: nnx.State, flat: list[jax.Array], t: jax.Array) -> tuple[nnx.State, jax.Array]:
        return pure_step(cache, jax.tree_util.tree_unflatten(params_tree, flat), t)

    jitted = {
        "kept": jax.jit(pure_step),
        "donated": jax.jit(pure_step, donate_argnums=0),
        "flat": jax.jit(flat_step, donate_argnums=0),
    }
    step_params = {"kept": params, "donated": params, "flat": flat_params}

    def functional(kind: str) -> Callable[[], None]:
        step, per_session, p = jitted[kind], split_caches[kind], step_params[kind]

        def run() -> None:
            for i in range(CALLS):
                j = i % n_sessions
                per_session[j], out = step(per_session[j], p, token)
                out.block_until_ready()

        return run

    def library(key: str, donate: bool) -> Callable[[], None]:
        def run() -> None:
            for i in range(CALLS):
                holder[key], out = caches.step(holder[key], ids[i % n_sessions], token, donate=donate)
                out.block_until_ready()

        return run

    # Every side back at the first position before it passes the cache length, off the clock.
    def reset_bare() -> None:
        for m in models:
            for b in m.blocks:
                b.attn.init_cache((1, MAX_LEN, D))

    def reset_functional(kind: str) -> Callable[[], None]:
        def reset() -> None:
            split_caches[kind][:] = [jax.tree_util.tree_map(jnp.copy, cache0) for _ in models]

        return reset

    def reset_library(key: str) -> Callable[[], None]:
        def reset() -> None:  # (fresh buffers, as the hand-written side's: the first step need copy nothing)
            for sid in ids:
                fresh = fs.PytreeValue.create(jax.tree_util.tree_map(jnp.copy, caches.initial.view()))
                holder[key] = fs.put(holder[key], sid, caches.name, fresh)

        return reset

    fns = {
        "bare": bare,
        "functional": functional("kept"),
        "functional_donated": functional("donated"),
        "functional_flat": functional("flat"),
        "library": library("library", True),
        "no_donation": library("no_donation", False),
    }
    resets = {
        "bare": reset_bare,
        "functional": reset_functional("kept"),
        "functional_donated": reset_functional("donated"),
        "functional_flat": reset_functional("flat"),
        "library": reset_library("library"),
        "no_donation": reset_library("no_donation"),
    }
    return fns, {k: _when_due(reset, n_sessions) for k, reset in resets.items()}


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


def _step_pair() -> tuple[dict, dict]:
    """`fs.step(donate=True)` on a `PytreeValue` of the decoder's cache against the same function as a raw
    donated `jax.jit` call on the cache itself: the decode step, and a trivial update (the worst case: the
    kernel costs almost nothing, so the bookkeeping is all there is). With each its reset, off the clock."""
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

    fns, resets = {}, {}
    for name, kernel in (("decode", decode), ("bump", bump)):
        raw = jax.jit(kernel, donate_argnums=0)
        fn = on_value(kernel)
        state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
        h = {
            "raw": jax.tree_util.tree_map(jnp.copy, cache0),
            "s": fs.put(state, "a", "kv", fs.PytreeValue.create(jax.tree_util.tree_map(jnp.copy, cache0))),
        }

        def raw_run(h=h, raw=raw) -> None:
            for _ in range(CALLS):
                h["raw"], out = raw(h["raw"], token)
                out.block_until_ready()

        def lib_run(h=h, fn=fn) -> None:
            for _ in range(CALLS):
                h["s"], out = fs.step(h["s"], "a", "kv", fn, token, donate=True, has_aux=True)
                out.block_until_ready()

        def raw_reset(h=h) -> None:  # (back inside the cache length)
            h["raw"] = jax.tree_util.tree_map(jnp.copy, cache0)

        def lib_reset(h=h) -> None:
            h["s"] = fs.put(h["s"], "a", "kv", fs.PytreeValue.create(jax.tree_util.tree_map(jnp.copy, cache0)))

        fns[f"{name} raw"], fns[f"{name} lib"] = raw_run, lib_run
        resets[f"{name} raw"], resets[f"{name} lib"] = _when_due(raw_reset, 1), _when_due(lib_reset, 1)
    return fns, resets


def _spread(samples: dict[str, list[float]], a: str, b: str | list[str]) -> tuple[float, float, float]:
    """The median over rounds of ``a``'s time over ``b``'s (over the fastest of ``b`` in that round, for a
    list), and the lowest and highest such round ratio."""
    bs = [b] if isinstance(b, str) else b
    ratios = sorted(x / min(ys) for x, *ys in zip(samples[a], *(samples[k] for k in bs), strict=True))
    return statistics.median(ratios), ratios[0], ratios[-1]


def _fmt_ratio(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f}x (rounds {r[1]:.2f}–{r[2]:.2f})"


def run() -> dict:
    rows, figures = [], {}
    for n in (1, 64):
        fns, resets = _pair(n)
        r = interleaved_rounds(fns, repeats=REPEATS, clock="cpu", untimed=resets)
        per = {k: statistics.median(v) / CALLS for k, v in r.items()}
        per_bare, per_fn, per_fd, per_flat, per_lib, per_nd = (
            per[k] for k in ("bare", "functional", "functional_donated", "functional_flat", "library", "no_donation")
        )
        vs_hand = _spread(r, "library", ["functional", "functional_donated"])
        vs_flat = _spread(r, "library", "functional_flat")
        figures[f"{n}"] = {
            "bare_s": per_bare,
            "functional_s": per_fn,
            "functional_donated_s": per_fd,
            "functional_flat_s": per_flat,
            "vs_functional": vs_hand[0],
            "vs_functional_rounds": vs_hand[1:],
            "vs_flat": vs_flat[0],
            "vs_flat_rounds": vs_flat[1:],
            "library_s": per_lib,
            "no_donation_s": per_nd,
            "ratio": per_lib / per_bare,
        }
        rows.append((f"{n} session(s): bare `nnx.jit` decode", fmt_time(per_bare), ""))
        for label, t in (("", per_fn), (", donated", per_fd), (", donated, flat parameters", per_flat)):
            what = f"{n} session(s): hand-written `jax.jit` over `nnx.split`{label}"
            rows.append((what, fmt_time(t), f"{t / per_bare:.2f}x"))
        rows.append((f"{n} session(s): `SessionCaches.step`", fmt_time(per_lib), f"{per_lib / per_bare:.2f}x"))
        rows.append((f"{n} session(s): `step(donate=False)`", fmt_time(per_nd), f"{per_nd / per_bare:.2f}x"))
        rows.append((f"{n} session(s): `SessionCaches.step` / faster hand-written, per round", "", _fmt_ratio(vs_hand)))
        rows.append((f"{n} session(s): `SessionCaches.step` / flat-parameter hand-written", "", _fmt_ratio(vs_flat)))
    fns, resets = _step_pair()
    r = interleaved_rounds(fns, repeats=REPEATS, clock="cpu", untimed=resets)
    for name, what in (("decode", "the decode step"), ("bump", "a trivial update of the cache")):
        raw, lib = (statistics.median(r[f"{name} {k}"]) / CALLS for k in ("raw", "lib"))
        vs_raw = _spread(r, f"{name} lib", f"{name} raw")
        figures[f"step_{name}"] = {"raw_s": raw, "lib_s": lib, "ratio": vs_raw[0], "ratio_rounds": vs_raw[1:]}
        rows.append((f"{what}: raw donated `jax.jit` on the cache", fmt_time(raw), ""))
        rows.append((f"{what}: `fs.step(donate=True)` on a PytreeValue", fmt_time(lib), _fmt_ratio(vs_raw)))
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
                "SessionCaches.step / faster hand-written split+jit step, 1 session (goal <= 1.2)",
                figures["1"]["vs_functional"],
            ),
            (
                "SessionCaches.step / faster hand-written split+jit step, 64 sessions (goal <= 1.2)",
                figures["64"]["vs_functional"],
            ),
            (
                "SessionCaches.step / donated flat-parameter hand-written step, 1 session (no goal)",
                figures["1"]["vs_flat"],
            ),
            (
                "SessionCaches.step / donated flat-parameter hand-written step, 64 sessions (no goal)",
                figures["64"]["vs_flat"],
            ),
            ("step_many(8) / 8 single steps", figures["many"]["ratio"]),
            ("fs.step(donate=True) / raw donated jit, decode step (goal <= 1.2)", figures["step_decode"]["ratio"]),
            ("fs.step(donate=True) / raw donated jit, trivial update (goal <= 1.2)", figures["step_bump"]["ratio"]),
        ],
        "notes": (
            f"A 2-layer decoder (d={D}, {HEADS} heads, cache of {MAX_LEN} positions, vocabulary {VOCAB}), one "
            f"token per call, {CALLS} calls per run, round robin over the sessions; the bare side holds one "
            f"stateful model per session. Process CPU time (all threads), GC on, {REPEATS} rotated, interleaved "
            "rounds: a time is the median over rounds, a ratio row the median of the per-round ratios with the "
            "lowest and highest round beside it. Each side goes back to the first position (fresh buffers) "
            "before it passes the cache length, off the clock, and otherwise steps the buffers it stepped "
            "before, as a server does. `step` donates the cache (the default): to donate safely it asks the "
            "table's holder index whether anything else holds the cache's buffers (kept counts per buffer, so "
            "the cost does not grow with the sessions); `donate=False` skips the check (and copies nothing "
            "either: XLA writes a new cache). The goal's baseline is the faster of the hand-written steps "
            "with and without donation (per round; the donated one was faster in every run so far). "
            "`SessionCaches` passes the model's parameters to its jitted call as flat leaves, so jit's dispatch "
            "flattens no NNX Variable per call (the plain hand-written form pays that); the third hand-written "
            "step does the same, donated: the fastest form we know to write by hand, and the ratio against it "
            "is the library's own per-call bookkeeping (no goal). `fs.step(donate=True)` rows: a `PytreeValue` "
            "of the cache stepped by the same kernel as a raw donated `jax.jit` on the cache (the decode step, "
            "and a trivial update where the kernel costs almost nothing); a step over a structure and buffers "
            "already seen reads its leaves' extents from a record instead of walking them, and the object a "
            "step returned from a memo of it (issue 37)."
        ),
        "figures": figures,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1, default=str))
