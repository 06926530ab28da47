"""Hostile checkpoints (issue 35, issue 34 item 4): a load treats its directory as untrusted input.

The manifest's seal is a checksum, not a signature, so every edit here is resealed the way a save seals
(`persist.manifest.seal`): what must refuse it is the load's own checking of what the manifest says against
what the data holds. Each refusal is a `CheckpointError` naming the path, and the state handed to the load is
unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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
from functional_state.persist import manifest as manifest_module
from functional_state.persist.confined import MAX_DEPTH
from functional_state.transfer import checkpoint_info
from functional_state.transfer.blob import SessionBlob
from helpers import assert_unchanged, craft_ocdbt, refused_load_growth, snapshot

ROOT = Path(__file__).resolve().parents[1]


def _state() -> ManagerState:
    s, _ = fs.get_or_create(ManagerState.create(max_sessions=4), "a")
    s = fs.put(s, "a", "ring", fs.LatentBuffer.create(maxlen=3).commit(torch.arange(1024.0)))
    s = fs.put(s, "a", "j", fs.ArrayRing.create(2, (2,), jnp.float32))
    s = fs.put(s, "a", "d", fs.DenseValue.create([np.arange(4.0)]))
    s = fs.put(s, "a", "p", fs.PytreeValue.create({"k": jnp.zeros((2, 3))}))
    s = fs.set_attr(s, "a", "x", np.float32(2.5))
    return fs.set_attr(s, "a", "n", [1, {"k": "v"}])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hostile")
    fs.save_session(_state(), "a", base / "session")
    fs.save(_state(), base / "table")
    return {"session": base / "session", "table": base / "table"}


@pytest.fixture
def ck(saved, tmp_path) -> Path:
    """A fresh copy of the session checkpoint, for this test to damage."""
    return Path(shutil.copytree(saved["session"], tmp_path / "ck"))


@pytest.fixture
def table_ck(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved["table"], tmp_path / "table"))


def _step(path: Path) -> Path:
    return next(p for p in path.iterdir() if p.name.isdigit())


def _meta(path: Path) -> Path:
    return _step(path) / "manifest" / "metadata"


def _resealed(path: Path, edit) -> None:
    """Edit the manifest and seal it again, as an attacker can (the seal is a checksum, not a signature)."""
    manifest = json.loads(_meta(path).read_text())
    edit(manifest)
    manifest_module.seal(manifest)
    _meta(path).write_text(json.dumps(manifest))


def _torch_node(m: dict) -> dict:
    return m["sessions"][0]["objects"]["ring"]["fields"]["items"]["items"][0]


def _storage_key(m: dict) -> str:
    return _torch_node(m)["storage"]


def _data_file(path: Path, key: str) -> Path:
    """The data file holding leaf ``key``'s chunk (an indirect OCDBT value)."""
    from functional_state.persist.direct import database

    arrays = os.path.normpath(_step(path) / "arrays")
    return Path(arrays) / database(arrays)[f"{key}/0".encode()][0]


def _refused(path: Path, match: str = "", *, table: bool = False) -> CheckpointError:
    state = ManagerState.create()
    snap = snapshot(state)
    with pytest.raises(CheckpointError, match=f"{path}.*({match})" if match else str(path)) as info:
        fs.load(path) if table else fs.load_session(state, "a", path)
    assert_unchanged(state, snap)
    return info.value


def _loads_in_time(fn, seconds: float = 30.0) -> tuple[bool, BaseException | None]:
    """``(finished, error)`` of ``fn()`` run on a thread for at most ``seconds``."""
    out: list = []

    def body() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive()), (out[0] if out else None)


# --- 1. reads outside the checkpoint directory ------------------------------------------------------------------


def test_a_data_file_id_that_leaves_the_directory_is_refused_before_it_is_opened(ck, tmp_path, monkeypatch):
    # Regression: an OCDBT value id holding "../" was joined onto the database's directory and read by the
    # direct reader; with the leaf's checksum resealed to the outside file's, the session loaded its bytes.
    key = _storage_key(json.loads(_meta(ck).read_text()))
    secret = tmp_path / "secret"
    payload = np.arange(1024, dtype=np.float32)[::-1].copy()
    secret.write_bytes(payload.tobytes())
    arrays = os.path.normpath(_step(ck) / "arrays")
    escape = os.path.relpath(secret, arrays)
    assert escape.startswith("..")

    def outside(entry):
        if entry["key"] == f"{key}/0".encode():
            entry.pop("inline_value", None)
            entry["indirect_value"] = f"value::{escape}:0:{payload.nbytes}"

    craft_ocdbt(monkeypatch, outside)
    _resealed(ck, lambda m: m["leaves"][key].update(xxh3_128=manifest_module.checksum(payload.view(np.uint8))))
    _refused(ck, "leaves the checkpoint directory")


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../../x", "./a", "a//b", ""])
def test_relative_parts_refuses_every_name_that_could_leave_the_directory(name):
    from functional_state.persist.confined import relative_parts

    with pytest.raises(CheckpointError, match="refused"):
        relative_parts(name, "here")


# --- 2. a byte leaf must carry a checksum -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["torch_storage", "numpy"])
def test_a_byte_leaf_whose_checksum_was_removed_is_refused(ck, kind):
    # Regression: `verify` accepted a leaf with no checksum field unchecked.
    def strip(m):
        key = next(k for k, info in m["leaves"].items() if info["kind"] == kind)
        del m["leaves"][key]["xxh3_128"]

    _resealed(ck, strip)
    _refused(ck, "checksum")


# --- 3. symlinks ------------------------------------------------------------------------------------------------


def _moved_and_linked(path: Path, elsewhere: Path) -> None:
    shutil.move(path, elsewhere)
    os.symlink(elsewhere, path)


