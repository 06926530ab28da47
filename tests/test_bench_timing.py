"""The benchmarks' timing primitives (benchmarks/_timing.py) and the report writer's tail check
(benchmarks/run.py): a cell's tail is a measured call, rounds rotate, the CPU clock leaves out sleep, and a
table cell that shows a median with no p99 / p99.9 beside it is named under its table."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import _timing as timing  # noqa: E402


def _run_module():
    spec = importlib.util.spec_from_file_location("_bench_run_tails", BENCH / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_cell_shows_the_one_stalled_call_in_a_thousand_at_p999():
    c = timing.cell_of([1e-6] * 999 + [1e-3])
    assert c.median == 1e-6 and c.p99 == 1e-6 and c.p999 == 1e-3 and c.calls == 1000
    assert str(c) == "1.00 µs (p99 1.00 µs, p99.9 1.00 ms)"


def test_a_cell_of_nothing_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        timing.cell_of([])


def test_every_function_runs_in_every_position_equally_often():
    order: list[str] = []
    fns = {k: (lambda k=k: order.append(k)) for k in "abc"}
    timing.interleaved_rounds(fns, repeats=3)
    rounds = order[3:]  # after one warm-up call each
    assert [rounds[i * 3] for i in range(3)] == ["a", "b", "c"]
    assert all(sorted(rounds[i * 3 : i * 3 + 3]) == ["a", "b", "c"] for i in range(3))


def test_the_cpu_clock_leaves_out_time_spent_waiting():
    fns = {"sleep": lambda: time.sleep(0.02)}
    wall = timing.interleaved_cells(fns, repeats=2, clock="wall")["sleep"]
    cpu = timing.interleaved_cells(fns, repeats=2, clock="cpu")["sleep"]
    assert wall.median >= 0.019 and cpu.median < 0.01 and wall.calls == cpu.calls == 2


def test_timed_each_times_every_op():
    out: list[int] = []
    timing.timed_each(lambda k: time.sleep(0.002) if k == "slow" else None, ["fast"] * 9 + ["slow"], out)
    assert len(out) == 10 and max(out) == out[-1] >= 2_000_000 and timing.timer_overhead(1000) < 1e-4


def test_the_report_names_a_time_column_without_its_tail():
    pytest.importorskip("tabulate", reason="the report writer formats its tables with tabulate (the [dev] extra)")
    run = _run_module()
    rows = [["64", "1.20 µs", "1.20 µs (p99 2.00 µs, p99.9 9.00 µs)", "3.10x"]]
    assert run.untailed(["sessions", "bare", "with tail", "ratio"], rows) == ["bare"]
    result = {
        "title": "T",
        "header": ["sessions", "bare"],
        "rows": [["64", "335 ns"]],
        "ratio": ("r", 1.0),
        "notes": "",
    }
    assert "*Median only, no p99 / p99.9 measured, in: bare.*" in run._section("t", result)
    result["rows"] = [["64", str(timing.cell_of([3.35e-7]))]]
    assert "Median only" not in run._section("t", result)


def test_an_untimed_reset_runs_after_each_run_of_its_function_off_the_clock():
    order: list[str] = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    samples = timing.interleaved_rounds(
        fns, repeats=4, clock="wall", untimed={"a": lambda: (order.append("reset a"), time.sleep(0.02))}
    )
    assert order.count("reset a") == order.count("a") == 5  # the warm-up call and each of the 4 rounds
    assert all(order[i + 1] == "reset a" for i, k in enumerate(order) if k == "a")
    assert max(samples["a"]) < 0.01 and max(samples["b"]) < 0.01, "a reset was timed as part of a run"
