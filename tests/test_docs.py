"""The docs site (mkdocs.yml, docs/) builds with warnings as errors, covers every public name, and its guides'
code runs and prints what their comments say."""

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocstrings", reason="the docs build needs the [docs] extra")

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ["guides/jax.md", "guides/pytorch.md", "guides/serving.md"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    return out


@pytest.mark.parametrize(
    "package, page",
    [("functional_state", "functional_state"), ("torch_bridge", "torch_bridge"), ("torch_bridge.adapters", "adapters")],
)
def test_every_public_name_has_an_api_entry(site, package, page):
    module = __import__(package, fromlist=["__all__"])
    html = (site / "api" / page / "index.html").read_text()
    ids = set(re.findall(r'id="([^"]+)"', html))
    # A name that shares its module's name (functional_state.step) is documented by its full path.
    missing = [
        name
        for name in module.__all__
        if name != "__version__"
        and f"{package}.{name}" not in ids
        and not any(i.endswith(f".{name}.{name}") for i in ids)
    ]
    assert not missing, f"no API entry in docs/api/{page}.md for {missing}"


def test_every_page_of_the_nav_is_built(site):
    assert (site / "index.html").exists()
    for page in ["architecture", *[g.removesuffix(".md") for g in GUIDES]]:
        assert (site / page / "index.html").exists(), page


def test_guides_code_runs_and_prints_what_its_comments_say():
    namespace: dict = {}
    for guide in GUIDES:
        text = (ROOT / "docs" / guide).read_text()
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, flags=re.S)):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block, f"docs/{guide} block {i + 1}", "exec"), namespace)
            expected = re.findall(r"^\s*print\(.*\)  # (.+)$", block, flags=re.M)
            assert out.getvalue().splitlines() == expected, (guide, i + 1)


def test_readme_links_the_docs_and_make_docs_builds_them():
    readme = (ROOT / "README.md").read_text()
    assert "make docs" in readme and "docs/" in readme
    assert re.search(r"^docs: ", (ROOT / "Makefile").read_text(), flags=re.M)
