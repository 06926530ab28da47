"""Checkpoints that lose nothing (issue 19): parked objects with many storages, saves racing one directory,
a save left pending at exit, a damaged manifest, and every bad input refused with nothing changed."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functional_state as fs
from functional_state import CheckpointError, ManagerState
from helpers import assert_unchanged, snapshot

ROOT = Path(__file__).resolve().parents[1]


def _bits(x) -> tuple:
    """What must come back bit for bit: framework, dtype, shape and every byte."""
    if isinstance(x, torch.Tensor):
        raw = x.detach().contiguous().reshape(-1).view(torch.uint8)
        return ("torch", str(x.dtype), tuple(x.shape), raw.numpy().tobytes())
    a = np.asarray(x)
    return (type(x).__name__ if isinstance(x, np.ndarray) else "jax", a.dtype.name, a.shape, a.tobytes())


def _feat_map() -> list:
    """A streaming VAE cache as diffusers keeps one: 14 storages of mixed dtypes and odd sizes (so storages sit
    at unaligned starts in the parked host buffer), several leaves views at offsets, two sharing a storage."""
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.float16, torch.int32]
    out = []
    for i in range(14):
        n = 3 + 2 * i
        base = (torch.arange(2 * n) * (i + 3)) % 11 - 4
        base = (base % 3 == 0) if dtypes[i % 7] is torch.bool else base.to(dtypes[i % 7])
        out.append(base[1 : n + 1] if i % 2 else base)  # a view at an offset
        if i % 5 == 0:
            out.append(base.view(2, n)[:, 1:])  # a strided view of the same storage
    return out


def _objects() -> dict:
    return {
        "fm": fs.DenseValue.create(_feat_map()),
        "jx": fs.DenseValue.create(jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * 1.5),
        "mixed": fs.DenseValue.create(
            [jnp.arange(5, dtype=jnp.int32) - 2, torch.linspace(0, 1, 9), torch.arange(6, dtype=torch.bfloat16)[2:]]
        ),
    }


def _table(parked: bool = True) -> ManagerState:
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    for name, obj in _objects().items():
        s = fs.put(s, "a", name, obj)
        if parked:
            s, _ = fs.park(s, "a", name)
    return s


def _restored_bits(state: ManagerState, sid: str) -> dict:
    out = {}
    for name, obj in fs.lookup(state, sid).objects.items():
        if obj.parked:
            state, _ = fs.restore(state, sid, name)
        value = fs.view(state, sid, name)
        out[name] = [_bits(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return out


def _expected_bits() -> dict:
    return {
        name: [_bits(v) for v in (o.value if isinstance(o.value, (list, tuple)) else [o.value])]
        for name, o in _objects().items()
    }


# --- 1. parked objects with many storages --------------------------------------------------------------------


def test_a_parked_tensor_keeps_requires_grad_through_a_checkpoint(tmp_path):
    # Regression: the writer rebuilt parked leaves without their autograd flag, so a parked tensor that
    # required grad came back without it (a resident one kept it).
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    leaves = [torch.arange(8.0, requires_grad=True), torch.full((4,), 2.0), torch.arange(6)[2:]]
    s = fs.put(s, "a", "v", fs.DenseValue.create(leaves))
    s, _ = fs.park(s, "a", "v")
    fs.save_session(s, "a", tmp_path / "ck")
    back, _ = fs.restore(fs.load_session(ManagerState.create(), "a", tmp_path / "ck"), "a", "v")
    got = fs.view(back, "a", "v")
    assert [t.requires_grad for t in got] == [True, False, False]
    assert [_bits(t) for t in got] == [_bits(t) for t in leaves]


def test_a_parked_object_with_many_storages_comes_back_bit_exact_from_save_session(tmp_path):
    s = _table()
    assert all(o.parked for o in fs.lookup(s, "a").objects.values())
    snap = snapshot(s)
    fs.save_session(s, "a", tmp_path / "ck")
    assert_unchanged(s, snap)
    loaded = fs.load_session(ManagerState.create(), "a", tmp_path / "ck")
    assert all(o.parked for o in fs.lookup(loaded, "a").objects.values())  # parked again on load
    assert _restored_bits(loaded, "a") == _expected_bits()
    restored, _ = fs.restore(loaded, "a", "fm")
    fm = fs.view(restored, "a", "fm")
    # The leaves that viewed one storage view one storage again; the others stay apart.
    assert fm[0].untyped_storage().data_ptr() == fm[1].untyped_storage().data_ptr()
    assert len({t.untyped_storage().data_ptr() for t in fm}) == 14


def test_a_parked_feat_map_comes_back_bit_exact_from_a_whole_table_save(tmp_path):
    s = _table()
    s, _ = fs.get_or_create(s, "b")
    s = fs.put(s, "b", "fm", fs.DenseValue.create(_feat_map()[::-1]))
    s, _ = fs.park(s, "b", "fm")
    fs.save(s, tmp_path / "table", asynchronous=True).wait()
    loaded = fs.load(tmp_path / "table")
    assert _restored_bits(loaded, "a") == _expected_bits()
    assert _restored_bits(loaded, "b")["fm"] == [_bits(v) for v in _feat_map()[::-1]]


def test_objects_the_planner_parked_come_back_bit_exact(tmp_path):
    s = _table(parked=False)
    s, _ = fs.get_or_create(s, "new")
    s = fs.put(s, "new", "small", fs.DenseValue.create(torch.ones(4)))
    held = fs.stats(s)["nbytes:cpu"]
    budgeted = ManagerState.create(byte_budget={"cpu": 64})
    for sid in ("a", "new"):
        budgeted, _ = fs.get_or_create(budgeted, sid)
        for name, obj in fs.lookup(s, sid).objects.items():
            budgeted = fs.put(budgeted, sid, name, obj)
    assert held > 64
    within = fs.enforce_budget(budgeted, protect=["new"], levers=("park",))
    assert all(o.parked for o in fs.lookup(within, "a").objects.values())  # the planner parked them
    fs.save(within, tmp_path / "table")
    assert _restored_bits(fs.load(tmp_path / "table"), "a") == _expected_bits()


# --- 2. one writer per directory -----------------------------------------------------------------------------


def _generation_values(gen: int) -> list:
    return [torch.full((1 << 14,), float(gen)), torch.arange(gen + 1)]


def _generation(gen: int) -> ManagerState:
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "v", fs.DenseValue.create(_generation_values(gen)))
    s, _ = fs.park(s, "a", "v")
    return fs.set_attr(s, "a", "gen", gen)


def _loaded_generation(path: Path) -> int:
    t = fs.load_session(ManagerState.create(), "a", path)
    gen = fs.get_attr(t, "a", "gen")
    t, _ = fs.restore(t, "a", "v")
    assert [_bits(v) for v in fs.view(t, "a", "v")] == [_bits(v) for v in _generation_values(gen)]
    return gen


def test_saves_racing_to_one_directory_are_serialised_and_never_lose_the_checkpoint(tmp_path):
    path = tmp_path / "ck"
    fs.save_session(_generation(0), "a", path)
    rng = random.Random(19)
    states = {g: _generation(g) for g in range(1, 17)}
    for round_ in range(8):
        gens = (2 * round_ + 1, 2 * round_ + 2)
        delays = [rng.uniform(0, 0.02) for _ in gens]
        errors: list[BaseException] = []
        start = threading.Barrier(2)

        def save(gen: int, delay: float, asynchronous: bool) -> None:
            start.wait()
            threading.Event().wait(delay)
            try:
                fs.save_session(states[gen], "a", path, asynchronous=asynchronous).wait()
            except BaseException as e:  # reported below, with the round
                errors.append(e)

        threads = [
            threading.Thread(target=save, args=(gens[0], delays[0], True)),
            threading.Thread(target=save, args=(gens[1], delays[1], round_ % 2 == 0)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, f"round {round_}: {errors!r}"
        assert _loaded_generation(path) in gens  # whichever finished last, whole
        assert len([p for p in path.iterdir() if p.name.isdigit()]) == 1  # and only it: the older steps are gone


# --- 3. a pending asynchronous save at exit ------------------------------------------------------------------


def _child(code: str, *, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def test_an_asynchronous_save_nobody_waits_for_completes_at_exit(tmp_path):
    path = tmp_path / "ck"
    done = _child(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import functional_state as fs
        from test_checkpoint_faults import _generation
        fs.save_session(_generation(3), "a", {str(path)!r}, asynchronous=True)
        """
    )  # and exits at once, the write still in flight
    assert done.returncode == 0
    assert "Traceback" not in done.stderr and "cannot schedule" not in done.stderr and "ERROR" not in done.stderr
    assert fs.has_checkpoint(path) and _loaded_generation(path) == 3
    assert not [p for p in path.iterdir() if "tmp" in p.name]


