"""The byte budget: what enforcing it costs a commit, what a plan costs at 64 / 1k / 100k sessions, and the
DreamZero pressure scenario at deploy shapes (8 sessions, a budget for 3), with a plot.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

import functional_state as fs
from _timing import fmt_time, interleaved_medians
from functional_state.config import enable_override
from torch_bridge import harness as dz
from torch_bridge.adapters import DreamZeroSessions
from torch_bridge.adapters.dreamzero_store import estimate_session_nbytes

HERE = Path(__file__).resolve().parent
MIB = 2**20
PLOT = HERE / "dreamzero_pressure.png"


def _handles(budget):
    manager = fs.SessionStateManager(byte_budget=budget)
    for i in range(64):
        h = manager.get_or_create_session(f"s{i}")
        h.put("buf", fs.LatentBuffer.create(maxlen=4))
        h.set_attr("prompt", torch.zeros(8))
    return manager.get_session("s5")


def _commit_costs() -> dict[str, float]:
    """A handle commit of a 4 KiB tensor into a 4-item ring, 64 sessions, with and without a budget (never
    reached); and one DreamZero pipeline step (small shapes) with and without one."""
    items = [torch.zeros(1024) for _ in range(64)]
    plain, budgeted = _handles(None), _handles("64GiB")
    turn = {"p": 0, "b": 0}

    def commit_plain() -> None:
        for _ in range(200):
            plain.commit("buf", items[turn["p"] % 64])
            turn["p"] += 1

    def commit_budgeted() -> None:
        for _ in range(200):
            budgeted.commit("buf", items[turn["b"] % 64])
            turn["b"] += 1

    cfg = dz.small_config(prompt_every=10**6)
    nets = dz.Networks(cfg)
    stores = {}
    for label, budget in (("plain", None), ("budgeted", "64GiB")):
        with enable_override(True):
            store = DreamZeroSessions(resident_bound=8, byte_budget=budget)
        for s in range(4):
            dz.pipeline_step(store.begin(f"s{s}"), nets, cfg, s, 0)
        stores[label] = store
    steps = {"plain": 1, "budgeted": 1}

    def step(label: str) -> None:
        store = stores[label]
        for s in range(4):
            dz.pipeline_step(store.resume(f"s{s}"), nets, cfg, s, steps[label])
        steps[label] += 1

    t = interleaved_medians(
        {
            "commit_plain": commit_plain,
            "commit_budgeted": commit_budgeted,
            "step_plain": lambda: step("plain"),
            "step_budgeted": lambda: step("budgeted"),
        },
        repeats=9,
    )
    return {
        "commit_plain": t["commit_plain"] / 200,
        "commit_budgeted": t["commit_budgeted"] / 200,
        "step_plain": t["step_plain"] / 4,
        "step_budgeted": t["step_budgeted"] / 4,
    }


def _planner_costs() -> dict[int, tuple[float, float]]:
    """(plan time, one manager op time) at each size: a plan that must park 10 sessions' caches."""
    out = {}
    item = torch.zeros(64)
    for n in (64, 1_000, 100_000):
        state = fs.ManagerState.create(max_sessions=n, byte_budget="64GiB")
        for i in range(n):
            sid = f"s{i}"
            state, _ = fs.get_or_create(state, sid)
            state = fs.put(state, sid, "cache", fs.DenseValue.create([torch.zeros(64)]))

        def plan(state: fs.ManagerState = state) -> None:
            fs.plan_release(state, "cpu", 10 * 256, levers=["park"])

        def op(state: fs.ManagerState = state, sid: str = f"s{n // 2}") -> None:
            s, _ = fs.get_or_create(state, sid)
            fs.commit(s, sid, "cache", [item])

        t = interleaved_medians({"plan": plan, "op": op}, repeats=5)
        out[n] = (t["plan"], t["op"])
    return out


def _pressure(steps: int) -> dict[str, dz.RolloutResult]:
    """8 deploy-shape sessions (603 MiB feat map each) with a budget holding 3 sessions, against a count cap
    alone (every session resident), both through the serving store."""
    cfg = dz.RolloutConfig(steps=steps, sessions=8, prompt_every=10**9, trace_pools=True)
    per_session = estimate_session_nbytes(steps=steps)
    out = {}
    with enable_override(True):
        out["count cap only"] = dz.run_rollout(cfg)
        out["budget 3 sessions, parking"] = dz.run_rollout(
            dataclasses.replace(cfg, byte_budget={"cpu": 3 * per_session})
        )
    out["budget"] = 3 * per_session  # type: ignore[assignment]
    return out


