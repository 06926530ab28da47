"""`WanEncoderStream`: diffusers' real Wan causal VAE encoder, streamed per session through the manager.

Every result is compared with diffusers' own one-shot ``encode`` of the whole video, bit for bit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import AutoencoderKLWan

import functional_state as fs
from functional_state import (
    InvalidTypeError,
    ObjectNotFoundError,
    SessionExistsError,
    SessionStateLostError,
    SessionStateManager,
    StateShapeError,
)
from functional_state.shell.session_ops import SessionOps
from torch_bridge.adapters.wan import FEAT_MAP, MissingExtraError, WanEncoderStream, require_diffusers

ROOT = Path(__file__).resolve().parents[1]
HW = (16, 24)
FRAMES = 14  # 1 + 4 * 3 whole groups, and one frame left pending
CALLS = (1, 2, 3, 1, 5, 2)  # frames per call: groups fill across calls and calls span groups


def tiny_vae() -> AutoencoderKLWan:
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=4, num_res_blocks=1).eval()


@pytest.fixture(scope="module")
def vae() -> AutoencoderKLWan:
    return tiny_vae()


def video(seed: int, frames: int = FRAMES) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 3, frames, *HW, generator=g)


def reference(vae: AutoencoderKLWan, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' one-shot ``encode``: (the encoder's output, the latent distribution's parameters).

    The encoder output is what the feat cache carries from chunk to chunk, read off ``quant_conv``'s input.
    """
    whole = 1 + (x.shape[2] - 1) // 4 * 4  # the frames diffusers encodes (the last partial group waits)
    seen: list[torch.Tensor] = []
    hook = vae.quant_conv.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            params = vae.encode(x[:, :, :whole]).latent_dist.parameters
    finally:
        hook.remove()
    return seen[0], params


def assert_matches_one_shot(vae: AutoencoderKLWan, outs: list[torch.Tensor], x: torch.Tensor) -> None:
    """Each call's latents are diffusers' ``quant_conv`` of the one-shot encoder output over the same latent
    frames, bit for bit; and together they are ``encode(x).latent_dist.parameters``.

    ``quant_conv`` is a stateless 1x1x1 conv: oneDNN rounds it differently for different frame counts (an
    ulp), so the whole-video comparison allows that; everything the feat cache carries is compared exactly.
    """
    encoded, params = reference(vae, x)
    t = 0
    for out in outs:
        n = out.shape[2]
        with torch.no_grad():
            want = vae.quant_conv(encoded[:, :, t : t + n]) if n else out
        assert torch.equal(out, want), (t, n)
        t += n
    assert t == params.shape[2]
    torch.testing.assert_close(torch.cat(outs, 2), params, rtol=0, atol=1e-6)


def pieces(x: torch.Tensor, calls: tuple[int, ...] = CALLS) -> list[torch.Tensor]:
    out, t = [], 0
    for n in calls:
        out.append(x[:, :, t : t + n])
        t += n
    assert t == x.shape[2]
    return out


def storage_nbytes(tensors: list[torch.Tensor]) -> int:
    """An independent count: each distinct storage once."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def held_tensors(manager: SessionStateManager) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(feat cache tensors, pending tensors) of every session, read from the immutable table."""
    cache, pending = [], []
    for s in fs.sessions(manager.state).values():
        obj = s.get(FEAT_MAP, None)
        if obj is not None and obj.value is not None:
            cache += [t for t in obj.value if t is not None]
        p = s.get_attr("wan_pending_frames", None)
        if p is not None:
            pending.append(p)
    return cache, pending