# --- 4. the manifest carries its own checksum ----------------------------------------------------------------


def _manifest_file(path: Path) -> Path:
    return next(p for p in path.iterdir() if p.name.isdigit()) / "manifest" / "metadata"


def _ring_checkpoint(tmp_path) -> Path:
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    ring = fs.LatentBuffer.create(maxlen=3)
    for i in range(4):
        ring = ring.commit(torch.full((2, 2), float(i)))
    s = fs.put(fs.put(s, "a", "ring", ring), "a", "j", fs.ArrayRing.create(3, (2,), jnp.float32))
    fs.save_session(s, "a", tmp_path / "ck")
    return tmp_path / "ck"


@pytest.mark.parametrize(
    "old, new",
    [
        ('"shape": [2, 2]', '"shape": [2, 0]'),
        ('"capacity": {"t": "v", "v": 3}', '"capacity": {"t": "v", "v": 2}'),
        ("xxh3_128", "xxh3_129"),
    ],
)
def test_a_one_character_edit_of_the_manifest_is_refused(tmp_path, old, new):
    path = _ring_checkpoint(tmp_path)
    meta = _manifest_file(path)
    text = meta.read_text()
    assert old in text
    meta.write_text(text.replace(old, new, 1))
    state = ManagerState.create()
    snap = snapshot(state)
    with pytest.raises(CheckpointError, match=f"{path}.*(checksum|corrupted)"):
        fs.load_session(state, "a", path)
    assert_unchanged(state, snap)


