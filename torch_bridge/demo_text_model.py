"""The demo's section on real transformers K/V: Cosmos3's UND pass by a tiny Qwen2, and Llama sessions.

Cosmos3's encode-once K/V computed by a real (tiny, random-init) transformers Qwen2, held by
`Cosmos3StateAdapter` for each CFG placement: bytes stored, the footprint formula and `stats()` side by side,
copies counted by pointer, and what is left once the request ends. Then eight Llama sessions decoded through
`SessionCaches`, idle ones parked, checked token for token against each decoded alone. Skipped, with a
line saying so, where the ``[transformers]`` extra is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

TEXT_LEN, PADDED, MEDIA = 300, 512, 4096  # the demo's Cosmos3 text (padded) and media lengths, as section 1


def _sessions_check() -> tuple[bool, str]:
    """Eight greedy Llama sessions interleaved through `SessionCaches` (idle ones parked) vs each alone."""
    import torch
    import transformers

    from torch_bridge.adapters.transformers import SessionCaches
    from torch_bridge.harness.text_models import tiny_llama

    model = tiny_llama()
    prompts = [[i + 1, 2 * i + 3, 5, 7] for i in range(8)]
    caches = SessionCaches(model)
    last = {i: caches.begin(f"s{i}", torch.tensor([p])) for i, p in enumerate(prompts)}
    got: dict[int, list[int]] = {i: [] for i in last}
    for step in range(6):
        for i in last:
            tok = last[i][:, -1:].argmax(-1)
            got[i].append(int(tok))
            last[i] = caches.step(f"s{i}", tok)
            if (i + step) % 2:
                caches.park(f"s{i}")
    same = 0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            cache = transformers.DynamicCache(config=model.config)
            logits = model(input_ids=torch.tensor([p]), past_key_values=cache, use_cache=True).logits
            want = []
            for _ in range(6):
                tok = logits[:, -1:].argmax(-1)
                want.append(int(tok))
                logits = model(input_ids=tok, past_key_values=cache, use_cache=True).logits
            same += want == got[i] and torch.equal(logits, last[i])
    return same == len(prompts), f"{same}/{len(prompts)} Llama sessions (idle ones parked) bit-identical to each alone"


def text_model_section(console: Any, recap: list[tuple[str, str]]) -> bool:
    """Print the section, its heading first, and append its row to ``recap``; returns whether every check held."""
    console.print("\n6. Real transformers K/V: Cosmos3's UND pass by a Qwen2, and Llama sessions (SessionCaches)")
    if importlib.util.find_spec("transformers") is None:
        console.print("   skipped: install the [transformers] extra to run it")
        recap.append(("real transformers K/V", "skipped (no [transformers] extra)"))
        return True
    from torch_bridge.harness.cosmos3_text_model import PLACEMENTS, placement_figures
    from torch_bridge.harness.text_models import tiny_qwen2

    model = tiny_qwen2(layers=4)
    rich_table = importlib.import_module("rich.table")
    table = rich_table.Table(
        title=f"Cosmos3 UND K/V from a tiny Qwen2 (4 layers, bf16; text {TEXT_LEN} padded to {PADDED}, {MEDIA} media "
        "tokens), bytes per rank",
        title_justify="left",
    )
    for column in ("placement", "rank holds", "stored", "formula", "stats()", "copies", "after the request"):
        table.add_column(column, justify="left" if column in ("placement", "rank holds") else "right")
    ok = True
    for cfg in PLACEMENTS:
        for rank in placement_figures(model, cfg, text_len=TEXT_LEN, padded_text_len=PADDED, media_tokens=MEDIA):
            ok = ok and rank["stored"] == rank["formula"] == rank["stats"] and not rank["copies"] and not rank["after"]
            table.add_row(
                cfg, rank["branches"], *(f"{rank[k]:,}" for k in ("stored", "formula", "stats", "copies", "after"))
            )
    console.print(table)
    sessions_ok, line = _sessions_check()
    console.print(f"   {line}")
    verdict = "stored == formula == stats(), 0 copies, 0 bytes after" if ok else "FIGURES DIFFER"
    recap.append(("real transformers K/V", f"Cosmos3 from a Qwen2, 3 placements: {verdict}; {line}"))
    return ok and sessions_ok
