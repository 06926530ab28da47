"""The byte budget: what enforcing it costs a commit, what a plan costs at 64 / 1k / 100k sessions, and the
DreamZero pressure scenario at deploy shapes (8 sessions, a budget for 3), with a plot.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import immutables
import numpy as np
import torch

import functional_state as fs
from _timing import fmt_time, interleaved_medians
from functional_state.memory import parking
from functional_state.policy import enforce
from functional_state.shell.config import enable_override
from torch_bridge import harness as dz
from torch_bridge.adapters import DreamZeroSessions
from torch_bridge.adapters.dreamzero_store import estimate_session_nbytes

HERE = Path(__file__).resolve().parent
MIB = 2**20
PLOT = HERE / "dreamzero_pressure.png"
# Set to "commits" to run only the commit rows (the pressure part alone runs ~28 minutes; the planner part
# builds a 100,000-session table): what is printed then is not a whole section, so do not `--write` it.
PART_ENV = "FS_BENCH_BUDGET_PART"


def _handles(budget, prompt=lambda: torch.zeros(8)):
    """64 sessions, each a 4-item ring and one prompt attr (a torch tensor: mutable, so a budgeted write of a
    session compares it with what was recorded; a numpy one is fixed and is not read)."""
    manager = fs.SessionStateManager(byte_budget=budget)
    for i in range(64):
        h = manager.get_or_create_session(f"s{i}")
        h.put("buf", fs.LatentBuffer.create(maxlen=4))
        h.set_attr("prompt", prompt())
    return manager.get_session("s5")


# The floor of a budgeted commit: the least an exact, persistent accounting adds to an unbudgeted one, on
# the commit workload below (one pool, rings of plain torch storages, one torch prompt attr per session). It
# reads the added item's storage (its extent), moves two holder counts in a persistent map (the dropped
# item's extent remembered from its arrival, as ours), moves the pool total when a count starts or stops,
# compares the writer's prompt storage with the extent recorded on its arrival (a model may resize it in
# place), and compares total + attr bytes with the budget. No checks of the input, no devices, no unions,
# no counters. `tests/test_budget_floor.py` checks that it keeps the totals ours reports.
FLOOR_RING = 4


def floor_ledger(sessions: dict[str, Any]) -> tuple:
    """The floor's ledger for sessions ``{sid: prompt tensor}``, each with an empty 4-item ring:
    ``(refs, rings, total, attr bytes, recorded prompt extents)``."""
    recorded = {}
    attr = 0
    for sid, prompt in sessions.items():
        st = prompt.untyped_storage()
        recorded[sid] = (st.data_ptr(), st.nbytes())
        attr += st.nbytes()
    rings = immutables.Map({sid: () for sid in sessions})
    return (immutables.Map(), rings, 0, attr, recorded)


def floor_account(ledger: tuple, sid: str, item: Any, prompt: Any, budget: int) -> tuple | None:
    """The floor's accounting of ``item`` committed into session ``sid``'s ring: the new ledger, or None
    where ours would take its full check (the prompt changed in place, or the budget would be exceeded)."""
    refs, rings, total, attr, recorded = ledger
    st = item.untyped_storage()
    ext = (st.data_ptr(), st.nbytes())
    ring = rings[sid]
    n = refs.get(ext, 0)
    if not n:
        total += ext[1]
    refs = refs.set(ext, n + 1)
    if len(ring) == FLOOR_RING:
        out = ring[0]
        ring = (ring[1], ring[2], ring[3], ext)  # (unrolled: FLOOR_RING is 4)
        m = refs[out]
        if m == 1:
            refs = refs.delete(out)
            total -= out[1]
        else:
            refs = refs.set(out, m - 1)
    else:
        ring = (*ring, ext)
    ps = prompt.untyped_storage()
    if (ps.data_ptr(), ps.nbytes()) != recorded[sid] or total + attr > budget:
        return None
    return (refs, rings.set(sid, ring), total, attr, recorded)


def _commit_costs() -> dict[str, float]:
    """A handle commit of a 4 KiB tensor into a 4-item ring, 64 sessions, with and without a budget (never
    reached); and one DreamZero pipeline step (small shapes) with and without one."""
    items = [torch.zeros(1024) for _ in range(64)]
    # Storages torch did not allocate (`Loose`: frames from numpy): the pool's total is kept as a union.
    loose_items = [torch.from_numpy(np.zeros(1024, np.float32)) for _ in range(64)]
    plain, budgeted, loose = _handles(None), _handles("64GiB"), _handles("64GiB")
    fixed = _handles("64GiB", lambda: np.zeros(2, np.float32))
    turn = {"p": 0, "b": 0, "l": 0, "f": 0}

    def commit_plain() -> None:
        for _ in range(200):
            plain.commit("buf", items[turn["p"] % 64])
            turn["p"] += 1

    made: list[torch.Tensor] = []  # (the prompts of the floor's sessions s0..s63, in order)

    def recorded_prompt() -> torch.Tensor:
        made.append(torch.zeros(8))
        return made[-1]

    floor_handle = _handles(None, recorded_prompt)
    floor_prompts = {f"s{i}": t for i, t in enumerate(made)}
    floor_state = {"ledger": floor_ledger(floor_prompts), "k": 0}
    floor_budget, floor_prompt = fs.parse_bytes("64GiB"), floor_prompts["s5"]

    def commit_floor() -> None:  # the unbudgeted commit plus the floor's accounting (see `floor_account`)
        ledger, k = floor_state["ledger"], floor_state["k"]
        for _ in range(200):
            item = items[k % 64]
            floor_handle.commit("buf", item)
            ledger = floor_account(ledger, "s5", item, floor_prompt, floor_budget)
            assert ledger is not None  # (never over the budget, the prompt never changed: every commit counted)
            k += 1
        floor_state["ledger"], floor_state["k"] = ledger, k

    def commit_budgeted() -> None:
        for _ in range(200):
            budgeted.commit("buf", items[turn["b"] % 64])
            turn["b"] += 1

    def commit_fixed() -> None:
        for _ in range(200):
            fixed.commit("buf", items[turn["f"] % 64])
            turn["f"] += 1

    def commit_loose() -> None:
        for _ in range(200):
            loose.commit("buf", loose_items[turn["l"] % 64])
            turn["l"] += 1

    cfg = dz.small_config(prompt_every=10**6, vae_encoder="stand-in")  # commit overhead, not the encoder
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
            "commit_loose": commit_loose,
            "commit_fixed": commit_fixed,
            "commit_floor": commit_floor,
            "step_plain": lambda: step("plain"),
            "step_budgeted": lambda: step("budgeted"),
        },
        repeats=9,
    )
    tails = _commit_tails(plain, budgeted, items)
    return {
        "tails": tails,
        "commit_plain": t["commit_plain"] / 200,
        "commit_budgeted": t["commit_budgeted"] / 200,
        "commit_loose": t["commit_loose"] / 200,
        "commit_fixed": t["commit_fixed"] / 200,
        "commit_floor": t["commit_floor"] / 200,
        "step_plain": t["step_plain"] / 4,
        "step_budgeted": t["step_budgeted"] / 4,
    }


TAIL_ROUNDS = 100  # x 200 commits each, one at a time: p99 and p99.9 over 20,000 of each, per clock


def _commit_tails(plain: Any, budgeted: Any, items: list[torch.Tensor]) -> dict[str, Any]:
    """Per-commit times of the unbudgeted and the budgeted handle commit, each commit timed alone, 200 at a
    time, the two alternating which goes first (GC on): the medians' tails, p99 and p99.9. Timed twice: on the
    wall clock (what a caller waits, the machine's preemption included) and on the thread's CPU clock (what the
    commit itself costs: a time slice given to another process is not in it). ``collections``: the garbage
    collections per generation that ran during the timed commits (a `gc.callbacks` hook)."""
    out: dict[str, Any] = {}
    ran = [0, 0, 0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            ran[info["generation"]] += 1

    gc.callbacks.append(count)
    try:
        for clock_name, clock in (("wall", time.perf_counter), ("cpu", time.thread_time)):
            times: dict[str, list[float]] = {"plain": [], "budgeted": []}
            for r in range(TAIL_ROUNDS):
                for name in ("plain", "budgeted") if r % 2 == 0 else ("budgeted", "plain"):
                    handle, xs = (plain if name == "plain" else budgeted), times[name]
                    for k in range(200):
                        item = items[(r + k) % 64]
                        t0 = clock()
                        handle.commit("buf", item)
                        xs.append(clock() - t0)
            out[clock_name] = times
    finally:
        gc.callbacks.remove(count)
    out["collections"] = tuple(ran)
    return out


def _tail(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs``, nearest rank."""
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


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


class _Moves(logging.Handler):
    """The bytes each park and restore moved, as the table measured them on its ledger (the ``moved`` it
    returns and logs at debug level), so the floor is priced on what the run really moved."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.parked: list[int] = []  # bytes per park (what arrived in a host pool)
        self.restored: list[int] = []  # bytes per restore (what arrived back in a device pool)
        self.park_names = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg if isinstance(record.msg, str) else ""
        if not msg.startswith(("park: ", "restore: ")) or not record.args:
            return
        moved = record.args[-1]  # type: ignore[index]
        arrived = sum(n for n in moved.values() if n > 0)  # type: ignore[union-attr]
        if msg.startswith("park: "):
            self.parked.append(arrived)
            self.park_names += len(record.args[0])  # type: ignore[index, arg-type]
        else:
            self.restored.append(arrived)


class _Timed:
    """Wall time and minor page faults spent inside one library function (a profile without a profiler)."""

    def __init__(self, module: Any, name: str):
        self.module, self.name, self.fn = module, name, getattr(module, name)
        self.seconds, self.faults, self.calls = 0.0, 0, 0

    def __enter__(self) -> _Timed:
        fn = self.fn

        def timed(*args: Any, **kw: Any) -> Any:
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                self.calls += 1

        setattr(self.module, self.name, timed)
        return self

    def __exit__(self, *exc: Any) -> None:
        setattr(self.module, self.name, self.fn)


def _copy_seconds(sizes: list[int], fresh: bool) -> float:
    """Time to copy ``sizes`` bytes (each one transfer) from resident memory into host buffers, in pieces of
    `_PIECE`: fresh ones (``np.empty`` per piece: above glibc's mmap threshold, so each comes new from the
    kernel, page faults included, as a park into newly allocated memory pays them), or one buffer reused
    (touched before: memcpy speed alone)."""
    src = torch.ones(_PIECE, dtype=torch.uint8)
    reused = torch.ones(_PIECE, dtype=torch.uint8)
    t0 = time.perf_counter()
    for n in sizes:
        while n > 0:
            k = min(n, _PIECE)
            dst = torch.from_numpy(np.empty(k, np.uint8)) if fresh else reused[:k]
            dst.copy_(src[:k])
            del dst
            n -= k
    return time.perf_counter() - t0


_PIECE = 64 * MIB


def _pressure(steps: int, rounds: int) -> dict[str, Any]:
    """8 deploy-shape sessions (603 MiB feat map each) with a budget holding 3 sessions, against a count cap
    alone (every session resident), both through the serving store, and the data-movement floor of the budget
    run: its own parked and restored bytes copied at this machine's memcpy speed, plus the count-cap run.
    Interleaved round by round (count cap, pressure, the copies), one warm-up round, medians."""
    cfg = dz.RolloutConfig(steps=steps, sessions=8, prompt_every=10**9, trace_pools=True, vae_encoder="stand-in")
    budget = 3 * estimate_session_nbytes(steps=steps)
    pressure_cfg = dataclasses.replace(cfg, byte_budget={"cpu": budget})
    log = logging.getLogger("functional_state")
    samples: dict[str, list[float]] = {}
    results: dict[str, dz.RolloutResult] = {}
    moves = _Moves()
    for r in range(rounds + 1):
        gc.collect()
        with enable_override(True):
            t0 = time.perf_counter()
            results["count cap only"] = dz.run_rollout(cfg)
            count_cap = time.perf_counter() - t0
            moves = _Moves()
            level, propagate = log.level, log.propagate
            log.addHandler(moves)
            log.setLevel(logging.DEBUG)
            log.propagate = False  # nothing else formats the debug records (a plan's text is not free)
            try:
                with (
                    _Timed(enforce, "plan_release") as plan,
                    _Timed(parking, "_copy_storages_to_host") as park_copy,
                    _Timed(parking, "_copy_storages_to_device") as restore_copy,
                ):
                    t0 = time.perf_counter()
                    results["budget 3 sessions, parking"] = dz.run_rollout(pressure_cfg)
                    pressure = time.perf_counter() - t0
            finally:
                log.removeHandler(moves)
                log.setLevel(level)
                log.propagate = propagate
        sizes = moves.parked + moves.restored
        fresh, reused = _copy_seconds(sizes, True), _copy_seconds(sizes, False)
        if r == 0:
            continue  # warm-up: the allocator, the page cache and the host-buffer cache reach their steady state
        moved = sum(sizes)
        row = {
            "count_cap": count_cap,
            "pressure": pressure,
            "bw_fresh": moved / fresh,
            "bw_reused": moved / reused,
            "floor": count_cap + fresh,
            "floor_memcpy": count_cap + reused,
            "plan": plan.seconds,
            "park_copy": park_copy.seconds,
            "restore_copy": restore_copy.seconds,
            "faults": park_copy.faults + restore_copy.faults,
            "bookkeeping": pressure - count_cap - plan.seconds - park_copy.seconds - restore_copy.seconds,
        }
        row["ratio"] = pressure / row["floor"]
        row["ratio_memcpy"] = pressure / row["floor_memcpy"]
        for k, v in row.items():
            samples.setdefault(k, []).append(v)
    stats = results["budget 3 sessions, parking"].stats or {}
    if (moves.park_names, len(moves.restored)) != (stats.get("parks"), stats.get("restores")):
        raise AssertionError(
            f"bench_budget: captured {moves.park_names} parks / {len(moves.restored)} restores, the table counted "
            f"{stats.get('parks')} / {stats.get('restores')}: the byte capture missed some"
        )
    return {
        "results": results,
        "budget": budget,
        "medians": {k: statistics.median(v) for k, v in samples.items()},
        "parked": sum(moves.parked),
        "restored": sum(moves.restored),
        "rounds": rounds,
    }


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


def _commit_rows(costs: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The section's rows of the commit costs (`_commit_costs`)."""
    tails = costs["tails"]
    return [
        ("commit (handle, 4-item ring), no budget", fmt_time(costs["commit_plain"]), "-"),
        *(
            (
                f"  one commit timed alone, {name}, {clock} clock: median / p99 / p99.9 ({len(xs):,} commits)",
                " / ".join(fmt_time(v) for v in (statistics.median(xs), _tail(xs, 0.99), _tail(xs, 0.999))),
                "-",
            )
            for clock in ("wall", "cpu")
            for name, xs in tails[clock].items()
        ),
        (
            "  garbage collections during the timed commits, generation 0 / 1 / 2",
            " / ".join(str(n) for n in tails["collections"]),
            "-",
        ),
        (
            "commit (handle, 4-item ring), budget enforced",
            fmt_time(costs["commit_budgeted"]),
            f"{costs['commit_budgeted'] / costs['commit_plain']:.2f}x",
        ),
        (
            "commit (handle, 4-item ring), no budget + the least exact accounting (floor)",
            fmt_time(costs["commit_floor"]),
            f"{costs['commit_floor'] / costs['commit_plain']:.2f}x",
        ),
        (
            "commit (handle, 4-item ring), budget enforced, a numpy prompt attr (fixed: not re-read)",
            fmt_time(costs["commit_fixed"]),
            f"{costs['commit_fixed'] / costs['commit_plain']:.2f}x",
        ),
        (
            "commit (handle, 4-item ring of torch.from_numpy frames: a union kept), budget enforced",
            fmt_time(costs["commit_loose"]),
            f"{costs['commit_loose'] / costs['commit_plain']:.2f}x",
        ),
        ("DreamZero pipeline step, no budget", fmt_time(costs["step_plain"]), "-"),
        (
            "DreamZero pipeline step, budget enforced",
            fmt_time(costs["step_budgeted"]),
            f"{costs['step_budgeted'] / costs['step_plain']:.2f}x",
        ),
    ]


def _commit_ratios(costs: dict[str, Any]) -> list[tuple[str, float]]:
    """The section's ratios of the commit costs."""
    tails = costs["tails"]
    return [
        (
            "bare handle commit: budget enforced / none (goal <= 1.5)",
            costs["commit_budgeted"] / costs["commit_plain"],
        ),
        (
            "bare handle commit: floor (no budget + the least exact accounting) / none",
            costs["commit_floor"] / costs["commit_plain"],
        ),
        ("bare handle commit: budget enforced / floor", costs["commit_budgeted"] / costs["commit_floor"]),
        *(
            row
            for clock in ("wall", "cpu")
            for row in (
                (
                    f"one handle commit timed alone, {clock} clock: budgeted / none, median (goal <= 1.5)",
                    statistics.median(tails[clock]["budgeted"]) / statistics.median(tails[clock]["plain"]),
                ),
                (
                    f"one handle commit timed alone, {clock} clock: budgeted / none, p99",
                    _tail(tails[clock]["budgeted"], 0.99) / _tail(tails[clock]["plain"], 0.99),
                ),
                (
                    "  p99.9",
                    _tail(tails[clock]["budgeted"], 0.999) / _tail(tails[clock]["plain"], 0.999),
                ),
            )
        ),
    ]


def _commit_section(costs: dict[str, Any]) -> dict:
    """The commit rows alone (``FS_BENCH_BUDGET_PART=commits``): printed, never a whole section to write."""
    return {
        "title": "Byte budget: enforcement cost (the commit rows only)",
        "header": ("measure", "time or bytes", "ratio / counts"),
        "rows": _commit_rows(costs),
        "ratio": (
            "DreamZero pipeline step: budget enforced / none (goal <= 1.5)",
            costs["step_budgeted"] / costs["step_plain"],
        ),
        "extra_ratios": _commit_ratios(costs),
        "notes": f"Commit rows only ({PART_ENV}=commits): the planner and pressure parts were not run.",
        "figures": {"costs": costs},
    }


def run() -> dict:
    costs = _commit_costs()
    if os.environ.get(PART_ENV) == "commits":
        return _commit_section(costs)
    planner = _planner_costs()
    steps = 16
    t0 = time.perf_counter()
    found = _pressure(steps, rounds=5)
    pressure_s = time.perf_counter() - t0
    pressure, budget, m = found["results"], found["budget"], found["medians"]
    _plot(pressure, budget)
    rows = _commit_rows(costs)
    for n, (plan_s, op_s) in planner.items():
        rows.append(
            (
                f"plan_release at {n:,} sessions (park 10) vs one manager op",
                fmt_time(plan_s),
                f"{plan_s / op_s:,.0f} ops",
            )
        )
    peaks = {}
    for label, r in pressure.items():
        peaks[label] = peak = max(p.get("nbytes:cpu", 0) for p in r.pool_trace)
        s = r.stats or {}
        rows.append(
            (
                f"pressure, {label}: peak device pool / parks / restores / sessions lost",
                f"{peak / 2**30:.2f} GiB",
                f"{s.get('parks', 0)} / {s.get('restores', 0)} / {len(r.lost)}",
            )
        )
    gb = 1e9
    moved = found["parked"] + found["restored"]
    rows += [
        ("pressure: count-cap run / budget run (median)", fmt_time(m["count_cap"]), fmt_time(m["pressure"])),
        (
            "pressure: bytes parked / restored (the table's measured moves)",
            f"{found['parked'] / gb:.2f} GB",
            f"{found['restored'] / gb:.2f} GB",
        ),
        (
            "pressure: memcpy into fresh / into reused host buffers",
            f"{m['bw_fresh'] / gb:.2f} GB/s",
            f"{m['bw_reused'] / gb:.2f} GB/s",
        ),
        (
            "pressure: floor = count-cap run + moved bytes at fresh / at reused speed",
            fmt_time(m["floor"]),
            fmt_time(m["floor_memcpy"]),
        ),
        ("pressure: above the count-cap run: planner / park copies", fmt_time(m["plan"]), fmt_time(m["park_copy"])),
        (
            "pressure: restore copies / store bookkeeping (the rest)",
            fmt_time(m["restore_copy"]),
            f"{m['bookkeeping'] * 1e3:+.0f} ms",
        ),
        ("pressure: minor page faults in park and restore copies", f"{m['faults']:,.0f}", "-"),
    ]
    same = len({r.digest for r in pressure.values()}) == 1
    within = peaks["budget 3 sessions, parking"] <= budget
    lost = sum(len(r.lost) for r in pressure.values())
    return {
        "title": "Byte budget: enforcement cost, planner cost, DreamZero under pressure",
        "header": ("measure", "time or bytes", "ratio / counts"),
        "rows": rows,
        "ratio": (
            "DreamZero pipeline step: budget enforced / none (goal <= 1.5)",
            costs["step_budgeted"] / costs["step_plain"],
        ),
        "extra_ratios": [
            *_commit_ratios(costs),
            ("plan at 100,000 / plan at 1,000 sessions (linear would be 100)", planner[100_000][0] / planner[1_000][0]),
            ("pressure run / its data-movement floor, fresh host buffers (goal <= 1.5)", m["ratio"]),
            ("pressure run / the stricter floor, memcpy into reused buffers", m["ratio_memcpy"]),
            ("pressure run / count-cap run", m["pressure"] / m["count_cap"]),
            ("pressure digests equal across runs (1 = yes)", float(same)),
            ("pressure peak device pool within the budget, sessions lost 0 (1 = yes)", float(within and not lost)),
        ],
        "notes": (
            f"Enforcement: the shell decides a write within budget from the kept object totals (the commit's "
            f"accounting reads only the storage of the item it adds; the extents of the one it drops are "
            f"remembered from its arrival; two holder counts move), reading the attrs a write sets, comparing the writer's "
            f"mutable attrs (containers, torch tensors: a model may resize one in place) with what was recorded on "
            f"their arrival (a tensor: one storage read; the torch prompt each session here holds), and re-reading "
            f"every attr only when a pool nears its budget; a step that keeps the totals (a same-size ring step) is answered "
            f"from the last object check that passed, and a commit that follows one of the same session on the table "
            f"it installed re-reads only the writer's attr tensors (`admission.Recheck`: no walk of its attrs; a "
            f"round robin of sessions takes the walk). The floor row is the unbudgeted commit plus the least an "
            f"exact persistent accounting adds (`floor_account`: the item's storage read, two holder counts moved in "
            f"a persistent map, the pool total, the writer's prompt storage compared, one comparison with the "
            f"budget; one pool, no checks; its totals are checked against ours in tests/test_budget_floor.py). "
            f"Frames from numpy are storages torch did not allocate, which may overlap "
            f"without being equal: their pool keeps a sorted index and its total is their union, each step priced "
            f"by the bytes it covers or uncovers. Planner: a park pass reads the sessions from the recency log as it "
            f"needs them (here the 10 oldest) and asks the ledger's attr index whether attrs hold a buffer. "
            f"Pressure: {steps} steps x 8 sessions at deploy shapes through the "
            f"serving store, {found['rounds']} interleaved rounds after a warm-up ({pressure_s:.0f} s in all); the "
            f"budget holds 3 sessions ({budget / 2**30:.2f} GiB; the peak is sampled after each round). The floor "
            f"is the count-cap run (all the work that is not data movement) plus the bytes this run parked and "
            f"restored ({moved / gb:.1f} GB, summed from the `moved` each park and restore measured on the "
            f"ledger) copied in the same round, in 64 MiB pieces, into fresh np.empty buffers (new pages from the "
            f"kernel, first-touch faults included) or, for the stricter floor, into one touched buffer. The "
            f"feat map is read every 4th step, so the 8 sessions cycle through 3 resident slots on those steps: "
            f"LRU misses every one of them (the minimum for LRU on a cycle longer than the cache: ~30 feat-map "
            f"parks and 24 restores carry all but ~0.16 GB of the 34.3 GB; the other parks are a session's small "
            f"objects, taken in name order, restored on its next step); the plot is "
            f"`benchmarks/{PLOT.name}`. The commit rows alone (a minute, not the half hour of the pressure "
            f"part): `{PART_ENV}=commits python benchmarks/run.py budget` (prints them; not for `--write`)."
        ),
        "figures": {
            "costs": costs,
            "planner": planner,
            "pressure": {k: {"lost": v.lost, "stats": v.stats} for k, v in pressure.items()},
            "pressure_medians": m,
        },
    }
