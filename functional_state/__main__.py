"""``python -m functional_state`` and the ``functional-state`` command: the parser, and the dispatch.

``inspect`` runs here (`functional_state.checkpoint_summary`: no torch). The other commands drive the torch
adapters, so they live in `torch_bridge.cli`; the parser lives here and imports neither torch nor the command
line's extras, so ``--help`` and ``--version`` work on a core-only install, and
a command whose extra is missing says in one line what to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from ._version import __version__

PROG = "functional-state"
COMMANDS = ("demo", "ab", "bench", "inspect")
_BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"  # present in a source checkout only


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (and exit status 2) instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults in --help and keep descriptions as written."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _camera_hw(text: str) -> tuple[int, int]:
    """``HxW`` of one camera: three are stitched two over one and the VAE encodes them at 1/8 scale, so the
    height must be at least 8 and the width a multiple of 4."""
    try:
        h, w = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW (e.g. 48x80), got {text!r}") from None
    if h < 8 or w <= 0 or w % 4:
        raise argparse.ArgumentTypeError(f"expected HxW with H >= 8 and W a multiple of 4, got {text!r}")
    return h, w


def benchmark_names() -> list[str]:
    """The benchmarks of a source checkout (``benchmarks/bench_<name>.py``); none in an installed package."""
    if not _BENCH_DIR.is_dir():
        return []
    return sorted(p.stem.removeprefix("bench_") for p in _BENCH_DIR.glob("bench_*.py"))


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``functional-state`` parser and its subcommands' own parsers, by command name."""
    parser = _Parser(
        prog=PROG,
        description="functional-state: immutable per-session state for world models. Inspect or verify a "
        "checkpoint; run the demo, the A/B equivalence check, or the benchmarks.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,ab,bench,inspect,serve-demo}", parser_class=_Parser)

    def add_common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--camera-hw",
            type=_camera_hw,
            default=(48, 80),
            metavar="HxW",
            help="DreamZero camera size (three, stitched two over one; deploy: 180x320, minutes per run on CPU)",
        )
        p.add_argument(
            "--vae-encoder",
            choices=("wan", "stand-in"),
            default="wan",
            help="DreamZero's VAE encoder: diffusers' real Wan encoder, or the elementwise stand-in",
        )
        p.add_argument(
            "--feat-map-mib",
            type=_non_negative_float,
            default=24.0,
            help="the stand-in encoder's feat map in MiB (deploy: 603); the Wan encoder's is its own",
        )
        p.add_argument("--ab-steps", type=_positive_int, default=400, help="steps of the small-shape A/B run")
        p.add_argument(
            "--ab-demo-steps",
            "--ab-deploy-steps",
            dest="ab_demo_steps",
            type=_positive_int,
            default=48,
            help="steps of the A/B run at --camera-hw",
        )

    demo = sub.add_parser(
        "demo",
        help="run the tour",
        formatter_class=_Formatter,
        description="Concurrent DreamZero sessions (through diffusers' real Wan VAE encoder) and Cosmos3 requests "
        "through one manager, the per-session memory and pools, park bandwidth, the A/B check in fresh processes, "
        "a bytes-per-step plot, six sessions under a byte budget for two, and a recap of what was measured. "
        "Exits 1 if any digest differs or the budget is not held.",
    )
    add_common(demo)
    demo.add_argument("--sessions", type=_positive_int, default=3, help="concurrent DreamZero sessions")
    demo.add_argument("--steps", type=_positive_int, default=60, help="steps per DreamZero session")
    demo.add_argument("--requests", type=_positive_int, default=4, help="concurrent Cosmos3 requests")
    demo.add_argument("--plot-steps", type=_positive_int, default=240, help="steps of the bytes-per-step plot")
    demo.add_argument("--budget-steps", type=_positive_int, default=12, help="steps of the byte-budget run")
    demo.add_argument("--out-dir", default="out", help="where the PNG goes")
    demo.add_argument("--no-plot", action="store_true", help="skip the plot")

    ab = sub.add_parser(
        "ab",
        help="A/B: flag off vs on in fresh processes; exit 1 if any digest differs",
        formatter_class=_Formatter,
        description="Run the deterministic DreamZero rollout twice per configuration, each time in a fresh "
        "process, with only OMNI_DIFFUSION_SESSION_STATE_MANAGER flipped (0: the bespoke state, 1: the manager-"
        "backed adapter), and compare the digests of every per-step output. Exits 1 if any digest differs.",
    )
    add_common(ab)

    names = benchmark_names()
    bench = sub.add_parser(
        "bench",
        help="run benchmarks/; --write also rewrites BENCHMARKS.md",
        formatter_class=_Formatter,
        description="Run the benchmarks side by side and print their tables (from a source checkout); "
        "BENCHMARKS.md is rewritten only with --write. "
        f"Benchmarks: {', '.join(names) if names else '(none here: they ship with the repository, not the package)'}.",
    )
    # Names are checked in `parse`: argparse's `choices` on an empty nargs="*" positional checks the default
    # too, and fails when another option is unknown.
    bench.add_argument("names", nargs="*", metavar="NAME", default=[], help="benchmarks to run; all when none is named")
    bench.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md with the results")
    inspect = sub.add_parser(
        "inspect",
        help="print a checkpoint's sessions, objects, bytes per pool and metadata; --verify checks checksums",
        formatter_class=_Formatter,
        description="Read the checkpoint at PATH (a directory `save` or `save_session` wrote) from its manifest, "
        "without loading it into a manager, and print its sessions, their objects and bytes, the bytes per pool "
        "a load places them in, and its metadata. With --verify, read every array and check its checksum too. "
        "Exits 1 if the checkpoint cannot be read or a checksum fails. Needs the [checkpoint] extra, not torch.",
    )
    inspect.add_argument("path", metavar="PATH", help="the checkpoint directory")
    inspect.add_argument("--verify", action="store_true", help="read every array and check its checksum")
    serve = sub.add_parser(
        "serve-demo",
        help="sessions across 3 Ray Serve replicas: one killed mid-rollout, a drain, a rebalance (the [ray] extra)",
        formatter_class=_Formatter,
        description="Start a local Ray and Serve, serve sessions on a deployment of 3 SessionServer replicas behind "
        "SessionAffinityRouter, kill the busiest mid-rollout (its sessions resume elsewhere from their checkpoints "
        "with a replay), drain one replica and rebalance, and print where each session went and whether every "
        "rollout matches an uninterrupted one. Exits 1 if any differs.",
    )
    serve.add_argument("--sessions", type=_positive_int, default=12, help="sessions")
    serve.add_argument("--steps", type=_positive_int, default=8, help="steps per session")
    return parser, {"demo": demo, "ab": ab, "bench": bench, "inspect": inspect, "serve-demo": serve}


