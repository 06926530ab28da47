"""The DreamZero serving lifecycle, on both paths: begin, resume, close, exports, admission, capacity."""

import hashlib

import pytest
import torch

from functional_state import InvalidArgumentError, SessionAdmissionError, SessionStateLostError
from functional_state.config import enable_override
from torch_bridge.adapters import (
    BespokeDreamZeroCache,
    DreamZeroSessions,
    DreamZeroStateAdapter,
    begins_session,
)
from torch_bridge.adapters import dreamzero_rollout as rollout
from torch_bridge.adapters.dreamzero_store import default_resident_bound, estimate_session_nbytes

PATHS = ["bespoke", "manager"]


def _store(path, bound=2):
    with enable_override(path == "manager"):
        return DreamZeroSessions(resident_bound=bound)


def _run_steps(store, sid, steps, session=0, start=0, cfg=None):
    """Drive ``steps`` rollout steps on ``sid`` through the store (begin on the first when start == 0)."""
    cfg = cfg or rollout.small_config(feat_map_bytes=4096, feat_map_entries=4)
    nets = rollout._Networks(cfg)
    h = hashlib.sha256()
    for step in range(start, start + steps):
        state = store.begin(sid) if begins_session({"reset": step == 0}) else store.resume(sid)
        for value in rollout._step(state, nets, cfg, session, step):
            rollout._hash(h, value)
    return h.hexdigest()


def _fields(state):
    """Every field of a session, as plain values, to compare a session before and after."""
    feat = state.vae_enc_feat_map
    latents = state.get_concatenated_video_latents()
    return {
        "call_count": state.call_count,
        "current_start_frame": state.current_start_frame,
        "language": state.language.tolist(),
        "prompt": state.prompt_embeds.float().tolist(),
        "stream": state.vae_stream_initialized,
        "feat_map": [None if t is None else t.float().tolist() for t in feat],
        "encoder": state.vae_encoder_out.float().tolist(),
        "latents": None if latents is None else latents.float().tolist(),
        "pending": [f.tolist() for f in state.vae_pending_body_frames],
    }


@pytest.mark.parametrize("path", PATHS)
def test_begin_resume_close(path):
    store = _store(path)
    state = store.begin("a")
    assert store.resume("a") is state and store.resume("a") is state  # the same state each time
    assert "a" in store and len(store) == 1 and store.current is state
    assert store.close("a") and not store.close("a") and not store.close("never")  # idempotent
    with pytest.raises(SessionStateLostError, match="begin .*reset=True"):
        store.resume("a")
    assert len(store) == 0
    default = store.begin(None)
    assert store.resume("default") is default and store.resume(None) is default


@pytest.mark.parametrize("path", PATHS)
def test_resume_of_an_unknown_session_creates_nothing(path):
    store = _store(path)
    with pytest.raises(SessionStateLostError, match="'ghost' cannot be continued"):
        store.resume("ghost")
    assert len(store) == 0 and "ghost" not in store and len(store.manager) == 0 and not store._adapters


@pytest.mark.parametrize("path", PATHS)
def test_a_refused_begin_leaves_every_resident_session_untouched(path):
    store = _store(path, bound=2)
    _run_steps(store, "a", 9)
    _run_steps(store, "b", 5, session=1)
    before = _fields(store.resume("a"))
    with pytest.raises(SessionAdmissionError, match=r"'c' refused: 2 of 2 resident"):
        store.begin("c")
    assert _fields(store.resume("a")) == before  # feat map, stream, counters, prompt: field by field
    assert "c" not in store and len(store) == 2
    _run_steps(store, "a", 3, start=9)  # residents are still served at the bound
    store.close("b")
    store.begin("c")  # admission recovers after a close
    assert len(store) == 2


@pytest.mark.parametrize("path", PATHS)
def test_begin_of_an_existing_session_restarts_it_clean(path):
    store = _store(path)
    _run_steps(store, "a", 6)
    state = store.begin("a")
    assert state.call_count == 0 and state.vae_enc_feat_map is None and state.get_concatenated_video_latents() is None
    assert len(store) == 1


