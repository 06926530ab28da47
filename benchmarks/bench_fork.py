"""Fork a DreamZero-shaped session of about 600 MiB, like for like.

Two kinds of fork, each done the functional way and the mutable way:

* **snapshot**: the fork may diverge by committing and by assigning items of its lists (the feat map the
  encoder replaces item by item), so those containers are copied and the tensors shared. Functional:
  `fork_session` with the feat map declared ``on_fork="copy_container"``. Mutable: a dict of the same
  contents whose lists and deques are shallow-copied.
* **deep**: the fork may also write tensors in place, so every tensor is cloned. Functional: the feat map
  declared ``on_fork="clone"``. Mutable: ``copy.deepcopy``.

"New bytes" is measured by the accounting over source and fork together, minus the source alone.

The version check (`functional_state.table.torch_writes`, issue 34): what recording torch version counters on
fork and commit, and comparing them before each use, costs per fork and per commit, measured side by side
(interleaved rounds) with the same operation with the check's hooks replaced by no-ops (what the code did
before it), on torch values and on JAX values.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections import deque

import jax.numpy as jnp
import torch

import functional_state as fs
from _timing import fmt_time, interleaved_rounds, round_ratio
from functional_state.table import object_verbs, session_verbs

MIB = 2**20


def _contents():
    feat_map = [torch.ones(20 * MIB // 2, dtype=torch.bfloat16) for _ in range(30)]  # 600 MiB, like DreamZero's
    latents = [torch.ones(1, 16, 1, 44, 80, dtype=torch.bfloat16) for _ in range(50)]
    frames = deque([torch.zeros(352, 640, 3, dtype=torch.uint8) for _ in range(4)], maxlen=4)
    return feat_map, latents, frames


def _functional(policy: str):
    feat_map, latents, frames = _contents()
    state, _ = fs.get_or_create(fs.ManagerState.create(max_sessions=4096), "src")
    buf = fs.LatentBuffer.create()
    for t in latents:
        buf = buf.commit(t)
    ring = fs.LatentBuffer.create(maxlen=4)
    for f in frames:
        ring = ring.commit(f)
    state = fs.put(fs.put(state, "src", "video_latents", buf), "src", "stitched_frames", ring)
    return fs.set_attr(state, "src", "vae_enc_feat_map", feat_map, on_fork=policy)


def _times(fn, n: int) -> list[float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return sorted(times)


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def _p99(times: list[float]) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


_HOOKS_ON = (object_verbs.RECORDS, object_verbs.check_object, object_verbs.record_commit, session_verbs.record_fork)
_HOOKS_OFF = ({}, *(lambda *a, **k: None,) * 3)  # the check's hooks as no-ops: the code as it was before it


def _set_hooks(hooks) -> None:
    object_verbs.RECORDS, object_verbs.check_object, object_verbs.record_commit, session_verbs.record_fork = hooks


def _switched(fn, off: bool):
    """``fn`` with the version check on or off; both pay the same four assignments."""
    hooks = _HOOKS_OFF if off else _HOOKS_ON

    def run():
        _set_hooks(hooks)
        try:
            return fn()
        finally:
            _set_hooks(_HOOKS_ON)

    return run


def _static_cache(make):
    """A session "p" holding a 2-layer Llama-sized static K/V cache (keys, values, length per layer) as one
    `PytreeValue`, forked to "c" and made writable: the per-step commit of a model writing it in place."""
    tree = {
        "keys": [make((1, 2, 256, 16)) for _ in range(2)],
        "values": [make((1, 2, 256, 16)) for _ in range(2)],
        "length": [make(()) for _ in range(2)],
    }
    state, _ = fs.get_or_create(fs.ManagerState.create(), "p")
    state = fs.fork_session(fs.put(state, "p", "kv", fs.PytreeValue.create(tree)), "p", "c")
    if isinstance(tree["length"][0], torch.Tensor):
        state, tree = fs.writable(state, "p", "kv")
    return state, tree


def _check_rows(snap_state) -> tuple[list[tuple[str, str, str, str]], dict[str, float]]:
    """Fork and commit with the version check on and off, interleaved round by round."""
    ids = itertools.count()
    torch_state, torch_tree = _static_cache(torch.zeros)
    jax_state, jax_tree = _static_cache(jnp.zeros)
    ring_state, _ = fs.get_or_create(fs.ManagerState.create(), "p")
    ring_state = fs.fork_session(fs.put(ring_state, "p", "ring", fs.ArrayRing.create(8, (1024,))), "p", "c")
    frame = jnp.ones(1024)
    ratios: dict[str, float] = {}
    ops = {
        "fork": lambda: fs.fork_session(snap_state, "src", f"v{next(ids)}"),
        "commit torch": lambda: fs.commit(torch_state, "p", "kv", torch_tree),
        "commit jax": lambda: fs.commit(jax_state, "p", "kv", jax_tree),
        "commit ring": lambda: fs.commit(ring_state, "p", "ring", frame),
    }
    samples = {}
    for name, fn in ops.items():  # each pair on its own: its two sides alternate first and second, round by round
        pair = interleaved_rounds({"on": _switched(fn, False), "off": _switched(fn, True)}, repeats=2001, rotate=True)
        samples.update({f"{name}, {side}": times for side, times in pair.items()})
        ratios[name] = round_ratio(pair, "on", "off")
    labels = {
        "fork": "version check: fork_session of this session",
        "commit torch": "version check: commit, torch static K/V cache (6 tensors, forked)",
        "commit jax": "version check: commit, the same cache in JAX (forked)",
        "commit ring": "version check: commit, a JAX ArrayRing (forked)",
    }
    rows, figures = [], {}
    for name, label in labels.items():
        figures[f"{name.replace(' ', '_')}_on_off"] = ratios[name]
        for state in ("on", "off"):
            times = samples[f"{name}, {state}"]
            rows.append((f"{label}, check {state}", fmt_time(_median(times)), fmt_time(_p99(times)), ""))
            figures[f"{name.replace(' ', '_')}_{state}_s"] = _median(times)
            figures[f"{name.replace(' ', '_')}_{state}_p99_s"] = _p99(times)
    return rows, figures


def _mp(times: list[float]) -> tuple[str, str]:
    return fmt_time(_median(times)), fmt_time(_p99(times))


def run() -> dict:
    # snapshot forks
    snap_state = _functional("copy_container")
    held = fs.stats(snap_state)["total_nbytes"]
    fork_times = _times(lambda i: fs.fork_session(snap_state, "src", f"fork{i}"), 2001)
    t_fork = _median(fork_times)
    new_fork = fs.stats(fs.fork_session(snap_state, "src", "f"))["total_nbytes"] - held
    check_rows, check_figures = _check_rows(snap_state)  # (before the deep forks' 1.2 GiB of clones)
    feat_map, latents, frames = _contents()
    mutable = {"video_latents": latents, "stitched_frames": frames, "vae_enc_feat_map": feat_map}

    def mutable_snapshot(_: int):
        return {
            "video_latents": list(mutable["video_latents"]),
            "stitched_frames": deque(mutable["stitched_frames"], maxlen=4),
            "vae_enc_feat_map": list(mutable["vae_enc_feat_map"]),
        }

    mut_times = _times(mutable_snapshot, 2001)
    t_mut = _median(mut_times)
    m_held = fs.total_nbytes(mutable)
    new_mut = fs.total_nbytes(mutable, mutable_snapshot(0)) - m_held

    # deep forks
    deep_state = _functional("clone")
    deep_held = fs.stats(deep_state)["total_nbytes"]
    clone_times = _times(lambda i: fs.fork_session(deep_state, "src", f"fork{i}"), 3)
    t_clone = _median(clone_times)
    new_clone = fs.stats(fs.fork_session(deep_state, "src", "f"))["total_nbytes"] - deep_held
    deep_times = _times(lambda i: copy.deepcopy(mutable), 3)
    t_deep = _median(deep_times)
    new_deep = fs.total_nbytes(mutable, copy.deepcopy(mutable)) - m_held
    rows = [
        ("snapshot: fork_session, feat map copy_container", *_mp(fork_times), f"{new_fork / MIB:.3f} MiB"),
        ("snapshot: mutable dict, lists and deque copied", *_mp(mut_times), f"{new_mut / MIB:.3f} MiB"),
        ("deep: fork_session, feat map clone", *_mp(clone_times), f"{new_clone / MIB:.1f} MiB"),
        ("deep: copy.deepcopy of the mutable dict", *_mp(deep_times), f"{new_deep / MIB:.1f} MiB"),
        *check_rows,
    ]
    on_off = [
        (f"version check, {what}: on / off (median of round ratios)", check_figures[f"{key}_on_off"])
        for what, key in (
            ("fork", "fork"),
            ("torch commit", "commit_torch"),
            ("JAX commit", "commit_jax"),
            ("ring commit", "commit_ring"),
        )
    ]
    return {
        "title": f"Fork a {held / MIB:.0f} MiB DreamZero-shaped session, like for like",
        "header": ("fork / commit", "median time", "p99", "new bytes (measured)"),
        "rows": rows,
        "ratio": ("snapshot fork: functional / mutable", t_fork / t_mut),
        "extra_ratios": [("deep fork: functional (clone) / deepcopy", t_clone / t_deep), *on_off],
        "notes": (
            "A snapshot fork isolates everything the model changes by assignment (commits, list items) and "
            "shares tensors; a deep fork also clones the tensors, for a model that writes them in place. The "
            "functional snapshot shares the committed buffers as immutable objects and copies only the "
            "declared containers. Medians of 2,001 snapshot forks and of 3 deep forks. The version check's "
            "rows (issue 34): the check on, against the same operation with its hooks replaced by no-ops (the "
            "code before it), 2,001 rounds per operation, its two sides alternating which runs first (timed "
            "one after another, the second read the caches the first warmed: every 'on' came out slower). "
            "A fork compares the versions of every torch tensor its source holds (here 54; each object is read "
            "once, on its first fork), a torch commit compares and records the cache's 6, a JAX commit looks "
            "up one dictionary entry and reads its payload's leaf types (none for an array payload). Measured "
            "on a machine shared with other jobs: noisy."
        ),
        "figures": {
            "fork_s": t_fork,
            "mutable_s": t_mut,
            "clone_s": t_clone,
            "deepcopy_s": t_deep,
            "new_fork": new_fork,
            "new_mutable": new_mut,
            "new_clone": new_clone,
            "new_deep": new_deep,
            **check_figures,
        },
    }
