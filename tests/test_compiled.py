"""functional_state._compiled: which build runs, checked against the modules Python really imported.

`make test` sets FUNCTIONAL_STATE_EXPECT_COMPILED=1 (the compiled build must be the one in use); the
fallback's runs set FUNCTIONAL_STATE_PURE=1 (every module must be its source). With neither, only the
report's agreement with the imports is checked.
"""

import importlib
import importlib.machinery
import os
import runpy
from pathlib import Path

import pytest

import functional_state
from functional_state import _compiled

ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def _imported_compiled(name: str) -> bool:
    return importlib.import_module(name).__file__.endswith(EXTENSIONS)


def test_the_report_matches_the_modules_python_imported():
    report = _compiled.compiled_modules()
    assert list(report) == list(_compiled.MODULES)
    assert report == {name: _imported_compiled(name) for name in _compiled.MODULES}
    assert functional_state.COMPILED is all(report.values())


def test_a_partial_build_does_not_report_compiled(tmp_path, monkeypatch):
    # One compiled module of two is no compiled build: COMPILED needs all of them.
    table = tmp_path / "functional_state" / "table"
    table.mkdir(parents=True)
    for name in ("lru", "recency_log"):
        (table / f"{name}.py").write_text("")
    (table / f"lru{EXTENSIONS[0]}").write_bytes(b"")
    fake = tmp_path / "functional_state" / "_compiled.py"
    fake.write_text((ROOT / "functional_state" / "_compiled.py").read_text())
    monkeypatch.setattr(_compiled, "MODULES", ("functional_state.table.lru", "functional_state.table.recency_log"))
    monkeypatch.setattr(_compiled, "__file__", str(fake))
    assert _compiled.compiled_modules() == {
        "functional_state.table.lru": True,
        "functional_state.table.recency_log": False,
    }
    assert runpy.run_path(str(fake))["COMPILED"] is False


def test_the_compiled_modules_hold_no_doctest():
    # `make test` cannot collect a compiled module's source for doctests (pytest refuses a module whose
    # __file__ is its .so), so it skips them: a doctest there would never run.
    for name in _compiled.MODULES:
        assert ">>>" not in (ROOT / (name.replace(".", "/") + ".py")).read_text(), f"{name}: move its doctest"


@pytest.mark.skipif(
    not os.environ.get("FUNCTIONAL_STATE_EXPECT_COMPILED"), reason="`make test` asks for the compiled build"
)
def test_the_compiled_build_is_in_use_after_make():
    assert functional_state.COMPILED, f"not compiled: {_compiled.compiled_modules()} (rebuild: make)"
    for name in _compiled.MODULES:
        module = importlib.import_module(name)
        assert module.__file__.endswith(".so"), module.__file__
        # Python imports the .so before the .py: one older than its source runs code the tree no longer has.
        source = ROOT / (name.replace(".", "/") + ".py")
        if source.exists():
            assert Path(module.__file__).stat().st_mtime >= source.stat().st_mtime, f"{name}: stale build (make)"


@pytest.mark.skipif(
    os.environ.get(_compiled.PURE_ENV, "") in ("", "0"), reason=f"{_compiled.PURE_ENV} asks for the pure build"
)
def test_the_pure_build_is_in_use_when_asked_for():
    assert functional_state.COMPILED is False
    for name in _compiled.MODULES:
        assert importlib.import_module(name).__file__.endswith(".py")


# A compiled function checks its annotated argument types on entry and raises a bare TypeError; the verbs
# compiled for speed (`table.verb_core`, `table.checks`) take Any and check inside, so a wrong argument still
# gets the verb's own error on both builds. (Compiled with `find_object(name: str)`, an int name raised
# "TypeError: str object expected"; with `resolve_session_id` in the compiled `checks`, an int id did.)
def _table():
    state, _ = functional_state.get_or_create(functional_state.ManagerState.create(), "a")
    return functional_state.put(state, "a", "buf", functional_state.LatentBuffer.create(maxlen=2))


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        (lambda s: functional_state.get_or_create(s, 3), functional_state.InvalidTypeError, "`get_or_create`"),
        (lambda s: functional_state.get_or_create(s, b"a"), functional_state.InvalidTypeError, "non-empty str"),
        (lambda s: functional_state.get_or_create({}, "a"), functional_state.InvalidTypeError, "ManagerState"),
        (lambda s: functional_state.commit(s, 3, "buf", 1), functional_state.InvalidTypeError, "`commit`"),
        (lambda s: functional_state.commit(s, "", "buf", 1), functional_state.InvalidTypeError, "non-empty str"),
        (lambda s: functional_state.commit(s, "a", 7, 1), functional_state.ObjectNotFoundError, "buf"),
        (lambda s: functional_state.commit(s, "b", "buf", 1), functional_state.SessionStateLostError, "'b'"),
        (lambda s: functional_state.commit(None, "a", "buf", 1), functional_state.InvalidTypeError, "NoneType"),
        (lambda s: functional_state.get_session(s, 1.5), functional_state.InvalidTypeError, "`get_session`"),
        (lambda s: functional_state.resolve_session_id(3), functional_state.InvalidTypeError, "resolve_session_id"),
    ],
)
def test_the_compiled_verbs_raise_their_own_errors_for_wrong_arguments(call, error, says):
    state = _table()
    with pytest.raises(error, match=says.replace("(", r"\(")) as info:
        call(state)
    assert type(info.value) is not TypeError
    assert functional_state.view(state, "a", "buf") == ()  # (the table is unchanged)
