"""The floor of the budgeted commit (benchmarks/bench_budget.py, `floor_account`) is a bound only if it does
the accounting ours does: after the same commits it must hold the same pool total as our manager reports
(views of one storage counted once, an item held twice in a ring counted once), leave an old ledger as it
was (ours is persistent, so the floor must be), and refuse, as ours sends to its full check, a write over the
budget or one whose session's prompt was resized in place."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

import functional_state as fs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_budget as bb


def _tables(n: int, budget: str = "64GiB"):
    manager = fs.SessionStateManager(byte_budget=budget)
    prompts = {}
    for i in range(n):
        sid = f"s{i}"
        prompts[sid] = torch.zeros(8 + i)  # (sizes differ: a total that mixed sessions up would differ)
        h = manager.get_or_create_session(sid)
        h.put("buf", fs.LatentBuffer.create(maxlen=bb.FLOOR_RING))
        h.set_attr("prompt", prompts[sid])
    return manager, prompts, bb.floor_ledger(prompts)


def test_the_floor_keeps_the_totals_ours_reports():
    manager, prompts, ledger = _tables(4)
    base = [torch.randn(64), torch.randn(256), torch.randn(1024)]
    items = [*base, base[1][:16], base[2][100:]]  # views: their storages, counted once with the base
    rng = random.Random(0)
    for _ in range(300):
        sid, item = f"s{rng.randrange(4)}", rng.choice(items)
        manager.get_session(sid).commit("buf", item)
        ledger = bb.floor_account(ledger, sid, item, prompts[sid], fs.parse_bytes("64GiB"))
        assert ledger is not None
        floor_total = ledger[2] + ledger[3]
        assert floor_total == manager.stats()["nbytes:cpu"] == manager.stats(exact=True)["nbytes:cpu"]


def test_an_old_floor_ledger_is_left_as_it_was():
    _, prompts, ledger = _tables(2)
    t = torch.randn(32)
    old = bb.floor_account(ledger, "s0", t, prompts["s0"], 10**9)
    snapshot = (dict(old[0]), dict(old[1]), old[2], old[3], dict(old[4]))
    new = old
    for item in (torch.randn(8), t, torch.randn(16), torch.randn(4), torch.randn(2)):
        new = bb.floor_account(new, "s0", item, prompts["s0"], 10**9)
    assert (dict(old[0]), dict(old[1]), old[2], old[3], dict(old[4])) == snapshot
    assert new[2] != old[2]  # (the later ledger did move)


def test_the_floor_refuses_what_ours_checks_in_full():
    _, prompts, ledger = _tables(1)
    attr = ledger[3]
    budget = attr + 4 * 64  # room for 64 float32 values in the ring
    within = bb.floor_account(ledger, "s0", torch.zeros(64), prompts["s0"], budget)
    assert within is not None
    assert bb.floor_account(within, "s0", torch.zeros(1), prompts["s0"], budget) is None  # over the budget
    prompts["s0"].resize_(4096)  # a model growing its prompt in place: more bytes than recorded
    assert bb.floor_account(ledger, "s0", torch.zeros(1), prompts["s0"], budget) is None
