"""Tiny random-init transformers text models, seeded: what the tests, the benchmarks and the demo run real
transformers code on. Needs the ``[transformers]`` extra; weights are never downloaded.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

__all__ = ["tiny_llama", "tiny_qwen2"]


def tiny_llama(
    *, layers: int = 2, hidden: int = 64, kv_heads: int = 2, vocab: int = 96, max_positions: int = 64, seed: int = 0
) -> Any:
    """A random-init `LlamaForCausalLM` in eval mode: 4 query heads of ``hidden / 4``, an MLP twice as wide.

    Example:
      >>> model = tiny_llama(layers=3)
      >>> model.config.num_hidden_layers, model.config.num_key_value_heads
      (3, 2)
    """
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
    )
    return transformers.LlamaForCausalLM(config).eval()


def tiny_qwen2(*, layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A random-init `Qwen2ForCausalLM` at test size (hidden 64, 4 query and 2 K/V heads of 16), seeded."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model: Any = transformers.Qwen2ForCausalLM(config)
    return model.to(dtype).eval()
