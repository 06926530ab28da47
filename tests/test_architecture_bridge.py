"""torch_bridge's shape, checked on its source (AST, no imports) as tests/test_architecture.py checks the core:
small modules, layers that import only downwards (the bridge, then the adapters, then the A/B harness), no
private name shared between modules (nor taken from functional_state), and a harness face that is the
documented set."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "torch_bridge"
ROOT = "torch_bridge"

# Bottom first. ``base`` is the bridge's report; ``face`` the package __init__ and the CLI, which may import
# anything. The harness drives the adapters; the adapters never need the harness.
LAYERS = ["base", "bridge", "adapters", "harness", "face"]
TOP = {
    "_report": "base",
    "bridge": "bridge",
    "__init__": "face",
    "cli": "face",
    "demo": "face",
    "runner": "face",
    "demo_text_model": "face",
    "": "face",
}

# Adapter-side modules allowed to import the harness, each with why.
UPWARD_OK = {
    "adapters.dreamzero_worker": "a restart/migration worker that serves the harness rollout; kept at its path",
}

MAX_LINES = 420
OVERSIZED: dict[str, str] = {}  # none: every module is within the limit

HARNESS_PUBLIC = {
    *("DEPLOY_FEAT_MAP_BYTES", "MIB", "VAE_ENCODERS", "WAN_BASE_DIM", "RolloutConfig", "small_config"),
    *("Networks", "wan_encoder", "SelfAttnKV", "RolloutResult", "pipeline_step", "run_rollout"),
    *("hash_value", "new_feat_map", "prompt_tokens", "stitched_frame", "EngineError", "ReferenceKVEngine"),
    *("Cosmos3Shapes", "Cosmos3TransformerCache", "build_freqs_gen", "encode_und_kv"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _layer(name: str) -> str:
    return TOP.get(name, name.split(".")[0])


def _imports(name: str) -> list[tuple[str, str, bool]]:
    """``(module, name or "", internal)`` for every import in module ``name``: relative ones resolved inside
    torch_bridge (``internal``), absolute ones of torch_bridge or functional_state."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [p for p in package if p]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}".strip(".")
                out.append((full, "", True) if full in MODULES else (base.strip("."), alias.name, True))
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in (ROOT, "functional_state")
        ):
            internal = node.module.split(".")[0] == ROOT
            base = node.module.removeprefix(ROOT).strip(".") if internal else node.module
            for alias in node.names:
                full = f"{base}.{alias.name}".strip(".")
                out.append((full, "", internal) if internal and full in MODULES else (base, alias.name, internal))
    return out


def _module_aliases(name: str) -> set[str]:
    """Local names bound to a module (``from .. import harness as dz``, ``import functional_state.x as m``)."""
    out = set()
    for target, imported, _ in _imports(name):
        if not imported:
            out.add(target.split(".")[-1])
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname and not alias.name[0].isupper():
                    out.add(alias.asname)
        elif isinstance(node, ast.Import):
            out |= {
                a.asname or a.name.split(".")[0]
                for a in node.names
                if a.name.split(".")[0] in (ROOT, "functional_state")
            }
    return out


def test_no_module_is_oversized_except_the_listed_ones():
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in MODULES.values()}
    over = {f: n for f, n in sizes.items() if n > MAX_LINES and f not in OVERSIZED}
    assert not over, f"modules over {MAX_LINES} lines: {over}; split them by concept"
    stale = [f for f in OVERSIZED if sizes.get(f, 0) <= MAX_LINES]
    assert not stale, f"listed as oversized but no longer are (drop them from OVERSIZED): {stale}"


def test_no_import_runs_up_the_layer_order():
    upward = [
        f"{name} ({_layer(name)}) imports {target} ({_layer(target)})"
        for name in MODULES
        if name not in UPWARD_OK
        for target, _, internal in _imports(name)
        if internal and LAYERS.index(_layer(target)) > LAYERS.index(_layer(name))
    ]
    assert not upward, upward


def test_no_private_name_crosses_a_module():
    crossing = []
    for name, path in MODULES.items():
        aliases = _module_aliases(name)
        for target, imported, _ in _imports(name):
            if imported.startswith("_") and not imported.startswith("__"):
                crossing.append(f"{name}: from {target} import {imported}")
        for node in ast.walk(ast.parse(path.read_text())):
            private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            if private and isinstance(node.value, ast.Name) and node.value.id in aliases:
                crossing.append(f"{name}: {node.value.id}.{node.attr}")
    assert not crossing, crossing


def test_the_harness_face_is_the_documented_set_and_the_adapters_keep_no_old_paths():
    pytest.importorskip("torch")
    from torch_bridge import adapters, harness

    assert set(harness.__all__) == HARNESS_PUBLIC, (
        sorted(set(harness.__all__) - HARNESS_PUBLIC),
        sorted(HARNESS_PUBLIC - set(harness.__all__)),
    )
    for name in ("Cosmos3Shapes", "Cosmos3TransformerCache", "cosmos3_bespoke", "dreamzero_rollout", "paged_engine"):
        assert not hasattr(adapters, name), name  # nothing was released: no shim keeps an old import path
