"""The package's shape, checked on its source (AST, no imports): small modules, layers that import only
downwards, no private name shared between modules, and a public face that is the documented set."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

import functional_state as fs

PKG = Path(__file__).resolve().parents[1] / "functional_state"

# The layer order, bottom first: a module may import its own layer and the ones before it, never a later one.
# Top-level modules are the base (errors, _version, _repr) or the face (__init__, __main__ and the shims kept
# for old import paths), which may import anything.
LAYERS = [
    "base",
    "memory",
    "core",
    "engine",
    "table",
    "batched",
    "policy",
    "persist",
    "transfer",
    "shell",
    "serving",
    "face",
]
BASE = {"errors", "_version", "_repr"}

# Modules are split by concept, not by a line count (issue 39 retired the 420-line cap, which had cut modules
# into half-concepts). This bound is only a sanity check against a module that has swallowed several concepts.
SANITY_LINES = 1_500

# The public face: what README, docs/api/functional_state.md (`::: functional_state`) and users rely on.
# Changing it is a decision: change this list, the docs and the changelog together.
PUBLIC = {
    *("DEFAULT_MAX_SESSIONS", "DEFAULT_SESSION_ID", "FORK_POLICIES", "LEVERS", "__version__", "COMPILED"),
    *("ArrayRing", "DenseValue", "LatentBuffer", "ManagerState", "PagedKVHandle", "PagedKVPool", "SessionAttr"),
    *("ReentrantWriteError", "ReleaseAction", "ReleasePlan", "SaveHandle", "SessionHandle", "SessionState"),
    *("SessionStateManager", "StateObject", "PytreeValue", "pytree_dataclass", "Pool", "Usage"),
    *("AttrNotFoundError", "BudgetExceededError", "CheckpointError", "CopyRequiredError", "DeletedArrayError"),
    *("InvalidArgumentError", "InvalidTypeError", "KVFreeError", "NotAllocatedError", "NotParkedError"),
    *("NotResidentError", "NothingStagedError", "ObjectNotFoundError", "ObjectParkedError", "PoolChangedError"),
    *("SessionAdmissionError", "SessionExistsError", "SessionStateError", "SessionStateLostError"),
    *("SharedStorageError", "SharedStorageWrittenError", "StateConsumedError", "StateShapeError"),
    *("StaleEpochError", "TransferError"),
    *("apply_plan", "capacity_for", "commit", "del_attr", "discard", "drop_session", "enforce_budget", "evict"),
    *("fork_session", "format_bytes", "free_released", "get_attr", "get_or_create", "get_session"),
    *("has_checkpoint", "incarnation", "load", "load_session", "lookup", "nbytes_by_device", "paged_gather"),
    *("park", "parse_bytes", "plan_release", "put", "raise_max_sessions", "read_session", "register_alias"),
    *("register_checkpoint_type", "released_blocks", "reset_session", "resolve_session_id"),
    *("resolve_session_state_config", "restore", "save", "save_session", "sessions", "set_attr", "stage"),
    *("stats", "step", "total_nbytes", "update_session", "usage", "view", "with_sessions", "writable"),
}


def _modules() -> dict[str, Path]:
    """Dotted name relative to the package (``table.manager_state``, ``errors``) -> file."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _layer(name: str) -> str:
    top = name.split(".")[0]
    if not name:
        return "face"
    if "." in name or top in LAYERS:
        return top
    return "base" if top in BASE else "face"


def _imports(name: str) -> list[tuple[str, str]]:
    """``(module imported, name imported or "")`` for each package-internal import of module ``name``."""
    tree = ast.parse(MODULES[name].read_text())
    package = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])]).strip(
                "."
            )
            for alias in node.names:
                full = f"{base}.{alias.name}".strip(".")
                out.append((full, "") if full in MODULES else (base, alias.name))
    return out


def test_no_module_has_swallowed_several_concepts():
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in MODULES.values()}
    over = {f: n for f, n in sizes.items() if n > SANITY_LINES}
    assert not over, f"modules over {SANITY_LINES} lines: {over}; does each still hold one concept?"


