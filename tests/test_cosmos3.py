"""Cosmos3: the bespoke clobber bug, the per-session adapter, request-scoped cleanup, footprint model."""

import sys
import threading

import jax
import pytest
import torch

import functional_state as fs
from functional_state import SessionStateManager, nbytes_by_device
from helpers import race
from torch_bridge import report, reset_report
from torch_bridge.adapters import BranchStateError, Cosmos3StateAdapter, cosmos3_footprint, request_session
from torch_bridge.harness import Cosmos3Shapes, Cosmos3TransformerCache, build_freqs_gen, encode_und_kv

SHAPES = Cosmos3Shapes(num_layers=3, num_heads=2, head_dim=16, text_len=7, padded_text_len=32, media_tokens=24)


def _query(seed):
    return torch.randn(1, SHAPES.num_heads, 5, SHAPES.head_dim, generator=torch.Generator().manual_seed(seed))


def _encoded(transformer, seed, is_negative=False, shapes=SHAPES):
    transformer.cached_kv = encode_und_kv(shapes, seed)
    transformer.freqs_gen = build_freqs_gen(shapes, offset=float(is_negative))
    return transformer.cached_kv, transformer.freqs_gen


def test_bespoke_shared_cache_clobbers_interleaved_requests():
    """The bug the adapter fixes: request A's K/V is replaced by B's on the shared instance."""
    shared = Cosmos3TransformerCache()
    shared.reset_cache()
    shared.encode_branch(SHAPES, False, seed=1)  # request A encodes
    solo_a = shared.attend(_query(0))
    shared.reset_cache()
    shared.encode_branch(SHAPES, False, seed=2)  # request B starts on the same instance
    a_after_b = shared.attend(_query(0))  # A's next denoising step reads B's conditioning
    assert not torch.equal(solo_a, a_after_b)

    # With one manager session per request, A's step reads A's K/V whatever B did.
    manager, transformer = SessionStateManager(), Cosmos3TransformerCache()
    a, b = Cosmos3StateAdapter("A", manager), Cosmos3StateAdapter("B", manager)
    _encoded(transformer, 1)
    a.capture_from_transformer(transformer, False)
    _encoded(transformer, 2)
    b.capture_from_transformer(transformer, False)
    a.load_into_transformer(transformer, False)
    assert torch.equal(transformer.attend(_query(0)), solo_a)


def test_round_trip_by_reference():
    reset_report()
    adapter = Cosmos3StateAdapter("r", SessionStateManager())
    kv, freqs = encode_und_kv(SHAPES, 0), build_freqs_gen(SHAPES)
    adapter.set_branch(False, kv, freqs)
    got_kv, got_freqs = adapter.get_branch(False)
    assert len(got_kv) == SHAPES.num_layers
    for (k, v), (gk, gv) in zip(kv, got_kv):
        assert gk is k and gv is v  # trimmed slices of padded allocations stay torch tensors, by reference
    for t, g in zip(freqs, got_freqs):
        assert g.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and torch.equal(g, t)
    r = report()
    assert r["copied_count"] == 0 and r["wrapped_count"] == 2 and r["kept_torch_count"] == 2 * SHAPES.num_layers


def test_contiguous_kv_is_stored_as_jax_aliases():
    shapes = Cosmos3Shapes(num_layers=2, num_heads=2, head_dim=16, text_len=32, padded_text_len=32, media_tokens=8)
    manager = SessionStateManager()
    adapter = Cosmos3StateAdapter("r", manager)
    kv = encode_und_kv(shapes, 0)  # text_len == padded: the slices are whole, contiguous tensors
    adapter.set_branch(True, kv, build_freqs_gen(shapes))
    stored = fs.sessions(manager.state)["r"].get("und_kv/uncond/0000").view()[0]
    assert isinstance(stored[0], jax.Array) and stored[0].unsafe_buffer_pointer() == kv[0][0].data_ptr()
    assert stored[0].dtype == jax.numpy.bfloat16
    back = adapter.get_branch(True)[0][0][0]
    assert back.data_ptr() == kv[0][0].data_ptr() and back.dtype == torch.bfloat16


