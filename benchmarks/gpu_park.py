"""Park and restore on a GPU: the numbers `bench_park` cannot measure on a CPU-only machine.

Run on a machine with CUDA: ``python benchmarks/gpu_park.py`` (prints one JSON object). It measures, side by
side in one run:

* park + restore of the 603 MiB DreamZero feat map (30 bf16 tensors on cuda:0) against a plain per-tensor
  ``t.to("cpu")`` / ``t.to("cuda")`` loop and against the PCIe pinned-memory bandwidth (one pinned host
  buffer of the same size copied there and back);
* coalesced park of 4,096 small (16 KiB) tensors against copying them to the host one by one;
* the DreamZero park-every-step overhead: a 150 ms control step (a busy-wait kernel) alone, and followed by
  a park and a restore of the feat map (goal: overhead <= 20%).
"""

from __future__ import annotations

import json
import time

import torch

from functional_state import DenseValue

MIB = 2**20


def _time(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_park.py needs CUDA")
    dev = torch.device("cuda:0")
    per = 603 * MIB // (2 * 30)
    feat = [torch.randn(per, device=dev).to(torch.bfloat16) for _ in range(30)]
    nbytes = sum(t.numel() * t.element_size() for t in feat)
    dense = DenseValue.create(feat)
    holder = {"p": dense.park()}
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    small = [torch.randn(4096, device=dev) for _ in range(4096)]
    small_dense = DenseValue.create(small)
    results = {
        "park_s": _time(lambda: holder.__setitem__("p", dense.park())),
        "restore_s": _time(lambda: holder["p"].restore()),
        "loop_out_s": _time(lambda: [t.to("cpu") for t in feat]),
        "loop_back_s": _time(lambda: [t.to(dev) for t in [x.to("cpu") for x in feat]])
        - _time(lambda: [t.to("cpu") for t in feat]),
        "pinned_d2h_s": _time(lambda: pinned.copy_(flat, non_blocking=True)),
        "pinned_h2d_s": _time(lambda: flat.copy_(pinned, non_blocking=True)),
        "small_park_s": _time(lambda: small_dense.park()),
        "small_one_by_one_s": _time(lambda: [t.to("cpu") for t in small]),
    }
    cycles = int(0.150 * torch.cuda.get_device_properties(dev).clock_rate * 1e3)  # clock_rate in kHz

    def control() -> None:
        torch.cuda._sleep(cycles)

    def control_with_park() -> None:
        torch.cuda._sleep(cycles)
        holder["p"] = dense.park()
        holder["p"].restore()

    results["step_s"] = _time(control)
    results["step_with_park_s"] = _time(control_with_park)
    results["bytes"] = nbytes
    gb = nbytes / 1e9
    results["park_restore_vs_pinned"] = (2 * gb / (results["park_s"] + results["restore_s"])) / (
        2 * gb / (results["pinned_d2h_s"] + results["pinned_h2d_s"])
    )
    results["small_coalesced_speedup"] = results["small_one_by_one_s"] / results["small_park_s"]
    results["park_every_step_overhead"] = results["step_with_park_s"] / results["step_s"] - 1
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
