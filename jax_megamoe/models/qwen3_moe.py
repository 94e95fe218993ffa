"""Qwen3-MoE causal language model in flax.nnx, numerically matching Hugging Face transformers.

Module and parameter names follow transformers' (`layers.N.self_attn.q_proj`, `layers.N.mlp`, ...) so the
checkpoint mapping in `hf_checkpoint` stays a short table. The sparse layers are `jax_megamoe.nn.MoE`.
"""

from __future__ import annotations

import functools
import os
import typing

import jax
import jax.numpy as jnp
from flax import nnx

from jax_megamoe.models import hf_checkpoint, layer_scan, sharding
from jax_megamoe.models.attention import causal_attention, chunked_attention
from jax_megamoe.models.generation import Generation, GenerationPlan, compiled_programs, generate, generation_plan
from jax_megamoe.models.kv_cache import KVCache
from jax_megamoe.models.qwen3_moe_config import Qwen3MoeConfig, qwen3_30b_a3b, qwen3_235b_a22b, tiny
from jax_megamoe.models.sampling import process_logits, sample_logits, token_logprobs
from jax_megamoe.nn import MoE, MoEAux, active_mesh

__all__ = [
    "Generation",
    "GenerationPlan",
    "KVCache",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "chunked_attention",
    "compiled_programs",
    "from_pretrained",
    "generate",
    "generation_plan",
    "process_logits",
    "qwen3_30b_a3b",
    "qwen3_235b_a22b",
    "sample_logits",
    "save_pretrained",
    "tiny",
    "token_logprobs",
]


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
_recomputed_norm = nnx.remat(_norm, prevent_cse=False)
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
            _recomputed_norm(self.input_layernorm, x), cos, sin, key_mask, cache, index, prefill=prefill
        )
        x = x + attended
        h = _recomputed_norm(self.post_attention_layernorm, x)
        if isinstance(self.mlp, MoE):
            recording = cache is not None and cache.routing is not None
            y, aux = self.mlp(h, routing, return_routing=return_routing or recording)
            if recording:
                assert cache is not None and aux.routing is not None
                cache = cache.record(index, aux.routing)
            return x + y, (aux if cache is None else None), cache
        return x + self.mlp(h), None, cache


def combine_aux(layer_aux: list[MoEAux], num_experts: int) -> MoEAux:
    """Model-level aux from the sparse layers' aux in layer order, each with a leading layer axis (a scanned
    run's `[n, ...]`, an unrolled layer's `[1, ...]`): losses averaged over the MoE layers, counts stacked
    `[L_moe, E]`, drops summed."""
    if not layer_aux:
        zero = jnp.zeros((), jnp.float32)
        return MoEAux(zero, zero, jnp.zeros((0, num_experts), jnp.int32), jnp.zeros((), jnp.int32))
    stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs), *layer_aux)
    return MoEAux(
        jnp.mean(stacked.load_balancing_loss),
        jnp.mean(stacked.router_z_loss),
        stacked.expert_counts,
        jnp.sum(stacked.dropped_pairs),
        stacked.routing,
    )


def routing_dtype(num_experts: int):
    """The narrowest signed integer type holding expert ids `0 .. num_experts - 1` and -1 (a routing record's)."""
    for dtype in (jnp.int8, jnp.int16):
        if num_experts <= jnp.iinfo(dtype).max:
            return dtype
    return jnp.int32


def stack_layers(layers) -> DecoderLayer:
    """One `DecoderLayer` whose parameters are the given same-kind layers' stacked on a leading layer axis
    (what `layer_scan.scan` iterates over); sharding names gain a leading None for that axis."""
    graphdef = nnx.graphdef(layers[0])
    if any(nnx.graphdef(layer) != graphdef for layer in layers[1:]):
        raise ValueError("stack_layers needs layers of one kind (same structure and static attributes)")
    stacked = jax.tree.map(lambda *values: jnp.stack(values), *(nnx.state(layer) for layer in layers))
    for _, variable in nnx.to_flat_state(stacked):
        names = variable.get_metadata("out_sharding", None)
        if names is not None:
            variable.set_metadata("out_sharding", (None, *names))
    return nnx.merge(graphdef, stacked)