def test_no_import_runs_up_the_layer_order():
    upward = [
        f"{name} ({_layer(name)}) imports {target} ({_layer(target)})"
        for name in MODULES
        for target, _ in _imports(name)
        if LAYERS.index(_layer(target)) > LAYERS.index(_layer(name))
    ]
    assert not upward, upward


def test_no_private_name_crosses_a_module():
    crossing = []
    for name, path in MODULES.items():
        modules = {a.asname or a.name: f"{t}" for t, a in _aliases(path, name)}
        for target, imported in _imports(name):
            if imported.startswith("_") and not imported.startswith("__"):
                crossing.append(f"{name}: from {target} import {imported}")
        for node in ast.walk(ast.parse(path.read_text())):
            private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            if private and isinstance(node.value, ast.Name) and node.value.id in modules:
                crossing.append(f"{name}: {modules[node.value.id]}.{node.attr}")
    assert not crossing, crossing


# The modules of the table's own encoding: `records` defines its records (`Recency`, `Totals`), the
# others build them on the table's write paths.
TABLE_ENCODING = {
    "table.manager_state",
    "table.checks",
    "table.lru",
    "table.session_verbs",
    "table.object_verbs",
    "table.verb_core",
}


def test_the_table_layout_is_read_only_by_the_table_modules():
    # ManagerState's slots hold its records; only the table's own modules read them.
    owners = {MODULES[name] for name in TABLE_ENCODING}
    readers = [
        f"{p.relative_to(PKG)}: .{node.attr}"
        for p in MODULES.values()
        if p not in owners
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in {"_nodes", "_recency", "_hits", "_totals", "_config", "_acct"}
    ]
    assert not readers, readers


