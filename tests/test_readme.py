"""Every Python block of README.md runs as written, in order, in one namespace (as a reader would paste them)."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_starts_with_the_two_commands():
    first = README.read_text().split("```")[1].strip().splitlines()
    assert [line.split()[:2] for line in first] == [["make", "demo"], ["make", "test"]]


def test_every_python_block_runs_and_prints_what_its_comments_say():
    blocks = _blocks()
    assert len(blocks) >= 4
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, block in enumerate(blocks):
            exec(compile(block, f"README.md block {i + 1}", "exec"), namespace)
    printed = out.getvalue().splitlines()
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