# Parameters cast to the compute dtype before their per-layer gather: the ones the modules themselves cast
# (the router and the norms compute in float32 / on their own dtype and are left as they are).
_COMPUTE_DTYPE_LEAVES = ("kernel", "embedding", "w_gate_up", "w_down")


def compute_dtype(state, dtype):
    """`state` (a module's parameters) with its matrices cast to the compute dtype `dtype`."""

    def cast(path, value):
        names = sharding.path_names(path)
        if names[-1] in _COMPUTE_DTYPE_LEAVES and "router" not in names:
            return value.astype(dtype)
        return value

    return jax.tree_util.tree_map_with_path(cast, state)


def gathered(module: nnx.Module, dtype, expert_axis: str | None) -> nnx.Module:
    """`module` with its parameters in their compute form: matrices cast to the compute dtype, then
    constrained to `sharding.compute_spec`, which all-gathers FSDP shards (over `data`) here, one layer at a time,
    inside the scan (and again in the backward, under remat). Without an active multi-device mesh only the
    casts remain (the modules would do them anyway). Casting first gathers half the bytes in bf16."""
    mesh = active_mesh()
    graphdef, state = nnx.split(module)
    state = compute_dtype(state, dtype)

    def compute_form(path, value):
        names = sharding.path_names(path)
        if mesh is not None:
            value = jax.lax.with_sharding_constraint(value, sharding.compute_spec(names, value.ndim, mesh, expert_axis))
        return value

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(compute_form, state))


