"""The DreamZero serving lifecycle, on both paths: begin, resume, close, exports, admission, capacity."""

import dataclasses
import gc
import hashlib
import weakref

import numpy as np
import pytest
import torch

from functional_state import (
    InvalidArgumentError,
    InvalidTypeError,
    SessionAdmissionError,
    SessionStateLostError,
    incarnation,
)
from functional_state.shell.config import ENV_MAX_SESSIONS, enable_override
from torch_bridge import harness as rollout
from torch_bridge.adapters import (
    BespokeDreamZeroCache,
    DreamZeroSessions,
    DreamZeroStateAdapter,
    begins_session,
)
from torch_bridge.adapters.dreamzero_store import MIB, default_resident_bound, estimate_session_nbytes

PATHS = ["bespoke", "manager"]


def _store(path, bound=2):
    with enable_override(path == "manager"):
        return DreamZeroSessions(resident_bound=bound)


def _run_steps(store, sid, steps, session=0, start=0, cfg=None):
    """Drive ``steps`` rollout steps on ``sid`` through the store (begin on the first when start == 0)."""
    cfg = cfg or rollout.small_config(feat_map_bytes=4096, feat_map_entries=4)
    nets = rollout.Networks(cfg)
    h = hashlib.sha256()
    for step in range(start, start + steps):
        state = store.begin(sid) if begins_session({"reset": step == 0}) else store.resume(sid)
        for value in rollout.pipeline_step(state, nets, cfg, session, step):
            rollout.hash_value(h, value)
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
    store.set_resident_capacity(3)  # a lower capacity never lowers the bound (that would drop sessions)
    assert store.resident_bound == 5 and store.manager.state.max_sessions == 5
    for i in range(5):
        store.begin(f"s{i}")
    with pytest.raises(SessionAdmissionError):
        store.begin("one-more")


@pytest.mark.parametrize("n", [np.int64(5), np.int32(5), np.uint8(5)])
def test_set_resident_capacity_accepts_numpy_integers(n):
    # Regression (issue 19): an np.int64 capacity was silently ignored (isinstance(n, int) is False for it).
    store = DreamZeroSessions(enable_session_state_manager=True, resident_bound=2)
    store.set_resident_capacity(n)
    assert store.resident_bound == 5 and type(store.resident_bound) is int and store.manager.state.max_sessions == 5
    for i in range(5):
        store.begin(f"s{i}")
    assert len(store) == 5


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (True, InvalidTypeError, "got the bool True"),
        (2.5, InvalidTypeError, r"got 2\.5 \(float\)"),
        (9.0, InvalidTypeError, r"got 9\.0 \(float\)"),
        ("9", InvalidTypeError, r"got '9' \(str\)"),
        (None, InvalidTypeError, "got None"),
        (0, InvalidArgumentError, r"\(>= 1\), got 0"),
        (-4, InvalidArgumentError, r"\(>= 1\), got -4"),
        (np.int64(-1), InvalidArgumentError, r"got -1"),
    ],
)
def test_set_resident_capacity_refuses_what_is_not_a_positive_integer(bad, error, match):
    # Regression (issue 19): these were ignored without a word, so a runner never learnt its capacity was lost.
    store = DreamZeroSessions(enable_session_state_manager=True, resident_bound=2)
    with pytest.raises(error, match=r"`DreamZeroSessions.set_resident_capacity: n` .*" + match):
        store.set_resident_capacity(bad)
    assert store.resident_bound == 2 and store.manager.state.max_sessions == 2


def test_the_max_sessions_variable_sets_the_store_bound_unless_an_argument_does(monkeypatch, caplog):
    # Regression (issue 19): OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS had no effect on the store.
    monkeypatch.setenv(ENV_MAX_SESSIONS, "3")
    for enabled in (False, True):
        store = DreamZeroSessions(enable_session_state_manager=enabled)
        assert store.resident_bound == 3 and store.manager.state.max_sessions == 3
        for i in range(3):
            store.begin(f"s{i}")
        with pytest.raises(SessionAdmissionError, match="3 of 3 resident"):
            store.begin("s3")
    explicit = DreamZeroSessions(enable_session_state_manager=True, resident_bound=np.int64(5))
    assert explicit.resident_bound == 5 and explicit.manager.state.max_sessions == 5  # code beats the variable
    monkeypatch.setenv(ENV_MAX_SESSIONS, "many")
    with caplog.at_level("WARNING"):
        fallback = DreamZeroSessions(enable_session_state_manager=True)
    assert fallback.resident_bound == default_resident_bound() and "not a positive int" in caplog.text
    monkeypatch.delenv(ENV_MAX_SESSIONS)
    assert DreamZeroSessions(enable_session_state_manager=True).resident_bound == default_resident_bound()
    for bad, error in ((2.0, InvalidTypeError), (True, InvalidTypeError), (0, InvalidArgumentError)):
        with pytest.raises(error, match="resident_bound"):
            DreamZeroSessions(resident_bound=bad)