def test_encode_once_capture_is_a_no_op_when_stored():
    adapter, transformer = Cosmos3StateAdapter("r", SessionStateManager()), Cosmos3TransformerCache()
    first, _ = _encoded(transformer, 1)
    assert adapter.capture_from_transformer(transformer, False) is True
    _encoded(transformer, 2)
    assert adapter.capture_from_transformer(transformer, False) is False
    assert adapter.get_branch(False)[0][0][0] is first[0][0]


def test_cond_and_uncond_are_isolated_and_load_sets_both_fields():
    adapter, transformer = Cosmos3StateAdapter("r", SessionStateManager()), Cosmos3TransformerCache()
    cond_kv, cond_freqs = _encoded(transformer, 1, False)
    adapter.capture_from_transformer(transformer, False)
    uncond_kv, uncond_freqs = _encoded(transformer, 2, True)
    adapter.capture_from_transformer(transformer, True)
    assert adapter.is_branch_initialized(False) and adapter.is_branch_initialized(True)
    transformer.reset_cache()
    adapter.load_into_transformer(transformer, False)
    assert transformer.cached_kv[1][1] is cond_kv[1][1] and torch.equal(transformer.freqs_gen[1], cond_freqs[1])
    adapter.load_into_transformer(transformer, True)
    assert transformer.cached_kv[1][1] is uncond_kv[1][1] and torch.equal(transformer.freqs_gen[0], uncond_freqs[0])


@pytest.mark.parametrize("missing", ["freqs", "kv", "both"])
def test_capture_without_kv_or_freqs_raises_before_writing(missing):
    manager = SessionStateManager()
    adapter, transformer = Cosmos3StateAdapter("r", manager), Cosmos3TransformerCache()
    _encoded(transformer, 1)
    if missing in ("freqs", "both"):
        transformer.freqs_gen = None
    if missing in ("kv", "both"):
        transformer.cached_kv = []
    before = fs.sessions(manager.state)["r"]
    with pytest.raises(BranchStateError, match="holds no .*Nothing was stored"):
        adapter.capture_from_transformer(transformer, False)
    assert fs.sessions(manager.state)["r"] is before and not adapter.is_branch_initialized(False)


@pytest.mark.parametrize(
    "kv, freqs, match",
    [
        ([], None, "non-empty list"),
        ([(torch.zeros(1), "not a tensor")], (torch.zeros(1), torch.zeros(1)), r"cached_kv\[0\]"),
        ([(torch.zeros(1), torch.zeros(1))], (torch.zeros(1),), "freqs_gen"),
    ],
)
def test_set_branch_validates_before_writing(kv, freqs, match):
    manager = SessionStateManager()
    adapter = Cosmos3StateAdapter("r", manager)
    before = fs.sessions(manager.state)["r"]
    with pytest.raises(BranchStateError, match=match):
        adapter.set_branch(False, kv, freqs)
    assert fs.sessions(manager.state)["r"] is before


def _kv(layers=2, dtype=torch.bfloat16, text_len=7):
    shapes = Cosmos3Shapes(**{**SHAPES.__dict__, "num_layers": layers, "dtype": dtype, "text_len": text_len})
    return encode_und_kv(shapes, 0)


