"""``functional-state demo``: the tour, section by section, and the recap of what it measured.

DreamZero sessions stream through diffusers' real Wan causal VAE encoder (the rest of the pipeline is the
harness's stand-ins) while Cosmos3 requests share the manager; then the memory per session and per pool, the
park bandwidth, the A/B check in fresh processes, the bytes-per-step plot and six sessions under a byte budget
for two. `torch_bridge.runner` holds the console, the progress bars and the A/B runner.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from . import demo_text_model, runner

DEPLOY_CAMERA_HW = (180, 320)  # what DreamZero serves: three such cameras, stitched to 352x640
FEAT_MAP = "vae_enc_feat_map"  # the DreamZero session object holding the VAE encoder's feat cache

# component -> (bucket, bounded or growing) for the DreamZero memory table
_DREAMZERO_COMPONENTS = {
    "stitched_frames": ("object: LatentBuffer ring(4)", "bounded"),
    "video_latents": ("object: LatentBuffer append", "growing"),
    "vae_encoder_out": ("object: LatentBuffer ring(window)", "bounded"),
    "vae_enc_feat_map": ("object: DenseValue", "bounded (fixed size)"),
    "vae_pending_body_frames": ("attr", "bounded (< 4 frames)"),
    "conditioning": ("attr", "bounded"),
}


def _shapes(cfg: Any) -> str:
    (ch, cw), (h, w), (lh, lw) = cfg.camera_hw, cfg.stitched_hw, cfg.latent_hw
    return f"3 cameras {ch}x{cw} stitched to {h}x{w}, {lh}x{lw} latents"


def _provenance(vae_encoder: str, feat_map_mib: float) -> tuple[str, str]:
    """(real model code, stand-ins) of the DreamZero runs, as the plot and the summary state them."""
    stand_ins = "the DreamZero generator, text encoder and quant_conv, the camera frames, the paged KV engine"
    if vae_encoder == "wan":
        real = (
            "the VAE encoder: diffusers' AutoencoderKLWan encoder (WanEncoder3d, Wan 2.1's causal conv layout, "
            f"base_dim {runner.load_harness().WAN_BASE_DIM}, random init, seeded), its feat cache the model's own"
        )
        return real, stand_ins
    return (
        "none",
        f"the VAE encoder (elementwise, a {feat_map_mib:g} MiB feat map sized by --feat-map-mib), {stand_ins}",
    )


def _run_concurrent(args: argparse.Namespace, console: Any) -> tuple[Any, float, int]:
    import torch

    from functional_state import SessionStateManager
    from torch_bridge.adapters import DreamZeroStateAdapter, request_session
    from torch_bridge.harness import Cosmos3Shapes, Cosmos3TransformerCache, build_freqs_gen, encode_und_kv

    dz = runner.load_harness()
    manager = SessionStateManager()
    cfg = runner.rollout_config(
        runner.rollout_fields(args, steps=args.steps, sessions=args.sessions, prompt_every=10**9)
    )
    nets = dz.Networks(cfg)
    shapes = Cosmos3Shapes(
        num_layers=28, num_heads=16, head_dim=128, text_len=300, padded_text_len=512, media_tokens=4096
    )
    errors: list[BaseException] = []
    cosmos_peak: list[int] = []
    lock = threading.Lock()

    with runner.progress_bar(console) as progress:
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
    """One table: a row per component (its bucket, whether it grows) and the MiB each DreamZero session
    holds; sessions holding the same bytes share a column."""
    from functional_state import sessions
    from torch_bridge.adapters.dreamzero import dreamzero_component_nbytes

    columns: dict[tuple[int, ...], list[str]] = {}
    for sid, session in sorted(sessions(manager.state).items()):
        if sid.startswith("dreamzero-"):
            parts = dreamzero_component_nbytes(session)
            held = sum(session.nbytes_by_device().values())
            columns.setdefault((*(parts[name] for name in _DREAMZERO_COMPONENTS), held), []).append(sid)
    rich_table = importlib.import_module("rich.table")
    table = rich_table.Table(title="MiB per DreamZero session (in all: each allocation once)", title_justify="left")
    table.add_column("component")
    table.add_column("bucket")
    table.add_column("size")
    for sids in columns.values():
        label = ", ".join(sids) if len(sids) <= 2 else f"{sids[0]} .. {sids[-1]}"
        table.add_column(label + (" (each)" if len(sids) > 1 else ""), justify="right")
    for i, (name, (bucket, kind)) in enumerate(_DREAMZERO_COMPONENTS.items()):
        table.add_row(name, bucket, kind, *(f"{key[i] / runner.MIB:.3f}" for key in columns))
    table.add_row("in all", "", "", *(f"{key[-1] / runner.MIB:.3f}" for key in columns), style="bold")
    console.print(table)


def _pools_table(manager: Any, console: Any) -> None:
    """The manager's `stats()` as a table of pools, then its counters in one line."""
    from functional_state import format_bytes

    s = manager.stats()
    rich_table = importlib.import_module("rich.table")
    table = rich_table.Table(title="Pools: manager.stats()", title_justify="left")
    table.add_column("pool")
    table.add_column("held", justify="right")
    for key, value in s.items():
        if key.startswith("nbytes:"):
            table.add_row(key.removeprefix("nbytes:"), format_bytes(value))
        elif key.startswith("kv_pool:"):
            table.add_row(f"engine KV pool {key.removeprefix('kv_pool:')}", format_bytes(value))
    table.add_row("parked host copies", format_bytes(s["parked_nbytes"]))
    table.add_row("in all", format_bytes(s["total_nbytes"]), style="bold")
    console.print(table)
    console.print(
        f"   LRU: sessions {s['sessions']}/{s['max_sessions']}, hits {s['hits']}, misses {s['misses']}, "
        f"evictions {s['evictions']}; parks {s['parks']}, restores {s['restores']}"
    )