@pytest.mark.parametrize("what", ["data file", "manifest", "arrays", "step"])
def test_a_symlink_anywhere_in_the_step_is_refused(ck, tmp_path, what):
    # Regression: a data file, manifest/metadata, the arrays directory or the step itself symlinked elsewhere
    # (the same bytes, so every checksum holds) loaded from there.
    target = {
        "data file": lambda: _data_file(ck, _storage_key(json.loads(_meta(ck).read_text()))),
        "manifest": lambda: _meta(ck),
        "arrays": lambda: _step(ck) / "arrays",
        "step": lambda: _step(ck),
    }[what]()
    _moved_and_linked(target, tmp_path / "elsewhere")
    _refused(ck, "symlink")


# --- 4. FIFOs: no load blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["data file", "manifest"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(ck, what):
    # Regression: a data file replaced by a FIFO blocked `load_session` forever in `open`.
    target = _meta(ck) if what == "manifest" else _data_file(ck, _storage_key(json.loads(_meta(ck).read_text())))
    target.unlink()
    os.mkfifo(target)
    state = ManagerState.create()
    try:
        done, error = _loads_in_time(lambda: fs.load_session(state, "a", ck))
        polled, poll_error = _loads_in_time(lambda: fs.has_checkpoint(ck))
    finally:  # a reader blocked in open() (the old code) is let go: a writer opens the FIFO
        for _ in range(2):
            with contextlib.suppress(OSError):
                os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
    assert done and polled, "a load or a poll blocked on a FIFO"
    assert isinstance(error, CheckpointError) and str(ck) in str(error)
    assert poll_error is None


# --- 5. torch views past their storage ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "view",
    [
        {"shape": [1100]},  # exposed heap contents past the 1024 floats
        {"shape": [2**31]},  # grew the storage to 8 GiB
        {"offset": 1000, "shape": [25]},
        {"offset": 1024, "shape": [1]},
        {"shape": [2, 513], "stride": [512, 1]},
        {"shape": [4], "stride": [400]},
        {"stride": [-1]},
        {"offset": -1},
        {"dtype": "float64"},  # 1024 doubles on 4096 bytes
        {"dtype": "save"},  # a torch attribute, not a dtype
    ],
)
def test_a_torch_view_past_its_storage_is_refused_before_set_grows_it(ck, view):
    # Regression: `Reader._tensor` called `set_` unchecked, and `set_` grows a storage to fit the view.
    _resealed(ck, lambda m: _torch_node(m).update(view))
    _refused(ck, "offset|shape|stride|dtype")


def test_the_reader_checks_each_span_against_the_storage_it_views():
    # Issue 34 item 4: the decoder checks too (a reader of another form may build nodes itself).
    from functional_state.persist.decode import Reader

    storage = torch.zeros(64, dtype=torch.uint8)
    reader = Reader({"s": storage}, None, None)
    node = {"t": "torch", "storage": "s", "dtype": "float32", "shape": [16], "stride": [1], "offset": 0}
    assert reader.value({**node, "device": "cpu"}).shape == (16,)
    for bad in ({"shape": [17]}, {"offset": 1}, {"shape": [2, 9], "stride": [8, 1]}):
        with pytest.raises(CheckpointError, match="runs past"):
            reader.value({**node, "device": "cpu", **bad})
    assert storage.untyped_storage().nbytes() == 64  # never grown


# --- 6. memory by declaration ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [2**40, 2**31, 4097, 4095, 0])
def test_declared_bytes_must_equal_the_stored_bytes(ck, nbytes):
    # Regression: 2**40 raised a raw MemoryError after trying to allocate 1 TiB; 2**31 allocated 2 GiB and loaded.
    _resealed(ck, lambda m: m["leaves"][_storage_key(m)].update(nbytes=nbytes))
    _refused(ck, "bytes|past its storage")


@pytest.mark.parametrize("dtype", ["O", "U8", "S8", "V16", "f4,i4", "V", "(2,)f4", "M8[s]"])
def test_scalar_numpy_and_static_nodes_accept_numeric_dtypes_only(ck, dtype):
    # Regression: `{"t":"np","dtype":"V","v":2147483647}`, 40 bytes, made a 2 GiB scalar; objects, strings,
    # records loaded as such.
    _resealed(ck, lambda m: m["sessions"][0]["attrs"].update(x={"t": "np", "dtype": dtype, "v": 2147483647}))
    _refused(ck, "dtype")


@pytest.mark.parametrize("dtype", ["O", "U1", "V8", "f4,f4"])
def test_a_numpy_node_of_a_non_numeric_dtype_is_refused(ck, dtype):
    def edit(m):
        m["sessions"][0]["objects"]["d"]["fields"]["value"]["items"][0]["dtype"] = dtype

    _resealed(ck, edit)
    _refused(ck, "dtype|shape")


def test_a_numpy_node_whose_shape_disagrees_with_its_leaf_is_refused(ck):
    _resealed(ck, lambda m: m["sessions"][0]["objects"]["d"]["fields"]["value"]["items"][0].update(shape=[2, 4]))
    _refused(ck, "shape")


def test_a_refused_hostile_load_stays_within_64_mib_of_its_baseline(tmp_path):
    # Measured in a child process (peak RSS is per process): a genuine load first (the baseline), then the same
    # checkpoint declaring 2 GiB for its 8 KiB storage, and 1 TiB.
    code = textwrap.dedent(
        f"""
        import json, shutil, torch, functional_state as fs
        from functional_state.persist import manifest as mf
        s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
        s = fs.put(s, "a", "v", fs.DenseValue.create(torch.arange(2048.0)))
        fs.save_session(s, "a", {str(tmp_path / "good")!r})
        fs.load_session(fs.ManagerState.create(), "a", {str(tmp_path / "good")!r})
        for i, n in enumerate([2**31, 2**40]):
            bad = {str(tmp_path)!r} + f"/bad{{i}}"
            shutil.copytree({str(tmp_path / "good")!r}, bad)
            meta = bad + "/0/manifest/metadata"
            m = json.load(open(meta))
            next(iter(m["leaves"].values()))["nbytes"] = n
            mf.seal(m)
            json.dump(m, open(meta, "w"))
            refused_growth(bad)
        """
    )
    growth, loaded = refused_load_growth(code, ROOT)
    assert not loaded
    assert len(growth) == 2 and max(growth) < 64 * 1024, growth


