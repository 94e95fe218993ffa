"""Qwen3-MoE causal language model in flax.nnx, numerically matching Hugging Face transformers: the public names.

Module and parameter names follow transformers' (`layers.N.self_attn.q_proj`, `layers.N.mlp`, ...) so the
checkpoint mapping in `hf_checkpoint` stays a short table. The sparse layers are `jax_megamoe.nn.MoE`. The layers
live in `qwen3_moe_layers`, the model and its one forward in `qwen3_moe_model`, Hugging Face checkpoints in
`qwen3_moe_pretrained`, generation in `generation`; this module gathers what a user calls.
"""

from __future__ import annotations

from jax_megamoe.models.attention import chunked_attention
from jax_megamoe.models.compute_form import compute_form
from jax_megamoe.models.generation import Generation, GenerationPlan, compiled_programs, generate, generation_plan
from jax_megamoe.models.kv_cache import KVCache
from jax_megamoe.models.qwen3_moe_config import Qwen3MoeConfig, qwen3_30b_a3b, qwen3_235b_a22b, tiny
from jax_megamoe.models.qwen3_moe_layers import Attention, DecoderLayer, DenseMLP, apply_rope, rope_tables
from jax_megamoe.models.qwen3_moe_model import Qwen3MoeForCausalLM, combine_aux, routing_dtype, stack_layers
from jax_megamoe.models.qwen3_moe_pretrained import from_pretrained, save_pretrained
from jax_megamoe.models.sampling import process_logits, sample_logits, token_logprobs

__all__ = [
    "Attention",
    "DecoderLayer",
    "DenseMLP",
    "Generation",
    "GenerationPlan",
    "KVCache",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "apply_rope",
    "chunked_attention",
    "combine_aux",
    "compiled_programs",
    "compute_form",
    "from_pretrained",
    "generate",
    "generation_plan",
    "process_logits",
    "qwen3_30b_a3b",
    "qwen3_235b_a22b",
    "rope_tables",
    "routing_dtype",
    "sample_logits",
    "save_pretrained",
    "stack_layers",
    "tiny",
    "token_logprobs",
]
