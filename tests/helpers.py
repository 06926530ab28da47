"""Shared test helpers: deep bitwise snapshots of pytrees and tables, for purity checks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import chex
import jax
import numpy as np

import functional_state as fs
from functional_state.shell import admission as _admission

try:  # the core install has no torch (`make test-pythons` runs the tests that need none)
    import torch
except ImportError:
    torch = None  # type: ignore[assignment]


def _leaf_fingerprint(leaf: Any) -> tuple:
    if torch is not None and isinstance(leaf, torch.Tensor):
        flat = leaf.detach().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return ("torch", str(leaf.dtype), tuple(leaf.shape), leaf.untyped_storage().data_ptr(), raw)
    if isinstance(leaf, (jax.Array, np.ndarray)):
        a = np.asarray(leaf)
        return ("array", a.dtype.str, a.shape, a.tobytes())
    if isinstance(leaf, (int, float, str, bool, type(None), bytes)):
        return ("value", type(leaf).__name__, leaf)
    return ("object", type(leaf).__name__, id(leaf))


def _table_meta(state: fs.ManagerState) -> tuple:
    ids = state.session_ids
    return (
        ids,
        tuple(fs.incarnation(state, sid) for sid in ids),
        (state.hits, state.misses, state.evictions, state.max_sessions, state.byte_budget, state.evict_when_full),
    )


_TABLE = "ManagerState"  # a snapshot of a table starts with this tag; one of a pytree with its PyTreeDef


def _is_table_snapshot(snap: tuple) -> bool:
    # Compare the tag only when it is a str: PyTreeDef.__eq__ raises TypeError for a str on jaxlib < 0.8.
    return isinstance(snap[0], str) and snap[0] == _TABLE


def snapshot(tree: Any) -> tuple:
    """A deep, bitwise snapshot: structure (incl. aux data), every leaf's bytes or identity, and for a
    `ManagerState` its recency order, incarnations, counters and config."""
    if isinstance(tree, fs.ManagerState):
        return (_TABLE, _table_meta(tree), snapshot(fs.sessions(tree)))
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return treedef, [(jax.tree_util.keystr(p), _leaf_fingerprint(x)) for p, x in leaves_with_paths]


def assert_unchanged(tree: Any, snap: tuple) -> None:
    """Fail, naming the first difference, if ``tree`` no longer matches ``snap``."""
    if _is_table_snapshot(snap):
        assert isinstance(tree, fs.ManagerState)
        assert _table_meta(tree) == snap[1], f"table changed: {snap[1]} -> {_table_meta(tree)}"
        assert_unchanged(fs.sessions(tree), snap[2])
        return
    treedef, leaves = snapshot(tree)
    assert treedef == snap[0], f"tree structure changed:\n before {snap[0]}\n after  {treedef}"
    chex.assert_trees_all_equal([p for p, _ in leaves], [p for p, _ in snap[1]])  # same leaf paths, same order
    for (path, before), (_, after) in zip(snap[1], leaves):
        assert before == after, f"leaf {path} changed: {before[:3]} -> {after[:3]}"


def promised_frees(plan) -> dict[str, int]:
    """Bytes a release plan says leave each pool (negative: arriving), summed over its actions, sorted."""
    out: dict[str, int] = {}
    for action in plan.actions:
        for pool, n in action.frees.items():
            out[pool] = out.get(pool, 0) + n
    return {p: n for p, n in sorted(out.items()) if n}


def finishes(fn: Any, timeout: float = 10.0) -> bool:
    """Run ``fn`` in a thread; True if it returned within ``timeout`` (a deadlock would not)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # surfaced by the caller
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if errors:
        raise errors[0]
    return not t.is_alive()


