"""The docs site (mkdocs.yml, docs/) builds with warnings as errors, covers every public name, its guides'
code runs and prints what their comments say, and the conventions page's table of return shapes is the code's."""

import contextlib
import inspect
import io
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import functional_state as fs

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ["guides/jax.md", "guides/pytorch.md", "guides/serving.md", "guides/conventions.md"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocstrings", reason="the docs build needs the [docs] extra")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    return out


# The API reference, one page per topic (issue 40: it was one 650 KB page in source order).
API_PAGES = {
    "functional_state": ["state_objects", "table", "shell", "budget", "checkpoints", "errors"],
    "torch_bridge": ["torch_bridge"],
    "torch_bridge.adapters": ["adapters/dreamzero", "adapters/cosmos3"],
    "functional_state.transfer": ["transfer"],
    "functional_state.serving": ["serving"],
}
TOPIC_PAGES = [p for pages in API_PAGES.values() for p in pages] + [
    "adapters/wan",
    "adapters/transformers",
    "nnx",
    "equinox",
]
LEDGER_PROTOCOL = ("ledger_step", "ledger_extents", "ledger_blocks", "ledger_leaf_extents")


def _ids(site, page: str) -> set[str]:
    return set(re.findall(r'id="([^"]+)"', (site / "api" / page / "index.html").read_text()))


@pytest.mark.parametrize("package", sorted(API_PAGES))
def test_every_public_name_has_an_api_entry(site, package):
    module = __import__(package, fromlist=["__all__"])
    ids = set().union(*(_ids(site, page) for page in API_PAGES[package]))
    # A name that shares its module's name (functional_state.step) is documented by its full path.
    missing = [
        name
        for name in module.__all__
        if name != "__version__"
        and f"{package}.{name}" not in ids
        and not any(i.endswith(f".{name}.{name}") for i in ids)
    ]
    assert not missing, f"no API entry in docs/api/ for {missing}"


@pytest.mark.parametrize("page", TOPIC_PAGES)
def test_each_api_page_opens_with_a_summary_table_and_keeps_the_ledger_protocol_off(site, page):
    html = (site / "api" / page / "index.html").read_text()
    body = html[html.index("<h1") :]
    first_table, first_entry = body.find("<table"), body.find('class="doc doc-heading"')
    assert 0 <= first_table < first_entry, f"docs/api/{page}.md: no summary table before the first entry"
    assert not [name for name in LEDGER_PROTOCOL if name in body], f"docs/api/{page}.md shows the ledger protocol"


def test_the_extending_page_has_the_ledger_protocol_and_the_model_pages_their_entries(site):
    html = (site / "extending" / "index.html").read_text()
    assert all(f"StateObject.{name}" in html for name in LEDGER_PROTOCOL)
    assert "functional_state.nnx.SessionCaches" in _ids(site, "nnx")
    assert "functional_state.equinox.SessionStates" in _ids(site, "equinox")


def test_the_notebooks_are_rendered_in_the_site(site):
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        page = site / "notebooks" / notebook.stem / "index.html"
        assert page.exists(), f"{notebook.name} is not in the site (mkdocs.yml's nav)"


def test_every_page_of_the_nav_is_built(site):
    assert (site / "index.html").exists()
    for page in ["architecture", "extending", "guides/logging", *[g.removesuffix(".md") for g in GUIDES]]:
        assert (site / page / "index.html").exists(), page


@pytest.mark.parametrize("guide", GUIDES)
def test_guides_code_runs_and_prints_what_its_comments_say(guide):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / guide).read_text(), flags=re.S)
    if any(re.search(r"^(import|from) (torch|torch_bridge)\b", b, flags=re.M) for b in blocks):
        pytest.importorskip("torch", reason=f"docs/{guide} has torch examples (needs torch)")
    namespace: dict = {}
    for i, block in enumerate(blocks):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"docs/{guide} block {i + 1}", "exec"), namespace)
        expected = re.findall(r"^\s*print\(.*\)  # (.+)$", block, flags=re.M)
        assert out.getvalue().splitlines() == expected, (guide, i + 1)


