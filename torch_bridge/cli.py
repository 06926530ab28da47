"""The command line: ``functional-state {demo,ab,bench}`` (also ``python -m functional_state``).

``demo`` is the tour (`torch_bridge.demo`: DreamZero sessions through diffusers' real Wan VAE encoder, Cosmos3
requests, the memory picture, park bandwidth, the A/B check, a plot, a byte budget, and a recap of what it
measured); ``ab`` the A/B check alone: the same rollout in two fresh processes, only the manager flag flipped.
What the commands share (the console, the A/B runner, the harness's configs) lives in `torch_bridge.runner`.

The parser lives in `functional_state.__main__` (no torch, no extras), which calls `run` here once a command
is parsed; ``--help`` and ``--version`` never import this module.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from .runner import ROOT, MissingExtraError, ab_runs, open_console, pin_threads, run_ab


def _cmd_ab(args: argparse.Namespace) -> int:
    pin_threads()
    with open_console("ab") as console:
        console.print("A/B: the same rollout in fresh processes with only OMNI_DIFFUSION_SESSION_STATE_MANAGER flipped")
        ok = all(run_ab(console, ab_runs(args)))
        console.print("every digest matched" if ok else "DIGESTS DIFFER: the manager-backed path is not bit-identical")
    return 0 if ok else 1


# --- demo (torch_bridge.demo) ------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


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
