"""Qwen3-MoE causal language model in flax.nnx, numerically matching Hugging Face transformers.

Module and parameter names follow transformers' (`layers.N.self_attn.q_proj`, `layers.N.mlp`, ...) so the
checkpoint mapping in `hf_checkpoint` stays a short table. The sparse layers are `jax_megamoe.nn.MoE`.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx

from jax_megamoe.models import hf_checkpoint
from jax_megamoe.models.qwen3_moe_config import Qwen3MoeConfig, qwen3_30b_a3b, qwen3_235b_a22b, tiny
from jax_megamoe.nn import MoE, MoEAux

__all__ = ["Qwen3MoeConfig", "Qwen3MoeForCausalLM", "from_pretrained", "save_pretrained", "qwen3_30b_a3b",
           "qwen3_235b_a22b", "tiny"]


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """NeoX-style rotary tables `cos, sin [..., S, head_dim]` in float32 (frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates `x [B, S, N, D]` by the tables (`x*cos + rotate_half(x)*sin`, rotate_half = [-x2, x1])."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[..., None, :] + rotated * sin[..., None, :]).astype(x.dtype)


class Attention(nnx.Module):
    """GQA self-attention; q and k are RMS-normalised over head_dim before RoPE; causal."""

    def __init__(self, config: Qwen3MoeConfig, *, dtype, param_dtype, attention_impl: str | None, rngs: nnx.Rngs):
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                   kernel_init=nnx.initializers.normal(config.initializer_range), rngs=rngs)
        norm = functools.partial(nnx.RMSNorm, head_dim, epsilon=config.rms_norm_eps, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs)
        self.q_proj = linear(config.hidden_size, heads * head_dim)
        self.k_proj = linear(config.hidden_size, kv_heads * head_dim)
        self.v_proj = linear(config.hidden_size, kv_heads * head_dim)
        self.o_proj = linear(heads * head_dim, config.hidden_size)
        self.q_norm = norm()
        self.k_norm = norm()
        self.head_dim = head_dim
        self.attention_impl = attention_impl

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        batch, seq, _ = x.shape
        heads = functools.partial(jnp.reshape, shape=(batch, seq, -1, self.head_dim))
        q = apply_rope(self.q_norm(heads(self.q_proj(x))), cos, sin)
        k = apply_rope(self.k_norm(heads(self.k_proj(x))), cos, sin)
        v = heads(self.v_proj(x))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention_impl)
        return self.o_proj(out.reshape(batch, seq, -1))