# --- 7. nesting: no raw RecursionError ----------------------------------------------------------------------


def _deep(depth: int) -> dict:
    node: dict = {"t": "v", "v": 1}
    for _ in range(depth):
        node = {"t": "list", "items": [node]}
    return node


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000])
def test_json_nested_past_the_bound_is_refused_by_every_reader(ck, table_ck, depth):
    # Regression: nesting deeper than ~500 levels raised RecursionError from every load and from has_checkpoint.
    for path in (ck, table_ck):
        manifest = json.loads(_meta(path).read_text())
        manifest["sessions"][0]["attrs"]["n"] = _deep(depth)
        manifest_module.seal(manifest) if depth < 500 else None  # (json.dumps itself recurses past ~1000)
        text = json.dumps(manifest) if depth < 500 else _deep_text(manifest, depth)
        _meta(path).write_text(text)
    _refused(ck, "nests|recursion")  # (past the parser's own limit: its RecursionError, as a CheckpointError)
    _refused(table_ck, "nests|recursion", table=True)
    # A poll answers without raising: past the parser's limit the step is not a checkpoint; within it the step
    # counts, and the load refuses it.
    assert fs.has_checkpoint(ck) is (depth < 500)


def _deep_text(manifest: dict, depth: int) -> str:
    manifest["sessions"][0]["attrs"]["n"] = "@@"
    inner = '{"t": "list", "items": [' * depth + '{"t": "v", "v": 1}' + "]}" * depth
    return json.dumps(manifest).replace('"@@"', inner)


def test_the_depth_check_counts_containers_not_brackets_inside_strings():
    from functional_state.persist.confined import check_depth, load_json

    value = load_json(b'{"a": "[[[[{{{{", "b": [1, [2, {"c": []}]]}', "here")
    check_depth(value, "here", 5)  # the object, "b", its inner list, the object in it, "c"
    with pytest.raises(CheckpointError, match="here: the JSON nests more than the 4 levels"):
        check_depth(value, "here", 4)
    with pytest.raises(CheckpointError, match="not valid JSON"):  # past the parser's own limit: no RecursionError
        load_json(b"[" * 100_000 + b"]" * 100_000, "here")


# --- 8. ambiguity ---------------------------------------------------------------------------------------------


def test_two_sessions_with_one_id_are_refused(ck, table_ck):
    # Regression: in a session checkpoint the last of two sessions with one id won silently.
    _resealed(ck, lambda m: m["sessions"].append(m["sessions"][0]))
    _refused(ck, "sessions")

    def twin(m):
        m["sessions"].append(json.loads(json.dumps(m["sessions"][0])))

    _resealed(table_ck, twin)
    _refused(table_ck, "unique", table=True)


def test_a_duplicate_json_key_is_refused(ck):
    # Regression: the seal covers the parsed dict, not the bytes, so `{"nbytes": 1, "nbytes": 4096}` loaded.
    text = _meta(ck).read_text()
    assert text.count('"kind": "session"') == 1
    _meta(ck).write_text(text.replace('"kind": "session"', '"kind": "table", "kind": "session"', 1))
    _refused(ck, "twice")
    assert fs.has_checkpoint(ck) is False


@pytest.mark.parametrize(
    "table",
    [
        {"evict_when_full": "no"},
        {"evict_when_full": 0},
        {"max_sessions": 0},
        {"max_sessions": True},
        {"max_sessions": 1},  # fewer than the sessions it holds
        {"byte_budget": -1},
        {"byte_budget": {"cpu": "x"}},
        {"counters": [1, 2, 3, 4, -5]},
    ],
)
def test_a_table_configuration_of_the_wrong_type_is_refused(table_ck, table):
    # Regression: `evict_when_full: "no"` was read as true.
    def edit(m):
        m["table"].update(table)
        if table.get("max_sessions") == 1:
            m["sessions"].append({**json.loads(json.dumps(m["sessions"][0])), "id": "b"})

    _resealed(table_ck, edit)
    _refused(table_ck, "table|sessions", table=True)


# --- 9. decoded objects keep their type's invariants (`ObjectCodec.check`) ----------------------------------------


def _obj(m: dict, name: str) -> dict:
    return m["sessions"][0]["objects"][name]


def _v(value) -> dict:
    return {"t": "v", "v": value}


def _leaf_of(m: dict, name: str, field: str) -> dict:
    return _obj(m, name)["fields"][field]


def _aval(m: dict) -> dict:
    """The PytreeValue's one aval: ``{"t": "tuple", "items": [shape node, dtype node]}``."""
    return _obj(m, "p")["static"]["avals"]["items"][0]