def test_readme_links_the_docs_and_make_docs_builds_them():
    readme = (ROOT / "README.md").read_text()
    assert "make docs" in readme and "docs/" in readme
    assert re.search(r"^docs: ", (ROOT / "Makefile").read_text(), flags=re.M)


# --- the conventions page: every public pure function's return shape, as its annotation says -----------------

CONVENTIONS = ROOT / "docs" / "guides" / "conventions.md"
_PUBLIC_OBJECTS = [fs.LatentBuffer, fs.ArrayRing, fs.DenseValue, fs.PagedKVHandle, fs.PytreeValue]


def _is_state(tp: typing.Any, state: type) -> bool:
    if isinstance(tp, typing.TypeVar):  # `S` of StateObject's methods: bound to the class itself
        bound = tp.__bound__
        name = bound.__forward_arg__ if isinstance(bound, typing.ForwardRef) else getattr(bound, "__name__", None)
        return name == state.__name__
    return isinstance(tp, type) and issubclass(tp, state)


def _written(tp: typing.Any, state: type) -> str:
    """An annotation as the page writes it: ``state``, ``(state, int)``, ``dict[str, int]``, ``int or None``."""
    if tp is typing.Any:
        return "Any"
    if tp is type(None):
        return "None"
    if _is_state(tp, state):
        return "state"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_written(a, state) for a in args)
    if origin is tuple and len(args) == 2 and _is_state(args[0], state):
        return f"(state, {_written(args[1], state)})"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _written(a, state) for a in args)
        return f"{origin.__name__}[{inner}]"
    return "jax.Array" if tp is jax.Array else tp.__name__


def _shape(written: str) -> str:
    return "state" if written == "state" else "(state, value)" if written.startswith("(state, ") else "value"


def _page_rows() -> dict[str, list[str]]:
    rows = re.findall(r"^\| `([\w.]+)` \| (.+?) \|", CONVENTIONS.read_text(), flags=re.M)
    return {name: re.findall(r"`([^`]+)`", cell) for name, cell in rows}


def _public_pure_functions() -> dict[str, tuple[typing.Any, type]]:
    """``{row name: (function, what "state" is)}``: the table's functions (those taking or returning a
    `ManagerState`), `SessionState`'s methods, `StateObject`'s and each public type's own methods."""
    found: dict[str, tuple[typing.Any, type]] = {}
    for name in fs.__all__:
        fn = getattr(fs, name)
        hints = typing.get_type_hints(fn) if inspect.isfunction(fn) else {}
        if any(fs.ManagerState in (h, *typing.get_args(h)) for h in hints.values()):
            found[f"fs.{name}"] = (fn, fs.ManagerState)
    for cls, state in [(fs.SessionState, fs.SessionState), (fs.StateObject, fs.StateObject)]:
        for name, fn in vars(cls).items():
            if not name.startswith("_") and inspect.isfunction(fn):
                found[f"{cls.__name__}.{name}"] = (fn, state)
    for cls in _PUBLIC_OBJECTS:
        for name, fn in vars(cls).items():
            if not name.startswith("_") and inspect.isfunction(fn) and not hasattr(fs.StateObject, name):
                found[f"{cls.__name__}.{name}"] = (fn, fs.StateObject)
    return found


def _probes() -> dict[str, list[typing.Any]]:
    """What the functions annotated ``Any`` return when called: the page's shape for them is checked on these."""
    state, _ = fs.get_or_create(fs.ManagerState.create(), "a")
    state = fs.set_attr(fs.put(state, "a", "ring", fs.ArrayRing.create(2, (3,))), "a", "k", 1)
    session = fs.lookup(state, "a")

    def commit_with_aux(ring, x):
        return ring.commit(x), jnp.sum(x)

    return {
        "fs.get_attr": [fs.get_attr(state, "a", "k")],
        "fs.lookup": [session],
        "fs.view": [fs.view(state, "a", "ring")],
        "fs.step": [
            fs.step(state, "a", "ring", fs.ArrayRing.commit, jnp.ones(3)),
            fs.step(state, "a", "ring", commit_with_aux, jnp.ones(3), has_aux=True),
        ],
        "SessionState.get": [session.get("ring"), session.get("ring", cls=fs.ArrayRing)],
        "SessionState.get_attr": [session.get_attr("k")],
        "StateObject.view": [session.get("ring").view()],
    }


