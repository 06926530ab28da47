"""The command line: ``functional-state {demo,ab,bench}`` (also ``python -m functional_state``).

``demo`` runs concurrent DreamZero sessions and Cosmos3 requests through one manager at the deploy shapes,
checks A/B equivalence in fresh processes, prints the memory picture and writes a plot. Every section that
takes more than a moment shows its progress; log lines and warnings print above the progress bars.

The parser lives in `functional_state.__main__` (no torch, no extras), which calls `run` here once a command
is parsed; ``--help`` and ``--version`` never import this module.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20

# component -> (bucket, bounded or growing) for the DreamZero memory table
_DREAMZERO_COMPONENTS = {
    "stitched_frames": ("object: LatentBuffer ring(4)", "bounded"),
    "video_latents": ("object: LatentBuffer append", "growing"),
    "vae_encoder_out": ("object: LatentBuffer ring(window)", "bounded"),
    "vae_enc_feat_map": ("attr", "bounded (fixed size)"),
    "vae_pending_body_frames": ("attr", "bounded (< 4 frames)"),
    "conditioning": ("attr", "bounded"),
}


class MissingExtraError(RuntimeError):
    """A command needs a package of an extra that is not installed."""


def _require(module: str, extra: str, command: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"functional-state {command}: needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'functional-state[{extra}]'"
        ) from None


# --- output: a rich console, with logging and warnings routed above the progress bars --------------------


@contextlib.contextmanager
def _console(command: str) -> Iterator[Any]:
    rich_console = _require("rich.console", "cli", command)
    rich_logging = _require("rich.logging", "cli", command)
    console = rich_console.Console(highlight=False)
    if not console.is_terminal:
        console = rich_console.Console(highlight=False, width=120)
    handler = rich_logging.RichHandler(console=console, show_time=False, show_path=False)
    root = logging.getLogger()
    old_handlers, old_level = root.handlers[:], root.level
    root.handlers, root.level = [handler], logging.WARNING
    logging.captureWarnings(True)  # BridgeWarnings and friends print as log lines, above any live bar
    try:
        yield console
    finally:
        logging.captureWarnings(False)
        root.handlers, root.level = old_handlers, old_level


def _progress(console: Any) -> Any:
    progress = importlib.import_module("rich.progress")
    return progress.Progress(
        progress.SpinnerColumn(),
        progress.TextColumn("{task.description}"),
        progress.BarColumn(),
        progress.MofNCompleteColumn(),
        progress.TimeElapsedColumn(),
        console=console,
    )


# --- A/B ------------------------------------------------------------------------------------------------


def _rollout_process(flag: str, extra: Sequence[str]) -> dict[str, Any]:
    env = dict(os.environ, OMNI_DIFFUSION_SESSION_STATE_MANAGER=flag)
    cmd = [sys.executable, "-m", "torch_bridge.adapters.dreamzero_rollout", "--json", *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"rollout (flag={flag}) failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ab(console: Any, runs: Sequence[tuple[str, list[str]]]) -> bool:
    """Each run twice in fresh processes, flag 0 then 1; True when every digest matched."""
    rich_table = importlib.import_module("rich.table")
    table = rich_table.Table("run", "bespoke digest", "manager digest", "result", "seconds")
    all_match = True
    with _progress(console) as progress:
        for label, extra in runs:
            task = progress.add_task(f"A/B {label}", total=2)
            t0 = time.perf_counter()
            a = _rollout_process("0", extra)
            progress.advance(task)
            b = _rollout_process("1", extra)
            progress.advance(task)
            match = a["digest"] == b["digest"] and (a["path"], b["path"]) == ("bespoke", "manager")
            all_match &= match
            table.add_row(
                label,
                a["digest"][:16],
                b["digest"][:16],
                "MATCH" if match else "DIFFER",
                f"{time.perf_counter() - t0:.1f}",
            )
    console.print(table)
    return all_match


def _ab_runs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    return [
        (
            f"small shapes, real Wan encoder (diffusers), {args.ab_steps} steps x 3 sessions",
            ["--steps", str(args.ab_steps), "--sessions", "3", "--vae-encoder", "wan"],
        ),
        (f"small shapes, {args.ab_steps} steps x 3 sessions", ["--steps", str(args.ab_steps), "--sessions", "3"]),
        (
            f"deploy shapes, {args.ab_deploy_steps} steps x 2 sessions",
            [
                "--steps",
                str(args.ab_deploy_steps),
                "--sessions",
                "2",
                "--deploy-shapes",
                "--feat-map-mib",
                str(args.feat_map_mib),
            ],
        ),
    ]


def _cmd_ab(args: argparse.Namespace) -> int:
    with _console("ab") as console:
        console.print("A/B: the same rollout in fresh processes with only OMNI_DIFFUSION_SESSION_STATE_MANAGER flipped")
        ok = _ab(console, _ab_runs(args))
        console.print("every digest matched" if ok else "DIGESTS DIFFER: the manager-backed path is not bit-identical")
    return 0 if ok else 1


# --- demo -------------------------------------------------------------------------------------------------


def _run_concurrent(args: argparse.Namespace, console: Any) -> tuple[Any, float, int]:
    import torch

    from functional_state import SessionStateManager
    from torch_bridge import harness as dz
    from torch_bridge.adapters import DreamZeroStateAdapter, request_session
    from torch_bridge.harness import Cosmos3Shapes, Cosmos3TransformerCache, build_freqs_gen, encode_und_kv

    manager = SessionStateManager()
    cfg = dz.RolloutConfig(
        steps=args.steps, sessions=args.sessions, feat_map_bytes=int(args.feat_map_mib * MIB), prompt_every=10**9
    )
    nets = dz.Networks(cfg)
    shapes = Cosmos3Shapes(
        num_layers=28, num_heads=16, head_dim=128, text_len=300, padded_text_len=512, media_tokens=4096
    )
    errors: list[BaseException] = []
    cosmos_peak: list[int] = []
    lock = threading.Lock()

    with _progress(console) as progress:
        dz_task = progress.add_task("DreamZero steps", total=args.sessions * args.steps)
        c3_task = progress.add_task("Cosmos3 requests", total=args.requests)

        def dreamzero(session: int) -> None:
            try:
                for step in range(args.steps):
                    state = DreamZeroStateAdapter(
                        f"dreamzero-{session}", manager, vae_encoder_window=cfg.vae_encoder_window
                    )
                    dz.pipeline_step(state, nets, cfg, session, step)
                    progress.advance(dz_task)
            except Exception as e:  # reported after the join
                errors.append(e)

        def cosmos(request: int) -> None:
            try:
                transformer = Cosmos3TransformerCache()
                with request_session(manager, f"cosmos3-req-{request}") as state:
                    for is_negative in (False, True):  # sequential CFG: both branches on this rank
                        transformer.cached_kv = encode_und_kv(shapes, seed=2 * request + int(is_negative))
                        transformer.freqs_gen = build_freqs_gen(shapes, offset=float(is_negative))
                        state.capture_from_transformer(transformer, is_negative)
                    query = torch.randn(1, shapes.num_heads, 4, shapes.head_dim)
                    for is_negative in (False, True):
                        state.load_into_transformer(transformer, is_negative)
                        transformer.attend(query)
                    with lock:
                        cosmos_peak.append(manager.stats()["total_nbytes"])
                progress.advance(c3_task)
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=dreamzero, args=(i,)) for i in range(args.sessions)]
        threads += [threading.Thread(target=cosmos, args=(i,)) for i in range(args.requests)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return manager, time.perf_counter() - t0, max(cosmos_peak, default=0)


def _memory_table(manager: Any, console: Any) -> None:
    """One table: a row per DreamZero session, a column per component (MiB), and each session's total."""
    from functional_state import sessions
    from torch_bridge.adapters.dreamzero import dreamzero_component_nbytes

    rich_table = importlib.import_module("rich.table")
    table = rich_table.Table(title="MiB per session (in all: each allocation once)", title_justify="left")
    table.add_column("session")
    for name in _DREAMZERO_COMPONENTS:
        table.add_column(name, justify="right")
    table.add_column("in all", justify="right")
    for sid, session in sorted(sessions(manager.state).items()):
        if not sid.startswith("dreamzero-"):
            continue
        parts = dreamzero_component_nbytes(session)
        held = sum(session.nbytes_by_device().values())
        table.add_row(sid, *(f"{parts[name] / MIB:.3f}" for name in _DREAMZERO_COMPONENTS), f"{held / MIB:.3f}")
    console.print(table)
    console.print(
        "   buckets: " + "; ".join(f"{name} {bucket}, {kind}" for name, (bucket, kind) in _DREAMZERO_COMPONENTS.items())
    )