class DenseMLP(nnx.Module):
    """SwiGLU MLP `down(silu(gate(x)) * up(x))` of the non-sparse layers."""

    def __init__(self, config: Qwen3MoeConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                   kernel_init=nnx.initializers.normal(config.initializer_range), rngs=rngs)
        self.gate_proj = linear(config.hidden_size, config.intermediate_size)
        self.up_proj = linear(config.hidden_size, config.intermediate_size)
        self.down_proj = linear(config.intermediate_size, config.hidden_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))` with a sparse or dense MLP."""

    def __init__(self, config: Qwen3MoeConfig, layer_idx: int, *, dtype, param_dtype, attention_impl, moe_kwargs,
                 rngs: nnx.Rngs):
        norm = functools.partial(nnx.RMSNorm, config.hidden_size, epsilon=config.rms_norm_eps, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = norm()
        self.self_attn = Attention(config, dtype=dtype, param_dtype=param_dtype, attention_impl=attention_impl,
                                   rngs=rngs)
        self.post_attention_layernorm = norm()
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            init = nnx.initializers.normal(config.initializer_range)
            self.mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                           config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob, dtype=dtype,
                           param_dtype=param_dtype, kernel_init=init, router_init=init, rngs=rngs, **moe_kwargs)
        else:
            self.mlp = DenseMLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, MoEAux | None]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            y, aux = self.mlp(h)
            return x + y, aux
        return x + self.mlp(h), None


def combine_aux(layer_aux: list[MoEAux], num_experts: int) -> MoEAux:
    """Model-level aux: losses averaged over the MoE layers, counts stacked `[L_moe, E]`, drops summed."""
    if not layer_aux:
        zero = jnp.zeros((), jnp.float32)
        return MoEAux(zero, zero, jnp.zeros((0, num_experts), jnp.int32), jnp.zeros((), jnp.int32))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layer_aux)
    return MoEAux(jnp.mean(stacked.load_balancing_loss), jnp.mean(stacked.router_z_loss), stacked.expert_counts,
                  jnp.sum(stacked.dropped_pairs))


class Qwen3MoeForCausalLM(nnx.Module):
    """Qwen3-MoE decoder with an LM head: `logits, aux = model(input_ids)`.

    Args:
      config: the hyper-parameters (`Qwen3MoeConfig`).
      dtype: compute dtype (e.g. `jnp.bfloat16`); norms, softmax and the router run in float32.
      param_dtype: parameter storage dtype.
      implementation, expert_axis, transport, capacity_factor: passed to every `jax_megamoe.nn.MoE` layer (one
        `NvlinkTransport` serves them all).
      remat: recompute each decoder layer in the backward pass (`nnx.remat`) to save activation memory.
      remat_policy: with `remat`, a `jax.checkpoint_policies` policy of what to save instead; e.g.
        `save_only_these_names("moe_layout", "moe_gate_up")` keeps the experts' gate/up projections, so the MoE
        recomputes nothing (`jax_megamoe.moe_ffn`).
      attention_impl: `jax.nn.dot_product_attention`'s `implementation` (None: XLA; "cudnn" on GPUs).
      rngs: parameter initialisation keys (HF's: normal(initializer_range), norms at one).

    `aux` is a `MoEAux`: load-balancing and z losses averaged over the sparse layers (HF pools the router
    logits of all layers before its load-balancing product instead), `expert_counts [L_moe, E]`,
    `dropped_pairs` summed.
    """

    def __init__(self, config: Qwen3MoeConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, implementation="auto",
                 expert_axis: str | None = None, transport="xla",
                 capacity_factor: float | None = None, remat: bool = False, remat_policy=None,
                 attention_impl: str | None = None, rngs: nnx.Rngs):
        if remat_policy is not None and not remat:
            raise ValueError("remat_policy needs remat=True")
        self.config = config
        self.remat = remat
        self.remat_policy = remat_policy
        init = nnx.initializers.normal(config.initializer_range)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype,
                                      embedding_init=init, rngs=rngs)
        moe_kwargs = dict(implementation=implementation, expert_axis=expert_axis, transport=transport,
                          capacity_factor=capacity_factor)
        self.layers = nnx.List([
            DecoderLayer(config, i, dtype=dtype, param_dtype=param_dtype, attention_impl=attention_impl,
                         moe_kwargs=moe_kwargs, rngs=rngs) for i in range(config.num_hidden_layers)])
        self.norm = nnx.RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps, dtype=dtype,
                                param_dtype=param_dtype, rngs=rngs)
        self.lm_head = None if config.tie_word_embeddings else nnx.Linear(
            config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
            kernel_init=init, rngs=rngs)

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None) -> tuple[jax.Array, MoEAux]:
        """`input_ids [B, S]` -> `(logits [B, S, vocab] in the compute dtype, MoEAux)`.

        `positions` (`[S]` or `[B, S]`) defaults to `0..S-1`.
        """
        x, aux = self.hidden_states(input_ids, positions)
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits, aux

    def lm_head_kernel(self) -> jax.Array:
        """The LM head as an `[H, vocab]` matrix in the compute dtype (the embedding table's transpose when
        tied), for `jax_megamoe.losses.linear_cross_entropy(model.hidden_states(ids)[0], ...)`."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...].T.astype(self.embed_tokens.dtype)
        return self.lm_head.kernel[...].astype(self.lm_head.dtype)

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array | None = None) -> tuple[jax.Array, MoEAux]:
        """`(final normed hidden states [B, S, H], MoEAux)`: the model without its LM head."""
        if positions is None:
            positions = jnp.arange(input_ids.shape[-1])
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        x = self.embed_tokens(input_ids)
        layer_aux = []
        run_layer = nnx.remat(DecoderLayer.__call__, policy=self.remat_policy) if self.remat else DecoderLayer.__call__
        for layer in self.layers:
            x, aux = run_layer(layer, x, cos, sin)
            if aux is not None:
                layer_aux.append(aux)
        return self.norm(x), combine_aux(layer_aux, self.config.num_experts)


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None, mesh=None,
                    expert_axis: str | None = None, **model_kwargs) -> Qwen3MoeForCausalLM:
    """Loads a Hugging Face Qwen3-MoE checkpoint directory (`config.json` + safetensors).

    Reads a single `model.safetensors` or a sharded `model.safetensors.index.json`, with experts stored
    per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or fused (`mlp.experts.gate_up_proj
    [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`). With `mesh`, each parameter is placed directly with
    its sharding (experts split over `expert_axis`, default "expert" when the mesh has that axis; the rest
    replicated), one tensor at a time, so host memory stays near one tensor.

    Args:
      path: checkpoint directory.
      dtype: compute dtype. param_dtype: storage dtype (default: `dtype`).
      mesh: optional `jax.sharding.Mesh`. expert_axis: mesh axis of the experts.
      **model_kwargs: other `Qwen3MoeForCausalLM` arguments (implementation, remat, attention_impl, ...).
    """
    config = Qwen3MoeConfig.from_json(path)
    if mesh is not None and expert_axis is None and "expert" in mesh.axis_names:
        expert_axis = "expert"
    param_dtype = param_dtype or dtype
    abstract = nnx.eval_shape(lambda: Qwen3MoeForCausalLM(config, dtype=dtype, param_dtype=param_dtype,
                                                          expert_axis=expert_axis, rngs=nnx.Rngs(0), **model_kwargs))
    graphdef, state = nnx.split(abstract)
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    with hf_checkpoint.SafetensorsReader(path) as reader:
        for key, variable in nnx.to_flat_state(state):
            value = hf_checkpoint.load_param(reader, key, config).astype(param_dtype)
            expected = variable.get_value().shape
            if value.shape != expected:
                raise ValueError(f"checkpoint tensor for {'.'.join(map(str, key))} has shape {value.shape}, "
                                 f"the config implies {expected}")
            variable.set_value(hf_checkpoint.place(value, mesh, specs[key].get_value()))
    return nnx.merge(graphdef, state)


def save_pretrained(model: Qwen3MoeForCausalLM, path: str | os.PathLike, *, max_shard_bytes: int = 5 << 30,
                    dtype=None) -> None:
    """Writes `config.json` and safetensors (per-expert layout, sharded past `max_shard_bytes` with an
    index) that transformers' `Qwen3MoeForCausalLM.from_pretrained` reads. `dtype` casts on the way out
    (default: the parameters' dtype). Under multi-process JAX, process 0 writes."""
    state = nnx.state(model, nnx.Param)
    params = {key: variable.get_value() for key, variable in nnx.to_flat_state(state)}
    hf_checkpoint.write(path, model.config.to_dict(), hf_checkpoint.to_hf_tensors(params, model.config, dtype),
                        max_shard_bytes)
