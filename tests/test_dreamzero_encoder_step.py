"""The DreamZero adapter's per-step encoder write and read (issue 24): the lean path
(`append_vae_encoder_chunk` + `observation_latents`) against the bespoke history, through every way the
ring can change under it (park, fork, evict, a lost ring, a strict adapter whose session left), and the
fallbacks the lean path hands off to."""

import pytest
import torch

import functional_state as fs
from functional_state import SessionStateManager
from torch_bridge import wrap
from torch_bridge.adapters import BespokeDreamZeroState, DreamZeroStateAdapter

_ENCODER = "vae_encoder_out"


def _chunk(i, t=1):
    g = torch.Generator().manual_seed(i)
    return torch.randn(1, 8, t, 4, 6, generator=g).to(torch.bfloat16)


def _bits(x):
    return x.dtype, tuple(x.shape), x.contiguous().reshape(-1).view(torch.int16).tolist()


def _same(a, b):
    assert (a is None) == (b is None)
    if a is not None:
        assert _bits(a) == _bits(b)


def _fed(chunks, window=2, sid="s", manager=None):
    manager = manager or SessionStateManager()
    bespoke, adapter = BespokeDreamZeroState(), DreamZeroStateAdapter(sid, manager, vae_encoder_window=window)
    for c in chunks:
        bespoke.append_vae_encoder_chunk(c)
        adapter.append_vae_encoder_chunk(c)
    return bespoke, adapter, manager


def test_a_held_observation_is_fresh_storage_later_appends_and_writes_into_it_change_nothing():
    chunks = [_chunk(i) for i in range(3)]
    bespoke, adapter, _ = _fed(chunks)
    obs = adapter.observation_latents(2)
    held = _bits(obs)
    assert held == _bits(bespoke.observation_latents(2))
    ring_ptrs = {c.untyped_storage().data_ptr() for c in chunks}
    assert obs.untyped_storage().data_ptr() not in ring_ptrs  # a fresh tensor, as the deque's torch.cat returns
    for i in range(3, 6):
        adapter.append_vae_encoder_chunk(_chunk(i))
        bespoke.append_vae_encoder_chunk(_chunk(i))
    assert _bits(obs) == held  # a later append never reaches an observation the caller holds
    obs.add_(1)  # nor does a caller writing into its observation reach the ring
    _same(adapter.observation_latents(2), bespoke.observation_latents(2))
    _same(chunks[-1], _chunk(2))


@pytest.mark.parametrize("change", ["park", "fork", "evict", "remove", "reset_stream"])
def test_the_observation_follows_the_ring_through_park_fork_evict_and_loss(change):
    chunks = [_chunk(i) for i in range(4)]
    bespoke, adapter, manager = _fed(chunks, window=3)
    later = [_chunk(10 + i) for i in range(2)]
    if change == "park":
        assert adapter._session.park(_ENCODER)  # the next read restores it, bit for bit
        assert adapter._session.state.get(_ENCODER).parked
    elif change == "fork":
        manager.fork_session("s", "t")
        fork = DreamZeroStateAdapter("t", manager, vae_encoder_window=3)
        forked = BespokeDreamZeroState()
        for c in chunks + [_chunk(20)]:
            forked.append_vae_encoder_chunk(c)
        fork.append_vae_encoder_chunk(_chunk(20))  # the fork's own frame: never seen by the source
        for n in (1, 2, 3):
            _same(fork.observation_latents(n), forked.observation_latents(n))
    elif change in ("evict", "remove", "reset_stream"):
        if change == "evict":
            adapter._session.evict(_ENCODER)
        elif change == "remove":
            adapter._session.remove(_ENCODER)
        else:
            adapter.reset_vae_encoder_stream()
        assert adapter.observation_latents(2) is None  # the ring's frames are gone: none is served stale
        bespoke = BespokeDreamZeroState()
    for n in (1, 2, 3):
        _same(adapter.observation_latents(n), bespoke.observation_latents(n))
    for c in later:  # a parked ring is restored, a lost one rebuilt, by the append itself
        adapter.append_vae_encoder_chunk(c)
        bespoke.append_vae_encoder_chunk(c)
        for n in (1, 2, 3):
            _same(adapter.observation_latents(n), bespoke.observation_latents(n))
    ring = adapter._session.state.get(_ENCODER)
    kept = ring.view()[-1]  # a copy of the caller's chunk (issue 34: a reused buffer never reaches the ring)
    assert isinstance(ring, fs.LatentBuffer) and ring.resident and _bits(kept) == _bits(later[-1])
    assert kept.untyped_storage().data_ptr() != later[-1].untyped_storage().data_ptr()
    # The ring stays the session's state object, seen by the accounting: every byte of every ring, and no other.
    rings = [x for s in fs.sessions(manager.state).values() for x in s.get(_ENCODER).view()]
    assert manager.stats()["total_nbytes"] == sum(fs.nbytes_by_device(*rings).values())


