"""`functional-state inspect PATH [--verify]` (functional_state.checkpoint_summary): a checkpoint's sessions,
objects, bytes per pool and metadata from its manifest, and its checksums verified, without a manager."""

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import functional_state as fs
from functional_state.__main__ import main
from functional_state.checkpoint_summary import render, summarize, verify
from functional_state.persist.manifest import seal

pytest.importorskip("orbax.checkpoint", reason="checkpoints need the [checkpoint] extra (orbax-checkpoint)")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def saved(tmp_path):
    s, _ = fs.get_or_create(fs.ManagerState.create(max_sessions=8), "a")
    s = fs.put(s, "a", "ring", fs.ArrayRing.create(4, (8,)))  # 4*8*4 B storage, and two int32 counters
    s = fs.put(s, "a", "kv", fs.PytreeValue.create({"x": jnp.ones((16, 4), jnp.float32)}))  # 256 B
    s = fs.set_attr(s, "a", "prompt", "hello")
    s, _ = fs.get_or_create(s, "b")
    s = fs.put(s, "b", "latents", fs.PytreeValue.create({"z": np.zeros(10, np.float64)}))  # 80 B, numpy
    s, _ = fs.park(s, "a", "kv")
    fs.save(s, tmp_path / "ck")
    return tmp_path / "ck"


def test_summary_lists_sessions_objects_bytes_and_metadata(saved):
    info = summarize(saved)
    assert [x.id for x in info.sessions] == ["a", "b"]
    a = {o.name: o for o in info.sessions[0].objects}
    assert (a["kv"].type, a["kv"].status, a["kv"].nbytes) == ("PytreeValue", "parked", 256)
    assert (a["ring"].type, a["ring"].status, a["ring"].nbytes) == ("ArrayRing", "resident", 128 + 8)
    assert info.sessions[0].attrs == ("prompt",) and info.sessions[0].nbytes == 256 + 136
    assert info.sessions[1].nbytes == 80 and info.nbytes == 256 + 136 + 80
    assert sum(info.pools.values()) == info.nbytes and set(info.pools) == {"cpu"}
    assert info.metadata["kind"] == "table" and info.metadata["library_version"] == fs.__version__
    assert info.metadata["table"]["max_sessions"] == 8 and info.metadata["table"]["counters"]["parks"] == 1
    text = render(info)
    assert "session 'a': 2 object(s)" in text and "parked" in text and "bytes per pool: cpu 472 B" in text
    assert max(map(len, text.splitlines())) <= 100 + len(str(saved))


def test_verify_checks_every_checksum_and_names_a_corrupted_leaf(saved):
    assert verify(saved) == summarize(saved).leaves
    # The bytes on disk no longer match what the (resealed) manifest promises for one leaf.
    meta = saved / str(summarize(saved).step) / "manifest" / "metadata"
    manifest = json.loads(meta.read_text())
    key = next(k for k, info in manifest["leaves"].items() if info["kind"] == "numpy")
    manifest["leaves"][key]["xxh3_128"] = "0" * 32
    seal(manifest)
    meta.write_text(json.dumps(manifest))
    summarize(saved)  # the manifest itself is sound
    with pytest.raises(fs.CheckpointError, match=rf"leaf '{key}' \(.*\) fails its checksum"):
        verify(saved)


def test_inspect_command_prints_the_summary_and_exits_1_on_a_bad_path(saved, tmp_path, capsys):
    assert main(["inspect", str(saved), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "session 'b'" in out and "verified: every checksum" in out
    assert main(["inspect", str(tmp_path / "nothing")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_inspect_needs_no_torch(saved):
    # The command runs without importing torch (a JAX-only install can inspect a checkpoint).
    code = (
        "import sys; from functional_state.__main__ import main; rc = main(['inspect', sys.argv[1], '--verify']); "
        "assert 'torch' not in sys.modules, 'inspect imported torch'; sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(saved)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "session 'a'" in out.stdout