def test_every_single_character_edit_that_keeps_the_manifest_json_is_refused(tmp_path):
    path = _ring_checkpoint(tmp_path)
    meta = _manifest_file(path)
    good = meta.read_text()
    positions = [i for i, c in enumerate(good) if c.isalnum()]
    tried = 0
    for i in positions[:: max(1, len(positions) // 60)]:
        c = good[i]
        edited = good[:i] + ("1" if c == "0" else "0" if c.isdigit() else "x" if c != "x" else "y") + good[i + 1 :]
        try:
            json.loads(edited)
        except ValueError:
            continue
        meta.write_text(edited)
        tried += 1
        with pytest.raises(CheckpointError):
            fs.load_session(ManagerState.create(), "a", path)
    assert tried > 40
    meta.write_text(good)
    assert fs.has_checkpoint(path) and fs.load_session(ManagerState.create(), "a", path) is not None


def _unsealed(path: Path, edit) -> None:
    """Rewrite the manifest as versions before the manifest checksum wrote it, edited by ``edit``."""
    meta = _manifest_file(path)
    manifest = json.loads(meta.read_text())
    manifest.pop("manifest_xxh3_128", None)
    edit(manifest)
    meta.write_text(json.dumps(manifest))


def test_a_manifest_without_a_checksum_as_earlier_versions_wrote_still_loads(tmp_path):
    path = _ring_checkpoint(tmp_path)
    _unsealed(path, lambda m: None)
    t = fs.load_session(ManagerState.create(), "a", path)
    assert [x.tolist() for x in fs.lookup(t, "a").objects["ring"].items] == [[[float(i)] * 2] * 2 for i in (1, 2, 3)]


# --- 5. bad input: a library error naming the path, and nothing changed ---------------------------------------


def _drop(key):
    return lambda m: m.pop(key)


def _rename_in_torch_nodes(m) -> None:
    node = m["sessions"][0]["objects"]["ring"]["fields"]["items"]["items"][0]
    node["storag"] = node.pop("storage")


@pytest.mark.parametrize(
    "edit",
    [_drop("leaves"), _drop("sessions"), _rename_in_torch_nodes, lambda m: m["leaves"].popitem()],
    ids=["no-leaves", "no-sessions", "renamed-field", "a-leaf-missing"],
)
def test_an_unchecksummed_manifest_missing_what_a_load_reads_is_refused(tmp_path, edit):
    path = _ring_checkpoint(tmp_path)
    _unsealed(path, edit)
    state = ManagerState.create()
    snap = snapshot(state)
    with pytest.raises(CheckpointError, match=str(path)):
        fs.load_session(state, "a", path)
    assert_unchanged(state, snap)


@pytest.mark.parametrize("counters", [[1, 2, 3], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, "5"]])
def test_table_counters_of_another_shape_are_refused(tmp_path, counters):
    fs.save(_table(), tmp_path / "t")
    _unsealed(tmp_path / "t", lambda m: m["table"].update(counters=counters))
    with pytest.raises(CheckpointError, match=f"{tmp_path / 't'}.*counters"):
        fs.load(tmp_path / "t")


def test_paths_that_cannot_be_checkpoint_directories_get_a_checkpoint_error(tmp_path):
    s = _table()
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "loop_a", tmp_path / "file" / "ck", tmp_path / "file"):
        with pytest.raises(CheckpointError, match=str(bad)):
            fs.save_session(s, "a", bad)
        with pytest.raises(CheckpointError, match=str(bad)):
            fs.load_session(ManagerState.create(), "a", bad)
        assert not fs.has_checkpoint(bad)
    assert (tmp_path / "file").read_text() == "x"


