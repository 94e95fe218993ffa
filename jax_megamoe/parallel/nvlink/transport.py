"""`NvlinkTransport`: `moe_ffn_ep`'s transport over NVLink, fusing the rows' transfers with the expert kernels.

Per shard, the rows' local expert ids and routing weights go first by the plain exchange (`exchange.py`), so
that the receiving GEMM knows its groups before the rows arrive; then the fused calls (`fused.py`) push the
rows by the copy engines beside the gate_up GEMM of the shard's own rows, run the experts, and push the
results back beside the own rows' down GEMM. Two block layouts: when every token has a slot at every
destination (dropless, or a capacity of at least T rows), x itself is every destination's block and the call
sums the results per token; otherwise the rows travel in compacted send blocks. With the FP8 recipe the rows
cross quantised by the plain exchange, in compacted blocks, around the recipe's kernels (`parallel/fp8_rows.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_megamoe.ops.gemm_config import GemmConfig
from jax_megamoe.parallel.nvlink import exchange, fused
from jax_megamoe.parallel.nvlink.workspace import NvlinkWorkspace
from jax_megamoe.parallel.plan import INVALID_EXPERT, Plan
from jax_megamoe.parallel.rows import combine_rows, dispatch_rows
from jax_megamoe.parallel.transport import Transport, all_to_all_blocks, routing_blocks

TENSOR_CORE_MULTIPLE = 8  # H and I multiples of this run the bf16 tensor-core GEMMs the fused calls use


@dataclasses.dataclass(frozen=True, eq=False)
class NvlinkTransport(Transport):
    """The nvlink transport over `workspace` (an `NvlinkWorkspace` made once for the mesh's expert axis):
    `moe_ffn_ep(..., transport=NvlinkTransport(workspace))`. Hashable by identity, so it can be a static
    attribute of a Flax module."""

    workspace: NvlinkWorkspace
    name = "nvlink"

    def __post_init__(self):
        if not isinstance(self.workspace, NvlinkWorkspace):
            raise TypeError(f"NvlinkTransport takes an NvlinkWorkspace, got {self.workspace!r}")

    def check(self, ep: int) -> None:
        if self.workspace.ranks != ep:
            raise ValueError(f"the nvlink workspace spans {self.workspace.ranks} shards, the expert axis has {ep}")

    def unsupported(self, implementation, dtype, hidden, intermediate, recipe=None):
        if implementation != "cuda":
            return f"its kernels are CUDA kernels, the call's implementation is {implementation!r}"
        if recipe is not None:  # the recipe's own checks hold for its rows (fp8.check_fp8_args)
            return None
        if jnp.dtype(dtype) != jnp.bfloat16:
            return f"its GEMMs take bfloat16, x is {jnp.dtype(dtype)}"
        if hidden % TENSOR_CORE_MULTIPLE or intermediate % TENSOR_CORE_MULTIPLE:
            return (
                f"its tensor-core GEMMs need H and I multiples of {TENSOR_CORE_MULTIPLE}, got H={hidden}, "
                f"I={intermediate}"
            )
        return None

    def compact_rows(self, tokens: int, row_capacity: int, recipe: str | None = None) -> bool:
        # The fused calls push whole blocks, so compacting buys nothing once every token has a slot; the recipe's
        # rows go by the plain exchange, which moves the live rows of compacted blocks.
        return recipe is not None or row_capacity != tokens

    def exchange(self, buffer, send_counts, recv_counts, axis_name, fill_value=0):
        del axis_name  # the workspace knows its axis
        return exchange.exchange(buffer, send_counts, recv_counts, self.workspace, fill_value)

    def experts(
        self,
        x: jax.Array,
        weights: jax.Array,
        plan: Plan,
        w_gate_up: jax.Array,
        w_down: jax.Array,
        *,
        axis_name: str,
        implementation: str,
        recipe: str | None = None,
    ) -> jax.Array:
        if recipe is not None:  # the rows cross quantised by the plain exchange (parallel/fp8_rows.py)
            return super().experts(
                x,
                weights,
                plan,
                w_gate_up,
                w_down,
                axis_name=axis_name,
                implementation=implementation,
                recipe=recipe,
            )
        del implementation  # the fused kernels are CUDA's (`unsupported` says so)
        ep, row_capacity = plan.token.shape
        local_experts, _, two_inter = w_gate_up.shape
        ids, row_weights = routing_blocks(plan, weights, local_experts)
        x_as_blocks = not self.compact_rows(x.shape[0], row_capacity)  # the plan is uncompacted
        if x_as_blocks:  # rows sit at their token's index: whole blocks move
            send_counts = recv_counts = jnp.full((ep,), row_capacity, jnp.int32)
        else:
            send_counts, recv_counts = plan.row_counts, all_to_all_blocks(plan.row_counts, axis_name)
        recv_ids = self.exchange(ids, send_counts, recv_counts, axis_name, INVALID_EXPERT)
        recv_weights = self.exchange(row_weights, send_counts, recv_counts, axis_name)
        config = GemmConfig.for_problem(
            ep * row_capacity, recv_ids.shape[-1], x.shape[1], two_inter // 2, local_experts
        )
        if x_as_blocks:
            return fused.fused_experts_on_tokens(x, recv_ids, recv_weights, w_gate_up, w_down, self.workspace, config)
        send = dispatch_rows(x, plan.token, plan.slot)
        returned = fused.fused_experts(send, recv_ids, recv_weights, w_gate_up, w_down, self.workspace, config)
        return combine_rows(returned, plan.slot, plan.token)
