"""Cosmos3's UND K/V from a real transformers text model (tiny random-init Qwen2), held by `Cosmos3StateAdapter`.

Per CFG placement (no CFG, sequential CFG, CFG-parallel), with the text padded or not: the bytes stored equal
the footprint formula (per branch, every layer's K and V allocation plus the rotary cos/sin tables) and
`stats()`; no tensor is copied (pointers compared); nothing is left once the request ends.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from functional_state import SessionStateManager  # noqa: E402
from torch_bridge.adapters import BranchStateError, Cosmos3StateAdapter  # noqa: E402
from torch_bridge.harness.cosmos3_text_model import (  # noqa: E402
    PLACEMENTS,
    build_freqs_gen,
    encode_und_kv,
    placement_figures,
    text_ids,
)
from torch_bridge.harness.text_models import tiny_qwen2  # noqa: E402

MODEL = tiny_qwen2()
TEXT_LEN, MEDIA = 7, 24


@pytest.mark.parametrize("cfg", sorted(PLACEMENTS))
@pytest.mark.parametrize("padded", [TEXT_LEN, 32])
def test_stored_bytes_equal_the_formula_and_stats_with_no_copy_and_nothing_after_the_request(cfg, padded):
    ranks = placement_figures(MODEL, cfg, text_len=TEXT_LEN, padded_text_len=padded, media_tokens=MEDIA)
    assert len(ranks) == (2 if cfg == "parallel" else 1)
    for rank in ranks:
        assert rank["stored"] == rank["formula"] == rank["stats"], rank
        assert rank["copies"] == 0 and rank["after"] == 0 and rank["sessions_after"] == 0, rank
    kv_layer = 2 * 2 * padded * 16 * 2  # K and V: 2 heads x padded x 16, bf16
    tables = 2 * MEDIA * 16 * 4  # cos and sin, float32
    assert ranks[0]["formula"] == len(PLACEMENTS[cfg][0]) * (MODEL.config.num_hidden_layers * kv_layer + tables)


def test_the_kv_stored_is_the_models_cache_by_reference_and_is_the_text_positions_kv():
    ids = text_ids(TEXT_LEN, 32, seed=0)
    kv, cache = encode_und_kv(MODEL, ids, TEXT_LEN)
    state = Cosmos3StateAdapter("r", SessionStateManager())
    state.set_branch(False, kv, build_freqs_gen(MODEL, MEDIA))
    got, _ = state.get_branch(False)
    for (k, v), layer in zip(got, cache.layers, strict=True):
        assert k.untyped_storage().data_ptr() == layer.keys.untyped_storage().data_ptr()
        assert v.untyped_storage().data_ptr() == layer.values.untyped_storage().data_ptr()
        assert k.shape == (1, 2, TEXT_LEN, 16) and k.dtype == torch.bfloat16
    # Causal attention: the padding after the text leaves the text's K/V as the unpadded pass computes them.
    alone, _ = encode_und_kv(MODEL, ids[:, :TEXT_LEN], TEXT_LEN)
    for (k, v), (k0, v0) in zip(got, alone, strict=True):
        torch.testing.assert_close(k, k0, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(v, v0, rtol=2e-2, atol=2e-2)


def test_a_transformers_cache_object_itself_is_refused_with_nothing_stored():
    _, cache = encode_und_kv(MODEL, text_ids(TEXT_LEN, TEXT_LEN, seed=0), TEXT_LEN)
    manager = SessionStateManager()
    state = Cosmos3StateAdapter("r", manager)
    with pytest.raises(BranchStateError, match="per-layer"):
        state.set_branch(False, cache, build_freqs_gen(MODEL, MEDIA))
    assert not state.is_branch_initialized(False) and manager.stats()["total_nbytes"] == 0
