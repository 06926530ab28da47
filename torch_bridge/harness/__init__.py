"""The A/B harness: stand-in networks, deterministic inputs, reference engines and the synthetic rollout.

None of this is the library: it is what the tests, the benchmarks and ``functional-state demo`` drive the
adapters with. The VAE encoder stream is diffusers' real Wan encoder by default (``vae_encoder="wan"``); the
quant_conv, text encoder, generator, paged engine and Cosmos3 transformer cache are stand-ins, written here
because no real package provides them at test size.

==================  ===========================================================================
module              what it holds
==================  ===========================================================================
``config``          `RolloutConfig`, `small_config`: shapes and schedule of a rollout
``networks``        `Networks` (the encoder and the stand-in networks), `wan_encoder`
``inputs``          `stitched_frame`, `prompt_tokens`, `new_feat_map`, `hash_value`
``self_attn_kv``    `SelfAttnKV`: the generator's self-attention KV in a reference paged engine
``rollout``         `pipeline_step`, `run_rollout`, `RolloutResult` (``python -m torch_bridge.harness``)
``paged_engine``    `ReferenceKVEngine`, `EngineError`: block pools and a free queue, as a serving engine has
``cosmos3_bespoke`` `Cosmos3TransformerCache`, `Cosmos3Shapes`, `encode_und_kv`, `build_freqs_gen`
==================  ===========================================================================
"""

from .config import DEPLOY_FEAT_MAP_BYTES as DEPLOY_FEAT_MAP_BYTES
from .config import MIB as MIB
from .config import VAE_ENCODERS as VAE_ENCODERS
from .config import WAN_BASE_DIM as WAN_BASE_DIM
from .config import RolloutConfig as RolloutConfig
from .config import small_config as small_config
from .cosmos3_bespoke import Cosmos3Shapes as Cosmos3Shapes
from .cosmos3_bespoke import Cosmos3TransformerCache as Cosmos3TransformerCache
from .cosmos3_bespoke import build_freqs_gen as build_freqs_gen
from .cosmos3_bespoke import encode_und_kv as encode_und_kv
from .inputs import hash_value as hash_value
from .inputs import new_feat_map as new_feat_map
from .inputs import prompt_tokens as prompt_tokens
from .inputs import stitched_frame as stitched_frame
from .networks import Networks as Networks
from .networks import wan_encoder as wan_encoder
from .paged_engine import EngineError as EngineError
from .paged_engine import ReferenceKVEngine as ReferenceKVEngine
from .rollout import RolloutResult as RolloutResult
from .rollout import pipeline_step as pipeline_step
from .rollout import run_rollout as run_rollout
from .self_attn_kv import SelfAttnKV as SelfAttnKV

__all__ = [
    "DEPLOY_FEAT_MAP_BYTES",
    "MIB",
    "VAE_ENCODERS",
    "WAN_BASE_DIM",
    "Cosmos3Shapes",
    "Cosmos3TransformerCache",
    "EngineError",
    "Networks",
    "ReferenceKVEngine",
    "RolloutConfig",
    "RolloutResult",
    "SelfAttnKV",
    "build_freqs_gen",
    "encode_und_kv",
    "hash_value",
    "new_feat_map",
    "pipeline_step",
    "prompt_tokens",
    "run_rollout",
    "small_config",
    "stitched_frame",
    "wan_encoder",
]