def _shape_of_value(value: typing.Any, state: type) -> str:
    if isinstance(value, state):
        return "state"
    return "(state, value)" if isinstance(value, tuple) and value and isinstance(value[0], state) else "value"


def test_conventions_page_lists_every_public_pure_function_with_the_shape_its_annotation_says():
    page, code, probes = _page_rows(), _public_pure_functions(), _probes()
    missing = sorted(set(code) - set(page))
    assert not missing, f"docs/guides/conventions.md has no row for {missing}"
    stale = sorted(set(page) - set(code))
    assert not stale, f"docs/guides/conventions.md lists {stale}, which are not public pure functions"
    wrong = {}
    for name, (fn, state) in code.items():
        written = _written(typing.get_type_hints(fn)["return"], state)
        cells = page[name]
        if written == "Any":  # the annotation does not say: what the function returns does
            assert name in probes, f"{name} is annotated Any: add a call of it to _probes()"
            actual = {_shape_of_value(v, state) for v in probes[name]}
            if actual != {_shape(c) for c in cells}:
                wrong[name] = (cells, sorted(actual))
        elif cells != [written]:
            wrong[name] = (cells, written)
    assert not wrong, f"conventions.md disagrees with the code (page, code): {wrong}"


def test_an_override_returns_what_the_base_method_returns():
    # The page lists StateObject's methods once; a type's own version must keep the base's shape.
    for cls in _PUBLIC_OBJECTS:
        for name, fn in vars(cls).items():
            base = getattr(fs.StateObject, name, None)
            if name.startswith("_") or not inspect.isfunction(fn) or base is None:
                continue
            got = _written(typing.get_type_hints(fn)["return"], fs.StateObject)
            assert got == _written(typing.get_type_hints(base)["return"], fs.StateObject), (cls.__name__, name)


def test_readme_and_api_index_link_the_conventions_page():
    assert "docs/guides/conventions.md" in (ROOT / "README.md").read_text()
    assert "../guides/conventions.md" in (ROOT / "docs" / "api" / "table.md").read_text()
    assert "guides/conventions.md" in (ROOT / "mkdocs.yml").read_text()


# --- the architecture page: one row per module file, for the tree as it is -----------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _documented_modules() -> dict[str, set[str]]:
    """``{folder: module files}`` as the page's sections list them: a ``### `folder/``` heading, then a table
    whose rows begin with a module file's name."""
    found: dict[str, set[str]] = {}
    for folder, body in re.findall(r"^### `([\w/]+/)`[^\n]*\n(.*?)(?=^### |\Z)", ARCHITECTURE.read_text(), re.M | re.S):
        found.setdefault(folder, set()).update(re.findall(r"^\| `([\w.]+\.py)` \|", body, flags=re.M))
    return found


def _module_files() -> dict[str, set[str]]:
    """``{folder: module files}`` on disk: every package folder of functional_state and torch_bridge
    (its ``__init__.py`` aside: the section is about it)."""
    found: dict[str, set[str]] = {}
    for top in ("functional_state", "torch_bridge"):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            folder = init.parent.relative_to(ROOT).as_posix() + "/"
            found[folder] = {p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"}
    return found


def test_architecture_page_lists_every_module_file_and_no_other():
    page, disk = _documented_modules(), _module_files()
    missing = {f: sorted(disk[f] - page.get(f, set())) for f in disk if disk[f] - page.get(f, set())}
    assert not missing, f"docs/architecture.md has no row for these modules: {missing}"
    stale = {f: sorted(page[f] - disk.get(f, set())) for f in page if page[f] - disk.get(f, set())}
    assert not stale, f"docs/architecture.md lists modules that do not exist: {stale}"