@pytest.mark.parametrize("park", [False, True], ids=["resident", "park-every-call"])
def test_four_interleaved_sessions_equal_one_shot_encode(vae: AutoencoderKLWan, park: bool) -> None:
    manager = SessionStateManager()
    stream = WanEncoderStream(vae, manager, park_between_calls=park)
    twin = SessionStateManager()  # the same stream unparked: its bytes are what the parked run must report
    twin_stream = WanEncoderStream(vae, twin)
    videos = {f"s{i}": video(i) for i in range(4)}
    outs: dict[str, list[torch.Tensor]] = {sid: [] for sid in videos}
    for sid in videos:
        stream.begin(sid)
        twin_stream.begin(sid)
    for step in range(len(CALLS)):
        for sid, x in videos.items():
            chunk = pieces(x)[step]
            outs[sid].append(stream.encode(sid, chunk))
            twin_stream.encode(sid, chunk)
            cache, pending = held_tensors(twin)
            got = manager.stats()
            assert got["total_nbytes"] == storage_nbytes(cache + pending)
            if park:
                assert got["parked_nbytes"] == storage_nbytes(cache)
                assert got.get("nbytes:cpu", 0) == storage_nbytes(pending)
                assert fs.lookup(manager.state, sid).get(FEAT_MAP).parked
            else:
                assert got["nbytes:cpu"] == storage_nbytes(cache + pending) == manager.stats(exact=True)["nbytes:cpu"]
    for sid, x in videos.items():
        assert_matches_one_shot(vae, outs[sid], x)
        assert stream.pending_frames(sid) == 1 and stream.frames_in(sid) == FRAMES
    if park:
        assert manager.stats()["parks"] == 4 * len(CALLS) and manager.stats()["restores"] == 4 * len(CALLS) - 4


def test_one_transaction_per_call(vae: AutoencoderKLWan, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = SessionStateManager()
    stream = WanEncoderStream(vae, manager)
    stream.begin("s")
    calls: list[str] = []
    # Every write a handle makes to its session is one of these (a table verb, or a transaction).
    for verb in ("apply", "transact"):
        real = getattr(SessionOps, verb)
        monkeypatch.setattr(
            SessionOps, verb, lambda self, *a, _r=real, _v=verb, **kw: calls.append(_v) or _r(self, *a, **kw)
        )
    stream.encode("s", video(0, 5))  # two chunks, 17 cached convs each
    assert len(calls) == 1, calls


def test_fork_mid_group_each_branch_equals_an_unforked_run(vae: AutoencoderKLWan) -> None:
    manager = SessionStateManager()
    stream = WanEncoderStream(vae, manager)
    a, b = video(1), video(2)
    head = 7  # the first frame, one group, and two frames pending at the fork
    stream.begin("root")
    first = stream.encode("root", a[:, :, :head])
    stream.fork("root", "branch")
    assert stream.pending_frames("branch") == 2
    rest_a = stream.encode("root", a[:, :, head:])
    rest_b = stream.encode("branch", b[:, :, head:])
    assert_matches_one_shot(vae, [first, rest_a], a)
    assert_matches_one_shot(vae, [first, rest_b], torch.cat([a[:, :, :head], b[:, :, head:]], 2))


_RESUME = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    from functional_state import SessionStateManager
    from torch_bridge.adapters.wan import WanEncoderStream
    from tests.test_wan import tiny_vae, video
    manager = SessionStateManager()
    stream = WanEncoderStream(tiny_vae(), manager)
    outs = {}
    for sid, seed, path in (("resident", 3, sys.argv[1]), ("parked", 4, sys.argv[2])):
        manager.load_session(sid, path)
        outs[sid] = stream.encode(sid, video(seed)[:, :, int(sys.argv[4]):])
    torch.save(outs, sys.argv[3])
    """
)


@pytest.fixture
def one_torch_thread():
    """The child resumes on one thread; the parent's reference must too (conv results depend on the count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
def test_checkpoint_mid_stream_resumes_in_a_fresh_process(vae: AutoencoderKLWan, tmp_path: Path) -> None:
    pytest.importorskip("orbax.checkpoint")
    manager = SessionStateManager()
    resident = WanEncoderStream(vae, manager)
    parked = WanEncoderStream(vae, manager, park_between_calls=True)
    head = 6  # mid-group: one frame pending
    firsts = {}
    for sid, seed, s in (("resident", 3, resident), ("parked", 4, parked)):
        s.begin(sid)
        firsts[sid] = s.encode(sid, video(seed)[:, :, :head])
    assert fs.lookup(manager.state, "parked").get(FEAT_MAP).parked
    manager.save_session("resident", tmp_path / "resident")
    manager.save_session("parked", tmp_path / "parked")
    out = tmp_path / "out.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-c", _RESUME, str(tmp_path / "resident"), str(tmp_path / "parked"), str(out), str(head)],
        check=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    resumed = torch.load(out)
    for sid, seed in (("resident", 3), ("parked", 4)):
        assert_matches_one_shot(vae, [firsts[sid], resumed[sid]], video(seed))


