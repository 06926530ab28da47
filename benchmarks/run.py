"""Run the benchmarks side by side; with ``--write``, rewrite BENCHMARKS.md. ``python benchmarks/run.py [--write] [name ...]``."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The checkout this script lives in comes first, so a worktree benchmarks its own code and not the checkout
# an editable install's .pth points at.
sys.path[:0] = [str(HERE.parent), str(HERE)]

BENCHES = [
    "encoder_window",
    "dreamzero_memory",
    "manager",
    "gc",
    "shell",
    "bridge",
    "accounting",
    "ring",
    "fork",
    "park",
    "budget",
    "paged_kv",
    "checkpoint",
    "wan",
    "nnx",
    "batched",
    "transformers",
    "scaling",
    "transfer",
]


def _available() -> list[str]:
    return [b for b in BENCHES if (HERE / f"bench_{b}.py").exists()]


def _machine() -> str:
    import jax
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = cpu
    return (
        f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
        f"jax {jax.__version__}"
    )


_GOAL = re.compile(r"goal (<=|>=) ([0-9.]+)")


def verdict(label: str, value: float) -> str:
    """`` met`` or `` MISSED`` for a headline whose label states its goal (``goal <= 1.5``), else nothing."""
    m = _GOAL.search(label)
    if m is None:
        return ""
    bound = float(m.group(2))
    met = value <= bound if m.group(1) == "<=" else value >= bound
    return " (met)" if met else " (**MISSED**)"


def _section(name: str, result: dict) -> str:
    lines = [
        _MARKER.format(name),
        f"## {result['title']}",
        "",
        f"Reproduce: `make bench BENCH={name}` (or `python benchmarks/run.py {name}`).",
        "",
    ]
    lines += [_table(result["header"], result["rows"]), ""]
    bare = untailed(result["header"], result["rows"])
    if bare:
        lines += [f"*Median only, no p99 / p99.9 measured, in: {', '.join(bare)}.*", ""]
    for label, value in [result["ratio"], *result.get("extra_ratios", [])]:
        lines.append(f"**{label}: {value:.3g}**{verdict(label, value)}  ")
    lines.append("")
    lines.append(result["notes"])
    lines.append("")
    return "\n".join(lines)


_BARE_TIME = re.compile(r"^[0-9][0-9.,]* (ns|µs|ms|s)$")


def untailed(header: list[str], rows: list[list]) -> list[str]:
    """The columns that show a time with no p99 and p99.9 beside it (a bare ``1.20 µs``, where `_timing.fmt_cell`
    writes ``1.20 µs (p99 ..., p99.9 ...)``): the report names them, so a median alone never passes for a cell."""
    return [
        h for i, h in enumerate(header) if any(_BARE_TIME.match(str(row[i]).strip()) for row in rows if i < len(row))
    ]


def _table(header: list[str], rows: list[list]) -> str:
    """A Markdown table whose columns line up in the raw text too (what `functional-state bench` prints), the
    figures right-aligned; cells are kept exactly as the benchmark formatted them."""
    from tabulate import tabulate  # the [cli] extra, which `functional-state bench` needs anyway

    def cell(c: object) -> str:
        return str(c).replace("|", "\\|")

    return tabulate(
        [[cell(c) for c in row] for row in rows],
        headers=[cell(h) for h in header],
        tablefmt="pipe",
        disable_numparse=True,
        colalign=("left",) + ("right",) * (len(header) - 1),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run functional-state benchmarks; with --write, write BENCHMARKS.md.")
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {_available()})")
    parser.add_argument("--output", default=str(HERE.parent / "BENCHMARKS.md"), help="where --write writes the report")
    # BENCHMARKS.md is tracked: a run only prints unless asked to replace it (`make bench` asks).
    parser.add_argument("--write", action="store_true", help="write the report to --output (else print only)")
    args = parser.parse_args(argv)
    names = args.names or _available()
    unknown = [n for n in names if n not in _available()]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {_available()}")
    sections = _existing_sections(Path(args.output)) if args.names else {}
    for name in names:
        print(f"[bench] {name} ...", flush=True)
        result = _run_isolated(name)
        text = _section(name, result)
        print(text, flush=True)
        sections[name] = text
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    ordered = [sections[n] for n in _available() if n in sections]
    text = (
        "# Benchmarks\n\n"
        f"Written by `make bench` on {now}{' (sections: ' + ', '.join(names) + ')' if args.names else ''}.\n\n"
        f"Machine: {_machine()}.\n\n"
        "Every figure is a median of repeated runs, timed with the garbage collector on, as in a server, with "
        "its p99 and p99.9 beside it where the section measured them (a section that did not says so under its "
        "table), and every ratio compares two things measured side by side in the same run (interleaved, the "
        "order rotated round by round), because this machine is shared and noisy. Absolute times are for orientation only; the ratios are the claims. "
        "Each section names the command that reproduces it.\n\n" + "\n".join(ordered) + _notes(Path(args.output))
    )
    if not args.write:
        print(f"[bench] {args.output} left as it was (pass --write to replace it)")
        return 0
    Path(args.output).write_text(text)
    print(f"[bench] wrote {args.output}")
    return 0


def _run_isolated(name: str) -> dict:
    """Run one benchmark in a fresh process, so that none inherits another's heap, page cache pressure or
    threads (a checkpoint load measured after the fork benchmark's 600 MiB sessions reads another machine)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", name, out.name], check=True)
        return json.loads(Path(out.name).read_text())


def _run_one(name: str, out: str) -> int:
    result = importlib.import_module(f"bench_{name}").run()
    Path(out).write_text(json.dumps(result, default=float))
    return 0


_MARKER = "<!-- bench: {} -->"
_NOTES = "<!-- notes -->"  # hand-written notes that end the report: kept by every run, written by none


def _notes(path: Path) -> str:
    """The notes that end an earlier report (from ``_NOTES`` on), or ``""``."""
    text = path.read_text() if path.exists() else ""
    return "\n" + text[text.index(_NOTES) :].rstrip() + "\n" if _NOTES in text else ""


def _existing_sections(path: Path) -> dict[str, str]:
    """The sections of an earlier report, by benchmark name, so a partial run replaces only its own."""
    if not path.exists():
        return {}
    out: dict[str, str] = {}
    for chunk in path.read_text().split("<!-- bench: ")[1:]:
        name, _, _ = chunk.partition(" -->")
        out[name] = "<!-- bench: " + chunk.partition(_NOTES)[0].rstrip() + "\n"
    return out


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        sys.exit(_run_one(sys.argv[2], sys.argv[3]))
    sys.exit(main())
