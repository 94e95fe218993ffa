"""Flax NNX Mixture-of-Experts layer (Qwen3-MoE semantics) on `jax_megamoe`'s kernels.

`MoE` owns the parameters; `moe_block` is the functional core it calls (shared with `jax_megamoe.linen`):
router logits in float32 -> `route` -> optional capacity drop -> `moe_ffn` on one device, or
per shard inside `jax.shard_map` under an active multi-device mesh: `moe_ffn_ep` (expert parallelism)
when the layer has an `expert_axis`, else `moe_ffn` on each shard's tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_megamoe import reference
from jax_megamoe.ops.moe import moe_ffn
from jax_megamoe.ops.routing import load_balancing_loss, route, router_z_loss

if TYPE_CHECKING:
    from jax_megamoe.parallel import Transport

ROUTER_INIT = nnx.initializers.normal(0.02)  # the router kernel's default initialiser
ExpertFn = Callable[..., jax.Array]


class MoEAux(NamedTuple):
    """Side outputs of an MoE layer (a pytree: it flows through `jit`, `scan` and `remat`)."""

    load_balancing_loss: jax.Array  # [] float32, Switch/HF form; equals top_k at perfect balance
    router_z_loss: jax.Array  # [] float32, mean(logsumexp(logits)^2)
    expert_counts: jax.Array  # [E] int32, (token, k) pairs the router sent to each expert
    dropped_pairs: jax.Array  # [] int32, pairs dropped by the capacity limit (0 when dropless)
    # [T, K] int32 with `return_routing`: the router's own top-k experts of each token (under routing replay the
    # experts it would have chosen, not the replayed ones); else None.
    routing: jax.Array | None = None


def active_mesh():
    """The mesh set with `jax.set_mesh` when it spans more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    return mesh


def apply_capacity(experts: jax.Array, num_experts: int, capacity_factor: float):
    """Drops the (token, k) pairs past each expert's capacity `ceil(capacity_factor * T * K / E)`.

    Earlier tokens keep their slots (GShard order). Dropped pairs get expert id -1, which `moe_ffn`
    skips. Returns `(experts, dropped_pairs)`.
    """
    flat = experts.reshape(-1)
    capacity = math.ceil(capacity_factor * flat.size / num_experts)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.size, dtype=flat.dtype) - starts[flat[order]])
    keep = rank < capacity
    return jnp.where(keep, flat, -1).reshape(experts.shape), jnp.sum(~keep, dtype=jnp.int32)


def local_ffn(x, weights, experts, w_gate_up, w_down, *, implementation, capacity_factor, recipe=None):
    """The experts on one device: capacity drop (if any), then `moe_ffn`. Returns `(y, dropped_pairs)`."""
    dropped = jnp.zeros((), jnp.int32)
    if capacity_factor is not None:
        experts, dropped = apply_capacity(experts, w_gate_up.shape[0], capacity_factor)
    expert_fn = (
        implementation
        if callable(implementation)
        else functools.partial(moe_ffn, implementation=implementation, recipe=recipe)
    )
    return expert_fn(x, weights, experts, w_gate_up, w_down), dropped