def _plot(args: argparse.Namespace, console: Any) -> tuple[Path, dict[str, Any]]:
    matplotlib = _require("matplotlib", "cli", "demo")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from functional_state.config import enable_override
    from torch_bridge import harness as dz

    cfg = dz.RolloutConfig(
        steps=args.plot_steps,
        sessions=1,
        feat_map_bytes=int(args.feat_map_mib * MIB),
        prompt_every=10**9,
        trace_bytes=True,
    )
    traces = {}
    with _progress(console) as progress:
        for enabled, label in ((False, "bespoke"), (True, "manager-backed")):
            task = progress.add_task(f"rollout, {label}", total=cfg.steps)

            def advance(_: int, task: Any = task) -> None:
                progress.advance(task)

            with enable_override(enabled):
                traces[label] = dz.run_rollout(cfg, progress=advance).bytes_trace
    fig, (ax_enc, ax_total) = plt.subplots(1, 2, figsize=(11, 4))
    for label, trace in traces.items():
        steps = range(1, len(trace) + 1)
        ax_enc.plot(steps, [t["vae_encoder_out"] / MIB for t in trace], label=label)
        ax_total.plot(steps, [t["total"] / MIB for t in trace], label=label)
    ax_enc.set(title="VAE encoder output held", xlabel="step", ylabel="MiB")
    ax_total.set(title=f"whole session, deduplicated (feat map {args.feat_map_mib:g} MiB)", xlabel="step", ylabel="MiB")
    for ax in (ax_enc, ax_total):
        ax.legend()
        ax.grid(alpha=0.3)
    (h, w), (lh, lw) = cfg.stitched_hw, cfg.latent_hw
    fig.suptitle(
        f"DreamZero session bytes per step ({h}x{w} stitched frames, {lh}x{lw} bf16 latents; stand-in encoder: "
        f"its {args.feat_map_mib:g} MiB feat map is sized to the deploy one)"
    )
    fig.tight_layout()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "dreamzero_bytes_per_step.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    final = {label: trace[-1] for label, trace in traces.items()}
    return path, final


