"""The committed notebooks carry their outputs, readable in a plain viewer, with nothing that changes per run.

A check on the files as committed (`make notebooks` writes them; `make test` re-executes them with nbmake):
nothing here runs a kernel.
"""

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))

_spec = importlib.util.spec_from_file_location("execute_notebooks", REPO / "scripts" / "execute_notebooks.py")
assert _spec is not None and _spec.loader is not None
execute_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute_notebooks)

# What a run on another machine, or a second run here, would print differently.
VOLATILE = {
    "a temporary path": re.compile(r"/tmp/|/var/folders/|ipykernel_\d+"),
    "an absolute path of this machine": re.compile(
        "|".join(re.escape(p) for p in {str(REPO), str(Path.home()), "/work/", "/home/", "/Users/"})
    ),
    "a memory address": execute_notebooks.ADDRESS,
    "a timing": execute_notebooks.TIMING,
    "a traceback": re.compile(r"Traceback \(most recent call last\)|\x1b\["),
}
# A rich output a plain viewer cannot show: the repr of a display object, or a widget.
OPAQUE_TEXT = re.compile(r"^<IPython\.core\.display\.\w+ object>$|^<\w+(\.\w+)* object at ")


def _output_texts(output: dict) -> list[str]:
    texts = ["".join(output.get("text", ""))] + ["".join(line) for line in output.get("traceback", [])]
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/"):
            texts.append("".join(value))
    return texts


def _volatile(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, rx in VOLATILE.items() for m in rx.finditer(text)]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_code_cell_was_run_in_order_and_has_output(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), path.name
    # A cell that only defines (imports, helpers) may print nothing; the notebook as a whole shows results,
    # and every cell after the first definitions does.
    silent = [i for i, c in enumerate(code) if not c.outputs]
    assert len(silent) < len(code) and all(i == n for n, i in enumerate(silent)), (path.name, silent)
    for cell in code:
        assert not [o for o in cell.outputs if o.output_type == "error"], (path.name, cell.source[:80])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_hold_nothing_volatile(path):
    nb = nbformat.read(path, as_version=4)
    found = []
    for n, cell in enumerate(nb.cells):
        assert "execution" not in cell.metadata, (path.name, n)
        for output in cell.get("outputs", []):
            for text in _output_texts(output):
                found += [f"cell {n}: {v}" for v in _volatile(text)]
    assert not found, (
        f"{path.name}: run `make notebooks` (scripts/execute_notebooks.py normalises these)\n" + "\n".join(found)
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_rich_outputs_render_in_a_plain_viewer(path):
    # A plain viewer (GitHub, nbconvert --to html without JS) shows text and images; a script-built HTML
    # output (treescope.display, a widget) shows nothing there.
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            assert not any("widget" in mime for mime in data), (path.name, list(data))
            assert "<script" not in "".join(data.get("text/html", "")), (path.name, cell.source[:80])
            if data and not any(m.startswith("image/") for m in data):
                assert not OPAQUE_TEXT.search("".join(data.get("text/plain", ""))), (path.name, cell.source[:80])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_file_is_already_normalised(path):
    # Normalising again changes nothing, so `make notebooks` on unchanged code rewrites the same file.
    nb = nbformat.read(path, as_version=4)
    again = execute_notebooks.normalise(copy.deepcopy(nb))
    assert json.dumps(again, sort_keys=True) == json.dumps(nb, sort_keys=True), path.name


def test_normalise_removes_what_the_checks_look_for():
    raw = (
        f"{REPO}/notebooks/x.py: /tmp/tmpab12cd/robot saved in 12.5 ms (3 µs per leaf, 1.25s total)\n"
        "/tmp/ipykernel_4242/1234567.py:6: BridgeCopyWarning: at 0x7fec0890aa00 | RSS delta: +0.12 MiB\n"
    )
    assert len(_volatile(raw)) >= 6  # the checks see each of them
    clean = execute_notebooks.normalise_text(raw)
    assert _volatile(clean) == [], clean
    assert "<cell>:6: BridgeCopyWarning" in clean and "RSS delta: <rss> MiB" in clean
    assert execute_notebooks.normalise_text(clean) == clean


def test_normalise_drops_the_lines_rays_own_processes_print():
    # Whether the raylet's retry notes at `ray.shutdown` reach a cell depends on timing: they are no output of
    # the cell, and kept they would make the committed file differ run to run (and carry terminal colours).
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("ray.shutdown()")
    raylet = "\x1b[33m(raylet)\x1b[0m Task ServeController.listen_for_change failed.\n"
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text=raylet + "kept\n"),
        nbformat.v4.new_output("stream", name="stderr", text=raylet + "(pid=123) worker note\n"),
    ]
    nb.cells = [cell]
    out = execute_notebooks.normalise(nb)
    assert [o["text"] for o in out.cells[0].outputs] == ["kept\n"]
