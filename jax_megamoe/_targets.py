"""Every XLA FFI target of the extension, declared once.

Each `Target` names its handler by the literal that `cuda/ffi/registrations.cc` registers, so a grep for
the literal finds both the Python call site (through this table) and the C++ handler. `_ffi.call` reads
the table: the platform a target runs on, the query that sizes its trailing workspace result, which
operand a result is written over, and the attributes it takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType


@dataclasses.dataclass(frozen=True)
class Target:
    """One FFI target.

    name: the registered literal (also the C++ handler symbol).
    platform: `jax.ffi.register_ffi_target`'s platform: "cpu" or "CUDA".
    attrs: the attribute names the handler binds, in any order.
    workspace_query: the `_ext` function returning the bytes of the trailing uint8 result that holds the
      handler's temporaries (XLA allocates it, so the call can be captured into a CUDA graph); None when the
      handler takes none.
    aliases: operand index -> result index, for results written over an operand (`jax.ffi.ffi_call`'s
      `input_output_aliases`).
    vmap_method: `jax.ffi.ffi_call`'s `vmap_method`.
    """

    name: str
    platform: str
    attrs: tuple[str, ...] = ()
    workspace_query: str | None = None
    aliases: Mapping[int, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    vmap_method: str = "sequential"


def _aliases(**pairs: int) -> Mapping[int, int]:
    return MappingProxyType({int(k.removeprefix("operand")): v for k, v in pairs.items()})


# moe_ffn's four ops, per implementation (contract: jax_megamoe/ops/moe.py).
MOE_LAYOUT = {
    "cpu": Target("jmm_cpu_moe_layout", "cpu", attrs=("num_experts",)),
    "cuda": Target(
        "jmm_cuda_moe_layout", "CUDA", attrs=("num_experts",), workspace_query="jmm_cuda_moe_layout_workspace_bytes"
    ),
}
MOE_GATE_UP = {
    "cpu": Target("jmm_cpu_moe_gate_up", "cpu"),
    "cuda": Target(
        "jmm_cuda_moe_gate_up",
        "CUDA",
        attrs=("fwd_gate_up_tiles",),
        workspace_query="jmm_cuda_moe_gate_up_workspace_bytes",
    ),
}
MOE_DOWN = {
    "cpu": Target("jmm_cpu_moe_down", "cpu"),
    "cuda": Target(
        "jmm_cuda_moe_down", "CUDA", attrs=("fwd_down_tiles",), workspace_query="jmm_cuda_moe_down_workspace_bytes"
    ),
}
MOE_BACKWARD = {
    "cpu": Target("jmm_cpu_moe_backward", "cpu"),
    # dz (result 4, the gradient of gate_up) is written over the gate_up operand (5), its last reader.
    "cuda": Target(
        "jmm_cuda_moe_backward",
        "CUDA",
        attrs=("bwd_down_tiles", "bwd_gate_up_tiles"),
        workspace_query="jmm_cuda_moe_backward_workspace_bytes",
        aliases=_aliases(operand5=4),
    ),
}

# linear_cross_entropy's rows of one logits chunk (contract: jax_megamoe/losses.py): the gradient (result 1) is
# written over the logits (operand 0).
CROSS_ENTROPY_ROWS = {
    "cpu": Target("jmm_cpu_cross_entropy_rows", "cpu", aliases=_aliases(operand0=1)),
    "cuda": Target("jmm_cuda_cross_entropy_rows", "CUDA", aliases=_aliases(operand0=1)),
}

# The nvlink transport (contract: jax_megamoe/parallel/nvlink/). Emulated workspaces run every shard in one
# call, so under jax.vmap the handler sees the whole batch.
NVLINK_EXCHANGE = Target(
    "jmm_cuda_nvlink_exchange", "CUDA", attrs=("workspace", "fill_byte"), vmap_method="broadcast_all"
)
NVLINK_MOE_GATE_UP = Target(
    "jmm_cuda_nvlink_moe_gate_up",
    "CUDA",
    attrs=("workspace",),
    workspace_query="jmm_cuda_nvlink_moe_gate_up_workspace_bytes",
    vmap_method="broadcast_all",
)
NVLINK_MOE_DOWN = Target(
    "jmm_cuda_nvlink_moe_down",
    "CUDA",
    attrs=("workspace",),
    workspace_query="jmm_cuda_nvlink_moe_down_workspace_bytes",
    vmap_method="broadcast_all",
)
NVLINK_MOE_BACKWARD = Target(
    "jmm_cuda_nvlink_moe_backward",
    "CUDA",
    attrs=("workspace", "bwd_down_tiles", "bwd_gate_up_tiles"),
    workspace_query="jmm_cuda_nvlink_moe_backward_workspace_bytes",
    aliases=_aliases(operand5=4),
    vmap_method="broadcast_all",
)

# The "fp8_blockwise" recipe's kernels (contracts: jax_megamoe/ops/fp8_cuda.py: rows_gemm, weight_gemm,
# weight_blocks, row_operand, hidden, token_tiles, hidden_grad).
FP8_ROWS_GEMM = Target("jmm_cuda_fp8_rows_gemm", "CUDA", workspace_query="jmm_cuda_fp8_rows_gemm_workspace_bytes")
FP8_WEIGHT_GEMM = Target("jmm_cuda_fp8_weight_gemm", "CUDA", workspace_query="jmm_cuda_fp8_weight_gemm_workspace_bytes")
FP8_QUANTIZE_BLOCKS = Target("jmm_cuda_fp8_quantize_blocks", "CUDA", attrs=("transpose",))
FP8_QUANTIZE_ROWS = Target("jmm_cuda_fp8_quantize_rows", "CUDA")
FP8_SWIGLU_ROWS = Target("jmm_cuda_fp8_swiglu_rows", "CUDA")
FP8_TOKEN_TILES = Target("jmm_cuda_fp8_token_tiles", "CUDA")
FP8_SWIGLU_GRAD_ROWS = Target("jmm_cuda_fp8_swiglu_grad_rows", "CUDA")


def all_targets() -> tuple[Target, ...]:
    """Every declared target, for registration and the table's tests."""
    per_op = (MOE_LAYOUT, MOE_GATE_UP, MOE_DOWN, MOE_BACKWARD, CROSS_ENTROPY_ROWS)
    return (
        *(t for op in per_op for t in op.values()),
        NVLINK_EXCHANGE,
        NVLINK_MOE_GATE_UP,
        NVLINK_MOE_DOWN,
        NVLINK_MOE_BACKWARD,
        FP8_ROWS_GEMM,
        FP8_WEIGHT_GEMM,
        FP8_QUANTIZE_BLOCKS,
        FP8_QUANTIZE_ROWS,
        FP8_SWIGLU_ROWS,
        FP8_TOKEN_TILES,
        FP8_SWIGLU_GRAD_ROWS,
    )