def damage(path: Any, how: str) -> None:
    """Cut the file at ``path`` to half its length (``"truncate"``) or flip one byte in its middle (``"flip"``)."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


def race(target: Any, n_threads: int) -> None:
    """Run ``target(i)`` on ``n_threads`` threads at once, switching threads as often as the interpreter can
    (a race shows up within a few operations), and wait for them all."""
    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=target, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)


class HookLock:
    """A lock that runs the next of ``hooks`` (None: nothing) just before each acquisition while any are
    left: another thread's write landing between a caller's check and its own lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hooks: list[Callable[[], Any] | None] = []

    def acquire(self, *args: Any) -> bool:
        if self.hooks:
            hook = self.hooks.pop(0)
            if hook is not None:
                hook()
        return self._lock.acquire(*args)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> HookLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def leave_table(manager: fs.SessionStateManager, how: str) -> None:
    """Session "a" leaves the table: evicted by the count cap, dropped, or replaced by a new incarnation."""
    if how == "evicted":
        manager.get_or_create_session("b")
    else:
        manager.drop_session("a")
        if how == "replaced":
            manager.get_or_create_session("a").put("x", fs.LatentBuffer.create(maxlen=2))


def grow_in_place(t: Any, how: str, nbytes: int) -> None:
    """Give torch tensor ``t`` ``nbytes`` of storage in place, as a model may: ``"resize_"`` (the tensor),
    ``"storage"`` (its storage's ``resize_``) or ``"set_"`` (another storage swapped in)."""
    import torch

    if how == "resize_":
        t.resize_(nbytes // t.element_size())
    elif how == "storage":
        t.untyped_storage().resize_(nbytes)
    else:
        t.set_(torch.zeros(nbytes // t.element_size(), dtype=t.dtype))


class _Done:
    """A finished future holding ``value`` (what `tensorstore.ocdbt.dump` returns)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


def craft_ocdbt(monkeypatch: Any, edit: Callable[[dict[str, Any]], None]) -> None:
    """Make every OCDBT tree node a load reads pass through ``edit(entry)`` for each of its entries, as a
    crafted arrays database would hold them (tensorstore refuses to write such nodes itself)."""
    import tensorstore as ts

    real_dump = ts.ocdbt.dump

    def crafted(kv: Any, node: Any = None, **kw: Any) -> Any:
        if node is None:
            return real_dump(kv, **kw)
        value = real_dump(kv, node, **kw).result()
        for entry in value.get("entries", []):
            edit(entry)
        return _Done(value)

    monkeypatch.setattr(ts.ocdbt, "dump", crafted)


_REFUSED_GROWTH = """
import resource
import functional_state as _fs


def refused_growth(path):
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        _fs.load_session(_fs.ManagerState.create(), "a", path)
        print("LOADED")
    except _fs.CheckpointError:
        pass
    print("GROWTH_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""


def refused_load_growth(code: str, cwd: Any) -> tuple[list[int], bool]:
    """Run ``code`` in a fresh interpreter (peak RSS is per process), where ``refused_growth(path)`` loads
    session ``"a"`` of the checkpoint at ``path``; return the peak growth in KiB of each such load, and whether
    any of them loaded instead of being refused."""
    source = _REFUSED_GROWTH + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", source], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    growth = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("GROWTH_KIB")]
    return growth, "LOADED" in out.stdout


def table_with_attrs(n: int, attr: Callable[[int], Any]) -> fs.ManagerState:
    """A table of ``n`` sessions ``s{i}``, each with a 2-item torch `LatentBuffer` and the attr ``prompt =
    attr(i)``, its byte totals kept (`stats` called once)."""
    import torch

    state = fs.ManagerState.create(max_sessions=n)
    for i in range(n):
        state, _ = fs.get_or_create(state, f"s{i}")
        state = fs.put(state, f"s{i}", "buf", fs.LatentBuffer.create(maxlen=2).commit(torch.zeros(4)))
        state = fs.set_attr(state, f"s{i}", "prompt", attr(i))
    fs.stats(state)
    return state


def recheck_answers(m: Any) -> list[bool]:
    """Spy on the budget recheck of ``m``: a list with one entry per budgeted commit (True: the recheck decided)."""
    seen: list[bool] = []
    recheck = m._ops.slot.recheck  # (the shell's own recheck, read by the test only)

    class Spy(_admission.Recheck):
        __slots__ = ()

        def within(self, *args):  # type: ignore[no-untyped-def]
            seen.append(super().within(*args))
            return seen[-1]

    spy = Spy()
    for name in _admission.Recheck.__slots__:
        setattr(spy, name, getattr(recheck, name))
    m._ops.slot.recheck = spy
    return seen
