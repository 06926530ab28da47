"""Shared test helpers: deep bitwise snapshots of pytrees, for purity checks."""

from __future__ import annotations

from typing import Any

import chex
import jax
import numpy as np
import torch


def _leaf_fingerprint(leaf: Any) -> tuple:
    if isinstance(leaf, torch.Tensor):
        flat = leaf.detach().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return ("torch", str(leaf.dtype), tuple(leaf.shape), leaf.untyped_storage().data_ptr(), raw)
    if isinstance(leaf, (jax.Array, np.ndarray)):
        a = np.asarray(leaf)
        return ("array", a.dtype.str, a.shape, a.tobytes())
    if isinstance(leaf, (int, float, str, bool, type(None), bytes)):
        return ("value", type(leaf).__name__, leaf)
    return ("object", type(leaf).__name__, id(leaf))


def snapshot(tree: Any) -> tuple:
    """A deep, bitwise snapshot of ``tree``: structure (incl. aux data) and every leaf's bytes or identity."""
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return treedef, [(jax.tree_util.keystr(p), _leaf_fingerprint(x)) for p, x in leaves_with_paths]


def assert_unchanged(tree: Any, snap: tuple) -> None:
    """Fail, naming the first differing leaf, if ``tree`` no longer matches ``snap``."""
    treedef, leaves = snapshot(tree)
    assert treedef == snap[0], f"tree structure changed:\n before {snap[0]}\n after  {treedef}"
    chex.assert_trees_all_equal([p for p, _ in leaves], [p for p, _ in snap[1]])  # same leaf paths, same order
    for (path, before), (_, after) in zip(snap[1], leaves):
        assert before == after, f"leaf {path} changed: {before[:3]} -> {after[:3]}"