def _inspect(args: argparse.Namespace) -> int:
    """``functional-state inspect PATH [--verify]``: print the summary; 1 if unreadable or a checksum fails."""
    from . import checkpoint_summary
    from .errors import CheckpointError

    try:
        print(checkpoint_summary.render(checkpoint_summary.summarize(args.path)))
        if args.verify:
            checked = checkpoint_summary.verify(args.path)
            print(f"verified: every checksum of the {checked} leaves matches")
    except (CheckpointError, ImportError) as e:
        print(f"{PROG} inspect: error: {e}", file=sys.stderr)
        return 1
    return 0


def parse(argv: Sequence[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse ``argv``; a bad option exits 2 with one line naming the (sub)command it belongs to."""
    parser, commands = build_parser()
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if extra:
        # argparse hands a subcommand's unknown options up to the top parser, whose error would blame
        # `functional-state`; the subcommand's own parser names the command the option was given to.
        (commands[args.command] if args.command else parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "bench":
        known = benchmark_names()
        if not known:
            commands["bench"].error(
                "the benchmarks ship with the repository, not with the installed package: "
                "clone it and run `functional-state bench` (or `make bench`) from the checkout"
            )
        for name in args.names:
            if name not in known:
                choices = ", ".join(map(repr, known))
                commands["bench"].error(f"argument NAME: invalid choice: {name!r} (choose from {choices})")
    return parser, args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``functional-state`` console script."""
    parser, args = parse(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "serve-demo":  # (no torch: the Ray side needs only the core)
        from .serving.demo import main as serve_demo

        return serve_demo(sessions=args.sessions, steps=args.steps)
    if importlib.util.find_spec("torch") is None:
        print(
            f"{PROG} {args.command}: the command line drives the torch adapters and needs PyTorch: "
            "pip install 'functional-state[torch,cli]'",
            file=sys.stderr,
        )
        return 2
    from torch_bridge.cli import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
