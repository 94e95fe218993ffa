"""The Qwen3-MoE decoder's layers in flax.nnx, numerically matching Hugging Face transformers: rotary tables, the GQA
attention (over itself, or over a KV cache), the dense SwiGLU MLP and the pre-norm decoder block, whose sparse MLP is
`jax_megamoe.nn.MoE`. Names follow transformers' (`self_attn.q_proj`, `mlp`, ...)."""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
from flax import nnx

from jax_megamoe.models.attention import causal_attention, chunked_attention
from jax_megamoe.models.kv_cache import KVCache
from jax_megamoe.models.qwen3_moe_config import Qwen3MoeConfig
from jax_megamoe.nn import MoE, MoEAux


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


def _norm(norm: nnx.RMSNorm, x: jax.Array) -> jax.Array:
    return norm(x)


def _norm_rope(norm: nnx.RMSNorm, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    return apply_rope(norm(x), cos, sin)


# The norms and RoPE compute in float32 from x's dtype; the backward recomputes them from their inputs rather
# than keep their float32 intermediates. Inside the layer scan every kept value is written to a stacked
# buffer, and these were about half of a layer's residual bytes. (No CSE barrier: the recomputation sits in
# the backward's own loop, and unrolled, XLA may share it with the forward.)
recomputed_norm = nnx.remat(_norm, prevent_cse=False)
_recomputed_norm_rope = nnx.remat(_norm_rope, prevent_cse=False)


class Attention(nnx.Module):
    """GQA self-attention; q and k are RMS-normalised over head_dim before RoPE; causal."""

    def __init__(self, config: Qwen3MoeConfig, *, dtype, param_dtype, attention_impl: str | None, rngs: nnx.Rngs):
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = typing.cast(int, config.head_dim)  # set from hidden_size when the config leaves it None
        linear = functools.partial(
            nnx.Linear,
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=nnx.initializers.normal(config.initializer_range),
            rngs=rngs,
        )
        norm = functools.partial(
            nnx.RMSNorm, head_dim, epsilon=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.q_proj = linear(config.hidden_size, heads * head_dim)
        self.k_proj = linear(config.hidden_size, kv_heads * head_dim)
        self.v_proj = linear(config.hidden_size, kv_heads * head_dim)
        self.o_proj = linear(heads * head_dim, config.hidden_size)
        self.q_norm = norm()
        self.k_norm = norm()
        self.head_dim = head_dim
        self.attention_impl = attention_impl

    def _project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        heads = functools.partial(jnp.reshape, shape=(*x.shape[:2], -1, self.head_dim))
        q = _recomputed_norm_rope(self.q_norm, heads(self.q_proj(x)), cos, sin)
        k = _recomputed_norm_rope(self.k_norm, heads(self.k_proj(x)), cos, sin)
        return q, k, heads(self.v_proj(x))

    def _output(self, out: jax.Array) -> jax.Array:
        return self.o_proj(out.reshape(*out.shape[:2], -1))

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        key_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        index=None,
        *,
        prefill: bool = False,
    ) -> tuple[jax.Array, KVCache | None]:
        """`(out, cache)` of `x [B, T, H]` at the positions of the RoPE tables `cos, sin`.

        Without a cache the tokens attend causally over themselves, `key_mask [B, T]` hiding the keys where it is
        False. With one, their keys and values are written into layer `index` of `cache` at positions
        `cache.lengths[b] + t`; `prefill`: the cache holds nothing yet (lengths 0), so the tokens attend causally
        over themselves as without a cache; else over the cache's slots up to each query's position."""
        with jax.named_scope("attention"):  # the profiles' name for this block (benchmarks/profile_decode.py)
            q, k, v = self._project(x, cos, sin)
            if cache is None or prefill:
                out = causal_attention(q, k, v, implementation=self.attention_impl, key_mask=key_mask)
            if cache is not None:
                cache = cache.write(index, k, v)
                if not prefill:
                    positions = cache.lengths[:, None] + jnp.arange(x.shape[1])
                    out = chunked_attention(q, *cache.layer(index), query_positions=positions)
            return self._output(out), cache


class DenseMLP(nnx.Module):
    """SwiGLU MLP `down(silu(gate(x)) * up(x))` of the non-sparse layers."""

    def __init__(self, config: Qwen3MoeConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        linear = functools.partial(
            nnx.Linear,
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=nnx.initializers.normal(config.initializer_range),
            rngs=rngs,
        )
        self.gate_proj = linear(config.hidden_size, config.intermediate_size)
        self.up_proj = linear(config.hidden_size, config.intermediate_size)
        self.down_proj = linear(config.intermediate_size, config.hidden_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))` with a sparse or dense MLP."""

    def __init__(
        self, config: Qwen3MoeConfig, layer_idx: int, *, dtype, param_dtype, attention_impl, moe_kwargs, rngs: nnx.Rngs
    ):
        norm = functools.partial(
            nnx.RMSNorm,
            config.hidden_size,
            epsilon=config.rms_norm_eps,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.input_layernorm = norm()
        self.self_attn = Attention(
            config, dtype=dtype, param_dtype=param_dtype, attention_impl=attention_impl, rngs=rngs
        )
        self.post_attention_layernorm = norm()
        self.is_moe = config.is_moe_layer(layer_idx)
        self.mlp: MoE | DenseMLP
        if self.is_moe:
            init = nnx.initializers.normal(config.initializer_range)
            self.mlp = MoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                norm_topk_prob=config.norm_topk_prob,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=init,
                router_init=init,
                rngs=rngs,
                **moe_kwargs,
            )
        else:
            self.mlp = DenseMLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        key_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        index=None,
        routing: jax.Array | None = None,
        *,
        prefill: bool = False,
        return_routing: bool = False,
    ) -> tuple[jax.Array, MoEAux | None, KVCache | None]:
        """`(x, aux, cache)`: the block over `x [B, T, H]` (arguments as `Attention`'s). `aux` is the sparse MLP's
        `MoEAux` without a cache, else None (inference has no use for it, so nothing builds it); with
        `return_routing` it holds the router's own top-k (`MoEAux.routing`). `routing [B, T, K]` replays a routing
        record in the sparse MLP (`jax_megamoe.nn.MoE`); a cache that keeps a routing record gets the router's
        choices at the tokens' slots."""
        attended, cache = self.self_attn(
            recomputed_norm(self.input_layernorm, x), cos, sin, key_mask, cache, index, prefill=prefill
        )
        x = x + attended
        h = recomputed_norm(self.post_attention_layernorm, x)
        if isinstance(self.mlp, MoE):
            recording = cache is not None and cache.routing is not None
            y, aux = self.mlp(h, routing, return_routing=return_routing or recording)
            if recording:
                assert cache is not None and aux.routing is not None
                cache = cache.record(index, aux.routing)
            return x + y, (aux if cache is None else None), cache
        return x + self.mlp(h), None, cache
