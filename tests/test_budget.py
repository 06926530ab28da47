"""Sizes and budgets (functional_state.memory.budget): exact integer parsing, and only the pools stats() names."""

import pytest

import functional_state as fs
from functional_state import InvalidArgumentError, ManagerState, format_bytes, parse_bytes, plan_release
from functional_state.memory.budget import normalize_budget


@pytest.mark.parametrize(
    "text, expected",
    [
        ("9007199254740993", 9007199254740993),  # 2**53 + 1: a float reads it as 2**53
        ("9223372036854775807", 2**63 - 1),
        ("1.5GiB", 3 * 2**29),
        ("0.5 KiB", 512),
        ("1.25MB", 1_250_000),
        ("8388607 TiB", 8388607 * 2**40),
    ],
)
def test_parse_bytes_is_exact(text, expected):
    # Regression (issue 19): parsing went through float, so large counts lost their last digits.
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("absurd", ["1" * 400, "1" * 30, "8388608TiB", 2**63, 10**40, "9223372036854775808"])
def test_absurd_sizes_get_a_library_error(absurd):
    # Regression (issue 19): "1" * 400 raised OverflowError from float arithmetic.
    with pytest.raises(InvalidArgumentError, match="2\\*\\*63 - 1 bytes"):
        parse_bytes(absurd)


@pytest.mark.parametrize("pool", ["cpu:0", "gpu:0", "cuda:0/pinned_host", "tpu:1/unpinned_host", "cpu/device"])
def test_budgets_on_pools_stats_never_names_are_refused(pool):
    # Regression (issue 19): these were accepted, and never enforced (stats() files the host as "cpu",
    # JAX's GPUs as "cuda:N", and memory kinds only under "cpu").
    with pytest.raises(InvalidArgumentError, match=rf"unknown pool '{pool}'.*'cpu/pinned_host'"):
        ManagerState.create(byte_budget={pool: "1GiB"})
    with pytest.raises(InvalidArgumentError, match="pool must be a pool as stats"):
        plan_release(ManagerState.create(), pool, 1)


def test_budgets_accept_every_pool_stats_names():
    pools = {"cpu": 1, "cpu/pinned_host": 2, "cpu/unpinned_host": 3, "cuda:0": 4, "cuda:12": 5, "tpu:0": 6, "*": 7}
    assert normalize_budget(pools) == dict(sorted(pools.items()))
    state, _ = fs.get_or_create(ManagerState.create(byte_budget={"cpu": 10}), "a")
    assert set(fs.stats(state)["byte_budget"]) == {"cpu"}


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 * 2**20, "5.0 MiB"), (3 * 2**30, "3.00 GiB")]
    + [(2 * 2**40, "2.00 TiB"), (3 * 2**49, "1.50 PiB"), (2**63 - 1, "8.00 EiB"), (-(2**41), "-2.00 TiB")],
)
def test_format_bytes_reads_at_every_scale(n, text):
    # Regression (issue 23): sizes stopped at GiB, so a 2 TiB host pool or the largest budget printed as
    # "2048.00 GiB" and "8589934592.00 GiB" in plans and budget errors.
    assert format_bytes(n) == text
    if 0 <= n < 2**20:
        assert parse_bytes(text) == n  # these read back exactly