def _budget_demo(args: argparse.Namespace, console: Any) -> bool:
    """Six sessions under a byte budget for two: parking keeps every session and every output; the
    drop-only budget loses sessions, loudly. Returns whether the parked run matched the unbudgeted one."""
    import dataclasses

    from functional_state import format_bytes
    from functional_state.config import enable_override
    from torch_bridge import harness as dz

    steps = args.budget_steps
    # The feat map dominates a session at deploy shapes (603 of 627 MiB); a smaller one would leave mostly
    # the stitched frames, which the pending body frames (an attr) keep alive, so parking could free little.
    feat_map_mib = max(args.feat_map_mib, 16.0)
    cfg = dz.RolloutConfig(
        steps=steps, sessions=6, feat_map_bytes=int(feat_map_mib * MIB), prompt_every=10**9, trace_pools=True
    )
    results = {}
    with _progress(console) as progress, enable_override(True):

        def run(label: str, run_cfg: Any) -> None:
            task = progress.add_task(label, total=steps)
            results[label] = dz.run_rollout(run_cfg, progress=lambda _: progress.advance(task))

        run("count cap only", cfg)
        budget = 2 * max(results["count cap only"].totals.values())  # what two whole sessions hold, measured
        run("budget, park first", dataclasses.replace(cfg, byte_budget={"cpu": budget}))
        run("budget, drop only", dataclasses.replace(cfg, byte_budget={"cpu": budget}, release_levers=("drop",)))
    rich_table = importlib.import_module("rich.table")
    table = rich_table.Table("run", "peak device pool", "parks", "restores", "sessions lost", "outputs")
    reference = results["count cap only"].digest
    for label, r in results.items():
        peak = max(p.get("nbytes:cpu", 0) for p in r.pool_trace)
        same = "identical" if r.digest == reference else "differ (sessions lost)"
        counts = r.pool_trace[-1]  # stats() after the last round (the rollout ran on the manager path)
        table.add_row(label, format_bytes(peak), str(counts["parks"]), str(counts["restores"]), str(len(r.lost)), same)
    console.print(table)
    console.print(
        f"   budget {format_bytes(budget)}: two sessions (feat map {feat_map_mib:g} MiB); lost sessions raised "
        "instead of restarting"
    )
    return results["budget, park first"].digest == reference and not results["budget, park first"].lost


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)  # pinned: on a shared box more threads than cores slow every step down
    t_start = time.perf_counter()
    with _console("demo") as console:
        console.rule("functional-state demo: immutable per-session state behind DreamZero and Cosmos3 adapters")
        console.print(
            f"1. {args.sessions} DreamZero sessions x {args.steps} steps and {args.requests} Cosmos3 requests, "
            f"concurrently, through one SessionStateManager (deploy shapes; feat map {args.feat_map_mib:g} MiB)"
        )
        manager, seconds, cosmos_peak = _run_concurrent(args, console)
        console.print(
            f"   done in {seconds:.1f}s; Cosmos3 requests retained up to {cosmos_peak / MIB:.0f} MiB while live "
            f"(both CFG branches), and their sessions were dropped when each request ended"
        )

        console.print("\n2. A/B equivalence: the same rollout in fresh processes, only the flag flipped")
        ok = _ab(console, _ab_runs(args))
        console.print(f"   {'every digest matched' if ok else 'DIGESTS DIFFER'}")

        console.print("\n3. Memory per DreamZero session (manager-backed)")
        _memory_table(manager, console)
        s = manager.stats()
        console.print(
            f"   LRU: sessions {s['sessions']}/{s['max_sessions']}, hits {s['hits']}, misses {s['misses']}, "
            f"evictions {s['evictions']}"
        )
        console.print(
            f"   stats(): {s['total_nbytes'] / MIB:.1f} MiB held, parks {s['parks']}, restores {s['restores']}"
        )

        if not args.no_plot:
            console.print(f"\n4. Bytes per step, bespoke vs manager-backed ({args.plot_steps} steps, one session)")
            path, final = _plot(args, console)
            b, m = final["bespoke"]["vae_encoder_out"], final["manager-backed"]["vae_encoder_out"]
            console.print(
                f"   VAE encoder output after {args.plot_steps} steps: bespoke {b / MIB:.2f} MiB (growing, "
                f"0.215 MiB per latent frame), ring {m / MIB:.2f} MiB (constant)"
            )
            console.print(f"   wrote {path.resolve()}", soft_wrap=True)
        console.print(f"\n5. Six DreamZero sessions under a byte budget for two ({args.budget_steps} steps each)")
        budget_ok = _budget_demo(args, console)
        console.print(f"   {'parking kept every session, bit-identical' if budget_ok else 'PARKED RUN DIFFERS'}")
        ok = ok and budget_ok
        console.print(
            "\n   real model code: diffusers' Wan causal VAE encoder in the first A/B run (its feat cache streamed "
            "through the state); stand-ins (no package provides them here): the DreamZero generator, text encoder, "
            "quant_conv, and the encoder of the concurrent, plot and budget runs (deploy shapes, sized feat map)"
        )
        console.print(f"\n{'OK' if ok else 'FAILED'}: demo finished in {time.perf_counter() - t_start:.0f}s")
    return 0 if ok else 1


# --- bench ------------------------------------------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace) -> int:
    script = ROOT / "benchmarks" / "run.py"
    if not script.exists():
        print(
            f"functional-state bench: error: {script} not found; `bench` runs from a source checkout", file=sys.stderr
        )
        return 2
    write = ["--write"] if getattr(args, "write", False) else []
    return subprocess.call([sys.executable, str(script), *write, *getattr(args, "names", [])])


# --- dispatch ---------------------------------------------------------------------------------------------

_COMMANDS = {"demo": _cmd_demo, "ab": _cmd_ab, "bench": _cmd_bench}


def run(args: argparse.Namespace) -> int:
    """Run the parsed command (``functional_state.__main__.parse`` parses); a missing extra exits 2."""
    try:
        return _COMMANDS[args.command](args)
    except MissingExtraError as e:
        print(e, file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``functional-state`` console script (the same as ``functional_state.__main__.main``)."""
    from functional_state.__main__ import main as fs_main

    return fs_main(argv)


if __name__ == "__main__":
    sys.exit(main())
