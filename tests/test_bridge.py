import gc
import json
import subprocess
import sys
import textwrap
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from functional_state import CopyRequiredError
from torch_bridge import (
    AliasInvalidatedError,
    BridgeCopyWarning,
    BridgeKeptTorchWarning,
    BridgeWarning,
    bridge,
    check_alias,
    copy_reason,
    report,
    reset_report,
    to_jax,
    to_torch,
    tree_to_jax,
    tree_to_torch,
    unwrap,
    wrap,
)


@pytest.fixture(autouse=True)
def _fresh_report():
    reset_report()


def _bits(x):
    t = to_torch(x) if isinstance(x, jax.Array) else x
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


ALIAS_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.complex64,
]


def _random(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.transpose(0, 1),
    "permuted": lambda t: t.permute(2, 0, 3, 1),
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "row_slice": lambda t: t[2:],  # offset 2 * 3*4*8 elements: aligned for every dtype here
}


@pytest.mark.parametrize("dtype", ALIAS_DTYPES, ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_alias_per_dtype_and_layout_is_zero_copy_and_bit_exact(dtype, layout):
    t = LAYOUTS[layout](_random((4, 3, 4, 16), dtype))
    assert copy_reason(t) is None
    a = to_jax(t, strict=True)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.shape == tuple(t.shape) and str(a.dtype) == str(t.dtype).removeprefix("torch.")
    assert _bits(a) == _bits(t)
    assert report()["wrapped_count"] == 1 and report()["copied_count"] == 0


@pytest.mark.parametrize(
    "t",
    [torch.zeros(0, 3), torch.tensor(2.5), torch.zeros(1, 0, dtype=torch.bfloat16)],
    ids=["zero-size", "0-d", "zero-bf16"],
)
def test_edge_shapes_alias(t):
    a = to_jax(t, strict=True)
    assert a.shape == tuple(t.shape) and str(a.dtype) == str(t.dtype).removeprefix("torch.")
    if t.numel():
        assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert _bits(a) == _bits(t)


COPY_CASES = {
    "misaligned": (lambda: torch.arange(64.0)[1:], "not 64-byte aligned", "alignment"),
    "column_slice": (lambda: torch.arange(64.0).reshape(8, 8)[:, :4], "non-compact", "strides"),
    "step_slice": (lambda: torch.arange(64.0)[::2], "non-compact", "strides"),
    "expand": (lambda: torch.arange(4.0).reshape(1, 4).expand(3, 4), "non-compact", "strides"),
    "neg_view": (lambda: torch._neg_view(torch.arange(16.0)), "negative-bit", "neg"),
    "conj_view": (lambda: torch.complex(torch.arange(16.0), torch.ones(16)).conj(), "conjugate-bit", "conj"),
}


@pytest.mark.parametrize("case", sorted(COPY_CASES))
def test_copy_cases_raise_in_strict_mode(case):
    make, why, _ = COPY_CASES[case]
    with pytest.raises(CopyRequiredError, match=why):
        to_jax(make(), strict=True)
    assert report()["copied_count"] == 0


@pytest.mark.parametrize("case", sorted(COPY_CASES))
def test_copy_cases_copy_once_correctly_and_warn_once_per_category(case):
    make, why, category = COPY_CASES[case]
    t = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = to_jax(t)
        to_jax(make())  # the same reason again: counted, not announced again
    expected = t.resolve_conj().resolve_neg()
    np.testing.assert_array_equal(np.asarray(a), expected.numpy())
    r = report()
    assert r["copied_count"] == 2 and r["copied_bytes"] == 2 * t.numel() * t.element_size()
    assert r[f"copied[{category}]"] == 2
    assert [w.category for w in caught] == [BridgeCopyWarning] and why in str(caught[0].message)


def test_report_keys_stay_bounded_by_category():
    # Regression: every distinct shape/stride/offset made a new report key and a new "once" message.
    base = torch.arange(4096.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(1, 201):
            to_jax(base[i : i + 8])  # 200 distinct misaligned slices
    keys = [k for k in report() if "[" in k]
    assert keys == ["copied[alignment]"] and report()["copied[alignment]"] == 200 - 200 // 16
    assert len(caught) == 1


def test_bridge_warnings_are_filterable_and_wrap_never_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=BridgeWarning)
        to_jax(torch.arange(64.0)[1:])
    assert caught == []
    reset_report()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = wrap(torch.zeros(8, 8)[:, :2])
    assert isinstance(kept, torch.Tensor) and caught == [] and report()["kept_torch[strides]"] == 1


def test_neg_bit_view_gives_correct_values():
    t = torch._neg_view(torch.arange(8.0))
    assert t.is_neg()
    with pytest.warns(BridgeCopyWarning, match="negative-bit"):
        a = to_jax(t)
    np.testing.assert_array_equal(np.asarray(a), -np.arange(8.0))


def test_requires_grad_is_detached_not_copied():
    t = torch.ones(16, requires_grad=True)
    a = to_jax(t, strict=True)
    assert a.unsafe_buffer_pointer() == t.data_ptr()


@pytest.mark.parametrize(
    "t",
    [torch.zeros(2, dtype=torch.float16).view(torch.complex32), torch.arange(4), torch.ones(2, dtype=torch.float64)],
    ids=["complex32", "int64", "float64"],
)
def test_dtypes_jax_cannot_hold_stay_torch(t):
    with pytest.warns(BridgeKeptTorchWarning, match="returned the torch tensor itself"):
        out = to_jax(t)
    assert out is t and report()["kept_torch_count"] == 1
    with pytest.raises(CopyRequiredError, match="no dtype|downcast"):
        to_jax(t, strict=True)


def test_int64_aliases_with_x64():
    jax.config.update("jax_enable_x64", True)
    try:
        t = torch.arange(16)
        a = to_jax(t, strict=True)
        assert a.dtype == jnp.int64 and a.unsafe_buffer_pointer() == t.data_ptr()
    finally:
        jax.config.update("jax_enable_x64", False)


def test_wrap_never_copies():
    padded = torch.randn(4, 64, 8)
    trimmed = padded[:, :10]  # K/V slice of a padded allocation: not aliasable
    assert wrap(trimmed) is trimmed
    whole = wrap(padded)
    assert isinstance(whole, jax.Array) and whole.unsafe_buffer_pointer() == padded.data_ptr()
    assert unwrap(trimmed) is trimmed
    assert unwrap(whole).data_ptr() == padded.data_ptr()
    r = report()
    assert r["copied_count"] == 0 and r["kept_torch_count"] == 1 and r["wrapped_count"] == 1


def test_round_trip_returns_the_same_storage():
    t = torch.randn(8, 8).to(torch.bfloat16)
    back = to_torch(to_jax(t))
    assert back.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)


