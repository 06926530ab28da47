"""Move a DreamZero-shaped session between processes without a filesystem (issue 36), like for like.

At 64 MiB and 603 MiB of torch storages, medians of interleaved rounds of:

* **memcpy**: every storage cloned (fresh memory, as an import needs).
* **object store put/get**: the same bytes as numpy arrays through ``ray.put`` and ``ray.get`` (the floor a
  transfer through Ray can reach: one copy into the store, the read in place).
* **transfer**: `export_session` (the buffers are views), ``ray.put`` of its buffers and manifest, ``ray.get``,
  `import_session` (checked whole, copied into memory of its own with the checksums in the same pass).
* **checkpoint** (64 MiB only): `save_session` + `load_session` through a directory, the way before.

Then one move between two Ray actors (`SessionCluster.move`: export on one, import and claim on the other,
release on the first), a failover (an actor killed, its session resumed on another from its checkpoint), and
the placement figures of a 10,000-session table.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
import torch

import functional_state as fs
from _timing import fmt_time, interleaved_medians
from functional_state.serving import SessionCluster, SessionReplica
from functional_state.transfer import SessionBlob, claim, export_session, import_session, placement

MIB = 2**20

_BREAKDOWN = " Where the transfer's time goes (603 MiB, one process, separately, on the busy machine): export 23-63 ms (checksums of views), the put 78 ms into store memory touched before (490 ms the first times), the get 1-2 ms, the import 190-660 ms once warm. The import copies torch storages into fresh torch memory advised for huge pages (`memory.huge_pages`: ~1,100 page faults instead of ~154,000, 35-80 ms of kernel time instead of 250 ms), checksummed in the same pass; the first such import in a process paid 1.4 s of kernel time compacting memory (the machine's free memory is fragmented by other jobs), which the medians here include in their first rounds. An import must own writable memory for torch storages (a model writes them in place; the store's memory is read-only and shared), so one copy stays: the goals need that copy to land in recycled memory kept warm between imports, or a copy-on-write import over the store's buffers (`writable` copying a storage first), neither done."


def _session(mib: int) -> fs.ManagerState:
    """A feat map of 20 MiB bf16 tensors plus latents and frames, about ``mib`` MiB in all."""
    state, _ = fs.get_or_create(fs.ManagerState.create(), "s")
    n = max(1, (mib - 3) // 20)
    feat = [torch.randn(10 * MIB, dtype=torch.float32).to(torch.bfloat16) for _ in range(n)]
    latents = fs.LatentBuffer.create()
    for _ in range(8):
        latents = latents.commit(torch.randn(1, 16, 1, 44, 80).to(torch.bfloat16))
    frames = fs.LatentBuffer.create(maxlen=4)
    for _ in range(4):
        frames = frames.commit(torch.randint(0, 255, (352, 640, 3), dtype=torch.uint8))
    state = fs.put(fs.put(state, "s", "video_latents", latents), "s", "frames", frames)
    return fs.put(state, "s", "feat_map", fs.DenseValue.create(feat))


def _storages(state: fs.ManagerState) -> list[torch.Tensor]:
    blob = export_session(state, "s")
    return [torch.from_numpy(np.asarray(b)) for b in blob.buffers]


def _step_fn(handle, t):  # (the actors' model: the bench moves sessions, it steps none)
    return t


def run() -> dict:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=1536 * MIB)
    try:
        return _run(ray)
    finally:
        ray.shutdown()


def _run(ray) -> dict:
    rows, figures = [], {}
    ratios = []
    for mib in (64, 603):
        state = _session(mib)
        nbytes = sum(t.nbytes for t in _storages(state))
        storages = _storages(state)
        arrays = [t.numpy() for t in storages]

        def memcpy(storages=storages):
            return [t.clone() for t in storages]

        warm = [np.empty_like(a) for a in arrays]

        def memcpy_warm(arrays=arrays, warm=warm):
            for src, dst in zip(arrays, warm):
                np.copyto(dst, src)

        def put_get(arrays=arrays):
            return ray.get(ray.put(arrays))

        def transfer(state=state):
            blob = export_session(state, "s")
            manifest, buffers = ray.put(blob.manifest_bytes()), ray.put(list(blob.buffers))
            got = SessionBlob.from_parts(ray.get(manifest), ray.get(buffers))
            return import_session(fs.ManagerState.create(), got)

        fns = {
            "memcpy (fresh memory)": memcpy,
            "memcpy (memory touched before)": memcpy_warm,
            "object store put/get": put_get,
            "transfer": transfer,
        }
        if mib == 64:
            path = tempfile.mkdtemp() + "/s"

            def checkpoint(state=state, path=path):
                fs.save_session(state, "s", path)
                return fs.load_session(fs.ManagerState.create(), "s", path)

            fns["checkpoint save + load"] = checkpoint
        t = interleaved_medians(fns, repeats=5 if mib > 100 else 9)
        for name, v in t.items():
            rows.append([f"{nbytes / MIB:.0f} MiB: {name}", fmt_time(v), f"{nbytes / v / 1e9:.2f} GB/s"])
        figures[f"{mib}"] = {k: v for k, v in t.items()}
        ratios += [
            (f"{mib} MiB transfer / memcpy into fresh memory", t["transfer"] / t["memcpy (fresh memory)"]),
            (
                f"{mib} MiB transfer / memcpy into touched memory (goal <= 2)",
                t["transfer"] / t["memcpy (memory touched before)"],
            ),
            (f"{mib} MiB transfer / object store put+get (goal <= 1.2)", t["transfer"] / t["object store put/get"]),
        ]
        del arrays, warm

    # One move between two actors, and a failover, at 603 MiB (a fresh session built on the first actor).
    actor = ray.remote(SessionReplica).options(num_cpus=0)
    with tempfile.TemporaryDirectory() as root:
        reps = {n: actor.remote(n, model="wm", step=_step_fn) for n in ("a", "b", "c")}
        cluster = SessionCluster(reps, root)
        blob = export_session(claim(state, "s", model="wm"), "s")  # the 603 MiB session, onto actor "a"
        cluster.owners["s"] = ("a", ray.get(reps["a"].accept.remote(blob.manifest_bytes(), list(blob.buffers), 1)))
        del blob
        start = time.perf_counter()
        cluster.move("s", "b")
        move_s = time.perf_counter() - start
        cluster.save("s")
        ray.kill(reps["b"])
        start = time.perf_counter()
        cluster.failover("b")
        failover_s = time.perf_counter() - start
    rows.append(
        [f"{nbytes / MIB:.0f} MiB: move between two actors", fmt_time(move_s), f"{nbytes / move_s / 1e9:.2f} GB/s"]
    )
    rows.append([f"{nbytes / MIB:.0f} MiB: failover (resume from checkpoint)", fmt_time(failover_s), ""])

    table = fs.ManagerState.create(max_sessions=10_000, byte_budget="64 GiB")
    for i in range(10_000):
        table, _ = fs.get_or_create(table, f"s{i}")
        table = fs.put(table, f"s{i}", "x", fs.DenseValue.create([np.zeros(16, np.float32)]))
    placement(table)
    placed = interleaved_medians({"placement": lambda: placement(table)}, repeats=7)["placement"]
    rows.append(["placement figures, 10,000 sessions", fmt_time(placed), ""])
    figures.update(move_s=move_s, failover_s=failover_s, placement_10k_s=placed)
    return {
        "title": "Move a session between processes on Ray (export, object store, import)",
        "header": ("operation", "median time", "throughput"),
        "rows": rows,
        "ratio": ratios[-1],
        "extra_ratios": ratios[:-1],
        "notes": (
            "In one process, interleaved rounds (9 at 64 MiB, 5 at 603 MiB): memcpy (fresh memory) is a clone of every "
            "storage, which pays the first touch of new pages as an import must; memcpy (memory touched before) copies "
            "into buffers written once already (the issue's 110 ms memcpy); object store put/get is `ray.put` + `ray.get` of the same bytes as numpy arrays; transfer is "
            "`export_session` (views of the storages, checksummed), `ray.put` of its manifest text and buffers, "
            "`ray.get` (read in place), and `import_session` (every check of a checkpoint load, then one copy into "
            "memory of the session's own, checksummed in the same pass). The actor rows are single runs including "
            "Ray's task round trips." + _BREAKDOWN + " Measured on a 2-core machine shared with other jobs: noisy."
        ),
        "figures": figures,
    }


if __name__ == "__main__":
    r = run()
    for row in r["rows"]:
        print(row)
