"""Command line entry point: ``python -m functional_state {demo,ab,bench}``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    import functional_state as fs

    state = fs.ManagerState.create(max_sessions=2)
    for sid in ("a", "b", "c"):
        state, _ = fs.get_or_create(state, sid)
        state = fs.put(state, sid, "ring", fs.ArrayRing.create(4, (8,), jnp.float32))
        for step in range(6):
            state = fs.commit(state, sid, "ring", jnp.full((8,), step, jnp.float32))
    forked = fs.fork_session(state, "c", "c-draft")
    print("sessions:", state.session_ids, "-> after fork:", forked.session_ids)
    print("latest(2) of c:", fs.view(state, "c", "ring")[-2:, 0].tolist())
    print("stats:", fs.stats(forked))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="functional-state", description="functional-state: immutable per-session state for world models."
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo}")
    demo = sub.add_parser("demo", help="run a short tour of the pure API")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        args = parser.parse_args(["demo", *(argv or [])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
