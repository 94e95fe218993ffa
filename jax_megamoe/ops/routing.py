"""Router: top-k expert selection and the auxiliary losses (pure JAX; XLA fuses it well)."""

from __future__ import annotations

import jax

from jax_megamoe import reference
from jax_megamoe.ops.validation import check_rank, check_recorded_routing, check_route_args


def route(router_logits: jax.Array, top_k: int, norm_topk_prob: bool = True, recorded: jax.Array | None = None):
    """Selects `top_k` experts per token. Returns `(weights [T, K] float32, experts [T, K] int32)`.

    Softmax over all experts in float32, top-k in descending order (ties toward the lower id), and
    with `norm_topk_prob` the k weights renormalised to sum to one (Qwen3-MoE semantics).
    Differentiable in `router_logits` through `weights`.

    Routing replay: `recorded [T, K]` (any integer dtype) gives each token the experts another run chose (a
    sampler's, `generate(..., return_routing=True)`), weighted by this router's probabilities at those experts
    and renormalised as above, so the router still gets gradients. A row of -1 has no record: that token takes
    its own top-k. In a recorded row, ids outside `[0, E)` get weight 0 (excluded from the renormalisation)
    and are dropped by `moe_ffn`.
    """
    check_route_args(router_logits, top_k)
    if recorded is not None:
        check_recorded_routing(recorded, router_logits.shape[0], top_k)
    return reference.route(router_logits, top_k, norm_topk_prob, recorded)


def load_balancing_loss(router_logits: jax.Array, experts: jax.Array) -> jax.Array:
    """Switch/HF load-balancing loss `E * sum_e (c_e / T) * P_e` (equals K at perfect balance)."""
    check_rank("router_logits", router_logits, 2, "[T, E]")
    check_rank("experts", experts, 2, "[T, K]")
    return reference.load_balancing_loss(router_logits, experts)


def router_z_loss(router_logits: jax.Array) -> jax.Array:
    """Router z-loss `mean(logsumexp(logits) ** 2)`."""
    check_rank("router_logits", router_logits, 2, "[T, E]")
    return reference.router_z_loss(router_logits)