@pytest.mark.parametrize("path", PATHS)
def test_hundred_begin_close_cycles_at_the_bound_reclaim_every_slot(path):
    store = _store(path, bound=3)
    for sid in ("x", "y"):
        store.begin(sid)
    for i in range(100):
        _run_steps(store, f"s{i}", 2)  # never refused part-way: each close frees its slot
        assert store.close(f"s{i}")
    store.close("x")
    store.close("y")
    assert len(store) == 0
    if path == "manager":
        s = store.manager.stats()
        assert s["sessions"] == 0 and s["total_nbytes"] == 0


@pytest.mark.parametrize("path", PATHS)
def test_the_pipeline_alias_follows_close(path):
    store = _store(path)
    store.begin("a")
    b = store.begin("b")
    assert store.current_session_id == "b"
    store.close("a")  # an alias to another session survives
    assert store.current is b
    store.close("b")  # an alias to the released session is cleared
    assert store.current_session_id is None and store.current is None


@pytest.mark.parametrize("path", PATHS)
def test_exports_consume_history_and_never_create_it(path):
    store = _store(path)
    for what in (store.decode_accumulated_video_latents, store.clear_accumulated_video_latents):
        with pytest.raises(SessionStateLostError, match="found no resident session"):
            what("ghost")
    assert len(store) == 0
    _run_steps(store, "a", 12)
    latents = store.decode_accumulated_video_latents("a")
    assert latents is not None and latents.shape[2] > 0
    state = store.resume("a")
    calls, frame = state.call_count, state.current_start_frame
    store.clear_accumulated_video_latents("a")
    assert store.decode_accumulated_video_latents("a") is None
    state = store.resume("a")  # continuable: the stream, frames and counters survive
    assert (state.call_count, state.current_start_frame) == (calls, frame) and state.vae_enc_feat_map is not None
    _run_steps(store, "a", 4, start=12)
    store.close("a")
    with pytest.raises(SessionStateLostError):
        store.decode_accumulated_video_latents("a")


def test_set_resident_capacity_raises_both_bounds_never_lowers_them():
    store = DreamZeroSessions(enable_session_state_manager=False, resident_bound=2)
    store.set_resident_capacity(5)
    assert store.resident_bound == 5 and store.manager.state.max_sessions == 5
    for ignored in (3, 0, -4, True, 2.5, "9"):
        store.set_resident_capacity(ignored)
        assert store.resident_bound == 5 and store.manager.state.max_sessions == 5
    for i in range(5):
        store.begin(f"s{i}")
    with pytest.raises(SessionAdmissionError):
        store.begin("one-more")


def test_the_default_bound_is_sized_by_bytes_not_by_the_64_slot_cap():
    per = estimate_session_nbytes()
    bound = default_resident_bound()
    assert bound * per <= 8 * 2**30 < (bound + 1) * per
    assert bound < 64 and DreamZeroSessions(enable_session_state_manager=True).resident_bound == bound
    with pytest.raises(InvalidArgumentError):
        DreamZeroSessions(resident_bound=0)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (None, False),
        ({}, False),
        ({"reset": True}, True),
        ({"reset": False}, False),
        ({"reset": 1}, True),
        ({"reset": "yes"}, True),
        ({"tick": {"reset": True}}, True),
        ({"tick": {"reset": True}, "reset": False}, True),  # either source saying begin is a begin
        ({"tick": {"reset": False}, "reset": True}, True),
        ({"tick": {"step": 3}}, False),
        ({"tick": "malformed", "reset": True}, True),  # a malformed tick falls back to the flat key
        ({"tick": {"reset": "maybe"}, "reset": False}, False),
        ({"tick": ["reset"], "reset": False}, False),
    ],
)
def test_begins_session_reads_the_flat_key_and_the_typed_tick(extra, expected):
    assert begins_session(extra) is expected