_OBJECT_EDITS = {
    # ArrayRing "j" (capacity 2, frame (2,), float32), resident:
    "ring capacity huge": ("j", "capacity", lambda m: _obj(m, "j")["static"].update(capacity=_v(2**40))),
    "ring capacity vs storage": ("j", "capacity", lambda m: _obj(m, "j")["static"].update(capacity=_v(3))),
    "ring capacity zero": ("j", "capacity", lambda m: _obj(m, "j")["static"].update(capacity=_v(0))),
    "ring frame_shape vs storage": (
        "j",
        "frame_shape",
        lambda m: _obj(m, "j")["static"]["frame_shape"]["items"][0].update(v=3),
    ),
    "ring frame_shape negative": (
        "j",
        "frame_shape",
        lambda m: _obj(m, "j")["static"]["frame_shape"]["items"][0].update(v=-1),
    ),
    "ring dtype vs storage": ("j", "dtype", lambda m: _obj(m, "j")["static"]["dtype"].update(v="int32")),
    "ring dtype a str": ("j", "dtype", lambda m: _obj(m, "j")["static"].update(dtype=_v("float32"))),
    "ring storage when evicted": ("j", "storage", lambda m: _obj(m, "j")["static"].update(status=_v("evicted"))),
    "ring staged shape": (
        "j",
        "staged",
        lambda m: _obj(m, "j")["fields"].update(staged=dict(_leaf_of(m, "j", "storage"))),
    ),
    "ring head shape": ("j", "head", lambda m: _obj(m, "j")["fields"].update(head=dict(_leaf_of(m, "j", "storage")))),
    "ring size a python int": ("j", "size", lambda m: _obj(m, "j")["fields"].update(size=_v(1))),
    # LatentBuffer "ring" (maxlen 3, one torch item), resident:
    "buffer maxlen 0": ("ring", "maxlen", lambda m: _obj(m, "ring")["static"].update(maxlen=_v(0))),
    "buffer maxlen -1": ("ring", "maxlen", lambda m: _obj(m, "ring")["static"].update(maxlen=_v(-1))),
    "buffer maxlen float": (
        "ring",
        "maxlen",
        lambda m: _obj(m, "ring")["static"].update(maxlen={"t": "f", "v": "1.5"}),
    ),
    "buffer maxlen bool": ("ring", "maxlen", lambda m: _obj(m, "ring")["static"].update(maxlen=_v(True))),
    "buffer more items than maxlen": (
        "ring",
        "items",
        lambda m: (
            _obj(m, "ring")["static"].update(maxlen=_v(1)),
            _leaf_of(m, "ring", "items")["items"].append(_leaf_of(m, "ring", "items")["items"][0]),
        ),
    ),
    "buffer items a list": ("ring", "items", lambda m: _leaf_of(m, "ring", "items").update(t="list")),
    "buffer items a str": ("ring", "items", lambda m: _obj(m, "ring")["fields"].update(items=_v("abc"))),
    "buffer items when unallocated": (
        "ring",
        "items",
        lambda m: _obj(m, "ring")["static"].update(status=_v("unallocated")),
    ),
    # Every object's common fields:
    "status an int": ("d", "status", lambda m: _obj(m, "d")["static"].update(status=_v(1))),
    "status unknown": ("j", "status", lambda m: _obj(m, "j")["static"].update(status=_v("bogus"))),
    "status parked": ("ring", "status", lambda m: _obj(m, "ring")["static"].update(status=_v("parked"))),
    "status a str of another case": ("p", "status", lambda m: _obj(m, "p")["static"].update(status=_v("Resident"))),
    "recompute_source an int": (
        "j",
        "recompute_source",
        lambda m: _obj(m, "j")["static"].update(recompute_source=_v(5)),
    ),
    "recompute_source empty": (
        "ring",
        "recompute_source",
        lambda m: _obj(m, "ring")["static"].update(recompute_source=_v("")),
    ),
    "recompute_cost a str": ("j", "recompute_cost", lambda m: _obj(m, "j")["static"].update(recompute_cost=_v("x"))),
    "recompute_cost negative": (
        "ring",
        "recompute_cost",
        lambda m: _obj(m, "ring")["static"].update(recompute_cost={"t": "f", "v": "-1.0"}),
    ),
    "recompute_cost nan": (
        "d",
        "recompute_cost",
        lambda m: _obj(m, "d")["static"].update(recompute_cost={"t": "f", "v": "nan"}),
    ),
    "parked when evicted": (
        "ring",
        "parked",
        lambda m: (
            _obj(m, "ring").update(parked=True),
            _obj(m, "ring")["static"].update(status=_v("evicted")),
            _leaf_of(m, "ring", "items").update(items=[]),
        ),
    ),
    # DenseValue "d" (a tuple of one numpy array) and PytreeValue "p" ({"k": f32[2,3]}):
    "dense source names another object": (
        "d",
        "recompute_source",
        lambda m: _obj(m, "d")["static"].update(recompute_source=_v("j")),
    ),
    "dense value a list": ("d", "value", lambda m: _leaf_of(m, "d", "value").update(t="list")),
    "dense value a str": ("d", "value", lambda m: _obj(m, "d")["fields"].update(value=_v("abc"))),
    "dense value when evicted": ("d", "value", lambda m: _obj(m, "d")["static"].update(status=_v("evicted"))),
    "dense staged an int": ("d", "staged", lambda m: _obj(m, "d")["fields"].update(staged=_v(3))),
    "pytree aval shape vs leaf": ("p", "leaves", lambda m: _aval(m)["items"][0]["items"][1].update(v=4)),
    "pytree aval dtype vs leaf": ("p", "leaves", lambda m: _aval(m)["items"][1].update(v="int32")),
    "pytree aval dtype not numeric": ("p", "avals", lambda m: _aval(m)["items"][1].update(v="object")),
    "pytree aval shape negative": ("p", "avals", lambda m: _aval(m)["items"][0]["items"][1].update(v=-3)),
    "pytree avals vs structure": (
        "p",
        "avals",
        lambda m: _obj(m, "p")["static"]["avals"]["items"].append(_aval(m)),
    ),
    "pytree leaves when unallocated": (
        "p",
        "leaves",
        lambda m: _obj(m, "p")["static"].update(status=_v("unallocated")),
    ),
    "pytree source": ("p", "recompute_source", lambda m: _obj(m, "p")["static"].update(recompute_source=_v("j"))),
    "pytree staged of another layout": (
        "p",
        "staged",
        lambda m: _obj(m, "p")["fields"].update(staged={"t": "dict", "items": [["k", _leaf_of(m, "j", "storage")]]}),
    ),
}


@pytest.mark.parametrize("case", sorted(_OBJECT_EDITS))
def test_a_decoded_object_that_breaks_its_types_invariants_is_refused_naming_the_field(ck, case):
    # Regression (issue 35 follow-up): objects were rebuilt as `cls(**fields, **static)`, bypassing the factories'
    # validation, so each of these edits loaded (a ring claiming 2**40 frames over a 2-frame storage, a buffer
    # whose items are a str, an int status, leaves that disagree with their avals, ...). A buffer's items and
    # staged item may hold any value a checkpoint holds (numbers, strings: `LatentBuffer.commit` takes any).
    name, field, edit = _OBJECT_EDITS[case]
    _resealed(ck, edit)
    error = _refused(ck, f"session 'a': object '{name}': field '{field}' holds")
    assert "expected" in str(error)


