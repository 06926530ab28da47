"""Fork a DreamZero-shaped session of about 600 MiB, like for like.

Two kinds of fork, each done the functional way and the mutable way:

* **snapshot**: the fork may diverge by committing and by assigning items of its lists (the feat map the
  encoder replaces item by item), so those containers are copied and the tensors shared. Functional:
  `fork_session` with the feat map declared ``on_fork="copy_container"``. Mutable: a dict of the same
  contents whose lists and deques are shallow-copied.
* **deep**: the fork may also write tensors in place, so every tensor is cloned. Functional: the feat map
  declared ``on_fork="clone"``. Mutable: ``copy.deepcopy``.

"New bytes" is measured by the accounting over source and fork together, minus the source alone.
"""

from __future__ import annotations

import copy
import time
from collections import deque

import torch

import functional_state as fs
from _timing import fmt_time

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


def _median_time(fn, n: int) -> float:
    times = []
    for i in range(n):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run() -> dict:
    # snapshot forks
    snap_state = _functional("copy_container")
    held = fs.stats(snap_state)["total_nbytes"]
    t_fork = _median_time(lambda i: fs.fork_session(snap_state, "src", f"fork{i}"), 2001)
    new_fork = fs.stats(fs.fork_session(snap_state, "src", "f"))["total_nbytes"] - held
    feat_map, latents, frames = _contents()
    mutable = {"video_latents": latents, "stitched_frames": frames, "vae_enc_feat_map": feat_map}

    def mutable_snapshot(_: int):
        return {
            "video_latents": list(mutable["video_latents"]),
            "stitched_frames": deque(mutable["stitched_frames"], maxlen=4),
            "vae_enc_feat_map": list(mutable["vae_enc_feat_map"]),
        }

    t_mut = _median_time(mutable_snapshot, 2001)
    m_held = fs.total_nbytes(mutable)
    new_mut = fs.total_nbytes(mutable, mutable_snapshot(0)) - m_held

    # deep forks
    deep_state = _functional("clone")
    deep_held = fs.stats(deep_state)["total_nbytes"]
    t_clone = _median_time(lambda i: fs.fork_session(deep_state, "src", f"fork{i}"), 3)
    new_clone = fs.stats(fs.fork_session(deep_state, "src", "f"))["total_nbytes"] - deep_held
    t_deep = _median_time(lambda i: copy.deepcopy(mutable), 3)
    new_deep = fs.total_nbytes(mutable, copy.deepcopy(mutable)) - m_held
    rows = [
        ("snapshot: fork_session, feat map copy_container", fmt_time(t_fork), f"{new_fork / MIB:.3f} MiB"),
        ("snapshot: mutable dict, lists and deque copied", fmt_time(t_mut), f"{new_mut / MIB:.3f} MiB"),
        ("deep: fork_session, feat map clone", fmt_time(t_clone), f"{new_clone / MIB:.1f} MiB"),
        ("deep: copy.deepcopy of the mutable dict", fmt_time(t_deep), f"{new_deep / MIB:.1f} MiB"),
    ]
    return {
        "title": f"Fork a {held / MIB:.0f} MiB DreamZero-shaped session, like for like",
        "header": ("fork", "median time", "new bytes (measured)"),
        "rows": rows,
        "ratio": ("snapshot fork: functional / mutable", t_fork / t_mut),
        "extra_ratios": [("deep fork: functional (clone) / deepcopy", t_clone / t_deep)],
        "notes": (
            "A snapshot fork isolates everything the model changes by assignment (commits, list items) and "
            "shares tensors; a deep fork also clones the tensors, for a model that writes them in place. The "
            "functional snapshot shares the committed buffers as immutable objects and copies only the "
            "declared containers. Medians of 2,001 snapshot forks and of 3 deep forks."
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
        },
    }