def _park_bandwidth(manager: Any, rounds: int = 5) -> dict[str, float]:
    """Park and restore each DreamZero session's feat cache ``rounds`` times, interleaved with a copy of the
    same tensors (a memcpy); medians, in bytes per second, and the bytes of one feat cache."""
    import torch

    from functional_state import sessions

    sids = sorted(sid for sid in sessions(manager.state) if sid.startswith("dreamzero-"))
    park, restore, copy, sizes = [], [], [], []
    for _ in range(rounds):
        for sid in sids:
            tensors = [t for t in sessions(manager.state)[sid].get(FEAT_MAP).value if isinstance(t, torch.Tensor)]
            nbytes = sum(t.untyped_storage().nbytes() for t in tensors)
            t0 = time.perf_counter()
            _ = [t.clone() for t in tensors]
            t1 = time.perf_counter()
            manager.park(sid, FEAT_MAP)
            t2 = time.perf_counter()
            manager.restore(sid, FEAT_MAP)
            t3 = time.perf_counter()
            copy.append(nbytes / (t1 - t0))
            park.append(nbytes / (t2 - t1))
            restore.append(nbytes / (t3 - t2))
            sizes.append(nbytes)
    return {
        "park": statistics.median(park),
        "restore": statistics.median(restore),
        "memcpy": statistics.median(copy),
        "nbytes": statistics.median(sizes),
    }