def test_ring_items_that_are_not_torch_tensors_are_read_back_as_torch():
    bespoke, adapter, _ = _fed([_chunk(0)])
    adapter._session.commit(_ENCODER, wrap(_chunk(1)))  # another writer put a JAX alias into the ring
    bespoke.append_vae_encoder_chunk(_chunk(1))
    _same(adapter.observation_latents(2), bespoke.observation_latents(2))
    _same(adapter.observation_latents(1), bespoke.observation_latents(1))


def test_a_tensor_subclass_and_multi_frame_chunks_take_the_checked_path():
    chunks = [torch.nn.Parameter(_chunk(0), requires_grad=False), _chunk(1, t=3), _chunk(2, t=0), _chunk(3)]
    bespoke, adapter, _ = _fed(chunks, window=2)
    for n in (1, 2):
        _same(adapter.observation_latents(n), bespoke.observation_latents(n))
    for bad in (torch.zeros(1, 8, 4, 6), [1, 2]):
        with pytest.raises(ValueError, match=r"\(B, C, T, H, W\)"):
            adapter.append_vae_encoder_chunk(bad)
    for bad in (0, -1, True, 2.0, 3):
        with pytest.raises(ValueError, match="positive int|retains 2"):
            adapter.observation_latents(bad)
    _same(adapter.observation_latents(2), bespoke.observation_latents(2))  # the refusals changed nothing


def test_a_strict_adapter_refuses_the_encoder_step_once_its_session_left():
    manager = SessionStateManager(max_sessions=1)
    strict = DreamZeroStateAdapter("a", manager, strict=True)
    strict.append_vae_encoder_chunk(_chunk(0))
    DreamZeroStateAdapter("b", manager)  # the count cap evicts "a"
    for use in (lambda: strict.append_vae_encoder_chunk(_chunk(1)), lambda: strict.observation_latents(1)):
        with pytest.raises(fs.SessionStateLostError, match="'a': this state object refers to a session"):
            use()
    assert "a" not in manager


@pytest.mark.parametrize("window", [1, 2, 3])
def test_a_caller_that_reuses_its_output_buffer_never_changes_the_window(window):
    # The ring kept the caller's chunk by reference: an encoder writing each chunk into one preallocated buffer
    # changed every frame of the adapter's window, while the bespoke history had copied them (`torch.cat`).
    bespoke, adapter = (
        BespokeDreamZeroState(),
        DreamZeroStateAdapter("s", SessionStateManager(), vae_encoder_window=window),
    )
    out = torch.empty_like(_chunk(0))
    for i in range(6):
        out.copy_(_chunk(i))
        bespoke.append_vae_encoder_chunk(out)
        adapter.append_vae_encoder_chunk(out)
        # The bespoke keeps its first chunk itself (no copy before its first torch.cat), so its oldest frame
        # reads the caller's buffer: compared on the frames it copied.
        for n in range(1, min(window, max(i, 1)) + 1):
            _same(adapter.observation_latents(n), bespoke.observation_latents(n))
    out.zero_()  # the caller's buffer, written after the last append
    for n in range(1, window + 1):
        _same(adapter.observation_latents(n), bespoke.observation_latents(n))
        _same(adapter.observation_latents(n)[:, :, -1:], _chunk(5))
    adapter.vae_encoder_out = out.copy_(_chunk(7))  # a ring seeded wholesale keeps its own copy too
    out.zero_()
    _same(adapter.vae_encoder_out, _chunk(7))