def test_a_save_never_deletes_a_directory_it_did_not_write(tmp_path):
    s = _table()
    other = tmp_path / "other_tool"
    (other / "0" / "manifest").mkdir(parents=True)
    (other / "0" / "manifest" / "notes.txt").write_text("keep me")
    assert not fs.has_checkpoint(other)
    with pytest.raises(CheckpointError, match=f"{other / '0'}.*would delete it"):
        fs.save_session(s, "a", other)
    assert (other / "0" / "manifest" / "notes.txt").read_text() == "keep me"
    # Nor a step-like directory that turns up beside our own checkpoint.
    ours = tmp_path / "ours"
    fs.save_session(_generation(1), "a", ours)
    (ours / "5").mkdir()
    (ours / "5" / "data.bin").write_bytes(b"\x01")
    with pytest.raises(CheckpointError, match=f"{ours / '5'}"):
        fs.save_session(_generation(2), "a", ours)
    assert (ours / "5" / "data.bin").read_bytes() == b"\x01"
    assert not fs.has_checkpoint(ours)  # the newest step is not ours
    (ours / "5" / "data.bin").unlink()
    (ours / "5").rmdir()
    assert _loaded_generation(ours) == 1


_FSIZE_CHILD = """
import resource, signal, sys
sys.path.insert(0, {tests!r})
import functional_state as fs
from test_checkpoint_faults import _generation
s = _generation(2)
s = fs.set_attr(s, "a", "big", __import__("torch").ones(1 << 20))  # 4 MiB: more than the file size limit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    fs.save_session(s, "a", {path!r}, asynchronous={asynchronous}).wait()
except fs.CheckpointError as e:
    print("CheckpointError", e)
{tail}
"""


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_write_that_fails_for_lack_of_space_raises_a_checkpoint_error_and_keeps_the_previous(tmp_path, asynchronous):
    path = tmp_path / "ck"
    fs.save_session(_generation(1), "a", path)
    code = _FSIZE_CHILD.format(tests=str(ROOT / "tests"), path=str(path), asynchronous=asynchronous, tail="")
    done = _child(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("CheckpointError") and str(path) in done.stdout, done.stdout + done.stderr[-2000:]
    assert _loaded_generation(path) == 1
    fs.save_session(_generation(4), "a", path)  # and the directory takes the next save
    assert _loaded_generation(path) == 4


def test_an_asynchronous_save_that_fails_unheard_is_reported_at_exit(tmp_path):
    path = tmp_path / "ck"
    fs.save_session(_generation(1), "a", path)
    code = _FSIZE_CHILD.format(tests=str(ROOT / "tests"), path=str(path), asynchronous=True, tail="")
    code = code.replace(".wait()", "")  # nobody waits: the failure must still be heard
    done = _child(code)
    assert "the asynchronous save to" in done.stderr and "failed before exit" in done.stderr, done.stderr[-2000:]
    assert _loaded_generation(path) == 1


def test_a_directory_another_controller_is_marking_is_not_refused_as_foreign(tmp_path):
    # Regression: the controllers of one multi-process save prepare the directory at once; the second saw the
    # first's half-written marker (or its fresh directory) and refused, failing the save (seen under load).
    path = tmp_path / "ck"
    path.mkdir()
    (path / "_FUNCTIONAL_STATE.4242.1.tmp").write_text("{}")  # another process, mid-write
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "v", fs.DenseValue.create(torch.arange(4.0)))
    fs.save_session(s, "a", path)
    back = fs.load_session(ManagerState.create(), "a", path)
    assert torch.equal(fs.view(back, "a", "v"), torch.arange(4.0))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not ours")
    with pytest.raises(CheckpointError, match="non-empty directory"):
        fs.save_session(s, "a", tmp_path / "other")