def _plot(args: argparse.Namespace, console: Any) -> tuple[Path, dict[str, Any]]:
    """Bytes per step of one session, bespoke vs manager-backed, as a PNG; returns its path and each path's
    last trace entry."""
    matplotlib = runner.require_extra("matplotlib", "cli", "demo")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from functional_state.shell.config import enable_override

    cfg = runner.rollout_config(
        runner.rollout_fields(args, steps=args.plot_steps, sessions=1, prompt_every=10**9, trace_bytes=True)
    )
    traces = {}
    with runner.progress_bar(console) as progress:
        for enabled, label in ((False, "bespoke"), (True, "manager-backed")):
            task = progress.add_task(f"rollout, {label}", total=cfg.steps)

            def advance(_: int, task: Any = task) -> None:
                progress.advance(task)

            with enable_override(enabled):
                traces[label] = runner.load_harness().run_rollout(cfg, progress=advance).bytes_trace
    final = {label: trace[-1] for label, trace in traces.items()}
    feat_mib = final["manager-backed"]["vae_enc_feat_map"] / runner.MIB
    fig, (ax_enc, ax_total) = plt.subplots(1, 2, figsize=(12, 4.6))
    for label, trace in traces.items():
        steps = range(1, len(trace) + 1)
        ax_enc.plot(steps, [t["vae_encoder_out"] / runner.MIB for t in trace], label=label)
        ax_total.plot(steps, [t["total"] / runner.MIB for t in trace], label=label)
    ax_enc.set(title="VAE encoder output held", xlabel="step", ylabel="MiB")
    ax_total.set(title=f"whole session, deduplicated (feat cache {feat_mib:.1f} MiB)", xlabel="step", ylabel="MiB")
    for ax in (ax_enc, ax_total):
        ax.legend()
        ax.grid(alpha=0.3)
    real, stand_ins = _provenance(args.vae_encoder, args.feat_map_mib)
    dh, dw = DEPLOY_CAMERA_HW
    fig.suptitle(
        f"DreamZero session bytes per step, as run: {_shapes(cfg)}, {cfg.steps} steps\n"
        f"(deploy shapes: 3 cameras {dh}x{dw} stitched to 352x640, a 603 MiB feat map)",
        fontsize=10,
    )
    fig.text(0.01, 0.01, f"real model code: {real}\nstand-ins (this repository): {stand_ins}", fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "dreamzero_bytes_per_step.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, final


def _budget_demo(args: argparse.Namespace, console: Any) -> dict[str, Any]:
    """Six sessions under a byte budget for two: parking keeps every session and every output; the
    drop-only budget loses sessions, loudly. Returns the measured figures of the parked run."""
    import dataclasses

    from functional_state import format_bytes
    from functional_state.shell.config import enable_override

    steps = args.budget_steps
    # With the stand-in, the feat map must dominate a session as at deploy shapes (603 of 627 MiB); a smaller
    # one would leave mostly the stitched frames, which the pending body frames keep alive, so parking could
    # free little. The real encoder's feat cache dominates at any shape.
    feat_map_mib = max(args.feat_map_mib, 16.0)
    cfg = runner.rollout_config(
        runner.rollout_fields(
            args,
            steps=steps,
            sessions=6,
            feat_map_bytes=int(feat_map_mib * runner.MIB),
            prompt_every=10**9,
            trace_pools=True,
        )
    )
    results = {}
    with runner.progress_bar(console) as progress, enable_override(True):

        def run(label: str, run_cfg: Any) -> None:
            task = progress.add_task(label, total=steps)
            results[label] = runner.load_harness().run_rollout(run_cfg, progress=lambda _: progress.advance(task))

        run("count cap only", cfg)
        budget = 2 * max(results["count cap only"].totals.values())  # what two whole sessions hold, measured
        run("budget, park first", dataclasses.replace(cfg, byte_budget={"cpu": budget}))
        run("budget, drop only", dataclasses.replace(cfg, byte_budget={"cpu": budget}, release_levers=("drop",)))
    rich_table = importlib.import_module("rich.table")
    table = rich_table.Table("run", "peak device pool", "parks", "restores", "sessions lost", "outputs")
    reference = results["count cap only"].digest
    peaks = {}
    for label, r in results.items():
        peaks[label] = max(p.get("nbytes:cpu", 0) for p in r.pool_trace)
        same = "identical" if r.digest == reference else "differ (sessions lost)"
        counts = r.pool_trace[-1]  # stats() after the last round (the rollout ran on the manager path)
        table.add_row(
            label, format_bytes(peaks[label]), str(counts["parks"]), str(counts["restores"]), str(len(r.lost)), same
        )
    console.print(table)
    console.print(
        f"   budget {format_bytes(budget)}: what two sessions hold; lost sessions raised instead of restarting"
    )
    parked = results["budget, park first"]
    return {
        "budget": budget,
        "peak": peaks["budget, park first"],
        "unbudgeted_peak": peaks["count cap only"],
        "parks": parked.pool_trace[-1]["parks"],
        "restores": parked.pool_trace[-1]["restores"],
        "lost": len(parked.lost),
        "identical": parked.digest == reference,
        "drop_lost": len(results["budget, drop only"].lost),
    }


def _recap(console: Any, rows: list[tuple[str, str]], ok: bool, seconds: float) -> None:
    """What was measured, a line each (not wrapped: a terminal wraps them, a log keeps them whole)."""
    console.rule("Recap: every figure measured in this run")
    for what, figure in rows:
        console.print(f"  [bold]{what}[/bold]: {figure}", soft_wrap=True)
    console.print(f"\n{'OK' if ok else 'FAILED'}: demo finished in {seconds:.0f}s")


def run_demo(args: argparse.Namespace) -> int:
    """The tour (``functional-state demo``); 0 when every check held, 1 otherwise."""
    import torch

    from functional_state import format_bytes

    runner.pin_threads()
    t_start = time.perf_counter()
    recap: list[tuple[str, str]] = []
    with runner.open_console("demo") as console:
        cfg = runner.rollout_config(runner.rollout_fields(args, steps=args.steps, sessions=args.sessions))
        encoder = "real Wan VAE encoder (diffusers)" if args.vae_encoder == "wan" else "stand-in VAE encoder"
        console.rule("functional-state demo: immutable per-session state behind DreamZero and Cosmos3 adapters")
        console.print(
            f"   DreamZero runs stream through the {encoder}; {_shapes(cfg)} "
            f"(deploy: {DEPLOY_CAMERA_HW[0]}x{DEPLOY_CAMERA_HW[1]} cameras; --camera-hw sets them); "
            f"torch threads: {torch.get_num_threads()}"
        )
        console.print(
            f"\n1. {args.sessions} DreamZero sessions x {args.steps} steps and {args.requests} Cosmos3 requests "
            "(deploy shapes), concurrently, through one SessionStateManager"
        )
        manager, seconds, cosmos_peak = _run_concurrent(args, console)
        console.print(
            f"   done in {seconds:.1f}s; Cosmos3 requests retained up to {cosmos_peak / runner.MIB:.0f} MiB while live "
            f"(both CFG branches), and their sessions were dropped when each request ended"
        )
        console.print("\n2. Memory per DreamZero session (manager-backed)")
        _memory_table(manager, console)
        _pools_table(manager, console)
        bw = _park_bandwidth(manager)
        console.print(
            f"   park / restore of a {format_bytes(int(bw['nbytes']))} feat cache (median of 5 per session): park "
            f"{bw['park'] / 2**30:.2f} GiB/s, restore {bw['restore'] / 2**30:.2f} GiB/s; a copy of the same "
            f"tensors {bw['memcpy'] / 2**30:.2f} GiB/s"
        )
        recap.append(
            (
                "park bandwidth",
                f"park {bw['park'] / 2**30:.2f} GiB/s, restore {bw['restore'] / 2**30:.2f} GiB/s of a "
                f"{format_bytes(int(bw['nbytes']))} feat cache ({bw['park'] / bw['memcpy']:.2f}x and "
                f"{bw['restore'] / bw['memcpy']:.2f}x of a copy of the same tensors, "
                f"{bw['memcpy'] / 2**30:.2f} GiB/s)",
            )
        )

        console.print("\n3. A/B equivalence: the same rollout in fresh processes, only the flag flipped")
        matches = runner.run_ab(console, runner.ab_runs(args))
        ok = all(matches)
        console.print(f"   {'every digest matched' if ok else 'DIGESTS DIFFER'}")
        recap.insert(
            0,
            (
                "A/B, bespoke vs manager-backed",
                f"{'bit-identical' if ok else 'NOT bit-identical'}: {sum(matches)}/{len(matches)} runs with equal "
                "digests of every per-step output",
            ),
        )

        if not args.no_plot:
            console.print(f"\n4. Bytes per step, bespoke vs manager-backed ({args.plot_steps} steps, one session)")
            path, final = _plot(args, console)
            b, m = final["bespoke"]["vae_encoder_out"], final["manager-backed"]["vae_encoder_out"]
            per_frame = b / (1 + (args.plot_steps - 1) // 4)  # the first frame alone, then a latent per 4
            console.print(
                f"   VAE encoder output after {args.plot_steps} steps: bespoke {format_bytes(b)} (growing, "
                f"{format_bytes(int(per_frame))} per latent frame), ring {format_bytes(m)} (constant)"
            )
            console.print(f"   wrote {path.resolve()}", soft_wrap=True)
            bt, mt = final["bespoke"]["total"], final["manager-backed"]["total"]
            recap.append(
                (
                    f"bounded ring vs bespoke growth ({args.plot_steps} steps)",
                    f"encoder output held: bespoke {format_bytes(b)}, ring {format_bytes(m)}: "
                    f"{format_bytes(b - m)} saved; whole session: bespoke {format_bytes(bt)}, "
                    f"manager-backed {format_bytes(mt)}",
                )
            )
        console.print(f"\n5. Six DreamZero sessions under a byte budget for two ({args.budget_steps} steps each)")
        budget = _budget_demo(args, console)
        budget_ok = budget["identical"] and not budget["lost"]
        console.print(f"   {'parking kept every session, bit-identical' if budget_ok else 'PARKED RUN DIFFERS'}")
        held = "held" if budget["peak"] <= budget["budget"] else "EXCEEDED"
        recap.append(
            (
                "byte budget (6 sessions, budget for 2)",
                f"{held}: peak {format_bytes(budget['peak'])} <= limit {format_bytes(budget['budget'])} "
                f"(unbudgeted {format_bytes(budget['unbudgeted_peak'])}); {budget['parks']} parks, "
                f"{budget['restores']} restores, {budget['lost']} sessions lost, outputs "
                f"{'identical' if budget['identical'] else 'DIFFER'}; drop-only lost {budget['drop_lost']}",
            )
        )
        text_ok = demo_text_model.text_model_section(console, recap)
        ok = ok and budget_ok and held == "held" and text_ok
        real, stand_ins = _provenance(args.vae_encoder, args.feat_map_mib)
        recap += [("real model code", real), ("stand-ins (this repository)", f"{stand_ins}; Cosmos3's K/V in 1")]
        console.print()
        _recap(console, recap, ok, time.perf_counter() - t_start)
    return 0 if ok else 1
