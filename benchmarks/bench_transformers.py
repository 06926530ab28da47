"""`torch_bridge.adapters.transformers.SessionCaches` against the bare transformers model with its own caches.

Per token at 8 sessions, round robin: the bare side holds one `DynamicCache` per session and calls the model;
the library side calls `SessionCaches.step` (the session's tensors looked up, a cache rebuilt around them, the
new tensors committed), and again with every session parked after each of its tokens (restored by the next
`step`), its cache over 1 MiB. Then a batched `StaticCache` step of 8 sessions: `step_many` against the bare
model called on one batch-8 `StaticCache`. Every side decodes the same tokens from the same prompts.
"""

from __future__ import annotations

import statistics
import time

import torch
import transformers

from _timing import fmt_time, interleaved_rounds, round_ratio
from torch_bridge.adapters.transformers import SessionCaches
from torch_bridge.harness.text_models import tiny_llama

SESSIONS, PROMPT, MAX_LEN = 8, 160, 512
CALLS = 32  # tokens per timed run (4 per session)
REPEATS = 21


def _model() -> transformers.LlamaForCausalLM:
    return tiny_llama(layers=4, hidden=256, kv_heads=4, vocab=256, max_positions=1024)


def _p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def _quartiles(rounds: dict[str, list[float]], a: str, b: str) -> tuple[float, float]:
    """The first and third quartiles of the per-round ratios ``a / b`` (the spread around `round_ratio`)."""
    q = statistics.quantiles([x / y for x, y in zip(rounds[a], rounds[b], strict=True)], n=4)
    return round(q[0], 3), round(q[2], 3)


def _prompts() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 256, (SESSIONS, PROMPT), generator=g)


def _per_token(model: transformers.LlamaForCausalLM) -> tuple[dict, dict[str, list[float]], int]:
    """Timed functions: bare, library, library with park every token; and the per-token samples."""
    prompts, token = _prompts(), torch.tensor([[3]])
    bare_caches = [transformers.DynamicCache(config=model.config) for _ in range(SESSIONS)]
    with torch.no_grad():
        for j, cache in enumerate(bare_caches):
            model(input_ids=prompts[j : j + 1], past_key_values=cache, use_cache=True)
    lib, parked = SessionCaches(model), SessionCaches(model)
    for j in range(SESSIONS):
        lib.begin(f"s{j}", prompts[j : j + 1])
        parked.begin(f"s{j}", prompts[j : j + 1])
        parked.park(f"s{j}")
    cache_bytes = sum(t.untyped_storage().nbytes() for t in parked.manager.get_session("s0").view("kv"))
    samples: dict[str, list[float]] = {"bare": [], "library": [], "park": [], "copies": []}
    bare_copy = [transformers.DynamicCache(config=model.config) for _ in range(SESSIONS)]
    with torch.no_grad():
        for j, cache in enumerate(bare_copy):
            model(input_ids=prompts[j : j + 1], past_key_values=cache, use_cache=True)

    def bare() -> None:
        with torch.no_grad():
            for i in range(CALLS):
                t0 = time.perf_counter()
                model(input_ids=token, past_key_values=bare_caches[i % SESSIONS], use_cache=True)
                samples["bare"].append(time.perf_counter() - t0)

    def library() -> None:
        for i in range(CALLS):
            t0 = time.perf_counter()
            lib.step(f"s{i % SESSIONS}", token)
            samples["library"].append(time.perf_counter() - t0)

    def park() -> None:
        for i in range(CALLS):
            t0 = time.perf_counter()
            parked.step(f"s{i % SESSIONS}", token)  # restores the parked cache first
            parked.park(f"s{i % SESSIONS}")
            samples["park"].append(time.perf_counter() - t0)

    def copies() -> None:  # the floor of a park and a restore: the bare model, and its cache copied out and back
        with torch.no_grad():
            for i in range(CALLS):
                t0 = time.perf_counter()
                cache = bare_copy[i % SESSIONS]
                model(input_ids=token, past_key_values=cache, use_cache=True)
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys.clone().clone(), layer.values.clone().clone()
                samples["copies"].append(time.perf_counter() - t0)

    return {"bare": bare, "library": library, "park": park, "copies": copies}, samples, cache_bytes


def _batched(model: transformers.LlamaForCausalLM) -> tuple[dict, dict[str, list[float]]]:
    prompts, tokens = _prompts(), torch.full((SESSIONS, 1), 3)
    bare_cache = transformers.StaticCache(config=model.config, max_cache_len=MAX_LEN)
    with torch.no_grad():
        model(input_ids=prompts, past_key_values=bare_cache, use_cache=True)
    lib = SessionCaches(model, cache="static", max_cache_len=MAX_LEN)
    ids = [f"s{j}" for j in range(SESSIONS)]
    for j, sid in enumerate(ids):
        lib.begin(sid, prompts[j : j + 1])
    samples: dict[str, list[float]] = {"bare": [], "library": []}

    def bare() -> None:
        with torch.no_grad():
            t0 = time.perf_counter()
            model(input_ids=tokens, past_key_values=bare_cache, use_cache=True)
            samples["bare"].append(time.perf_counter() - t0)

    def library() -> None:
        t0 = time.perf_counter()
        lib.step_many(ids, tokens)
        samples["library"].append(time.perf_counter() - t0)

    return {"bare": bare, "library": library}, samples


