"""The Qwen3-MoE causal language model in flax.nnx: embedding, the decoder layers (`qwen3_moe_layers`) in runs of one
kind, each run scanned over its stacked parameters, the final norm and the LM head; one forward for training,
prefill and decode. The public names are `jax_megamoe.models.qwen3_moe`'s."""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
from flax import nnx

from jax_megamoe.models import layer_scan
from jax_megamoe.models.compute_form import compute_form
from jax_megamoe.models.kv_cache import KVCache
from jax_megamoe.models.qwen3_moe_config import Qwen3MoeConfig
from jax_megamoe.models.qwen3_moe_layers import DecoderLayer, recomputed_norm, rope_tables
from jax_megamoe.nn import MoEAux, check_routing_dtype


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
    (`compute_form`) inside its step of the scan, so parameters sharded over `data` (FSDP,
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
        """`input_ids [B, S]` -> `(logits [B, S, vocab] in float32, MoEAux)`.

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
        """The LM head: final normed hidden states `[..., H]` -> logits `[..., vocab]` in float32, from operands in
        the compute dtype. Rounding the logits to bf16 would move a log-prob by up to half a bf16 step of the
        logit (2^-7 at logits of 2 to 4), differently for a decode row and a training row: the sampler and the
        trainer would disagree by that much whatever else agrees."""
        with jax.named_scope("lm_head"):
            return jnp.einsum(
                "...h,hv->...v", hidden.astype(self.dtype), self.lm_head_kernel(), preferred_element_type=jnp.float32
            )

    def lm_head_kernel(self) -> jax.Array:
        """The LM head as an `[H, vocab]` matrix in the compute dtype (the embedding table's transpose when
        tied), gathered whole (for `jax_megamoe.losses.linear_cross_entropy(model.hidden_states(ids)[0], ...)`)."""
        if self.lm_head is None:
            embed = compute_form(self.embed_tokens, self.dtype, None)
            return embed.embedding[...].T
        return compute_form(self.lm_head, self.dtype, None).kernel[...]

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
        check_routing_dtype(routing)
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
        x = compute_form(self.embed_tokens, self.dtype, None)(input_ids)
        dtype, expert_axis = self.dtype, self.expert_axis

        def apply(layer, x, cache, index, routing, cos, sin, key_mask):
            layer = compute_form(layer, dtype, expert_axis)
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
                    prepare = functools.partial(compute_form, dtype=self.dtype, gather=False)
                else:
                    stacked = compute_form(stacked, self.dtype, gather=False)

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
        return recomputed_norm(self.norm, x), aux, cache

    def compute_form(self) -> Qwen3MoeForCausalLM:
        """This model with every parameter in its compute form (`compute_form`): matrices in the compute dtype and,
        under an active multi-device mesh, in their compute sharding (the experts over `expert_axis`, the rest
        whole). Decoding runs on it, so that no step gathers FSDP shards: inside the layers `compute_form` is then a
        no-op."""
        return compute_form(self, self.dtype, self.expert_axis)

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