def test_jax_to_torch_aliases_and_is_writable():
    a = jnp.arange(16.0) * 2
    t = to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    np.testing.assert_array_equal(t.numpy(), np.arange(16.0) * 2)


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "float16", "bfloat16", "float32", "complex64"])
def test_jax_to_torch_is_bit_exact_per_dtype(dtype):
    a = jax.random.normal(jax.random.key(0), (4, 8)) * 50
    a = a.astype(jnp.complex64) * (1 + 2j) if dtype == "complex64" else a.astype(dtype)
    t = to_torch(a)
    assert str(t.dtype) == f"torch.{dtype}" and t.data_ptr() == a.unsafe_buffer_pointer()
    assert _bits(t) == np.asarray(a).tobytes()
    back = to_jax(t, strict=True)
    assert back.dtype == a.dtype and np.asarray(back).tobytes() == np.asarray(a).tobytes()


def test_to_torch_refuses_deleted_and_sharded():
    a = jnp.ones(8)
    a.delete()
    with pytest.raises(ValueError, match="deleted"):
        to_torch(a)


def test_source_deleted_and_collected_values_intact():
    t = torch.arange(1024.0)
    storage_ref = weakref.ref(t)
    a = to_jax(t)
    del t
    gc.collect()
    assert storage_ref() is None  # the user's tensor object is gone ...
    np.testing.assert_array_equal(np.asarray(a), np.arange(1024.0))  # ... its memory is not
    assert float(jnp.sum(a)) == float(np.arange(1024.0).sum())


def test_resize_after_import_is_detected():
    t = torch.arange(64.0)
    a = to_jax(t)
    check_alias(a)
    t.resize_(1 << 20)  # reallocates the shared storage
    with pytest.raises(AliasInvalidatedError, match="resize_"):
        check_alias(a)
    with pytest.raises(AliasInvalidatedError):
        to_torch(a)


def test_trees_convert_tensor_leaves_only():
    tree = {"k": torch.ones(4), "meta": "text", "n": 3, "arr": np.ones(2), "nested": [torch.zeros(2, 2), None]}
    j = tree_to_jax(tree)
    assert isinstance(j["k"], jax.Array) and isinstance(j["nested"][0], jax.Array)
    assert j["meta"] == "text" and j["n"] == 3 and j["arr"] is tree["arr"] and j["nested"][1] is None
    back = tree_to_torch(j)
    assert back["k"].data_ptr() == tree["k"].data_ptr() and back["arr"] is tree["arr"]


def test_async_safety_waits_for_pending_jax_work():
    x = jnp.ones((512, 512))
    y = x @ x  # dispatched asynchronously
    t = to_torch(y)
    assert float(t[0, 0]) == 512.0


