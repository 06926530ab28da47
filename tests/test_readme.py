"""Every Python block of README.md runs as written, in order, in one namespace (as a reader would paste them).

The blocks are found and run by mktestdocs (`check_md_file(..., memory=True)`: one namespace for the whole
file). A block a reader should not run is fenced ```` ```python notest ````, which mktestdocs skips; any other
word after ``python`` would skip a block silently, so the fences themselves are checked here too.
"""

import re
from pathlib import Path

import pytest
from mktestdocs import check_md_file, grab_code_blocks

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP_MARK = "notest"


def test_readme_starts_with_the_two_commands():
    first = README.read_text().split("```")[1].strip().splitlines()
    assert [line.split()[:2] for line in first] == [["make", "demo"], ["make", "test"]]


def test_python_fences_are_run_or_explicitly_skipped():
    # mktestdocs runs a fence whose info string is exactly `python`; `python notest` is our explicit skip.
    infos = re.findall(r"^```(py\S*(?:[ \t]+\S+)*)[ \t]*$", README.read_text(), flags=re.M)
    assert infos and set(infos) <= {"python", f"python {SKIP_MARK}"}, infos
    run = grab_code_blocks(README.read_text(), lang="python")
    assert len(run) == infos.count("python") >= 4


def test_every_python_block_runs_and_prints_what_its_comments_say(capsys):
    check_md_file(README, memory=True)
    printed = capsys.readouterr().out.splitlines()
    # The outputs the README promises in its comments.
    assert printed[0] == "(0, 16) (1, 16)"
    assert printed[1] == "256"
    assert printed[2] == "[1.]"
    assert "{'cpu': -16384, 'cpu/unpinned_host': 16384}" in printed and "1 1" in printed
    assert "1536 1536" in printed and "[(0, 1, 2)]" in printed and "[1.0, 1.0]" in printed
    i = printed.index("park ('old',)")
    assert printed[i + 1] == "16384"
    assert printed[-2:] == ["False", "SessionStateLostError"]


def test_install_lines_work_from_a_clone_and_name_every_extra():
    # Regression: the README began with `pip install functional-state`, which no package index serves.
    import tomllib

    text = README.read_text()
    installs = re.findall(r"^pip install (.+?)\s+#", text, flags=re.M)
    assert installs and all(line.startswith("-e ") for line in installs), installs
    named = set(re.findall(r"\.\[(\w+)\]", " ".join(installs)))
    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert named == set(extras) - {"dev"}, (named, set(extras))


def test_the_torch_pipeline_block_is_the_one_the_type_checkers_see():
    # Regression: the block called `to_jax(t).unsafe_buffer_pointer()` and `.observation_latents(1).shape`,
    # both errors under mypy and pyright (a union with torch.Tensor, and with None). `make typecheck` checks
    # tests/typing_usage.py with both; this keeps its copy of the block equal to the README's.
    import ast
    import textwrap

    block = next(b for b in grab_code_blocks(README.read_text(), lang="python") if "from torch_bridge import" in b)
    source = (README.parent / "tests" / "typing_usage.py").read_text()
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "readme_torch_pipeline")
    body = "\n".join(source.splitlines()[fn.body[0].lineno - 1 : fn.end_lineno])
    assert textwrap.dedent(body).strip() == block.strip()


def test_the_layout_table_names_every_layer():
    # A subpackage (a layer of functional_state, a part of torch_bridge) missing from the README's Layout
    # table is a room a newcomer cannot find.
    root = README.parent
    layout = README.read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([\w/]+/)` \|", layout, flags=re.M))
    packages = [p.parent for top in ("functional_state", "torch_bridge") for p in (root / top).glob("*/__init__.py")]
    named = {f"{p.name}/" if p.parent.name == "functional_state" else f"torch_bridge/{p.name}/" for p in packages}
    assert named <= rows, f"README's Layout table has no row for {sorted(named - rows)}"
    assert {"torch_bridge/", "benchmarks/"} <= rows


def test_the_real_and_stand_in_paragraph_matches_the_harness():
    # Issue 22: the README says which parts of the A/B rollout are real model code and which are stand-ins;
    # the encoder it calls the default, the `vae_encoder=` values and the stand-ins it names must be the
    # harness's own, and no line may send a reader to the old rollout path.
    harness = pytest.importorskip("torch_bridge.harness")
    text = README.read_text()
    para = text.split("The A/B rollout (`torch_bridge.harness`", 1)[1].split("\n\n", 1)[0]
    assert "by default" in para and "`WanEncoder3d`" in para and harness.RolloutConfig().vae_encoder == "wan"
    values = re.findall(r'vae_encoder="([\w-]+)"', para)
    assert values and set(values) <= set(harness.VAE_ENCODERS), values
    named = re.findall(r"\(`([A-Z]\w+)`\)", para)
    assert named and all(hasattr(harness, n) for n in named), named
    assert "adapters.dreamzero_rollout" not in text