def _plot(results: dict, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bytes, ax_moves) = plt.subplots(1, 2, figsize=(11, 4))
    for label, r in results.items():
        rounds = range(1, len(r.pool_trace) + 1)
        ax_bytes.plot(rounds, [p.get("nbytes:cpu", 0) / 2**30 for p in r.pool_trace], label=f"{label}: device pool")
        if any("nbytes:cpu/unpinned_host" in p for p in r.pool_trace):
            ax_bytes.plot(
                rounds,
                [p.get("nbytes:cpu/unpinned_host", 0) / 2**30 for p in r.pool_trace],
                "--",
                label=f"{label}: parked (host pool)",
            )
        parks = [p["parks"] for p in r.pool_trace]
        ax_moves.plot(rounds, [b - a for a, b in zip([0, *parks], parks)], label=f"{label}: parks per round")
    ax_bytes.axhline(budget / 2**30, color="k", linestyle=":", label="budget")
    ax_bytes.set(title="device-pool bytes after each round (8 sessions)", xlabel="round", ylabel="GiB")
    ax_moves.set(title="parks per round (each park is restored on the next access)", xlabel="round")
    for ax in (ax_bytes, ax_moves):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("DreamZero under a byte budget, deploy shapes (603 MiB feat map per session)")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)


def run() -> dict:
    costs = _commit_costs()
    planner = _planner_costs()
    steps = 16
    t0 = time.perf_counter()
    pressure = _pressure(steps)
    pressure_s = time.perf_counter() - t0
    budget = pressure.pop("budget")
    _plot(pressure, budget)  # type: ignore[arg-type]
    rows = [
        ("commit (handle, 4-item ring), no budget", fmt_time(costs["commit_plain"]), "-"),
        (
            "commit (handle, 4-item ring), budget enforced",
            fmt_time(costs["commit_budgeted"]),
            f"{costs['commit_budgeted'] / costs['commit_plain']:.2f}x",
        ),
        ("DreamZero pipeline step, no budget", fmt_time(costs["step_plain"]), "-"),
        (
            "DreamZero pipeline step, budget enforced",
            fmt_time(costs["step_budgeted"]),
            f"{costs['step_budgeted'] / costs['step_plain']:.2f}x",
        ),
    ]
    for n, (plan_s, op_s) in planner.items():
        rows.append(
            (
                f"plan_release at {n:,} sessions (park 10) vs one manager op",
                fmt_time(plan_s),
                f"{plan_s / op_s:,.0f} ops",
            )
        )
    for label, r in pressure.items():
        peak = max(p.get("nbytes:cpu", 0) for p in r.pool_trace)
        s = r.stats or {}
        rows.append(
            (
                f"pressure, {label}: peak device pool / parks / restores / sessions lost",
                f"{peak / 2**30:.2f} GiB",
                f"{s.get('parks', 0)} / {s.get('restores', 0)} / {len(r.lost)}",
            )
        )
    same = len({r.digest for r in pressure.values()}) == 1
    return {
        "title": "Byte budget: enforcement cost, planner cost, DreamZero under pressure",
        "header": ("measure", "time or bytes", "ratio / counts"),
        "rows": rows,
        "ratio": (
            "DreamZero pipeline step: budget enforced / none (goal <= 1.5)",
            costs["step_budgeted"] / costs["step_plain"],
        ),
        "extra_ratios": [
            (
                "bare handle commit: budget enforced / none (goal <= 1.5)",
                costs["commit_budgeted"] / costs["commit_plain"],
            ),
            ("plan at 100,000 / plan at 1,000 sessions (linear would be 100)", planner[100_000][0] / planner[1_000][0]),
            ("pressure digests equal across runs (1 = yes)", float(same)),
        ],
        "notes": (
            f"Enforcement: the shell decides a write within budget from the kept object totals (the commit's "
            f"accounting inspects only the item it adds; the extents of the one it drops are remembered from its "
            f"arrival), re-reading attrs only when a write changes "
            f"them or a pool nears its budget. Planner: one park pass in recency order plus the O(n) scans of "
            f"attrs and object holders. Pressure: {steps} steps x 8 sessions at deploy shapes through the "
            f"serving store ({pressure_s:.0f} s for both runs); the budget holds 3 sessions "
            f"({budget / 2**30:.2f} GiB); the plot is `benchmarks/{PLOT.name}`."
        ),
        "figures": {
            "costs": costs,
            "planner": planner,
            "pressure": {k: {"lost": v.lost, "stats": v.stats} for k, v in pressure.items()},
        },
    }
