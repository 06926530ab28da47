"""The Cosmos3 OOM check: whole generations in fresh processes, cache-off vs bespoke vs flag-on.

Each mode runs in its own fresh process with otherwise identical settings and reports process peak RSS,
RSS after each request and after an idle gap between requests (cleanup shows there, not in manager
stats), and, where CUDA exists, synchronized peak allocated and reserved memory. Do not infer safety from
the manager byte total, a single denoising step, or an operator-only profile.

``python benchmarks/cosmos3_memcheck.py --requests 4 --steps 6``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

MODES = ("cache-off", "bespoke", "flag-on")


def _child(args: argparse.Namespace) -> dict:
    import psutil
    import torch

    from functional_state import SessionStateManager, nbytes_by_device
    from torch_bridge.adapters import request_session
    from torch_bridge.harness import Cosmos3Shapes, Cosmos3TransformerCache, build_freqs_gen, encode_und_kv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = Cosmos3Shapes(
        num_layers=args.layers,
        num_heads=args.heads,
        head_dim=args.head_dim,
        text_len=args.text_len,
        padded_text_len=args.padded_text_len,
        media_tokens=args.media_tokens,
    )
    branches = {"none": [False], "sequential": [False, True]}[args.cfg]
    proc = psutil.Process()
    transformer = Cosmos3TransformerCache()
    manager = SessionStateManager()
    between, after = [], []

    def to_device(kv, freqs):
        return [(k.to(device), v.to(device)) for k, v in kv], tuple(f.to(device) for f in freqs)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def denoise(request: int, state=None) -> None:
        query = torch.randn(1, shapes.num_heads, 16, shapes.head_dim, device=device)
        for _ in range(args.steps):
            for is_negative in branches:
                seed = 2 * request + int(is_negative)
                if args.mode == "cache-off":  # recompute the conditioning at every step
                    transformer.cached_kv, transformer.freqs_gen = to_device(
                        encode_und_kv(shapes, seed), build_freqs_gen(shapes)
                    )
                elif args.mode == "bespoke":  # encode once into the shared instance's branch cache
                    if is_negative not in transformer.branch_cache:
                        kv, freqs = to_device(encode_und_kv(shapes, seed), build_freqs_gen(shapes))
                        transformer.branch_cache[is_negative] = (kv, freqs)
                    transformer.use_branch(is_negative)
                else:  # flag-on: encode once into the request's manager session
                    if not state.is_branch_initialized(is_negative):
                        transformer.cached_kv, transformer.freqs_gen = to_device(
                            encode_und_kv(shapes, seed), build_freqs_gen(shapes)
                        )
                        state.capture_from_transformer(transformer, is_negative)
                    else:
                        state.load_into_transformer(transformer, is_negative)
                query = transformer.attend(query).to(query.dtype)
        sync()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for request in range(args.requests):
        transformer.reset_cache()  # the start of each generation, as the pipeline does
        if args.mode == "flag-on":
            with request_session(manager, f"req-{request}") as state:
                denoise(request, state)
        else:
            denoise(request)
        after.append(proc.memory_info().rss)
        time.sleep(args.gap_s)  # the time between requests is part of the check
        between.append(proc.memory_info().rss)
    out = {
        "mode": args.mode,
        "device": device,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_request": after,
        "rss_between_requests": between,
        "manager_sessions_after": len(manager),
        "manager_total_nbytes_after": manager.stats()["total_nbytes"],
        # What the last request left on the transformer until the next reset_cache(): invisible to stats().
        "transformer_still_holds": sum(nbytes_by_device(transformer.cached_kv, transformer.freqs_gen).values()),
    }
    if device == "cuda":
        out["cuda_peak_allocated"] = torch.cuda.max_memory_allocated()
        out["cuda_peak_reserved"] = torch.cuda.max_memory_reserved()
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4, help="generations per process")
    p.add_argument("--steps", type=int, default=6, help="denoising steps per generation")
    p.add_argument("--cfg", choices=["none", "sequential"], default="sequential", help="CFG placement on this rank")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--text-len", type=int, default=300)
    p.add_argument("--padded-text-len", type=int, default=512)
    p.add_argument("--media-tokens", type=int, default=4096)
    p.add_argument("--gap-s", type=float, default=0.2, help="idle seconds between requests")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.mode:
        print(json.dumps(_child(args)))
        return 0
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    results = {}
    for mode in MODES:
        out = subprocess.run(
            [sys.executable, __file__, *passthrough, "--mode", mode], capture_output=True, text=True, env=env
        )
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(results))
        return 0
    mib = lambda b: f"{b / 2**20:.1f}"
    print(
        f"{'mode':10s} {'peak RSS MiB':>13s} {'RSS after last req':>19s} {'RSS between (last)':>19s} "
        f"{'mgr sessions':>12s} {'transformer-held MiB':>21s}"
    )
    for mode, r in results.items():
        print(
            f"{mode:10s} {mib(r['peak_rss']):>13s} {mib(r['rss_after_request'][-1]):>19s} "
            f"{mib(r['rss_between_requests'][-1]):>19s} {r['manager_sessions_after']:>12d} "
            f"{mib(r['transformer_still_holds']):>21s}"
        )
    if results["flag-on"]["device"] == "cuda":
        for mode, r in results.items():
            print(
                f"{mode:10s} CUDA peak allocated {mib(r['cuda_peak_allocated'])} MiB, reserved {mib(r['cuda_peak_reserved'])} MiB"
            )
    else:
        print("(no CUDA here: process RSS only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