def test_a_malformed_flat_reset_is_an_error():
    with pytest.raises(InvalidArgumentError, match="must be a flag"):
        begins_session({"reset": "maybe"})


def _interleaved_digest(get_state, sessions=3, steps=24):
    """Digest of an interleaved rollout whose state per request comes from ``get_state(sid, step)``."""
    cfg = rollout.small_config(feat_map_bytes=4096, feat_map_entries=4)
    nets = rollout._Networks(cfg)
    h = hashlib.sha256()
    for step in range(steps):
        for session in range(sessions):
            for value in rollout._step(get_state(f"s{session}", step), nets, cfg, session, step):
                rollout._hash(h, value)
    return h.hexdigest()


def test_a_continuation_after_lru_pressure_raises_instead_of_silently_restarting():
    """The old configuration evicted the least recently used session to admit a new one; the continuation of
    the evicted session then got fresh state and the rollout restarted silently, changing the output."""
    roomy = BespokeDreamZeroCache(max_sessions=64)
    reference = _interleaved_digest(lambda sid, step: roomy.get_or_create(sid))
    tight = BespokeDreamZeroCache(max_sessions=2)  # 3 sessions: every new one evicts a resident one
    assert _interleaved_digest(lambda sid, step: tight.get_or_create(sid)) != reference  # the silent restart

    from functional_state import SessionStateManager

    evicting = SessionStateManager(max_sessions=2)  # the manager-backed path of the old configuration
    digest = _interleaved_digest(lambda sid, step: DreamZeroStateAdapter(sid, evicting))
    assert digest != reference

    for path in PATHS:  # the store: the third session is refused; continuations never restart
        store = _store(path, bound=2)
        with pytest.raises(SessionAdmissionError):
            _interleaved_digest(lambda sid, step, store=store: store.begin(sid) if step == 0 else store.resume(sid))
        store.close("s0")  # released: a continuation raises instead of restarting
        with pytest.raises(SessionStateLostError):
            store.resume("s0")


def test_flag_flip_ab_through_the_store_is_bit_identical():
    digests = {}
    for enabled in (False, True):
        with enable_override(enabled):
            digests[enabled] = rollout.run_rollout(rollout.small_config(steps=60, sessions=3)).digest
    assert digests[False] == digests[True]


def test_the_store_repr_and_alias_of_torch_state():
    store = DreamZeroSessions(enable_session_state_manager=True, resident_bound=4)
    store.begin("a").vae_enc_feat_map = [torch.zeros(4)]
    assert repr(store) == "DreamZeroSessions(manager, 1/4 resident)"


def test_under_a_byte_budget_parking_keeps_every_session_and_every_output():
    """8 sessions, a device budget that holds 3 of them: with parking, all finish 400 steps bit-identical to
    the unbudgeted run and none is lost; without it, the planner drops sessions and continuations raise."""
    import dataclasses

    cfg = rollout.small_config(steps=400, sessions=8)
    with enable_override(False):
        reference = rollout.run_rollout(cfg)
    with enable_override(True):
        unbudgeted = rollout.run_rollout(cfg)
        per_session = max(unbudgeted.totals.values())
        budget = {"cpu": 3 * per_session}
        parked = rollout.run_rollout(dataclasses.replace(cfg, byte_budget=budget, trace_pools=True))
        dropping = rollout.run_rollout(dataclasses.replace(cfg, byte_budget=budget, release_levers=("evict", "drop")))
    assert unbudgeted.digest == reference.digest == parked.digest and parked.lost == []
    assert max(p.get("nbytes:cpu", 0) for p in parked.pool_trace) <= budget["cpu"]  # never over, after any round
    assert parked.stats["parks"] > 8 * 100 and parked.stats["evictions"] == 0
    assert dropping.lost and dropping.stats["evictions"] == len(dropping.lost) and dropping.digest != reference.digest