def test_bad_inputs():
    with pytest.raises(TypeError, match="torch.Tensor"):
        to_jax(np.ones(3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        wrap([1])
    with pytest.raises(TypeError, match="jax.Array"):
        to_torch(np.ones(3))


def test_one_gib_wrap_is_zero_copy_in_rss():
    script = textwrap.dedent(
        """
        import json, psutil, torch
        from torch_bridge import to_jax
        t = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB, pages touched
        proc = psutil.Process()
        before = proc.memory_info().rss
        a = to_jax(t, strict=True)
        a.block_until_ready()
        after = proc.memory_info().rss
        print(json.dumps({"same_ptr": a.unsafe_buffer_pointer() == t.data_ptr(), "rss_delta": after - before}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same_ptr"]
    assert result["rss_delta"] < 16 * 2**20, result


@pytest.fixture(params=["direct", "public"])
def dlpack_path(request, monkeypatch):
    """Run a test through the bridge's direct DLPack entry points and through the public ones (the fallback
    where the feature check fails), with the device cache fresh either way."""
    monkeypatch.setattr(bridge, "_FAST_DEVICES", {})
    if request.param == "public":
        monkeypatch.setattr(bridge, "_C_IMPORT", None)
        monkeypatch.setattr(bridge, "_TORCH_DIRECT", False)
    elif bridge._C_IMPORT is None or not bridge._TORCH_DIRECT:
        pytest.skip("this JAX/torch has no direct DLPack entry point the bridge can use")
    return request.param


def test_a_copy_jax_made_of_an_aliasable_tensor_is_an_error_not_a_silent_alias(monkeypatch, dlpack_path):
    if dlpack_path == "public":
        real = jax.dlpack.from_dlpack
        monkeypatch.setattr(jax.dlpack, "from_dlpack", lambda x: jnp.array(real(x), copy=True))
    else:
        bridge._fast_device(1, 0)  # pass the feature check first, then have the direct import copy
        real_direct = bridge._direct_import
        monkeypatch.setattr(bridge, "_direct_import", lambda *a: jnp.array(real_direct(*a), copy=True))
    t = torch.arange(16, dtype=torch.float32)
    with pytest.raises(CopyRequiredError, match="please report this layout"):
        to_jax(t, strict=True)


def test_direct_import_is_used_where_available(dlpack_path):
    device = bridge._fast_device(1, 0)  # DLPack's CPU device 0
    assert (device is not None) == (dlpack_path == "direct")


@pytest.mark.parametrize("dtype", ALIAS_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "row_slice"])
def test_both_paths_alias_bit_exact_and_round_trip(dtype, layout, dlpack_path):
    t = LAYOUTS[layout](_random((4, 3, 4, 8), dtype))
    a = to_jax(t, strict=True)
    assert a.unsafe_buffer_pointer() == t.data_ptr() and a.shape == tuple(t.shape)
    assert a.dtype == jax.dlpack.from_dlpack(t.contiguous()).dtype
    assert _bits(a) == _bits(t)
    assert to_torch(a) is not None and to_torch(a).data_ptr() == t.data_ptr()
    native = jnp.asarray(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    back = to_torch(native)  # not an alias: through DLPack export
    assert back.data_ptr() == native.unsafe_buffer_pointer() and back.dtype == torch.float32
    assert back.shape == (2, 3, 4) and back.stride() == (12, 4, 1)
    np.testing.assert_array_equal(back.numpy(), np.asarray(native))
    assert report()["wrapped_count"] == 1 and report()["copied_count"] == 0


def test_a_direct_import_that_disagrees_with_the_public_one_is_not_used(monkeypatch):
    monkeypatch.setattr(bridge, "_FAST_DEVICES", {})
    real_direct = bridge._direct_import
    monkeypatch.setattr(bridge, "_direct_import", lambda *a: jnp.array(real_direct(*a), copy=True))
    t = torch.arange(16, dtype=torch.float32)
    a = to_jax(t, strict=True)  # the feature check saw the copy: the public path imports, and aliases
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert bridge._FAST_DEVICES[(1, 0)] is None


def test_a_direct_import_that_raises_in_the_check_falls_back(monkeypatch):
    monkeypatch.setattr(bridge, "_FAST_DEVICES", {})

    def broken(*args):
        raise TypeError("signature changed")

    monkeypatch.setattr(bridge, "_direct_import", broken)
    t = torch.arange(16, dtype=torch.float32)
    assert to_jax(t, strict=True).unsafe_buffer_pointer() == t.data_ptr()
    assert bridge._FAST_DEVICES[(1, 0)] is None


def test_torch_direct_export_check(monkeypatch):
    assert bridge._check_torch_direct() is (callable(getattr(torch._C, "_from_dlpack", None)))
    with monkeypatch.context() as m:  # torch.from_dlpack needs it too: gone only for the check
        m.delattr(torch._C, "_from_dlpack")
        assert bridge._check_torch_direct() is False
    monkeypatch.setattr(bridge, "_TORCH_DIRECT", False)
    a = jnp.ones(8)
    assert to_torch(a).data_ptr() == a.unsafe_buffer_pointer()  # the public path, still an alias


def test_to_torch_refuses_a_multi_device_array_with_a_library_error():
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs two JAX devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("x",))
    spread = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    with pytest.raises(ValueError, match="spans 2 device buffers"):
        to_torch(spread)
