"""Router: top-k expert selection and the auxiliary losses (pure JAX; XLA fuses it well)."""

from __future__ import annotations

import jax

from jax_megamoe import reference
from jax_megamoe.ops.validation import check_rank, check_route_args


def route(router_logits: jax.Array, top_k: int, norm_topk_prob: bool = True):
    """Selects `top_k` experts per token. Returns `(weights [T, K] float32, experts [T, K] int32)`.

    Softmax over all experts in float32, top-k in descending order (ties toward the lower id), and
    with `norm_topk_prob` the k weights renormalised to sum to one (Qwen3-MoE semantics).
    Differentiable in `router_logits` through `weights`.
    """
    check_route_args(router_logits, top_k)
    return reference.route(router_logits, top_k, norm_topk_prob)


def load_balancing_loss(router_logits: jax.Array, experts: jax.Array) -> jax.Array:
    """Switch/HF load-balancing loss `E * sum_e (c_e / T) * P_e` (equals K at perfect balance)."""
    check_rank("router_logits", router_logits, 2, "[T, E]")
    check_rank("experts", experts, 2, "[T, K]")
    return reference.load_balancing_loss(router_logits, experts)


def router_z_loss(router_logits: jax.Array) -> jax.Array:
    """Router z-loss `mean(logsumexp(logits) ** 2)`."""
    check_rank("router_logits", router_logits, 2, "[T, E]")
    return reference.router_z_loss(router_logits)