def _aliases(path: Path, name: str) -> list[tuple[str, ast.alias]]:
    """The package modules ``name`` imports as modules (``from ..memory import accounting``)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            out += [(f"{base}.{a.name}".strip("."), a) for a in node.names if f"{base}.{a.name}".strip(".") in MODULES]
    return out


def test_the_public_face_is_the_documented_set_and_each_layer_exports_its_part():
    assert set(fs.__all__) == PUBLIC, (sorted(set(fs.__all__) - PUBLIC), sorted(PUBLIC - set(fs.__all__)))
    from functional_state import core, engine, errors, memory, persist, policy, shell, table

    layers = [memory, core, engine, table, policy, persist, shell]
    exported = [n for layer in layers for n in layer.__all__]
    assert len(exported) == len(set(exported)), "a name exported by two layers"
    assert set(exported) | set(errors.__all__) | {"__version__", "COMPILED", "step", "usage"} == PUBLIC
    for layer in layers:
        assert all(getattr(layer, n) is getattr(fs, n) for n in layer.__all__), layer.__name__


# Every import counts, a deferred one inside a function too: a circle through a deferred import still ties two
# modules together (neither can be read, tested or moved alone), only `if TYPE_CHECKING:` imports do not.
ROOTS = {"functional_state": PKG, "torch_bridge": PKG.parent / "torch_bridge"}


def _all_modules() -> dict[str, Path]:
    """Absolute dotted name (``functional_state.table.manager_state``) -> file, for both packages."""
    out = {}
    for top, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join([top, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    return out


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """The nodes of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack += node.orelse
            continue
        out.append(node)
        stack += ast.iter_child_nodes(node)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (absolute or relative, at the top or deferred)."""
    modules = _all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle():
    circles = import_circles(import_graph())
    assert not circles, f"import circles (break each: move the shared name down a layer): {circles}"


def test_the_circle_check_sees_a_circle():
    # The check itself can fail: a deferred import back from handlers to directory closes a circle.
    graph = import_graph()
    graph["functional_state.persist.handlers"].add("functional_state.persist.directory")
    assert ["functional_state.persist.directory", "functional_state.persist.handlers"] in import_circles(graph)


# --- Named structure, not indexes (issue 39) -----------------------------------------------------------
# A structure one module builds and another reads is a record read by attribute. Checked two ways:
# 1. No module subscripts by an int constant defined at module level in another package module
#    (``node[SESSION]`` with ``SESSION: Final = 0`` imported from where nodes are built), Final or not.
# 2. The records below are read by name: those that are not tuples cannot be indexed at all, and a value
#    annotated with a tuple record (a parameter, an annotated assignment, or a loop variable over a
#    collection so annotated, e.g. ``for e in extents`` with ``extents: frozenset[Extent]``) is never
#    subscripted by an int (``e[0]``, ``e[2] - e[1]``).
TUPLE_RECORDS = {"Extent", "Loose", "StorageStamp", "Counters", "AttrEntry"}
CLASS_RECORDS = {
    "table.records": ("Recency", "Totals"),
    "core.state_object": ("LedgerDelta", "BlocksMoved"),
    "table.ledger": ("ReleaseLog",),
}
_CONTAINERS = {"Iterable", "Iterator", "list", "set", "frozenset", "Sequence", "Collection", "tuple", "Set"}


def _int_constants(tree: ast.Module) -> set[str]:
    """Module-level names bound to an int literal (``SESSION: Final = 0``, ``USED = 1``)."""
    out = set()
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if isinstance(value, ast.Constant) and type(value.value) is int:
            out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _record_of(annotation: ast.AST | None) -> str | None:
    """The tuple record an annotation names (``Extent``, ``Extent | None``, ``"Extent"``), else None."""
    if annotation is None:
        return None
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(annotation, ast.BinOp):  # X | None
        return _record_of(annotation.left) or _record_of(annotation.right)
    if isinstance(annotation, ast.Name) and annotation.id in TUPLE_RECORDS:
        return annotation.id
    return None


def _element(annotation: ast.AST | None) -> ast.AST | None:
    """The element annotation of a collection annotation (``frozenset[Extent]`` -> ``Extent``), else None."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(annotation, ast.BinOp):
        return _element(annotation.left) or _element(annotation.right)
    if isinstance(annotation, ast.Subscript):
        container = annotation.value
        name = container.attr if isinstance(container, ast.Attribute) else getattr(container, "id", None)
        if name in _CONTAINERS:
            inner = annotation.slice
            return inner.elts[0] if isinstance(inner, ast.Tuple) else inner
    return None


def _int_index(node: ast.AST) -> bool:
    """Whether a subscript's index is an int literal (``[0]``, ``[-1]``) or a slice of them (``[:3]``)."""
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _int_index(node.operand)
    if isinstance(node, ast.Slice):
        bounds = [b for b in (node.lower, node.upper) if b is not None]
        return bool(bounds) and all(_int_index(b) for b in bounds)
    return False


def _record_index_reads(label: str, tree: ast.Module) -> list[str]:
    """Int subscripts of values annotated as a tuple record, function by function (see rule 2)."""
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        args = fn.args
        env: dict[str, ast.AST | None] = {
            a.arg: a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.annotation
        }
        for node in ast.walk(fn):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                env[node.target.id] = node.annotation
        changed = True
        while changed:  # loop variables take the element annotation of what they iterate (nested loops too)
            changed = False
            for node in ast.walk(fn):
                loop = isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name)
                if loop and isinstance(node.iter, ast.Name) and node.target.id not in env:
                    element = _element(env.get(node.iter.id))
                    if element is not None:
                        env[node.target.id] = element
                        changed = True
        for node in ast.walk(fn):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and _int_index(node.slice):
                record = _record_of(env.get(node.value.id))
                if record is not None:
                    out.append(f"{label}:{node.lineno}: {ast.unparse(node)} reads a {record} by index")
    return out


