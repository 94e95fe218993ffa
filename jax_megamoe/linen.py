"""Flax Linen Mixture-of-Experts layer: the same layer as `jax_megamoe.nn.MoE`, for Linen models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_megamoe.nn import ExpertFn, MoEAux, apply_layer, check_layer_args, default_expert_init

if TYPE_CHECKING:
    from jax_megamoe.parallel import Transport

__all__ = ["MoE", "MoEAux"]


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE): `y, aux = MoE(...).apply(variables, x)` for `x [..., H]`.

    Parameters `router/kernel [H, E]`, `w_gate_up [E, H, 2I]`, `w_down [E, I, H]`, the expert dimension
    boxed with `nn.with_partitioning` on `expert_axis`. Arguments as in `jax_megamoe.nn.MoE` (H is taken
    from the input), including `implementation`, `transport` (`"xla"`, `"ragged"` or a
    `jax_megamoe.NvlinkTransport`; a module attribute, not a variable) and `recipe` (None or
    `"fp8_blockwise"`, docs/fp8.md).
    """

    intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    capacity_factor: float | None = None
    implementation: str | ExpertFn = "auto"
    expert_axis: str | None = None
    transport: str | Transport = "xla"
    recipe: str | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = None
    router_init: Any = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self, x: jax.Array, routing: jax.Array | None = None) -> tuple[jax.Array, MoEAux]:
        """`(y, aux)` for `x [..., H]`; `routing [..., K]` replays a routing record (as `jax_megamoe.nn.MoE`)."""
        hidden = x.shape[-1]
        check_layer_args(hidden, self.intermediate_size, self.num_experts, self.top_k, self.capacity_factor)
        tokens = x.reshape(-1, hidden)
        router_logits = nn.Dense(
            self.num_experts,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=self.param_dtype,
            kernel_init=self.router_init,
            name="router",
        )(tokens.astype(jnp.float32))
        init = self.kernel_init or default_expert_init()
        if self.expert_axis is not None:
            init = nn.with_partitioning(init, (self.expert_axis, None, None))
        w_gate_up = self.param(
            "w_gate_up", init, (self.num_experts, hidden, 2 * self.intermediate_size), self.param_dtype
        )
        w_down = self.param("w_down", init, (self.num_experts, self.intermediate_size, hidden), self.param_dtype)
        return apply_layer(self, x, router_logits, w_gate_up, w_down, routing)