_GOOD_FREQS = build_freqs_gen(SHAPES)
MALFORMED = {
    # name: (cached_kv, freqs_gen, what the message must say)
    "one stacked tensor": (
        torch.stack([torch.stack(pair) for pair in _kv()]),
        _GOOD_FREQS,
        r"per-layer \(K, V\) pairs of torch tensors, got one stacked tensor \(a torch.bfloat16 tensor of shape "
        r"\(2, 2, 1, 2, 7, 16\) on cpu\)",
    ),
    "a dict": ({0: _kv()[0]}, _GOOD_FREQS, r"non-empty list of per-layer \(K, V\) pairs .*got dict"),
    "a triple": ([(*_kv()[0], _kv()[0][0])], _GOOD_FREQS, r"cached_kv\[0\] must be a \(K, V\) pair .*tuple of 3"),
    "a single tensor per layer": ([_kv()[0][0]], _GOOD_FREQS, r"cached_kv\[0\] must be a \(K, V\) pair .*tensor"),
    "a non-tensor V": (
        [(_kv()[0][0], [1.0])],
        _GOOD_FREQS,
        r"cached_kv\[0\]: V must be a torch tensor, got a list of 1 item",
    ),
    "K and V dtypes differ": (
        [(_kv()[0][0], _kv()[0][1].float())],
        _GOOD_FREQS,
        r"cached_kv\[0\]: K \(.*bfloat16.*\) and V \(.*float32.*\) must share a dtype",
    ),
    "a layer of another dtype": (
        [_kv()[0], _kv(dtype=torch.float16)[1]],
        _GOOD_FREQS,
        r"cached_kv\[1\] K has shape \(1, 2, 7, 16\), torch.float16, cpu but layer 0's K has .*torch.bfloat16",
    ),
    "a layer of another shape": (
        [_kv()[0], _kv(text_len=5)[1]],
        _GOOD_FREQS,
        r"cached_kv\[1\] K has shape \(1, 2, 5, 16\).* layer 0's K has shape \(1, 2, 7, 16\)",
    ),
    "freqs not a pair": (_kv(), _GOOD_FREQS[0], r"freqs_gen must be a \(cos, sin\) pair .*tensor of shape"),
    "freqs of two shapes": (_kv(), (_GOOD_FREQS[0], _GOOD_FREQS[1][:3]), "freqs_gen cos has shape .* but sin has"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
@pytest.mark.parametrize("via", ["capture_from_transformer", "set_branch"])
def test_malformed_kv_or_freqs_raise_a_branch_error_and_change_nothing(case, via):
    # Regression (issue 19): one stacked tensor in `cached_kv` leaked torch's RuntimeError ("Boolean value of
    # Tensor ... is ambiguous") from capture; layers of mismatched shape or dtype were stored without a word.
    kv, freqs, match = MALFORMED[case]
    manager = SessionStateManager()
    adapter, transformer = Cosmos3StateAdapter("r", manager), Cosmos3TransformerCache()
    transformer.cached_kv, transformer.freqs_gen = kv, freqs
    before = fs.sessions(manager.state)["r"]
    with pytest.raises(BranchStateError, match=f"`{via}`: .*{match}"):
        if via == "set_branch":
            adapter.set_branch(False, kv, freqs)
        else:
            adapter.capture_from_transformer(transformer, False)
    assert fs.sessions(manager.state)["r"] is before and not adapter.is_branch_initialized(False)
    assert transformer.cached_kv is kv and transformer.freqs_gen is freqs  # the transformer is left as it was


def test_partially_stored_branch_raises_on_read():
    manager = SessionStateManager()
    adapter = Cosmos3StateAdapter("r", manager)
    adapter.set_branch(False, encode_und_kv(SHAPES, 0), build_freqs_gen(SHAPES))
    freed = manager.get_session("r").evict("und_kv/cond/0001")
    assert freed == 2 * (1 * 2 * 32 * 16 * 2)  # K and V: (batch, heads, padded_len, head_dim) bf16 each
    for read in (
        lambda: adapter.get_branch(False),
        lambda: adapter.is_branch_initialized(False),
        lambda: adapter.load_into_transformer(Cosmos3TransformerCache(), False),
    ):
        with pytest.raises(BranchStateError, match="2 of 3 layers"):
            read()
    adapter.reset()
    assert adapter.get_branch(False) is None


def test_load_of_a_missing_branch_raises():
    with pytest.raises(BranchStateError, match="no uncond branch"):
        Cosmos3StateAdapter("r", SessionStateManager()).load_into_transformer(Cosmos3TransformerCache(), True)


def test_reset_clears_both_branches_and_replacing_drops_stale_layers():
    manager = SessionStateManager()
    adapter = Cosmos3StateAdapter("r", manager)
    adapter.set_branch(False, encode_und_kv(SHAPES, 0), build_freqs_gen(SHAPES))
    adapter.set_branch(True, encode_und_kv(SHAPES, 1), build_freqs_gen(SHAPES))
    fewer = Cosmos3Shapes(**{**SHAPES.__dict__, "num_layers": 2})
    adapter.set_branch(False, encode_und_kv(fewer, 2), build_freqs_gen(fewer))
    assert len(adapter.get_branch(False)[0]) == 2
    adapter.reset()
    assert not adapter.is_branch_initialized(False) and not adapter.is_branch_initialized(True)
    assert manager.stats()["total_nbytes"] == 0


def test_fresh_adapter_sees_prior_state_and_state_survives_lru_eviction():
    manager = SessionStateManager(max_sessions=1)
    a = Cosmos3StateAdapter("a", manager)
    a.set_branch(False, encode_und_kv(SHAPES, 0), build_freqs_gen(SHAPES))
    assert Cosmos3StateAdapter("a", manager).is_branch_initialized(False)
    Cosmos3StateAdapter("b", manager)  # evicts "a" from the table
    assert "a" not in manager and a.is_branch_initialized(False)  # the adapter holding it keeps it
    assert not Cosmos3StateAdapter("a", manager).is_branch_initialized(False)


def _eight_threads_of_requests(manager, reps=30):
    """8 threads, each running ``reps`` requests through `request_session`; returns the errors they hit."""
    errors, barrier = [], threading.Barrier(8)

    def request(i):
        try:
            barrier.wait()
            transformer = Cosmos3TransformerCache()
            for rep in range(reps):
                with request_session(manager, f"req-{i}-{rep}") as state:
                    kv, _ = _encoded(transformer, seed=1000 * i + rep)
                    state.capture_from_transformer(transformer, False)
                    state.capture_from_transformer(transformer, True)
                    for is_negative in (False, True):
                        got = state.get_branch(is_negative)
                        assert got is not None, "a stored branch was lost"
                        assert all(g[0] is k[0] and g[1] is k[1] for g, k in zip(got[0], kv))
        except Exception as e:  # surfaced by the caller
            errors.append(e)

    race(request, 8)
    return errors


def test_eight_threads_of_requests_never_clobber_or_lose_a_write():
    # With the manager's lock replaced by a no-op (lock_factory=contextlib.nullcontext) this fails: two
    # threads swap tables computed from the same old one, so a stored branch or a drop is lost.
    for _ in range(3):  # without the lock one round fails about 4 times in 5; three rounds, >99%
        manager = SessionStateManager()
        errors = _eight_threads_of_requests(manager)
        assert not errors, errors[:3]
        assert len(manager) == 0 and manager.stats()["total_nbytes"] == 0


def test_request_session_drops_on_success_and_on_exception():
    manager = SessionStateManager()
    with request_session(manager, "ok") as state:
        state.set_branch(False, encode_und_kv(SHAPES, 0), build_freqs_gen(SHAPES))
        assert "ok" in manager
    assert "ok" not in manager
    with pytest.raises(RuntimeError, match="denoiser failed"), request_session(manager, "bad") as state:
        state.set_branch(False, encode_und_kv(SHAPES, 0), build_freqs_gen(SHAPES))
        raise RuntimeError("denoiser failed")
    assert "bad" not in manager and len(manager) == 0


def test_post_request_residency_is_visible_only_to_a_live_bytes_profile():
    manager, transformer = SessionStateManager(), Cosmos3TransformerCache()
    with request_session(manager, "req") as state:
        _encoded(transformer, 3)
        state.capture_from_transformer(transformer, False)
        transformer.reset_cache()
        state.load_into_transformer(transformer, False)
        held = manager.stats()["total_nbytes"]
    assert manager.stats()["total_nbytes"] == 0  # the manager no longer counts it ...
    live = nbytes_by_device(manager.state, transformer.cached_kv, transformer.freqs_gen)
    assert sum(live.values()) == held > 0  # ... but the transformer still keeps the last branch alive
    transformer.reset_cache()  # the next generation's start
    assert nbytes_by_device(manager.state, transformer.cached_kv, transformer.freqs_gen) == {}


def _simulate_rank(shapes, branches):
    """One rank as its own manager; returns its measured retained bytes."""
    manager = SessionStateManager()
    state = Cosmos3StateAdapter("req", manager)
    for is_negative in branches:
        state.set_branch(is_negative, encode_und_kv(shapes, int(is_negative)), build_freqs_gen(shapes))
    return manager.stats()["total_nbytes"]


@pytest.mark.parametrize("cfg", ["none", "sequential", "parallel"])
@pytest.mark.parametrize("sp_degree", [1, 2])
@pytest.mark.parametrize("padded", [7, 32])
def test_footprint_model_matches_measured_accounting(cfg, sp_degree, padded):
    shapes = Cosmos3Shapes(
        num_layers=3, num_heads=2, head_dim=16, text_len=7, padded_text_len=padded, media_tokens=24, text_batch=2
    )
    predicted = cosmos3_footprint(
        num_layers=3,
        num_heads=2,
        head_dim=16,
        padded_text_len=padded,
        media_tokens=24,
        text_batch=2,
        cfg=cfg,
        sp_degree=sp_degree,
    )
    placement = {"none": [[False]], "sequential": [[False, True]], "parallel": [[False], [True]]}[cfg]
    ranks = [branches for branches in placement for _ in range(sp_degree)]  # SP replicates UND K/V
    assert len(ranks) == predicted.ranks
    for branches in ranks:
        assert _simulate_rank(shapes, branches) == predicted.per_rank_bytes


@pytest.mark.parametrize(
    "kwargs, match",
    [({"cfg": "both"}, "cfg must be"), ({"num_layers": 0}, "num_layers"), ({"sp_degree": 1.5}, "sp_degree")],
)
def test_footprint_rejects_bad_config(kwargs, match):
    base = dict(num_layers=2, num_heads=2, head_dim=8, padded_text_len=8, media_tokens=8)
    with pytest.raises(ValueError, match=match):
        cosmos3_footprint(**{**base, **kwargs})


def test_memcheck_script_runs_each_mode_in_a_fresh_process_and_reports_rss():
    import json
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cosmos3_memcheck.py"
    args = [
        "--requests",
        "2",
        "--steps",
        "2",
        "--layers",
        "2",
        "--heads",
        "2",
        "--head-dim",
        "16",
        "--text-len",
        "7",
        "--padded-text-len",
        "32",
        "--media-tokens",
        "24",
        "--gap-s",
        "0",
        "--json",
    ]
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(results) == {"cache-off", "bespoke", "flag-on"}
    for mode, r in results.items():
        assert r["mode"] == mode and r["peak_rss"] > 0 and len(r["rss_between_requests"]) == 2
    flag_on = results["flag-on"]
    assert flag_on["manager_sessions_after"] == 0 and flag_on["manager_total_nbytes_after"] == 0
    # The last loaded branch stays on the transformer until the next reset_cache(): one branch of K/V + RoPE.
    one_branch = cosmos3_footprint(
        num_layers=2, num_heads=2, head_dim=16, padded_text_len=32, media_tokens=24, cfg="none"
    )
    assert flag_on["transformer_still_holds"] == one_branch.per_rank_bytes


def test_concurrent_requests_under_a_budget_for_one_are_refused_never_overshoot():
    """Decision: a request whose K/V would not fit is refused with BudgetExceededError (the caller retries or
    queues); open requests are pinned, so nothing of theirs is released to make room."""
    from functional_state import BudgetExceededError

    shapes = Cosmos3Shapes(num_layers=4, num_heads=2, head_dim=16, text_len=24, padded_text_len=32, media_tokens=8)
    one = cosmos3_footprint(num_layers=4, num_heads=2, head_dim=16, padded_text_len=32, media_tokens=8).per_rank_bytes
    budget = int(one * 1.2)  # one request (both CFG branches) fits; a second request's first branch does not
    manager = SessionStateManager(byte_budget={"cpu": budget})
    first, second = Cosmos3TransformerCache(), Cosmos3TransformerCache()
    with request_session(manager, "req-a") as a:
        kv_a = []
        for neg in (False, True):
            kv_a.append(_encoded(first, seed=int(neg), is_negative=neg, shapes=shapes)[0])
            a.capture_from_transformer(first, neg)
        assert manager.stats()["nbytes:cpu"] == one
        with request_session(manager, "req-b") as b:
            _encoded(second, seed=7, shapes=shapes)
            with pytest.raises(BudgetExceededError, match="pool 'cpu'"):
                b.capture_from_transformer(second, False)
            assert not b.is_branch_initialized(False)  # refused: nothing of it was kept
            assert manager.stats()["nbytes:cpu"] == one <= budget
        for neg, kv in zip((False, True), kv_a):  # the admitted request's K/V, bit-exact and by reference
            got = a.get_branch(neg)[0]
            assert all(g[0] is k[0] and g[1] is k[1] for g, k in zip(got, kv))
    with request_session(manager, "req-b") as b:  # once the first request ended, the second fits
        _encoded(second, seed=7, shapes=shapes)
        assert b.capture_from_transformer(second, False)
