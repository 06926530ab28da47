"""torch -> JAX without copying: `wrap` and `to_jax(strict=True)` on 1 KiB and 1 GiB, each cell measured."""

from __future__ import annotations

import psutil
import torch

from _timing import fmt_time, interleaved_medians
from torch_bridge import report, reset_report, to_jax, wrap

SIZES = {"1 KiB": 256, "1 GiB": 1 << 28}  # float32 elements


def _rss_delta_and_pointer(fn, t: torch.Tensor, proc: psutil.Process) -> tuple[int, bool]:
    before = proc.memory_info().rss
    alias = fn(t)
    alias.block_until_ready()
    delta = proc.memory_info().rss - before
    return delta, alias.unsafe_buffer_pointer() == t.data_ptr()


def run() -> dict:
    proc = psutil.Process()
    tensors = {label: torch.ones(n, dtype=torch.float32) for label, n in SIZES.items()}  # pages touched
    for fn in (wrap, to_jax):  # warm up: the first import in a process initialises JAX's DLPack path
        fn(torch.ones(16)).block_until_ready()
    reset_report()
    fns, checks = {}, {}
    for label, t in tensors.items():
        for name, fn in (("wrap", wrap), ("to_jax(strict=True)", lambda x: to_jax(x, strict=True))):
            checks[(label, name)] = _rss_delta_and_pointer(fn, t, proc)
            fns[f"{name}@{label}"] = lambda fn=fn, t=t: fn(t)
    t = interleaved_medians(fns, repeats=15, number=50)
    copied = report()["copied_bytes"]
    rows = []
    for label in SIZES:
        for name in ("wrap", "to_jax(strict=True)"):
            delta, same = checks[(label, name)]
            rows.append(
                (
                    f"{name}, {label}",
                    fmt_time(t[f"{name}@{label}"]),
                    "yes" if same else "NO",
                    f"{delta / 2**20:+.2f} MiB",
                )
            )
    return {
        "title": "Bridge: torch -> JAX without copying",
        "header": ("call, tensor", "median time", "pointer equal", "RSS delta"),
        "rows": rows,
        "ratio": ("wrap(1 GiB) / wrap(1 KiB)", t["wrap@1 GiB"] / t["wrap@1 KiB"]),
        "extra_ratios": [
            ("to_jax(1 GiB) / to_jax(1 KiB)", t["to_jax(strict=True)@1 GiB"] / t["to_jax(strict=True)@1 KiB"])
        ],
        "notes": (
            f"Each cell is measured: the pointer comparison and the RSS delta come from one call per row on its "
            f"own tensor, the time from 15 x 50 interleaved calls. `wrap` never copies (it returns the tensor "
            f"itself when JAX cannot alias it) and strict=True would raise on a copy; bytes copied during the "
            f"run: {copied}."
        ),
        "figures": {"times": t, "copied_bytes": copied, "checks": {f"{k[1]}@{k[0]}": v for k, v in checks.items()}},
    }