def _budget_store(levers=("drop",)):
    """A manager-backed store whose byte budget holds one 1 MiB feat map, not two."""
    return DreamZeroSessions(
        enable_session_state_manager=True, resident_bound=8, byte_budget={"cpu": 3 * MIB // 2}, release_levers=levers
    )


def _feat_map_session(store, sid):
    """Begin ``sid`` with a 1 MiB feat map; returns a weakref to the tensor (the caller keeps no reference)."""
    tensor = torch.full((MIB // 4,), 1.0)
    ref = weakref.ref(tensor)
    store.begin(sid).vae_enc_feat_map = [tensor]
    return ref


def test_a_session_the_budget_drops_is_freed_not_kept_alive_by_the_store():
    # Regression (issue 19): the store cached its adapters strongly, so a dropped session's feat map stayed in
    # memory (held by the adapter's detached copy) while stats() said its bytes were freed.
    store = _budget_store()
    first = _feat_map_session(store, "a")
    second = _feat_map_session(store, "b")  # over budget: the planner drops "a" (b is the writer)
    assert "a" not in store and "b" in store and store.manager.stats()["evictions"] == 1
    assert store.manager.stats()["nbytes:cpu"] == MIB
    gc.collect()
    assert first() is None, "the dropped session's feat map is still alive"
    assert second() is not None  # the live one is held by the table
    with pytest.raises(SessionStateLostError, match="'a' cannot be continued"):
        store.resume("a")


def test_the_store_never_serves_an_adapter_of_a_replaced_incarnation():
    # Regression (issue 19): after a drop and a re-create directly in the manager, `resume` served the cached
    # adapter of the old incarnation: it read the old history and its writes never reached the table.
    store = _store("manager")
    old = store.begin("a")
    old.call_count = 7
    old.vae_enc_feat_map = [torch.ones(4)]
    old_incarnation = incarnation(store.manager.state, "a")
    store.manager.drop_session("a")
    store.manager.get_or_create_session("a")  # a new incarnation under the same id
    assert incarnation(store.manager.state, "a") != old_incarnation
    new = store.resume("a")
    assert new is not old and new.in_table and not old.in_table
    assert new.call_count == 0 and new.vae_enc_feat_map is None  # the new session's (empty) history
    new.call_count = 3
    assert store.manager.get_session("a").get_attr("call_count") == 3  # its writes reach the table
    assert store.resume("a") is new and store.current is new
    with pytest.raises(SessionStateLostError, match="no longer in the manager"):
        old.call_count  # noqa: B018 (the old incarnation's state is dead, not served stale)


def test_the_store_cache_never_outlives_the_table_under_pressure():
    # Regression (issue 19): sessions released by the budget stayed in the adapter cache, which grew without
    # bound beyond the count cap; the cache holds at most what the table holds.
    store = _budget_store()
    for i in range(20):
        _feat_map_session(store, f"s{i}")
        gc.collect()
        assert len(store.manager) <= store.resident_bound
        assert set(store._adapters) <= {f"s{j}" for j in range(20) if f"s{j}" in store}
    assert store.manager.stats()["evictions"] == 19 and len(store._adapters) <= 1


@pytest.mark.parametrize("release", ["close", "budget drop", "restart"])
def test_a_state_used_after_its_session_left_the_table_raises(release):
    # Regression (issue 19): writes through a state whose session was dropped went to a detached copy nobody
    # reads (and reads served the dropped history): no error, no effect.
    store = _budget_store()
    state = store.begin("a")
    state.call_count = 2
    if release == "close":
        store.close("a")
    elif release == "budget drop":
        state.vae_enc_feat_map = [torch.zeros(MIB // 4)]
        _feat_map_session(store, "b")
    else:
        store.begin("a")  # a begin of a live session restarts it: old states refer to the old incarnation
    writes = [
        lambda: setattr(state, "call_count", 3),
        lambda: state.append_video_latents(torch.ones(1, 1, 16, 4, 8, dtype=torch.bfloat16)),
        lambda: state.accumulate_frames(torch.zeros(8, 16, 3, dtype=torch.uint8)),
        lambda: state.append_vae_encoder_chunk(torch.zeros(1, 32, 1, 4, 4)),
        lambda: setattr(state, "vae_enc_feat_map", [torch.zeros(4)]),
        state.reset,
        state.park_feat_map,
    ]
    for write in writes:
        with pytest.raises(SessionStateLostError, match="'a': this state object refers to a session that is no"):
            write()
    with pytest.raises(SessionStateLostError):
        state.call_count  # noqa: B018
    if release == "restart":
        assert store.resume("a").call_count == 0  # the live incarnation is untouched by the refused writes
    else:
        assert "a" not in store and "a" not in store.manager  # nothing was re-created silently
    assert not state.in_table and "'a'" in repr(state)  # still describable


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
    nets = rollout.Networks(cfg)
    h = hashlib.sha256()
    for step in range(steps):
        for session in range(sessions):
            for value in rollout.pipeline_step(get_state(f"s{session}", step), nets, cfg, session, step):
                rollout.hash_value(h, value)
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
            digests[enabled] = rollout.run_rollout(rollout.small_config(steps=30, sessions=3, prompt_every=26)).digest
    assert digests[False] == digests[True]


def test_flag_flip_ab_with_diffusers_real_wan_encoder_is_bit_identical_and_the_encoder_ring_stays_flat():
    """The A/B check on real model code: diffusers' `WanEncoder3d` (tiny, seeded) reads and writes its own
    feat cache through the state, on the bespoke path (a list) and the manager path (a `DenseValue`, parked
    between steps too); the manager's encoder ring stays flat while the bespoke history grows."""
    pytest.importorskip("diffusers")
    cfg = rollout.small_config(steps=33, sessions=2, prompt_every=10**6, vae_encoder="wan", trace_bytes=True)
    with enable_override(False):
        bespoke = rollout.run_rollout(cfg)
    with enable_override(True):
        managed = rollout.run_rollout(cfg)
        parked = rollout.run_rollout(dataclasses.replace(cfg, park_feat_map=True))
    stand_in = rollout.run_rollout(dataclasses.replace(cfg, vae_encoder="stand-in"))
    assert bespoke.digest == managed.digest == parked.digest != stand_in.digest
    nets = rollout.Networks(cfg)
    assert type(nets.wan).__module__.startswith("diffusers.") and nets.wan_convs > 0
    feat = {r.components["session-0"]["vae_enc_feat_map"] for r in (bespoke, managed)}
    assert len(feat) == 1 and feat.pop() > 0  # the model's own cache, the same bytes on both paths
    ring = [t["vae_encoder_out"] for t in managed.bytes_trace]
    history = [t["vae_encoder_out"] for t in bespoke.bytes_trace]
    assert len(set(ring[8:])) == 1  # bounded by vae_encoder_window once the ring fills
    assert history[-1] >= 4 * ring[-1] and history == sorted(history)  # the bespoke history keeps growing


def test_the_store_repr_and_alias_of_torch_state():
    store = DreamZeroSessions(enable_session_state_manager=True, resident_bound=4)
    store.begin("a").vae_enc_feat_map = [torch.zeros(4)]
    assert repr(store) == "DreamZeroSessions(manager, 1/4 resident)"


def test_under_a_byte_budget_parking_keeps_every_session_and_every_output():
    """8 sessions, a device budget that holds 3 of them: with parking, all finish 40 steps bit-identical to
    the unbudgeted run and none is lost; without it, the planner drops sessions and continuations raise."""
    import dataclasses

    cfg = rollout.small_config(steps=40, sessions=8)
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
    assert parked.stats["parks"] > cfg.sessions * cfg.steps // 4 and parked.stats["evictions"] == 0
    assert dropping.lost and dropping.stats["evictions"] == len(dropping.lost) and dropping.digest != reference.digest
