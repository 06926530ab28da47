"""Moved to `torch_bridge.harness.cosmos3_bespoke` (issue 20); this old import path keeps its public names."""

from ..harness.cosmos3_bespoke import Cosmos3Shapes as Cosmos3Shapes
from ..harness.cosmos3_bespoke import Cosmos3TransformerCache as Cosmos3TransformerCache
from ..harness.cosmos3_bespoke import build_freqs_gen as build_freqs_gen
from ..harness.cosmos3_bespoke import encode_und_kv as encode_und_kv

__all__ = ["Cosmos3Shapes", "Cosmos3TransformerCache", "build_freqs_gen", "encode_und_kv"]