@pytest.mark.parametrize("aux", [{"t": "tuple", "items": []}, {"t": "tuple", "items": [_v("k"), _v("k")]}])
def test_a_pytree_description_jax_would_crash_on_is_refused_at_load(ck, aux):
    # Regression: a dict node described with fewer (or repeated) keys than children loaded (plain structures
    # were not built at load), and the first `view()` handed the description to jax's own node builder, which
    # trusts it: a segfault or a raw RuntimeError. Run in a child process, so a crash fails the test only.
    _resealed(ck, lambda m: _obj(m, "p")["static"]["structure"]["items"][1]["items"].__setitem__(1, aux))
    code = textwrap.dedent(
        f"""
        import functional_state as fs
        try:
            t = fs.load_session(fs.ManagerState.create(), "a", {str(ck)!r})
        except fs.CheckpointError as e:
            print("REFUSED", e)
        else:
            fs.get_session(t, "a")[1].objects["p"].view()
            print("VIEWED")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "REFUSED" in out.stdout, (out.returncode, out.stdout, out.stderr[-2000:])
    assert "object 'p': field 'structure' holds" in out.stdout


def test_a_table_load_checks_its_objects_too(table_ck):
    # Regression: `load` rebuilt a table's objects through the same unchecked path (a 2**40-frame ring loaded).
    _resealed(table_ck, _OBJECT_EDITS["ring capacity huge"][2])
    _refused(table_ck, "session 'a': object 'j': field 'capacity' holds 1099511627776", table=True)


def _ring(**fields) -> fs.ArrayRing:
    good = fs.ArrayRing.create(2, (2,), jnp.float32).commit(jnp.ones(2, jnp.float32))
    return good._replace(**fields)


@pytest.mark.parametrize(
    "field, ring",
    [
        ("head", lambda: _ring(head=jnp.array(2, jnp.int32))),  # == capacity: the next write lands past the ring
        ("head", lambda: _ring(head=jnp.array(-1, jnp.int32))),
        ("size", lambda: _ring(size=jnp.array(3, jnp.int32))),  # more frames than the ring can hold
        ("size", lambda: _ring(size=jnp.array(1, jnp.int16))),
        ("staged", lambda: _ring(staged=jnp.ones(3, jnp.float32))),
        ("staged", lambda: _ring(staged=jnp.ones(2, jnp.int32))),
    ],
)
def test_a_ring_whose_saved_counters_or_staged_frame_break_its_invariants_is_refused(tmp_path, field, ring):
    # Regression: head and size are data (not in the manifest), so a crafted data file (here: a ring built past
    # its factory, saved as is) put the ring's next write outside its storage or made `latest` read unwritten
    # frames; both loaded.
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    fs.save_session(fs.put(s, "a", "j", ring()), "a", tmp_path / "ck")
    _refused(tmp_path / "ck", f"object 'j': field '{field}' holds")


def test_a_user_type_gets_the_common_checks_and_adds_its_own(tmp_path, monkeypatch):
    from functional_state.core import codec

    monkeypatch.setattr(codec, "_BY_TYPE", dict(codec._BY_TYPE))  # (nothing registered here outlives the test)
    monkeypatch.setattr(codec, "_BY_NAME", dict(codec._BY_NAME))

    class GainCodec(codec.ObjectCodec):
        def check(self, obj, where):
            super().check(obj, where)
            if float(np.min(obj.value)) < 0:
                raise codec.field_error(where, "value", obj.value, "gains >= 0")

    gain = type("Gain", (fs.DenseValue,), {"__module__": "user_models", "__qualname__": "Gain"})
    fs.register_checkpoint_type(gain, codec=GainCodec())

    def saved(tag: str, value, status: str = "resident") -> Path:
        obj = gain(value=value, staged=None, host_copy=None, status=status, recompute_source=None, recompute_cost=1.0)
        s, _ = fs.get_or_create(ManagerState.create(), "a")
        fs.save_session(fs.put(s, "a", "g", obj), "a", tmp_path / tag)
        return tmp_path / tag

    t = fs.load_session(ManagerState.create(), "a", saved("good", np.ones(3)))
    assert type(fs.get_session(t, "a")[1].objects["g"]) is gain
    _refused(saved("own", np.array([1.0, -1.0])), "object 'g': field 'value' holds .*expected gains >= 0")
    _refused(saved("common", np.ones(3), "bogus"), "object 'g': field 'status' holds 'bogus'")  # for free


# --- the resealed-edit sweep ----------------------------------------------------------------------------------


def _paths(x, at=()):
    yield at
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*at, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*at, i))


def _set(m, at, value):
    for k in at[:-1]:
        m = m[k]
    m[at[-1]] = value


_HOSTILE = [None, -1, 2**40, "../x", "os:system", [], {}, True, 1.5, [2**31]]


def _get(m, at):
    for k in at:
        m = m[k]
    return m


def _checked_field(at: tuple) -> bool:
    """Whether ``at`` is in an object node: what a load checks against the object's type (`ObjectCodec.check`),
    its leaves' shapes and dtypes and its node's form."""
    return len(at) > 4 and at[2] == "objects"


def _may_hold(at: tuple, value) -> bool:
    """Whether ``value`` at ``at`` (in an object node) is one its field may hold, so the load may accept it."""
    name, field = at[3], at[5] if at[4] in ("static", "fields") else at[4]
    if field == "structure":  # the key of the dict the PytreeValue holds: another key is another (valid) dict
        return at[6:] == ("items", 1, "items", 1, "items", 0, "v")
    if (name, field) in (("ring", "staged"), ("ring", "items")) and at[-1] == "v":
        return True  # a LatentBuffer item may be any value a checkpoint holds (`commit` takes any)
    allowed = {
        ("ring", "maxlen"): [None, 2**40],  # unbounded, or bounded above the one item it holds
        ("d", "value"): [[]],  # the node's items: an empty tuple is a DenseValue's value too
    }.get((name, field), [])
    return (field == "parked" and value is True) or any(value == v and type(value) is type(v) for v in allowed)


def test_every_manifest_field_edited_and_resealed_is_refused_or_loads_cleanly(ck):
    """Each field of the manifest, replaced by each hostile value and resealed: the load raises a
    `CheckpointError` naming the path or loads; never another exception, a hang, or a read outside. An edit
    inside an object node loads only where the value is one the field may hold (`_may_hold`)."""
    good = json.loads(_meta(ck).read_text())
    fields = [at for at in _paths(good) if at and at[0] != "manifest_xxh3_128"]
    assert len(fields) > 100
    outcomes: dict[str, int] = {"refused": 0, "loaded": 0}
    for i, at in enumerate(fields):
        for value in _HOSTILE[i % 3 :: 3]:  # every field, a third of the values each (all values over the sweep)
            m = json.loads(json.dumps(good))
            _set(m, at, value)
            manifest_module.seal(m)
            _meta(ck).write_text(json.dumps(m))
            state = ManagerState.create()
            try:
                fs.load_session(state, "a", ck)
                outcomes["loaded"] += 1
                unchanged = value == _get(good, at) and type(value) is type(_get(good, at))
                assert unchanged or not _checked_field(at) or _may_hold(at, value), f"editing {at} to {value!r} loaded"
            except CheckpointError as e:
                assert str(ck) in str(e), (at, value, e)
                outcomes["refused"] += 1
            except Exception as e:  # pragma: no cover - the failure this sweep exists to find
                pytest.fail(f"editing {at} to {value!r} raised {type(e).__name__}: {e}")
            assert len(state) == 0
    assert outcomes["refused"] > 5 * outcomes["loaded"], outcomes


# --- mutants that survived the suite (issue 34) -----------------------------------------------------------------


class _Pose:
    """An attr type a checkpoint cannot hold: saved and loaded through hooks."""

    def __init__(self, xyz: list[float]) -> None:
        self.xyz = xyz


def test_attr_and_object_import_hooks_are_applied_on_load(tmp_path):
    # Mutant that survived: `Reader` returning the exported value without calling the import hook (every test
    # used an identity hook, so the two were the same).
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.set_attr(s, "a", "pose", _Pose([1.0, 2.0, 3.0]))
    s = fs.put(s, "a", "o", fs.DenseValue.create(torch.arange(3.0)))
    attr_hooks = {"pose": (lambda p: {"xyz": p.xyz}, lambda d: _Pose(d["xyz"]))}
    object_hooks = {"o": (lambda o: [o.value], lambda v: fs.DenseValue.create(v[0] * 2))}
    fs.save_session(s, "a", tmp_path / "ck", attr_hooks=attr_hooks, object_hooks=object_hooks)
    t = fs.load_session(ManagerState.create(), "a", tmp_path / "ck", attr_hooks=attr_hooks, object_hooks=object_hooks)
    pose = fs.get_attr(t, "a", "pose")
    assert isinstance(pose, _Pose) and pose.xyz == [1.0, 2.0, 3.0]
    assert torch.equal(fs.view(t, "a", "o"), torch.arange(3.0) * 2)


@pytest.mark.parametrize("edit", ["renamed", "stripped-with-a-new-field"])
def test_a_current_manifest_without_its_checksum_and_with_a_field_no_earlier_one_has_is_refused(ck, edit):
    # Mutant that survived: `check_manifest` without its unsealed-manifest field check (a current manifest whose
    # checksum field was renamed, or stripped beside a field earlier versions never wrote, loaded unverified).
    manifest = json.loads(_meta(ck).read_text())
    seal = manifest.pop("manifest_xxh3_128")
    manifest["manifest_xxh3_12" if edit == "renamed" else "transfer"] = seal
    _meta(ck).write_text(json.dumps(manifest))
    _refused(ck, "no checksum")


@pytest.mark.parametrize(
    "field, edit",
    [
        ("nbytes", lambda m: m["leaves"][_storage_key(m)].update(nbytes=-1)),
        (
            "shape",
            lambda m: m["leaves"][m["sessions"][0]["objects"]["j"]["fields"]["storage"]["key"]].update(shape=[-2, -3]),
        ),
        ("offset", lambda m: _torch_node(m).update(offset=-4)),
    ],
)
def test_negative_counts_are_refused_naming_the_field(ck, field, edit):
    # Mutant that survived: the count check accepting negative numbers.
    _resealed(ck, edit)
    _refused(ck, field)


def test_negative_table_counters_are_refused(table_ck):
    _resealed(table_ck, lambda m: m["table"].update(counters=[1, 2, -3, 4, 5]))
    _refused(table_ck, "counters", table=True)


@pytest.mark.parametrize("chunks", [1, 2])
def test_copy_checksum_copies_and_hashes_the_last_byte_past_whole_chunks(chunks):
    # Mutant that survived: `copy_checksum` losing the last byte of a leaf of 4 MiB * k + 1 bytes.
    n = manifest_module._CHUNK * chunks + 1
    src = np.random.default_rng(chunks).integers(0, 256, n, dtype=np.uint8)
    out = np.zeros(n, np.uint8)
    assert manifest_module.copy_checksum(src, out) == manifest_module.checksum(src)
    assert out[-1] == src[-1] and np.array_equal(out, src)


def test_a_buffer_of_numbers_and_strings_saved_loads_back(tmp_path):
    # Regression: the decoded-object check refused a LatentBuffer whose items are not arrays, but `commit`
    # takes any item (the shell's load race commits floats), so a plain save could not be loaded back.
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "log", fs.LatentBuffer.create(maxlen=3))
    for item in (1.5, ("tag", np.arange(2.0)), "text"):
        s = fs.commit(s, "a", "log", item)
    s = fs.stage(s, "a", "log", "next")
    fs.save_session(s, "a", tmp_path / "ck")
    loaded = fs.load_session(ManagerState.create(), "a", tmp_path / "ck")
    items = fs.view(loaded, "a", "log", include_staged=False)
    assert items[0] == 1.5 and items[1][0] == "tag" and items[1][1].tolist() == [0.0, 1.0] and items[2] == "text"
    assert fs.view(loaded, "a", "log")[-1] == "next"


def test_json_that_could_hold_more_values_than_the_bound_is_refused_before_it_is_parsed(monkeypatch):
    from functional_state.persist import confined

    text = b"[" + b",".join([b"{}"] * 100) + b"]"  # 101 openings, 99 commas, plus the outermost: 201
    assert confined.json_values_at_most(text) == 201
    assert confined.json_values_at_most(text.decode()) == 201
    assert len(confined.load_json(text, "here", max_values=201)) == 100
    monkeypatch.setattr(confined.json, "loads", lambda *a, **k: pytest.fail("parsed before its values were counted"))
    with pytest.raises(CheckpointError, match="here: the JSON may hold 201 values, more than the 200"):
        confined.load_json(text, "here", max_values=200)


def test_a_transfer_blob_manifest_of_too_many_values_is_refused_as_a_transfer_error():
    from functional_state import TransferError
    from functional_state.persist.confined import MAX_JSON_VALUES

    with pytest.raises(TransferError, match="values, more than the"):
        SessionBlob.from_parts(b"[" + b"0," * MAX_JSON_VALUES + b"0]", [])


def _compressed(shape: list[int], stored: int) -> tuple[dict, dict]:
    from functional_state.persist.validate import StoredLeaf

    leaves = {"leaf0": {"kind": "jax", "shape": shape, "dtype": "float32", "sharding": {}}}
    return leaves, {"leaf0": StoredLeaf(tuple(shape), "<f4", None, stored)}


@pytest.mark.parametrize(
    "shape, stored",
    [([1 << 20], 100), ([1 << 28], 1 << 24), ([24 << 20], 1 << 20)],
    ids=["within-the-slack", "64x", "64x-plus-the-slack"],
)
def test_a_compressed_leaf_within_the_ratio_bound_is_accepted(shape, stored):
    from functional_state.persist.validate import check_stored

    check_stored(*_compressed(shape, stored), "here")


@pytest.mark.parametrize(
    "shape, stored",
    [([1 << 26], 1000), ([1 << 29], 1 << 24), ([(24 << 20) + 1], 1 << 20)],
    ids=["zeros", "128x", "one-past-the-bound"],
)
def test_a_compressed_leaf_declaring_far_more_than_its_stored_bytes_is_refused(shape, stored):
    from functional_state.persist.validate import check_stored

    with pytest.raises(CheckpointError, match=f"here: the compressed leaves declare {shape[0] * 4} bytes but"):
        check_stored(*_compressed(shape, stored), "here")


def test_a_save_a_load_would_refuse_as_too_large_is_refused_before_anything_is_written(tmp_path):
    # The load bounds a manifest before parsing it (`confined.MAX_JSON_VALUES`); a save past that bound wrote a
    # checkpoint no load accepts, so the sessions it was taken for were lost. It is refused at the save instead.
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    s = fs.put(s, "a", "many", fs.DenseValue.create(tuple(np.full(2, i, np.float32) for i in range(20_000))))
    before = snapshot(s)
    with pytest.raises(CheckpointError, match="more than a load accepts.*nothing was written"):
        fs.save_session(s, "a", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    assert_unchanged(s, before)
    s = fs.put(s, "a", "many", fs.DenseValue.create(tuple(np.full(2, i, np.float32) for i in range(3000))))
    fs.save_session(s, "a", tmp_path / "ok")  # within the bound: saves and loads back
    loaded = fs.load_session(ManagerState.create(), "a", tmp_path / "ok")
    assert fs.view(loaded, "a", "many")[2999].tolist() == [2999.0, 2999.0]


def test_a_manifest_of_empty_containers_stays_within_64_mib_of_the_baseline(tmp_path):
    # Found: a manifest was parsed whole (`confined.load_json`) before its seal or fields were checked, up to
    # 256 MiB of it: JSON of empty containers costs ~45x its bytes as Python objects (a 28 MiB manifest of `{}`
    # peaked at +1.3 GiB). Now its values are counted in the raw text and bounded before it is parsed.
    code = textwrap.dedent(
        f"""
        import json, numpy as np, functional_state as fs
        s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
        fs.save_session(fs.put(s, "a", "d", fs.DenseValue.create(np.zeros(4))), "a", {str(tmp_path / "ck")!r})
        fs.load_session(fs.ManagerState.create(), "a", {str(tmp_path / "ck")!r})  # (the baseline: a real load)
        meta = {str(tmp_path / "ck" / "0" / "manifest" / "metadata")!r}
        text = open(meta).read()
        open(meta, "w").write(text[:-1] + ', "junk": [' + ",".join(["{{}}"] * 3_000_000) + "]}}")
        del text
        refused_growth({str(tmp_path / "ck")!r})
        """
    )
    growth, loaded = refused_load_growth(code, ROOT)
    assert not loaded
    assert growth and growth[0] < 64 * 1024, f"a 9 MB manifest grew the peak by {growth[0] // 1024} MiB"


def test_a_compressed_leaf_cannot_allocate_far_more_than_its_stored_bytes(tmp_path):
    # Found: `check_stored` skipped the size check for a compressed zarr leaf (only checkpoints of versions
    # before 0.2.0 hold one): a ~100 KB checkpoint whose JAX leaf is one zstd chunk of zeros loaded a 256 MiB
    # array (2**31 floats would be 8 GiB). Compressed leaves are now held to a ratio of their stored bytes.
    code = textwrap.dedent(
        f"""
        import json, numpy as np, jax.numpy as jnp, tensorstore as ts, functional_state as fs
        from functional_state.persist import manifest as mf
        n, ck = 2**26, {str(tmp_path / "ck")!r}
        s, _ = fs.get_or_create(fs.ManagerState.create(), "a")
        fs.save_session(fs.put(s, "a", "p", fs.PytreeValue.create({{"k": jnp.ones(1024, jnp.float32)}})), "a", ck)
        fs.load_session(fs.ManagerState.create(), "a", ck)  # (the baseline: a real load)
        meta = {{"shape": [n], "chunks": [n], "dtype": "<f4", "compressor": {{"id": "zstd", "level": 3}},
                "fill_value": None, "dimension_separator": "."}}
        kv = {{"driver": "ocdbt", "base": "file://" + ck + "/0/arrays/", "path": "leaf0/"}}
        a = ts.open({{"driver": "zarr", "kvstore": kv, "metadata": meta}}, create=True, delete_existing=True).result()
        a.write(np.zeros(n, np.float32)).result()
        m = json.load(open(ck + "/0/manifest/metadata"))
        m["leaves"]["leaf0"].update(shape=[n], xxh3_128=mf.checksum(np.zeros(n, np.float32)))
        aval = {{"t": "tuple", "items": [{{"t": "tuple", "items": [{{"t": "v", "v": n}}]}}, {{"t": "v", "v": "float32"}}]}}
        m["sessions"][0]["objects"]["p"]["static"]["avals"] = {{"t": "tuple", "items": [aval]}}
        mf.seal(m)
        json.dump(m, open(ck + "/0/manifest/metadata", "w"))
        del a
        refused_growth(ck)
        """
    )
    growth, loaded = refused_load_growth(code, ROOT)
    assert not loaded, f"a ~100 KB checkpoint loaded a 256 MiB leaf (peak +{growth[0] // 1024} MiB)"
    assert growth and growth[0] < 64 * 1024, f"a refused load grew the peak by {growth[0] // 1024} MiB"


def test_checkpoint_info_of_a_resealed_float_attr_that_is_no_float_raises_a_checkpoint_error(tmp_path):
    # Found: `functional_state.transfer.checkpoint_info` (what a replica's router reads) raised a raw ValueError
    # from `float("abc")`; the validator checks an "f" node's value is a str, not that it parses.
    s, _ = fs.get_or_create(ManagerState.create(), "a")
    fs.save_session(fs.set_attr(s, "a", "step", 16.5), "a", tmp_path / "ck")
    meta = tmp_path / "ck" / "0" / "manifest" / "metadata"
    m = json.loads(meta.read_text())
    m["sessions"][0]["attrs"]["step"] = {"t": "f", "v": "abc"}
    manifest_module.seal(m)
    meta.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=str(tmp_path / "ck")):
        checkpoint_info(tmp_path / "ck")


def _bogus_fork_policy(m: dict) -> None:
    m["sessions"][0]["policies"] = {"h": "bogus"}


def _empty_session_id(m: dict) -> None:
    m["sessions"][1]["id"] = ""


def _empty_object_name(m: dict) -> None:
    m["sessions"][0]["objects"][""] = m["sessions"][0]["objects"].pop("d")


def _empty_attr_name(m: dict) -> None:
    m["sessions"][0]["attrs"][""] = m["sessions"][0]["attrs"].pop("h")


@pytest.mark.parametrize("edit", [_bogus_fork_policy, _empty_session_id, _empty_object_name, _empty_attr_name])
def test_a_resealed_table_checkpoint_of_names_or_policies_no_table_holds_raises_a_checkpoint_error(tmp_path, edit):
    # Found: `load` re-raised every SessionStateError as it was, so the InvalidArgumentError / InvalidTypeError
    # that rebuilding a crafted session raises (an unknown fork policy, an empty session, object or attr name)
    # escaped raw; `load_session` already turned them into CheckpointError.
    s, _ = fs.get_or_create(ManagerState.create(max_sessions=4), "a")
    s = fs.put(s, "a", "d", fs.DenseValue.create(np.zeros(4)))
    s = fs.set_attr(s, "a", "h", [1, 2], on_fork="copy_container")
    fs.save(fs.get_or_create(s, "b")[0], tmp_path / "ck")
    meta = tmp_path / "ck" / "0" / "manifest" / "metadata"
    m = json.loads(meta.read_text())
    edit(m)
    manifest_module.seal(m)
    meta.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=str(tmp_path / "ck")):
        fs.load(tmp_path / "ck")


@pytest.mark.parametrize("nbytes", [2**40, 2**30])
def test_a_database_entry_claiming_more_bytes_than_its_data_file_holds_is_refused_before_allocating(
    tmp_path, monkeypatch, nbytes
):
    # Found: `check_stored` holds a leaf's declared bytes to the length its OCDBT entry claims, never to the data
    # file: a hand-made tree node (simulated here as the hostile suite does, by editing what `ts.ocdbt.dump`
    # lists) claiming 1 TiB made the load raise a raw MemoryError from `np.empty`; 1 GiB allocated it, then
    # failed on the short read.

    s, _ = fs.get_or_create(ManagerState.create(), "a")
    fs.save_session(fs.put(s, "a", "d", fs.DenseValue.create(torch.arange(1024.0))), "a", tmp_path / "ck")
    meta = tmp_path / "ck" / "0" / "manifest" / "metadata"
    m = json.loads(meta.read_text())
    key = next(k for k, v in m["leaves"].items() if v["kind"] == "torch_storage")
    m["leaves"][key]["nbytes"] = nbytes
    manifest_module.seal(m)
    meta.write_text(json.dumps(m))

    def claim(entry):
        if entry["key"] == f"{key}/.zarray".encode():
            z = json.loads(bytes(entry["inline_value"]))
            z.update(shape=[nbytes], chunks=[nbytes])
            entry["inline_value"] = json.dumps(z).encode()
        elif entry["key"] == f"{key}/0".encode():
            entry["indirect_value"] = entry["indirect_value"].rsplit(":", 1)[0] + f":{nbytes}"

    craft_ocdbt(monkeypatch, claim)
    allocated: list[int] = []
    real_empty = np.empty

    def watched(shape, *args, **kw):
        allocated.append(int(np.prod(shape)))
        return real_empty(shape, *args, **kw)

    monkeypatch.setattr(np, "empty", watched)
    with pytest.raises(CheckpointError, match="holds"):
        fs.load_session(ManagerState.create(), "a", tmp_path / "ck")
    assert max(allocated, default=0) < 2**20, f"allocated {max(allocated)} bytes for a 4 KiB storage"