def sharded_ffn(
    mesh,
    x,
    weights,
    experts,
    w_gate_up,
    w_down,
    *,
    expert_axis,
    implementation,
    transport,
    capacity_factor,
    recipe=None,
):
    """The experts under `shard_map` over `mesh`: tokens split over every mesh axis; the experts split
    over `expert_axis` (`moe_ffn_ep` with `transport`), or replicated when it is None (`moe_ffn` per shard).

    Per-shard kernels instead of one jit-partitioned custom call, which XLA could only run replicated.
    """
    num_shards = math.prod(mesh.shape.values())
    if x.shape[0] % num_shards:
        raise ValueError(
            f"the MoE layer splits its {x.shape[0]} tokens over all {num_shards} devices of the "
            f"mesh {dict(mesh.shape)}; the token count must be divisible by {num_shards}"
        )
    if expert_axis is not None and expert_axis not in mesh.axis_names:
        raise ValueError(f"expert_axis={expert_axis!r} is not an axis of the active mesh {mesh.axis_names}")
    if expert_axis is not None and callable(implementation):
        raise ValueError("a callable implementation computes the experts of one device; it cannot take expert_axis")
    all_axes = tuple(mesh.axis_names)
    tokens = P(all_axes)

    def shard_fn(*args):
        if expert_axis is None:
            y, dropped = local_ffn(*args, implementation=implementation, capacity_factor=capacity_factor, recipe=recipe)
        else:
            from jax_megamoe.parallel import moe_ffn_ep  # only expert-parallel use needs it

            y, stats = moe_ffn_ep(
                *args,
                axis_name=expert_axis,
                transport=transport,
                implementation=implementation,
                capacity_factor=capacity_factor,
                return_stats=True,
                num_experts=args[3].shape[0] * mesh.shape[expert_axis],  # w_gate_up's local experts
                recipe=recipe,
            )
            dropped = stats.pairs_dropped
        return y, jax.lax.psum(dropped, all_axes)

    experts_spec = P(expert_axis)
    return jax.shard_map(
        shard_fn, mesh=mesh, in_specs=(tokens, tokens, tokens, experts_spec, experts_spec), out_specs=(tokens, P())
    )(x, weights, experts, w_gate_up, w_down)


def moe_block(
    x: jax.Array,
    router_logits: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    top_k: int,
    norm_topk_prob: bool = True,
    capacity_factor: float | None = None,
    implementation: str | ExpertFn = "auto",
    expert_axis: str | None = None,
    transport: str | Transport = "xla",
    recipe: str | None = None,
    recorded: jax.Array | None = None,
    return_routing: bool = False,
) -> tuple[jax.Array, MoEAux]:
    """Routes `x [T, H]` by `router_logits [T, E]` and runs the experts; returns `(y [T, H], MoEAux)`, the aux
    with the router's own top-k experts (`MoEAux.routing`) where `return_routing`.

    `w_gate_up [E, H, 2I]` and `w_down [E, I, H]` must already be in x's dtype. `implementation` is a
    `moe_ffn` implementation name, or a function with `moe_ffn`'s positional signature (a baseline to compare
    against; it cannot be combined with `expert_axis`). Under an active multi-device mesh
    (`jax.set_mesh`) the experts run per shard in `shard_map` (see `sharded_ffn`); with `expert_axis`
    that is expert parallelism through `moe_ffn_ep` over `transport`.

    `recorded [T, K]` replays a routing record (`jax_megamoe.route`: the recorded experts, weighted by this
    router's probabilities; rows of -1 route themselves). Replay is dropless: it cannot be combined with a
    `capacity_factor`, whose drops depend on the batch the record was made in. The aux losses count the experts
    the layer used, the replayed ones where there is a record.
    """
    num_experts = router_logits.shape[-1]
    if recorded is not None and capacity_factor is not None:
        raise ValueError(
            "routing replay is dropless: a capacity_factor cannot reproduce the recorded run's drops "
            f"(capacity_factor={capacity_factor}); use capacity_factor=None with a routing record"
        )
    weights, experts = route(router_logits, top_k, norm_topk_prob, recorded)
    aux_losses = (
        load_balancing_loss(router_logits, experts),
        router_z_loss(router_logits),
        reference.expert_counts(experts, num_experts),
    )
    mesh = active_mesh()
    run = (
        local_ffn
        if mesh is None
        else functools.partial(sharded_ffn, mesh, expert_axis=expert_axis, transport=transport)
    )
    y, dropped = run(
        x,
        weights,
        experts,
        w_gate_up,
        w_down,
        implementation=implementation,
        capacity_factor=capacity_factor,
        recipe=recipe,
    )
    own = None
    if return_routing:
        own = experts if recorded is None else route(router_logits, top_k, norm_topk_prob)[1]
    return y, MoEAux(*aux_losses, dropped, own)


