"""Paged KV handles in the accounting: `stats()` over 64 sessions x 1,000 engine blocks against the same
sessions without handles, and what appending a block to a long handle costs."""

from __future__ import annotations

import torch
from bench_accounting import dreamzero_like_session

import functional_state as fs
from _timing import fmt_time, interleaved_medians
from torch_bridge.harness.paged_engine import ReferenceKVEngine

N_SESSIONS = 64
BLOCKS = 1_000


def _table(engine: ReferenceKVEngine | None) -> fs.SessionStateManager:
    manager = fs.SessionStateManager(max_sessions=N_SESSIONS)
    shared = torch.zeros(512, 64)
    prefix = engine.allocate(16) if engine is not None else ()  # a system prompt every session shares
    for i in range(N_SESSIONS):
        sid = f"s{i}"
        dreamzero_like_session(manager, sid, shared)
        if engine is not None:
            ids = prefix + engine.allocate(BLOCKS - len(prefix))
            manager.get_session(sid).put("self_attn_kv", fs.PagedKVHandle.create(engine.pool, ids))
    return manager


def run() -> dict:
    engine = ReferenceKVEngine(num_blocks=N_SESSIONS * BLOCKS, block_size=16, heads=2, head_dim=8, layers=2)
    plain, paged = _table(None), _table(engine)
    sp, sk = plain.state, paged.state
    fs.stats(sp), fs.stats(sk)  # the first call builds the kept totals (one walk)
    item = torch.zeros(64)
    handle = fs.lookup(sk, "s5").objects["self_attn_kv"]
    spare = engine.allocate(1)
    t = interleaved_medians(
        {
            "plain": lambda: fs.stats(sp),
            "paged": lambda: fs.stats(sk),
            "plain_exact": lambda: fs.stats(sp, exact=True),
            "paged_exact": lambda: fs.stats(sk, exact=True),
            "kv_view": lambda: handle.view(),
        },
        repeats=9,
    )
    t.update(
        interleaved_medians(
            {
                "commit_ring": lambda: fs.commit(sk, "s5", "vae_encoder_out", item),
                "commit_kv": lambda: fs.commit(sk, "s5", "self_attn_kv", list(spare)),
            },
            repeats=9,
            number=200,
        )
    )
    s_plain, s_paged = fs.stats(sp), fs.stats(sk)
    kv_bytes = s_paged["nbytes:cpu"] - s_plain["nbytes:cpu"]
    expected = (16 + N_SESSIONS * (BLOCKS - 16)) * engine.pool.block_nbytes
    exact_ok = s_paged["nbytes:cpu"] == fs.stats(sk, exact=True)["nbytes:cpu"]
    rows = [
        ("stats(), sessions without handles", fmt_time(t["plain"]), f"{s_plain['nbytes:cpu']:,}"),
        ("stats(), same sessions + a 1,000-block handle each", fmt_time(t["paged"]), f"{s_paged['nbytes:cpu']:,}"),
        ("stats(exact=True), without handles", fmt_time(t["plain_exact"]), "-"),
        ("stats(exact=True), with handles (64,000 blocks x 4 pool tensors)", fmt_time(t["paged_exact"]), "-"),
        ("commit one tensor to a 4-item ring (for scale)", fmt_time(t["commit_ring"]), "-"),
        ("commit one block to a 1,000-block handle", fmt_time(t["commit_kv"]), "-"),
        ("handle.view(): gather 1,000 blocks x 4 tensors", fmt_time(t["kv_view"]), "-"),
    ]
    return {
        "title": "Paged KV handles: stats() with 64 sessions x 1,000 engine blocks",
        "header": ("measure", "median time", "nbytes:cpu"),
        "rows": rows,
        "ratio": ("stats() with handles / without (goal <= 1.5)", t["paged"] / t["plain"]),
        "extra_ratios": [
            ("stats(exact=True) with handles / without", t["paged_exact"] / t["plain_exact"]),
            ("block commit / ring commit", t["commit_kv"] / t["commit_ring"]),
            ("KV bytes counted == hand count (1 = yes)", float(kv_bytes == expected)),
            ("kept totals == full walk (1 = yes)", float(exact_ok)),
        ],
        "notes": (
            f"{N_SESSIONS} DreamZero-like sessions (bench_accounting's), each also holding a handle on "
            f"{BLOCKS:,} blocks of a reference engine pool (2 layers x K and V, 1 KiB per block per tensor); the "
            f"first 16 blocks are a prefix every session shares, counted once. Blocks are counted by arithmetic "
            f"on ids (one extent per block per pool tensor), kept incrementally like every object: stats() reads "
            f"the kept totals; a block commit prices only the new block."
        ),
        "figures": {"times": t, "kv_bytes": kv_bytes, "expected": expected},
    }
