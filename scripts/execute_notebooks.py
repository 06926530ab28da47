"""Execute the notebooks in place and normalise what changes between runs, so they are committed with outputs.

`make notebooks` runs it. Each notebook runs top to bottom in a fresh ``python3`` kernel (jupyter_client
starts the kernelspec's ``python`` as this interpreter: run it with the venv's python), with the repository
root first on ``PYTHONPATH`` (the kernel and the workers it starts import this checkout). Then every output
is normalised: execution counts become 1, 2, ... in cell order; absolute paths become ``<repo>``,
``<venv>``, ``<cell>``, ``<tmp>``; memory addresses ``0x...``; timings and RSS readings ``<t>``, ``<rss>``;
the kernel's per-cell timing metadata is dropped. Re-running on unchanged code writes identical files;
``tests/test_notebooks.py`` checks the committed files for outputs and for any volatile string left.

Usage: ``python scripts/execute_notebooks.py [NOTEBOOK ...]`` (default: every ``notebooks/*.ipynb``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
TIMEOUT_S = 900  # per cell: notebook 04 starts worker processes that serve 400 steps

# Kept in one place so tests/test_notebooks.py checks exactly what this script promises to remove.
ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")
# A duration printed by a notebook or a library ("12.3 ms", "4 µs", "1.25s", "+0.12 MiB" RSS deltas).
TIMING = re.compile(r"(?<![\w.])[+-]?\d+(?:\.\d+)?\s?(?:ns|µs|us|ms|s|sec|seconds)\b")
RSS = re.compile(r"(RSS delta: )[+-]?\d+(?:\.\d+)?( MiB)")
_TMPDIRS = r"(?:/private)?(?:/tmp|/var/folders|" + re.escape(tempfile.gettempdir()) + r")"
# A warning raised in a cell names the kernel's file for it (/tmp/ipykernel_<pid>/<hash>.py).
CELL_FILE = re.compile(_TMPDIRS + r"/ipykernel_\d+/\d+\.py")
TMP = re.compile(_TMPDIRS + r"/[^\s'\",:)\]}]*")


def _path_rules() -> list[tuple[str, str]]:
    """Absolute prefixes to replace, longest first (the venv may live inside the repository)."""
    prefixes = {
        str(Path(sys.prefix).resolve()): "<venv>",
        sys.prefix: "<venv>",
        str(REPO): "<repo>",
        str(Path.home()): "~",
    }
    return sorted(prefixes.items(), key=lambda kv: -len(kv[0]))


def normalise_text(text: str, paths: list[tuple[str, str]] | None = None) -> str:
    """Replace the parts of one output text that differ between runs or machines."""
    for prefix, name in paths if paths is not None else _path_rules():
        text = text.replace(prefix, name)
    text = CELL_FILE.sub("<cell>", text)
    text = TMP.sub("<tmp>", text)
    text = ADDRESS.sub("0x...", text)
    text = RSS.sub(r"\g<1><rss>\g<2>", text)
    return TIMING.sub("<t>", text)


def _map_output_texts(output: dict, fn: Callable[[str], str]) -> None:
    if "text" in output:
        output["text"] = fn("".join(output["text"]))
    for mime, value in output.get("data", {}).items():
        # Text-like payloads only: images are base64 and their bytes are deterministic for the same data.
        if mime.startswith("text/") and isinstance(value, list | str):
            output["data"][mime] = fn("".join(value))
    if "traceback" in output:
        output["traceback"] = [fn(line) for line in output["traceback"]]


# A line Ray's own processes print into the notebook's streams (raylet, a worker): whether it arrives before a
# cell ends depends on timing (at `ray.shutdown`, the controller's retries), so it is no output of the cell.
RAY_PROCESS_LINE = re.compile(
    r"^(?:\x1b\[\d+m)?\((?:raylet|pid=[^)]*|[A-Za-z_][\w.]* pid=[^)]*)\)(?:\x1b\[0m)?.*\n?", re.M
)


def _without_ray_process_lines(outputs: list) -> list:
    kept = []
    for output in outputs:
        if output.get("output_type") == "stream":
            output["text"] = RAY_PROCESS_LINE.sub("", "".join(output["text"]))
            if not output["text"]:
                continue
        kept.append(output)
    return kept


def normalise(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Normalise an executed notebook in place (and return it): counts, paths, addresses, timings, metadata."""
    paths = _path_rules()
    count = 0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        cell.outputs = _without_ray_process_lines(cell.outputs)
        for output in cell.outputs:
            if "execution_count" in output:
                output["execution_count"] = count
            output.get("metadata", {}).pop("execution", None)
            _map_output_texts(output, lambda s: normalise_text(s, paths))
    nb.metadata.pop("widgets", None)
    nb.metadata.get("language_info", {}).pop("version", None)  # the patch release of the interpreter
    return nb


def execute(path: Path) -> float:
    """Run one notebook in place; returns its wall time in seconds. Raises on the first failing cell."""
    nb = nbformat.read(path, as_version=4)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(REPO) + (os.pathsep + env_path if env_path else "")
    t0 = time.perf_counter()
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=TIMEOUT_S,
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    elapsed = time.perf_counter() - t0
    os.environ["PYTHONPATH"] = env_path
    nbformat.write(normalise(nb), path)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    total = 0.0
    for path in paths:
        print(f"executing {path.name} ...", flush=True)
        elapsed = execute(path.resolve())
        total += elapsed
        print(f"  done in {elapsed:.1f} s", flush=True)
    print(f"{len(paths)} notebooks in {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