def check_layer_args(hidden_size, intermediate_size, num_experts, top_k, capacity_factor) -> None:
    """Validates the MoE layer's constructor arguments (shared by the NNX and Linen layers)."""
    for name, value in (
        ("hidden_size", hidden_size),
        ("intermediate_size", intermediate_size),
        ("num_experts", num_experts),
        ("top_k", top_k),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k must be <= num_experts={num_experts}, got {top_k}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive or None (dropless), got {capacity_factor!r}")


def check_routing_dtype(routing) -> None:
    """A routing record holds integer expert ids."""
    if not hasattr(routing, "dtype") or not jnp.issubdtype(routing.dtype, jnp.integer):
        raise TypeError(f"routing must be an integer array of expert ids (-1: no record), got {routing!r:.80}")


def check_routing_shape(routing, leading: tuple, top_k: int) -> None:
    """A layer's routing record: integer, the tokens' leading shape then K."""
    check_routing_dtype(routing)
    if tuple(routing.shape) != (*leading, top_k):
        raise ValueError(
            f"routing must have the tokens' shape then top_k, {(*leading, top_k)}, got {tuple(routing.shape)}"
        )


def default_expert_init() -> nnx.Initializer:
    """LeCun-normal per expert: fan-in is the middle axis of `[E, in, out]`."""
    return nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))


def _router_logits(router: nnx.Linear, tokens: jax.Array) -> jax.Array:
    return router(tokens.astype(jnp.float32))