def run() -> dict:
    torch.set_num_threads(1)  # a shared machine: one thread, as `make demo` runs
    model = _model()
    fns, samples, cache_bytes = _per_token(model)
    # CPU time (this process's): on a shared machine, time another job takes the core from us is not ours.
    rounds = interleaved_rounds(fns, repeats=REPEATS, clock="cpu")
    step_ratio, park_ratio = round_ratio(rounds, "library", "bare"), round_ratio(rounds, "park", "bare")
    park_floor = round_ratio(rounds, "park", "copies")
    bfns, bsamples = _batched(model)
    brounds = interleaved_rounds(bfns, repeats=4 * REPEATS, clock="cpu")
    batch_ratio = round_ratio(brounds, "library", "bare")
    spread = {
        "step": _quartiles(rounds, "library", "bare"),
        "park": _quartiles(rounds, "park", "bare"),
        "batch": _quartiles(brounds, "library", "bare"),
    }
    rows, figures = [], {"cache_bytes": cache_bytes, "ratio_quartiles": spread}
    labels = {
        "bare": "8 sessions: bare model, a DynamicCache each",
        "library": "8 sessions: `SessionCaches.step`",
        "park": "8 sessions: `step`, then `park` (every token)",
        "copies": "8 sessions: bare model, its cache then copied out and back",
    }
    for key, label in labels.items():
        med, p99 = statistics.median(samples[key]), _p99(samples[key])
        figures[f"{key}_s"], figures[f"{key}_p99_s"] = med, p99
        ratio = "" if key == "bare" else f"{med / statistics.median(samples['bare']):.2f}x"
        rows.append((label, fmt_time(med), fmt_time(p99), ratio))
    for key, label in (("bare", "batch of 8: bare model, one StaticCache"), ("library", "batch of 8: `step_many`")):
        med, p99 = statistics.median(bsamples[key]), _p99(bsamples[key])
        figures[f"batched_{key}_s"], figures[f"batched_{key}_p99_s"] = med, p99
        ratio = "" if key == "bare" else f"{med / statistics.median(bsamples['bare']):.2f}x"
        rows.append((label, fmt_time(med), fmt_time(p99), ratio))
    figures.update(step_ratio=step_ratio, park_ratio=park_ratio, park_floor=park_floor, batch_ratio=batch_ratio)
    return {
        "title": "transformers decode per session: `SessionCaches` against the bare model with its own caches",
        "header": ("what (one token per session)", "median per call", "p99", "vs bare"),
        "rows": rows,
        "ratio": ("SessionCaches.step / bare model, 8 sessions (goal <= 1.1)", step_ratio),
        "extra_ratios": [
            (f"step + park every token / bare, {cache_bytes / 2**20:.2f} MiB caches (goal <= 1.3)", park_ratio),
            ("step + park every token / bare model + two copies of its cache", park_floor),
            ("step_many(8) StaticCache / bare batched call (goal <= 1.2)", batch_ratio),
        ],
        "notes": (
            "A random-init transformers Llama (4 layers, hidden 256, 4 heads of 64, vocabulary 256), one torch "
            f"thread, prompts of {PROMPT} tokens, then one token per call, {CALLS} calls per run round robin over "
            f"{SESSIONS} sessions; the StaticCache holds {MAX_LEN} positions. Ratios are medians over "
            f"{REPEATS} rotated interleaved rounds of each round's ratio of CPU time (the batched one over "
            f"{4 * REPEATS}); the rounds' quartiles: step {spread['step'][0]:.2f}-{spread['step'][1]:.2f}, "
            f"park {spread['park'][0]:.2f}-{spread['park'][1]:.2f}, batched {spread['batch'][0]:.2f}-"
            f"{spread['batch'][1]:.2f}. The median and p99 columns are wall time over every call. The garbage "
            "collector is on. `step_many` runs the "
            "8 sessions as rows of a batch buffer it keeps (copied in only when a session changed) and writes back only the new "
            "positions. On the CPU a park takes the cache's own tensors as its host copy (nothing else holds them: "
            "no copy) and the restore hands the same tensors back; the figures still move the bytes from `cpu` to "
            "`cpu/unpinned_host`. The `copies` row is the bare model with its cache copied out and back after each "
            "call, the floor of a park that copies (`copy=True`): the copies evict the model's 10.5 MiB of weights "
            "from the caches, and the bare model with 2 x 1.25 MiB of unrelated memory copied after each call ran 5% "
            "slower. What the park row spends beyond the step row is the park's and the restore's bookkeeping "
            "(about 0.27 ms and 0.12 ms of CPU per token, measured alone). Both sides run under `torch.no_grad`, as "
            "transformers' `generate` does (`torch.inference_mode` is about 2% faster on the bare side, but its "
            "tensors keep no version counter, which the library's in-place-write checks read, and its logits "
            "could not be written outside it). Measured on a machine shared with other jobs: the figures are noisy."
        ),
        "figures": figures,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1, default=str))
