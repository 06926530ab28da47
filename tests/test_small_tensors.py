"""The one-run park (memory/small_tensors.py, issue 39): many small 1-D tensors of one dtype copied by one
``torch.cat`` that checks device, layout, dimensions and autograd in C++, while Python reads only what it does
not (type, dtype, the storage spanned, the negative bit, a storage twice). Whatever either turns down takes the
general path, which refuses it naming the leaf or parks it exactly."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_park_small_path import ODD, UNCOPYABLE

import functional_state as fs
from functional_state.memory import small_tensors
from functional_state.memory.parking import park_values, restore_values

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, params=["native", "python"])
def checks(request, monkeypatch):
    """Every test here runs with the C++ checks (where built) and with the Python ones."""
    if request.param == "python":
        monkeypatch.setattr(small_tensors, "NATIVE", None)
    elif small_tensors.native() is None:
        pytest.skip("tensor_run_checks is not built (python setup.py build_ext --inplace builds it)")
    return request.param


def _tensors(n: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n + numel)
    return [torch.randn(numel, generator=g) for _ in range(n)]


def _long(odd):
    values = _tensors(700, 1024)  # 2.7 MiB of 4 KiB storages: the one-run path
    values.insert(600, odd(values))
    return values


def _same(values, back):
    for a, b in zip(values, back):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
        assert (a.is_neg(), a.requires_grad, type(a)) == (b.is_neg(), b.requires_grad, type(b))
        assert torch.equal(a.detach(), b.detach())
    shares = [b.untyped_storage().data_ptr() == back[0].untyped_storage().data_ptr() for b in back]
    assert shares == [a.untyped_storage().data_ptr() == values[0].untyped_storage().data_ptr() for a in values]


def test_a_long_list_of_small_1d_tensors_is_copied_by_one_cat_into_one_segment(monkeypatch):
    values = _tensors(700, 1024)
    cats = []
    original = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: cats.append(len(a[0])) or original(*a, **k))
    parked = park_values(values)
    assert cats == [700] and len(parked.buffers) == 1 and len(parked.layout.segments) == 1
    assert small_tensors.one_run(values, 1 << 18) is not None
    _same(values, restore_values(parked))


@pytest.mark.parametrize(
    "odd",
    [
        lambda xs: torch.randn(1024, dtype=torch.float64),  # another dtype
        lambda xs: xs[5],  # one storage twice
        lambda xs: torch.randn(2048)[:1024],  # a slice of a larger storage
        lambda xs: torch._neg_view(torch.randn(1024)),
        lambda xs: torch.randn(1),  # one element: any stride
    ],
    ids=["dtype", "twice", "slice", "negative bit", "one element"],
)
def test_what_the_cat_would_not_catch_is_turned_down_before_it(odd):
    assert small_tensors.one_run(_long(odd), 1 << 18) is None


@pytest.mark.parametrize("odd", list(ODD))
def test_a_non_plain_leaf_deep_in_a_long_list_of_one_run_round_trips_exactly(odd):
    values = _long(ODD[odd])
    _same(values, restore_values(park_values(values)))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_leaf_that_requires_grad_keeps_its_flag_when_parked_with_autograd_off(mode):
    """The one-run copy lets `torch.cat` refuse a leaf that requires grad (an out= copy cannot record it); with
    autograd off around the park it would not refuse, and the leaf came back without its flag."""
    values = _long(lambda xs: torch.randn(1024).requires_grad_())
    with getattr(torch, mode)():
        parked = park_values(values)
    _same(values, restore_values(parked))


@pytest.mark.parametrize("kind", list(UNCOPYABLE))
def test_an_uncopyable_tensor_deep_in_a_long_list_of_one_run_is_refused_naming_its_leaf(kind):
    make, word = UNCOPYABLE[kind]
    values = _long(lambda xs: make())
    with pytest.raises(fs.InvalidTypeError, match=rf"the tensor at \[600\] is a {word}.*nothing was"):
        park_values(values)


@pytest.mark.parametrize(
    "odd",
    [
        lambda: torch.randn(1024).requires_grad_(),
        lambda: torch.empty(1024, device="meta"),
        lambda: torch.randn(32, 32),
        lambda: torch.randn(1024).to_sparse(),
        lambda: torch.nn.Parameter(torch.randn(1024), requires_grad=False),
        lambda: torch.randn(1).expand(1024),
        lambda: torch.randn(1 << 17),
    ],
    ids=["grad", "meta", "2-D", "sparse", "parameter", "stride 0", "over most"],
)
def test_what_either_the_checks_or_the_cat_refuse_is_not_copied(odd):
    """Both builds end where the Python checks and ``torch.cat`` together did: no one-run copy."""
    values = _long(lambda xs: odd())
    assert small_tensors.copied(values, 1 << 18, 0) is None


def test_the_compiled_checks_read_no_tensor_from_python(checks, monkeypatch):
    """With `tensor_run_checks` built, the run's per-tensor facts are read in C++: no Python call per tensor
    (4,096 small tensors cost about one copy in Python calls; bench_park.py)."""
    calls = []
    original = torch.Tensor.is_neg
    monkeypatch.setattr(torch.Tensor, "is_neg", lambda t: calls.append(1) or original(t))
    values = _tensors(700, 1024)
    assert small_tensors.one_run(values, 1 << 18) is not None
    assert (len(calls) == 0) == (checks == "native")


def test_the_compiled_checks_are_found_when_the_package_was_imported_before_torch():
    # The extension links against libtorch, which only `import torch` loads: looked up at the package's import
    # (before torch, as the full suite's doctest collection imports it), it failed and the Python checks ran.
    if small_tensors.native() is None:
        pytest.skip("tensor_run_checks is not built (python setup.py build_ext --inplace builds it)")
    code = (
        "import sys; import functional_state.memory.small_tensors as s; assert 'torch' not in sys.modules; "
        "import torch; print(s.native() is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.strip() == "True", out.stderr