# The router runs in float32; its backward recasts the tokens instead of keeping a float32 copy of them (inside
# a scan over layers, a stacked residual of twice the tokens' bytes). Its logits, a dot, are kept.
_recomputed_router = nnx.remat(_router_logits, prevent_cse=False, policy=jax.checkpoint_policies.dots_saveable)


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE): `y, aux = moe(x)` for `x [..., H]`.

    Parameters: `router.kernel [H, E]`, `w_gate_up [E, H, 2I]` (gate = `[..., :I]`, up = `[..., I:]`),
    `w_down [E, I, H]`; the expert dimension carries the sharding name `expert_axis`.

    Args:
      hidden_size, intermediate_size, num_experts, top_k: H, I (per expert), E and K.
      norm_topk_prob: renormalise the K routing weights to sum to one (Qwen3-MoE: True).
      capacity_factor: None for dropless; else each expert takes at most
        `ceil(capacity_factor * T * K / E)` pairs and the rest are dropped and counted in `aux.dropped_pairs`.
      implementation: `moe_ffn` implementation (`"auto"`, `"cpu"`, `"cuda"`, `"reference"`), or a function with
        `moe_ffn`'s positional signature (not with expert_axis).
      expert_axis: mesh axis that holds the experts. Under an active multi-device mesh (`jax.set_mesh`)
        the layer runs inside `shard_map` with its tokens split over all mesh axes: `moe_ffn_ep` over
        `expert_axis` when set (it must be a mesh axis), else `moe_ffn` per shard with replicated experts.
      transport: `moe_ffn_ep`'s transport under expert parallelism: `"xla"`, `"ragged"`, or
        `jax_megamoe.NvlinkTransport(workspace)` with its workspace made once outside `jit` for the mesh's
        `expert_axis` and sized for the tokens per shard. A static attribute (not a parameter); unused without
        expert parallelism.
      dtype: compute dtype (x and the expert weights are cast to it); None keeps x's dtype.
      param_dtype: parameter storage dtype.
      kernel_init, router_init: initialisers of the expert weights and the router kernel.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        capacity_factor: float | None = None,
        implementation: str | ExpertFn = "auto",
        expert_axis: str | None = None,
        transport: str | Transport = "xla",
        recipe: str | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init: nnx.Initializer | None = None,
        router_init: nnx.Initializer = ROUTER_INIT,
        rngs: nnx.Rngs,
    ):
        check_layer_args(hidden_size, intermediate_size, num_experts, top_k, capacity_factor)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.capacity_factor = capacity_factor
        self.implementation = implementation
        self.expert_axis = expert_axis
        self.recipe = recipe  # moe_ffn's recipe: None or "fp8_blockwise" (docs/fp8.md)
        self.transport = transport  # static: part of the graph definition, shared by every copy
        self.dtype = dtype
        self.router = nnx.Linear(
            hidden_size,
            num_experts,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            kernel_init=router_init,
            rngs=rngs,
        )
        kernel_init = kernel_init or default_expert_init()
        self.w_gate_up = self._expert_param(
            kernel_init, rngs, (num_experts, hidden_size, 2 * intermediate_size), param_dtype
        )
        self.w_down = self._expert_param(kernel_init, rngs, (num_experts, intermediate_size, hidden_size), param_dtype)

    def _expert_param(self, init, rngs, shape, param_dtype) -> nnx.Param:
        value = init(rngs.params(), shape, param_dtype)
        if self.expert_axis is None:
            return nnx.Param(value)
        # Flax shards eagerly only when a mesh with the axis is active; otherwise it records the name.
        mesh = jax.sharding.get_abstract_mesh()
        eager = not mesh.empty and self.expert_axis in mesh.axis_names
        return nnx.Param(value, out_sharding=(self.expert_axis, None, None), eager_sharding=eager)

    @jax.named_scope("moe")  # the profiles' name for the router and the experts
    def __call__(
        self, x: jax.Array, routing: jax.Array | None = None, *, return_routing: bool = False
    ) -> tuple[jax.Array, MoEAux]:
        """`(y, aux)` for `x [..., H]`; with `return_routing`, `aux.routing [..., K]` holds the router's own top-k
        experts of each token (int32).

        `routing [..., K]` (integer, x's leading shape) replays a routing record: each token whose row is not
        all -1 uses the recorded experts, weighted by this router's probabilities at them (`moe_block`)."""
        tokens = x.reshape(-1, x.shape[-1])
        router_logits = _recomputed_router(self.router, tokens)
        return apply_layer(self, x, router_logits, self.w_gate_up[...], self.w_down[...], routing, return_routing)


def apply_layer(
    layer, x: jax.Array, router_logits: jax.Array, w_gate_up, w_down, routing=None, return_routing: bool = False
) -> tuple[jax.Array, MoEAux]:
    """`moe_block` with a layer's settings (the NNX and Linen `MoE`'s attributes: top_k, norm_topk_prob,
    capacity_factor, implementation, expert_axis, transport, recipe, dtype) over `x [..., H]` and its router
    logits `[T, E]`, the tokens' leading shape kept in `y`, the routing record `routing [..., K]` and
    `aux.routing`."""
    dtype = layer.dtype or x.dtype
    recorded = None
    if routing is not None:
        check_routing_shape(routing, x.shape[:-1], layer.top_k)
        recorded = routing.reshape(-1, layer.top_k)
    y, aux = moe_block(
        x.reshape(-1, x.shape[-1]).astype(dtype),
        router_logits,
        w_gate_up.astype(dtype),
        w_down.astype(dtype),
        top_k=layer.top_k,
        norm_topk_prob=layer.norm_topk_prob,
        capacity_factor=layer.capacity_factor,
        implementation=layer.implementation,
        expert_axis=layer.expert_axis,
        transport=layer.transport,
        recipe=layer.recipe,
        recorded=recorded,
        return_routing=return_routing,
    )
    if aux.routing is not None:
        aux = aux._replace(routing=aux.routing.reshape(*x.shape[:-1], layer.top_k))
    return y.reshape(*x.shape[:-1], y.shape[-1]), aux