def test_bad_input_is_refused_and_changes_nothing(vae: AutoencoderKLWan) -> None:
    manager = SessionStateManager()
    stream = WanEncoderStream(vae, manager)
    stream.begin("s")
    stream.encode("s", video(0, 3))
    before = fs.lookup(manager.state, "s")
    bad = [
        (video(0, 2).double(), StateShapeError, "float32"),
        (torch.randn(1, 4, 2, *HW), StateShapeError, "3 channels"),
        (torch.randn(1, 3, 2, 8, 24), StateShapeError, "(1, 3, 16, 24, 'torch.float32')"),
        (torch.randn(1, 3, 0, *HW), StateShapeError, "time >= 1"),
        (torch.randn(3, 2, *HW), StateShapeError, "batch, channels, time"),
        (video(0, 2).numpy(), InvalidTypeError, "torch tensor"),
    ]
    for frames, error, text in bad:
        with pytest.raises(error, match=re.escape(text)):
            stream.encode("s", frames)
        assert fs.lookup(manager.state, "s") is before
    with pytest.raises(SessionStateLostError, match="nobody"):
        stream.encode("nobody", video(0, 1))
    manager.get_or_create_session("plain")
    with pytest.raises(ObjectNotFoundError, match="begin"):
        stream.encode("plain", video(0, 1))
    with pytest.raises(SessionExistsError, match="close"):
        stream.begin("s")
    assert fs.lookup(manager.state, "s") is before
    stream.close("s")
    assert FEAT_MAP not in fs.lookup(manager.state, "s")
    with pytest.raises(InvalidTypeError, match="AutoencoderKLWan"):
        WanEncoderStream(torch.nn.Linear(1, 1), manager)
    with pytest.raises(InvalidTypeError, match="SessionStateManager"):
        WanEncoderStream(vae, object())


def test_missing_diffusers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "diffusers" or m.startswith("diffusers.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtraError, match=r"functional-state\[diffusers\]"):
        require_diffusers()
    with pytest.raises(ImportError):  # also an ImportError, for code that guards optional imports
        WanEncoderStream(object(), SessionStateManager())


@pytest.mark.parametrize("dim_mult", [[1, 2, 2], [1, 2, 4, 4]])
def test_empty_outputs_have_the_latent_grid_of_the_vae(dim_mult: list[int]) -> None:
    # `_empty_latents` read `vae.spatial_compression_ratio`, a config value that defaults to 8 whatever the
    # encoder's real downsampling: with dim_mult=[1, 2, 2] a session returned (1, 8, 1, 4, 4), then
    # (1, 8, 0, 2, 2), and `torch.cat` of its outputs failed.
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, num_res_blocks=1, dim_mult=dim_mult)
    stream = WanEncoderStream(vae.eval(), SessionStateManager())
    stream.begin("s")
    x = torch.randn(1, 3, 6, 18, 26, generator=torch.Generator().manual_seed(3))  # not multiples of 8
    outs = [stream.encode("s", x[:, :, t : t + 1]) for t in range(6)]
    assert [o.shape[2] > 0 for o in outs] == [True, False, False, False, True, False]  # empty between chunks
    assert len({o.shape[:2] + o.shape[3:] for o in outs}) == 1, [tuple(o.shape) for o in outs]
    assert torch.cat(outs, 2).shape[2] == sum(o.shape[2] for o in outs)
