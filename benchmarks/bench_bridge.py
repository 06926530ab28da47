"""torch <-> JAX without copying, against the raw DLPack calls, at 1 KiB, 64 MiB and 1 GiB, each cell measured.

* ``to_jax(strict=True)`` and ``wrap`` against raw ``jax.dlpack.from_dlpack`` of the same tensor;
* ``to_torch`` of a JAX-native array against raw ``torch.from_dlpack`` of it (an array the bridge imported
  comes back as its tensor, which is cheaper still: shown for orientation);
* where the bridge has direct DLPack entry points, ``to_jax``/``to_torch`` with them switched off: the public
  path every JAX falls back to when the feature check fails.

Goal (issue 24): to_jax and to_torch <= 1.1x raw, through the public API, at 1 KiB and 64 MiB.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import psutil
import torch

from _timing import fmt_time, interleaved_medians
from torch_bridge import bridge as _bridge
from torch_bridge import report, reset_report, to_jax, to_torch, wrap

SIZES = {"1 KiB": 256, "64 MiB": 1 << 24, "1 GiB": 1 << 28}  # float32 elements
GOAL_SIZES = ("1 KiB", "64 MiB")


@contextlib.contextmanager
def _public_path():
    """The bridge with its direct entry points off (the tested fallback), if this version has them."""
    saved = {k: getattr(_bridge, k) for k in ("_C_IMPORT", "_FAST_DEVICES", "_TORCH_DIRECT") if hasattr(_bridge, k)}
    try:
        if "_C_IMPORT" in saved:
            _bridge._C_IMPORT = None
            _bridge._FAST_DEVICES = {}
        if "_TORCH_DIRECT" in saved:
            _bridge._TORCH_DIRECT = False
        yield
    finally:
        for k, v in saved.items():
            setattr(_bridge, k, v)


def _has_direct() -> bool:
    return getattr(_bridge, "_C_IMPORT", None) is not None or bool(getattr(_bridge, "_TORCH_DIRECT", False))


def _public(fn):
    def call():
        with _public_path():
            return fn()

    return call


def _rss_delta_and_pointer(fn, t: torch.Tensor, proc: psutil.Process) -> tuple[int, bool]:
    before = proc.memory_info().rss
    alias = fn(t)
    alias.block_until_ready()
    delta = proc.memory_info().rss - before
    return delta, alias.unsafe_buffer_pointer() == t.data_ptr()


def run() -> dict:
    torch.set_num_threads(1)
    proc = psutil.Process()
    tensors = {label: torch.ones(n, dtype=torch.float32) for label, n in SIZES.items()}  # pages touched
    natives = {label: jnp.ones(n, jnp.float32) for label, n in SIZES.items()}
    for fn in (wrap, to_jax, jax.dlpack.from_dlpack):  # the first import initialises JAX's DLPack path
        fn(torch.ones(16)).block_until_ready()
    torch.from_dlpack(jnp.ones(16))
    to_torch(jnp.ones(16))
    reset_report()
    direct = _has_direct()
    fns, checks = {}, {}
    for label, t in tensors.items():
        for name, fn in (("wrap", wrap), ("to_jax(strict=True)", lambda x: to_jax(x, strict=True))):
            checks[(label, name)] = _rss_delta_and_pointer(fn, t, proc)
        a, alias = natives[label], to_jax(t, strict=True)
        fns[f"raw from_dlpack@{label}"] = lambda t=t: jax.dlpack.from_dlpack(t)
        fns[f"to_jax(strict=True)@{label}"] = lambda t=t: to_jax(t, strict=True)
        fns[f"wrap@{label}"] = lambda t=t: wrap(t)
        fns[f"raw torch.from_dlpack@{label}"] = lambda a=a: torch.from_dlpack(a)
        fns[f"to_torch@{label}"] = lambda a=a: to_torch(a)
        fns[f"to_torch(alias)@{label}"] = lambda alias=alias: to_torch(alias)
        if direct:
            fns[f"to_jax, public path@{label}"] = _public(lambda t=t: to_jax(t, strict=True))
            fns[f"to_torch, public path@{label}"] = _public(lambda a=a: to_torch(a))
    t = interleaved_medians(fns, repeats=15, number=50)
    copied = report()["copied_bytes"]
    rows = []
    for label in SIZES:
        raw_j, raw_t = t[f"raw from_dlpack@{label}"], t[f"raw torch.from_dlpack@{label}"]
        for name in ("wrap", "to_jax(strict=True)"):
            delta, same = checks[(label, name)]
            rows.append(
                (
                    f"{name}, {label}",
                    fmt_time(t[f"{name}@{label}"]),
                    f"{t[f'{name}@{label}'] / raw_j:.2f}x raw from_dlpack ({fmt_time(raw_j)})",
                    "yes" if same else "NO",
                    f"{delta / 2**20:+.2f} MiB",
                )
            )
        cells = [
            ("to_torch (JAX-native array)", f"to_torch@{label}"),
            ("to_torch (bridge alias)", f"to_torch(alias)@{label}"),
        ]
        for name, key in cells:
            rows.append(
                (
                    f"{name}, {label}",
                    fmt_time(t[key]),
                    f"{t[key] / raw_t:.2f}x raw torch.from_dlpack ({fmt_time(raw_t)})",
                    "",
                    "",
                )
            )
        if direct:
            key = f"to_jax, public path@{label}"
            rows.append(
                (
                    f"to_jax, public path (fallback), {label}",
                    fmt_time(t[key]),
                    f"{t[key] / raw_j:.2f}x raw from_dlpack",
                    "",
                    "",
                )
            )
            key = f"to_torch, public path@{label}"
            rows.append(
                (
                    f"to_torch, public path (fallback), {label}",
                    fmt_time(t[key]),
                    f"{t[key] / raw_t:.2f}x raw torch.from_dlpack",
                    "",
                    "",
                )
            )
    ratios = [
        (
            f"to_jax(strict=True) / raw jax.dlpack.from_dlpack at {label} (goal <= 1.1)",
            t[f"to_jax(strict=True)@{label}"] / t[f"raw from_dlpack@{label}"],
        )
        for label in GOAL_SIZES
    ] + [
        (
            f"to_torch / raw torch.from_dlpack at {label} (goal <= 1.1)",
            t[f"to_torch@{label}"] / t[f"raw torch.from_dlpack@{label}"],
        )
        for label in GOAL_SIZES
    ]
    return {
        "title": "Bridge: torch <-> JAX without copying, against raw DLPack",
        "header": ("call, tensor", "median time", "against raw", "pointer equal", "RSS delta"),
        "rows": rows,
        "ratio": ratios[0],
        "extra_ratios": [
            *ratios[1:],
            ("wrap(1 GiB) / wrap(1 KiB)", t["wrap@1 GiB"] / t["wrap@1 KiB"]),
            ("to_jax(1 GiB) / to_jax(1 KiB)", t["to_jax(strict=True)@1 GiB"] / t["to_jax(strict=True)@1 KiB"]),
        ],
        "notes": (
            f"Each cell is measured: the pointer comparison and the RSS delta come from one call per row on its "
            f"own tensor, the times from 15 x 50 interleaved calls, torch on one thread. The bridge keeps every "
            f"check it promises on every call (the tensor's layout, dtype, alignment and device before the import; "
            f"the pointer comparison after it, raising if JAX copied; the alias registration; on export, deleted "
            f"and multi-device arrays refused and pending work waited for). "
            f"{'Its direct entry points (the C++ DLPack import under jax.dlpack.from_dlpack, torch._C._from_dlpack on CPU) are used where a feature check at first use finds them behaving as the public functions; the public-path rows are the fallback, measured in the same run. ' if direct else 'This bridge has no direct entry points: every call takes the public path. '}"
            f"`wrap` never copies (it returns the tensor itself when JAX cannot alias it) and strict=True would raise "
            f"on a copy; bytes copied during the run: {copied}. Reproduce: `PYTHONPATH=$PWD python benchmarks/run.py bridge`."
        ),
        "figures": {"times": t, "copied_bytes": copied, "checks": {f"{k[1]}@{k[0]}": v for k, v in checks.items()}},
    }


if __name__ == "__main__":
    result = run()
    for row in result["rows"]:
        print(" | ".join(str(c) for c in row))
    for label, value in [result["ratio"], *result["extra_ratios"]]:
        print(f"{label}: {value:.3g}")
