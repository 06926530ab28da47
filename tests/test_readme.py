"""Every Python block of README.md runs as written, each alone in a fresh namespace (as a reader pastes one),
and prints what its `print(...)  # output` comments say; torch blocks skip without torch.

The blocks are found by mktestdocs (`grab_code_blocks`). A block a reader should not run is fenced
```` ```python notest ````; any other word after ``python`` would skip a block silently, so the fences
themselves are checked here too.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest
from mktestdocs import grab_code_blocks

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


def _blocks() -> list[str]:
    return grab_code_blocks(README.read_text(), lang="python")


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_each_python_block_runs_alone_and_prints_what_its_comments_say(index):
    # Each block in a fresh namespace, as a reader pastes one (issue 40: blocks depended on earlier ones).
    block = _blocks()[index]
    if re.search(r"^(import|from) (torch|torch_bridge)\b", block, flags=re.M):
        pytest.importorskip("torch", reason="a torch block of the README (needs torch)")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})
    expected = re.findall(r"^\s*print\(.*\)  # (.+)$", block, flags=re.M)
    assert out.getvalue().splitlines() == expected


def test_the_readme_opens_with_the_idea_then_the_adapters():
    text = README.read_text()
    assert text.index("## For JAX users") < text.index("## For PyTorch users") < text.index("## World-model adapters")
    first_adapter = min(text.index(w) for w in ("DreamZero", "Cosmos3", "OMNI_DIFFUSION_"))
    assert first_adapter > text.index("## World-model adapters")
    assert "torch_bridge.harness" not in "".join(_blocks()), "a README example imports a harness stand-in"
    assert "05_flax_nnx_serving.ipynb" in text


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

    block = next(b for b in _blocks() if "DreamZeroStateAdapter" in b)
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
    pytest.importorskip("torch", reason="the harness runs torch")
    harness = pytest.importorskip("torch_bridge.harness")
    text = README.read_text()
    para = text.split("The A/B rollout (`torch_bridge.harness`", 1)[1].split("\n\n", 1)[0]
    assert "by default" in para and "`WanEncoder3d`" in para and harness.RolloutConfig().vae_encoder == "wan"
    values = re.findall(r'vae_encoder="([\w-]+)"', para)
    assert values and set(values) <= set(harness.VAE_ENCODERS), values
    named = re.findall(r"\(`([A-Z]\w+)`\)", para)
    assert named and all(hasattr(harness, n) for n in named), named
    assert "adapters.dreamzero_rollout" not in text