def bare_index_reads(root: Path) -> list[str]:
    """Every read that breaks rule 1 or rule 2 in the modules under ``root`` (a package directory)."""
    trees = {_module_name(root, p): (p, ast.parse(p.read_text())) for p in sorted(root.rglob("*.py"))}
    constants = {name: _int_constants(tree) for name, (_, tree) in trees.items()}
    out = []
    for name, (path, tree) in trees.items():
        is_package = path.name == "__init__.py"
        imported: dict[str, str] = {}  # local name -> the module defining it (for the int constants)
        modules: dict[str, str] = {}  # local name -> package module (``from . import state``)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                source = _resolve(name, is_package, node.level, node.module)
                for alias in node.names:
                    local = alias.asname or alias.name
                    if alias.name in constants.get(source, ()):
                        imported[local] = source
                    elif (full := ".".join(p for p in (source, alias.name) if p)) in trees:
                        modules[local] = full
        for node in ast.walk(tree):
            if not isinstance(node, ast.Subscript):
                continue
            foreign = {n for n in _names_in(node.slice) if n in imported}
            foreign |= {
                f"{a.value.id}.{a.attr}"
                for a in ast.walk(node.slice)
                if isinstance(a, ast.Attribute)
                and isinstance(a.value, ast.Name)
                and a.value.id in modules
                and a.attr in constants.get(modules[a.value.id], ())
            }
            if foreign:
                out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)} indexes by {sorted(foreign)}")
        out.extend(_record_index_reads(str(path.relative_to(root)), tree))
    return out


def test_no_bare_tuple_crossing_a_module_is_read_by_index():
    reads = bare_index_reads(PKG)
    assert not reads, "read these records by attribute:\n" + "\n".join(reads)


def test_the_class_records_cannot_be_indexed():
    import importlib

    for module, names in CLASS_RECORDS.items():
        for name in names:
            cls = getattr(importlib.import_module(f"functional_state.{module}"), name)
            assert not issubclass(cls, tuple) and not hasattr(cls, "__getitem__"), f"{module}.{name}"


def test_the_index_check_fails_on_index_constants_and_on_indexed_records(tmp_path):
    # The two shapes issue 39 found: a node indexed by constants imported from the module that builds it, and
    # an extent indexed in a loop over extents (``e[2] - e[1]``).
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "state.py").write_text("from typing import Final\nSESSION: Final = 0\nUSED = 1\nEXTENTS = 'e'\n")
    (pkg / "lru.py").write_text(
        "from . import state\nfrom .state import SESSION, EXTENTS\n"
        "def f(node, d):\n    return node[SESSION], node[state.USED], d[EXTENTS]\n"
    )
    (pkg / "ledger.py").write_text(
        "def g(add: 'Iterable[frozenset[Extent]]', e1: Extent | None, other: tuple) -> int:\n"
        "    n = other[0] + e1[0]\n"
        "    for extents in add:\n        for e in extents:\n            n += e[2] - e[1]\n    return n\n"
    )
    reads = bare_index_reads(pkg)
    assert [r.split(": ")[1] for r in reads] == [
        "e1[0] reads a Extent by index",
        "e[2] reads a Extent by index",
        "e[1] reads a Extent by index",
        "node[SESSION] indexes by ['SESSION']",
        "node[state.USED] indexes by ['state.USED']",
    ], reads


OLD_CORE = "9e77d29"  # main before issue 39's named records


@pytest.mark.skipif(
    subprocess.run(["git", "cat-file", "-e", OLD_CORE], cwd=PKG.parent, capture_output=True).returncode != 0,
    reason=f"the history holds no {OLD_CORE} (a shallow clone)",
)
def test_the_index_check_fails_on_the_core_before_named_records(tmp_path):
    archive = subprocess.run(
        ["git", "archive", OLD_CORE, "functional_state"], cwd=PKG.parent, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    reads = bare_index_reads(tmp_path / "functional_state")
    assert any(r.startswith("table/lru.py") and "indexes by ['SESSION']" in r for r in reads), reads
    assert any("ledger.py" in r and "reads a Extent by index" in r for r in reads), reads
    assert len(reads) > 50, reads
