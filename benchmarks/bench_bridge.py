"""torch -> JAX wrap time for 1 KiB vs 1 GiB, with pointer equality and the RSS delta."""

from __future__ import annotations

import psutil
import torch

from _timing import fmt_time, interleaved_medians
from torch_bridge import report, reset_report, to_jax


def run() -> dict:
    small = torch.ones(256, dtype=torch.float32)  # 1 KiB
    big = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB, pages touched
    proc = psutil.Process()
    reset_report()
    rss_before = proc.memory_info().rss
    alias = to_jax(big, strict=True)
    alias.block_until_ready()
    rss_delta = proc.memory_info().rss - rss_before
    same_ptr = alias.unsafe_buffer_pointer() == big.data_ptr()
    del alias
    t = interleaved_medians(
        {"1KiB": lambda: to_jax(small, strict=True), "1GiB": lambda: to_jax(big, strict=True)}, repeats=15, number=50
    )
    copied = report()["copied_bytes"]
    rows = [
        ("1 KiB", fmt_time(t["1KiB"]), "yes", "-"),
        ("1 GiB", fmt_time(t["1GiB"]), "yes" if same_ptr else "NO", f"{rss_delta / 2**20:+.2f} MiB"),
    ]
    return {
        "title": "Bridge: torch -> JAX wrap",
        "header": ("tensor", "median wrap time", "pointer equal", "RSS delta"),
        "rows": rows,
        "ratio": ("wrap(1 GiB) / wrap(1 KiB)", t["1GiB"] / t["1KiB"]),
        "notes": f"strict=True, so any copy would raise; bytes copied during the run: {copied}.",
        "figures": {"small_s": t["1KiB"], "big_s": t["1GiB"], "rss_delta": rss_delta, "copied_bytes": copied},
    }