class Qwen3MoeForCausalLM(nnx.Module):
    """Qwen3-MoE decoder with an LM head: `logits, aux = model(input_ids)`.

    Args:
      config: the hyper-parameters (`Qwen3MoeConfig`).
      dtype: compute dtype (e.g. `jnp.bfloat16`); norms, softmax and the router run in float32.
      param_dtype: parameter storage dtype.
      implementation, expert_axis, transport, capacity_factor, recipe: passed to every `jax_megamoe.nn.MoE`
        layer (one `NvlinkTransport` serves them all; `recipe="fp8_blockwise"` runs the experts' GEMMs in FP8,
        docs/fp8.md).
      remat: recompute each decoder layer in the backward pass (`nnx.remat`) to save activation memory.
      remat_policy: with `remat`, a `jax.checkpoint_policies` policy of what to save instead; e.g.
        `save_only_these_names("moe_layout", "moe_gate_up")` keeps the experts' gate/up projections, so the MoE
        recomputes nothing (`jax_megamoe.moe_ffn`).
      attention_impl: `jax.nn.dot_product_attention`'s `implementation` (None: XLA; "cudnn" on GPUs), or
        "chunked" (`chunked_attention`: pure JAX, memory linear in the sequence).
      scan_layers: run each run of consecutive same-kind layers (`config.layer_runs()`) as one `layer_scan.scan` over
        its stacked parameters (`layer_runs.{r}.*` with a leading layer axis), so the step's program and compile
        time grow with the number of runs, not the depth. False: a Python loop over `layers.{i}` (unrolled),
        for comparison. Both initialise the same parameters from the same `rngs`.
      rngs: parameter initialisation keys (HF's: normal(initializer_range), norms at one).

    `aux` is a `MoEAux`: load-balancing and z losses averaged over the sparse layers (HF pools the router
    logits of all layers before its load-balancing product instead), `expert_counts [L_moe, E]`,
    `dropped_pairs` summed.

    Under an active multi-device mesh each layer's parameters are gathered into their compute sharding
    (`gathered`) inside its step of the scan, so parameters sharded over `data` (FSDP,
    `jax_megamoe.models.sharding`) are whole on a device one layer at a time.

    Generation: `init_cache`, `prefill` and `decode` run the model over a `KVCache`, `logits` is its LM head, and
    `generate` (docs/models.md, "Generation") is the decode loop over them, on `compute_form()`.
    """

    def __init__(
        self,
        config: Qwen3MoeConfig,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        implementation="auto",
        expert_axis: str | None = None,
        transport="xla",
        capacity_factor: float | None = None,
        recipe: str | None = None,
        remat: bool = False,
        remat_policy=None,
        attention_impl: str | None = None,
        scan_layers: bool = True,
        rngs: nnx.Rngs,
    ):
        if remat_policy is not None and not remat:
            raise ValueError("remat_policy needs remat=True")
        self.config = config
        self.dtype = dtype
        self.expert_axis = expert_axis
        self.remat = remat
        self.remat_policy = remat_policy
        self.scan_layers = scan_layers
        init = nnx.initializers.normal(config.initializer_range)
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype, embedding_init=init, rngs=rngs
        )
        moe_kwargs = dict(
            implementation=implementation,
            expert_axis=expert_axis,
            transport=transport,
            capacity_factor=capacity_factor,
            recipe=recipe,
        )
        layers = [
            DecoderLayer(
                config,
                i,
                dtype=dtype,
                param_dtype=param_dtype,
                attention_impl=attention_impl,
                moe_kwargs=moe_kwargs,
                rngs=rngs,
            )
            for i in range(config.num_hidden_layers)
        ]
        if scan_layers:
            self.layer_runs = nnx.List(
                [stack_layers(layers[first : first + count]) for first, count, _ in config.layer_runs()]
            )
        else:
            self.layers = nnx.List(layers)
        self.norm = nnx.RMSNorm(
            config.hidden_size, epsilon=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nnx.Linear(
                config.hidden_size,
                config.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=init,
                rngs=rngs,
            )
        )

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        *,
        attention_mask: jax.Array | None = None,
        routing: jax.Array | None = None,
        return_routing: bool = False,
    ) -> tuple[jax.Array, MoEAux]:
        """`input_ids [B, S]` -> `(logits [B, S, vocab] in the compute dtype, MoEAux)`.

        `positions` (`[S]` or `[B, S]`) defaults to `0..S-1`. `attention_mask [B, S]` (bool or 0/1, default all
        true) is a padding mask: no token attends to a key where it is false. Right-padded rows need none (the
        causal mask already hides the padding from the tokens before it); left-padded rows need it and their
        positions (`positions[b]` counting from 0 at the row's first token). The MoE layers route every token,
        padding included (their `aux` counts it).

        `routing [B, S, L_moe, K]` (integer; routing replay) gives each sparse layer the experts a sampler chose
        for each token (`generate(..., return_routing=True)`) in place of its own top-k, weighted by this model's
        router probabilities at them (`jax_megamoe.route`), so the router still gets gradients; a token whose
        record in a layer is all -1 routes itself there. The aux losses count the experts used, the replayed ones
        where there is a record. Replay is dropless (a `capacity_factor` is refused with it).
        `return_routing`: `aux.routing [B, S, L_moe, K]` holds each sparse layer's own top-k experts of every token
        (under replay, what the router would have chosen), in a record's dtype: compared with a sampler's record it
        measures how often sampler and trainer route apart.
        """
        x, aux = self.hidden_states(
            input_ids, positions, attention_mask=attention_mask, routing=routing, return_routing=return_routing
        )
        return self.logits(x), aux

    def logits(self, hidden: jax.Array) -> jax.Array:
        """The LM head: final normed hidden states `[..., H]` -> logits `[..., vocab]` in the compute dtype."""
        with jax.named_scope("lm_head"):
            if self.lm_head is None:
                embed = typing.cast(nnx.Embed, gathered(self.embed_tokens, self.dtype, None))
                return embed.attend(hidden)
            return gathered(self.lm_head, self.dtype, None)(hidden)

    def lm_head_kernel(self) -> jax.Array:
        """The LM head as an `[H, vocab]` matrix in the compute dtype (the embedding table's transpose when
        tied), gathered whole (for `jax_megamoe.losses.linear_cross_entropy(model.hidden_states(ids)[0], ...)`)."""
        if self.lm_head is None:
            embed = typing.cast(nnx.Embed, gathered(self.embed_tokens, self.dtype, None))
            return embed.embedding[...].T
        return typing.cast(nnx.Linear, gathered(self.lm_head, self.dtype, None)).kernel[...]

    def hidden_states(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        *,
        attention_mask: jax.Array | None = None,
        routing: jax.Array | None = None,
        return_routing: bool = False,
    ) -> tuple[jax.Array, MoEAux]:
        """`(final normed hidden states [B, S, H], MoEAux)`: the model without its LM head (arguments as
        `__call__`'s)."""
        if positions is None:
            positions = jnp.arange(input_ids.shape[-1])
        key_mask = None if attention_mask is None else attention_mask.astype(bool)
        hidden, aux, _ = self._forward(
            input_ids, positions, key_mask=key_mask, routing=routing, return_routing=return_routing
        )
        return hidden, typing.cast(MoEAux, aux)

    def check_routing(self, routing, tokens_shape: tuple[int, ...]) -> None:
        """Refuses, at trace time, a routing record that is not integer `[B, T, L_moe, K]` for tokens of shape
        `[B, T]` (`L_moe` the sparse layers, K the experts per token)."""
        config = self.config
        expected = (*tokens_shape, len(config.moe_layer_index()), config.num_experts_per_tok)
        if not hasattr(routing, "dtype") or not jnp.issubdtype(routing.dtype, jnp.integer):
            raise TypeError(f"routing must be an integer array of expert ids (-1: no record), got {routing!r:.80}")
        if tuple(routing.shape) != expected:
            raise ValueError(
                f"routing must have shape [B, T, L_moe, K] = {expected} for tokens of shape {tuple(tokens_shape)} "
                f"({expected[2]} sparse layers, top_k {expected[3]}), got {tuple(routing.shape)}"
            )

    def _forward(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        *,
        key_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        prefill: bool = False,
        routing: jax.Array | None = None,
        return_routing: bool = False,
    ) -> tuple[jax.Array, MoEAux | None, KVCache | None]:
        """The model's one forward, for training and for generation: `(final normed hidden states, MoEAux without a
        cache else None, the cache)` of `input_ids [B, T]` at `positions` (`[T]` or `[B, T]`); `routing
        [B, T, L_moe, K]` replays a routing record in the sparse layers (`check_routing`).

        Each run of same-kind layers is one `layer_scan.scan` over its stacked parameters (or, without
        `scan_layers`, an unrolled loop), its carry the hidden states and, with a cache or a routing record, the
        layer's index (into the cache, and into the run's slice of the record); a cache rides in the carry too, so
        it is written in place (a plain scan: nothing is differentiated there)."""
        if routing is not None:
            self.check_routing(routing, input_ids.shape)
        cos, sin = self._rope(positions)
        x = gathered(self.embed_tokens, self.dtype, None)(input_ids)
        dtype, expert_axis = self.dtype, self.expert_axis

        def apply(layer, x, cache, index, routing, cos, sin, key_mask):
            layer = gathered(layer, dtype, expert_axis)
            return layer(x, cos, sin, key_mask, cache, index, routing, prefill=prefill, return_routing=return_routing)

        if self.remat and cache is None:
            apply = nnx.remat(apply, policy=self.remat_policy)
        consts = (cos, sin, key_mask)
        moe_index = self.config.moe_layer_index()
        layer_aux = []
        if self.scan_layers:
            for (first, count, _), run in zip(self.config.layer_runs(), self.layer_runs, strict=True):
                graphdef, stacked = nnx.split(run)
                # The weights' gradients stack in the compute dtype either way, converted once where the
                # optimizer reads them. Without remat the stacks are cast once before the scan and the backward
                # slices the cast stacks; under remat the scan casts each layer's slice (again in the
                # backward), so that no cast copy of every layer is kept.
                prepare = None
                if self.remat and cache is None:
                    prepare = functools.partial(compute_dtype, dtype=self.dtype)
                else:
                    stacked = compute_dtype(stacked, self.dtype)

                # The run's slice of the record, layer-major, read by each layer at its index (an input of the
                # scan like the RoPE tables: layer_scan stacks floating-point parameters only).
                run_routing = None
                if routing is not None and first in moe_index:
                    run_routing = jnp.moveaxis(routing[:, :, moe_index[first] : moe_index[first] + count], 2, 0)

                def layer(params, carry, consts, graphdef=graphdef, first=first):
                    x, cache, index = carry
                    *consts, run_routing = consts
                    layer_routing = None
                    if run_routing is not None:
                        layer_routing = jax.lax.dynamic_index_in_dim(run_routing, index - first, keepdims=False)
                    x, aux, cache = apply(nnx.merge(graphdef, params), x, cache, index, layer_routing, *consts)
                    return (x, cache, None if index is None else index + 1), aux

                index = None if cache is None and run_routing is None else jnp.asarray(first, jnp.int32)
                (x, cache, _), aux = layer_scan.scan(layer, stacked, (x, cache, index), (*consts, run_routing), prepare)
                if aux is not None:
                    layer_aux.append(aux)
        else:
            for layer_index, decoder_layer in enumerate(self.layers):
                layer_routing = None
                if routing is not None and layer_index in moe_index:
                    layer_routing = routing[:, :, moe_index[layer_index]]
                x, aux, cache = apply(decoder_layer, x, cache, layer_index, layer_routing, *consts)
                if aux is not None:
                    layer_aux.append(jax.tree.map(lambda a: a[None], aux))
        aux = None
        if cache is None:
            aux = combine_aux(layer_aux, self.config.num_experts)
            if aux.routing is not None:  # [L_moe, B * T, K] -> [B, T, L_moe, K], narrowed like a record
                own = jnp.moveaxis(aux.routing.reshape(-1, *input_ids.shape, aux.routing.shape[-1]), 0, 2)
                aux = aux._replace(routing=own.astype(routing_dtype(self.config.num_experts)))
        return _recomputed_norm(self.norm, x), aux, cache

    def compute_form(self) -> Qwen3MoeForCausalLM:
        """This model with every parameter in its compute form (`gathered`): matrices in the compute dtype and,
        under an active multi-device mesh, in their compute sharding (the experts over `expert_axis`, the rest
        whole). Decoding runs on it, so that no step gathers FSDP shards: inside the layers `gathered` is then a
        no-op."""
        return typing.cast(Qwen3MoeForCausalLM, gathered(self, self.dtype, self.expert_axis))

    def init_cache(self, batch: int, length: int, *, record_routing: bool = False) -> KVCache:
        """An empty `KVCache` of `length` slots per row for this model, in the compute dtype; with `record_routing`
        it also records the experts each sparse layer chooses for every token written (`routing_dtype`)."""
        config = self.config
        return KVCache.empty(
            layers=config.num_hidden_layers,
            batch=batch,
            length=length,
            kv_heads=config.num_key_value_heads,
            head_dim=typing.cast(int, config.head_dim),
            dtype=self.dtype,
            routing_top_k=config.num_experts_per_tok if record_routing else None,
            routing_dtype=routing_dtype(config.num_experts),
        )

    def prefill(
        self, input_ids: jax.Array, lengths: jax.Array, cache: KVCache, *, routing: jax.Array | None = None
    ) -> tuple[jax.Array, KVCache]:
        """Runs right-padded prompts `input_ids [B, P]` (row b's first `lengths[b]` tokens real, at positions
        0, 1, ...) into `cache` (at least P slots; what it held is dropped): `(final normed hidden states
        [B, P, H], the cache with their keys and values in slots 0..P-1 and its lengths set to lengths)`. The
        tokens attend causally over themselves, as in `__call__` (`attention_impl` included); the padding's slots
        are overwritten by `decode` before any query sees them. `routing [B, P, L_moe, K]` replays a record
        (as in `__call__`)."""
        cache = cache._replace(lengths=jnp.zeros_like(cache.lengths))
        positions = jnp.arange(input_ids.shape[1])
        hidden, _, written = self._forward(input_ids, positions, cache=cache, prefill=True, routing=routing)
        return hidden, typing.cast(KVCache, written)._replace(lengths=jnp.asarray(lengths, jnp.int32))

    def decode(
        self, input_ids: jax.Array, cache: KVCache, *, routing: jax.Array | None = None
    ) -> tuple[jax.Array, KVCache]:
        """Runs `input_ids [B, T]` as the next tokens of each row, row b's at positions `cache.lengths[b]`,
        `+1`, ...: `(final normed hidden states [B, T, H], the cache with their keys and values written and its
        lengths advanced by T)`. Each token attends over the cache's slots up to its own position. `routing
        [B, T, L_moe, K]` replays a record (as in `__call__`)."""
        positions = cache.lengths[:, None] + jnp.arange(input_ids.shape[1])
        hidden, _, written = self._forward(input_ids, positions, cache=cache, routing=routing)
        return hidden, typing.cast(KVCache, written).advance(input_ids.shape[1])

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        return rope_tables(positions, typing.cast(int, self.config.head_dim), self.config.rope_theta)


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh=None,
    expert_axis: str | None = None,
    fsdp: bool = True,
    fsdp_over_expert: bool = False,
    **model_kwargs,
) -> Qwen3MoeForCausalLM:
    """Loads a Hugging Face Qwen3-MoE checkpoint directory (`config.json` + safetensors).

    Reads a single `model.safetensors` or a sharded `model.safetensors.index.json`, with experts stored
    per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or fused (`mlp.experts.gate_up_proj
    [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`). With `mesh`, every parameter is created directly in its
    shards (`jax_megamoe.models.sharding`: experts over `expert_axis`, default "expert" when the mesh has that
    axis; with `fsdp`, every matrix over "data" too), each process reading from the files only the slices its
    devices hold, one tensor at a time: no host or device ever holds a replicated copy of the model.

    Args:
      path: checkpoint directory.
      dtype: compute dtype. param_dtype: storage dtype (default: `dtype`).
      mesh: optional `jax.sharding.Mesh`. expert_axis: mesh axis of the experts.
      fsdp: with `mesh`, shard the parameters over its "data" axis as well (ignored without one).
      fsdp_over_expert: with `fsdp`, shard the non-expert matrices over "data" x `expert_axis` (every device).
      **model_kwargs: other `Qwen3MoeForCausalLM` arguments (implementation, remat, scan_layers, ...).
    """
    config = Qwen3MoeConfig.from_json(path)
    if mesh is not None and expert_axis is None and "expert" in mesh.axis_names:
        expert_axis = "expert"
    param_dtype = param_dtype or dtype
    abstract = nnx.eval_shape(
        lambda: Qwen3MoeForCausalLM(
            config, dtype=dtype, param_dtype=param_dtype, expert_axis=expert_axis, rngs=nnx.Rngs(0), **model_kwargs
        )
    )
    graphdef, state = nnx.split(abstract)
    specs = (
        dict(
            nnx.to_flat_state(
                sharding.tree_specs(state, mesh, fsdp=fsdp, expert_axis=expert_axis, fsdp_over_expert=fsdp_over_expert)
            )
        )
        if mesh is not None
        else {}
    )
    with hf_checkpoint.SafetensorsReader(path) as reader:
        for key, variable in nnx.to_flat_state(state):
            expected = variable.get_value().shape
            shape = hf_checkpoint.param_shape(reader, key, config)
            if shape != expected:
                raise ValueError(
                    f"checkpoint tensor for {'.'.join(map(str, key))} has shape {shape}, the config implies {expected}"
                )
            if mesh is None:
                value = jax.device_put(hf_checkpoint.read_param(reader, key, config).astype(param_dtype))
            else:
                value = hf_checkpoint.load_sharded(
                    reader, key, config, shape, jax.sharding.NamedSharding(mesh, specs[key].get_value()), param_dtype
                )
            variable.set_value(value)
    return nnx.merge(graphdef, state)


def save_pretrained(
    model: Qwen3MoeForCausalLM, path: str | os.PathLike, *, max_shard_bytes: int = 5 << 30, dtype=None
) -> None:
    """Writes `config.json` and safetensors (per-expert layout, sharded past `max_shard_bytes` with an
    index) that transformers' `Qwen3MoeForCausalLM.from_pretrained` reads. `dtype` casts on the way out
    (default: the parameters' dtype). Under multi-process JAX, process 0 writes."""
    state = nnx.state(model, nnx.Param)
    params = {key: variable.get_value() for key, variable in nnx.to_flat_state(state)}
    hf_checkpoint.write(
        path, model.config.to_dict(), hf_checkpoint.to_hf_tensors(params, model.config, dtype), max_shard_bytes
    )
