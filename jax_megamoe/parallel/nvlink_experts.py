"""Stage 2 of the nvlink transport: the token rows' transfers fused with the expert forward and backward.

One FFI call per shard (`jmm_cuda_nvlink_moe_forward`, cuda/ffi/nvlink_forward_cuda.cc) moves the rows to the
peers by the copy engines (DMA into the workspace's push slots, signalled by stream writes) and runs the expert
forward on them: the transfer and the gather of the peers' rows run on a side stream beside the gate_up GEMM
of the shard's own rows, whose peer groups wait (bounded) for their rows. The GEMM's groups must be known
before the rows arrive, so the local expert ids and routing weights travel first (stage 1's exchange) and the
pairs are laid out by the fine key (local expert, source shard). The rows arrive in source order, so that
layout has the plain expert layout's row order. The results go back to their sources in the same call, pushed while
the own tokens are combined. The backward is one more FFI call per shard (`jmm_cuda_nvlink_moe_backward`,
cuda/ffi/nvlink_backward_cuda.cc): the results' cotangent to the experts by the same copy-engine protocol, `moe_ffn`'s
CUDA backward on the received rows, and the rows' cotangent back to their sources while its last GEMM (d_w_gate_up)
runs. Forward and gradients are bit for bit stage 1's.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import _ffi
from jax_megamoe.ops.moe import GEMM_TILES_ENV, Layout, moe_layout
from jax_megamoe.parallel import nvlink

TENSOR_CORE_MULTIPLE = 8  # H and I multiples of this run the bf16 tensor-core GEMMs (UseTensorCores, moe_cuda.h)


def overlap_applies(workspace: nvlink.NvlinkWorkspace, local_platform: str, dtype, hidden: int, inter: int) -> bool:
    """Whether `moe_ffn_ep`'s nvlink path runs stage 2's overlapped forward and backward: the workspace asks
    for them (`overlap=True`, the default), the local experts run on the CUDA kernels (`local_platform`, resolved), and the
    problem takes the bf16 tensor-core GEMMs (`dtype` bfloat16, `hidden` and `inter` multiples of 8).
    Otherwise stage 1 runs unchanged."""
    return (workspace.overlap and local_platform == "cuda" and jnp.dtype(dtype) == jnp.bfloat16
            and hidden % TENSOR_CORE_MULTIPLE == 0 and inter % TENSOR_CORE_MULTIPLE == 0)


def fine_keys(recv_ids: jax.Array) -> jax.Array:
    """Layout keys of the received pairs: `e * ep + s` for local expert id `e` received from source `s`, -1
    where the id is negative. `recv_ids [ep, C, K]` (block s from source s) -> `[ep * C, K]` int32.

    `moe_layout(keys, E_local * ep)` then sorts the pairs by (expert, source); its offsets every `ep`-th
    entry are the plain expert offsets. Ids >= E_local give keys >= E_local * ep, dropped like the id."""
    ep = recv_ids.shape[0]
    source = jnp.arange(ep, dtype=jnp.int32)[:, None, None]
    ids = recv_ids.astype(jnp.int32)
    keys = jnp.where(ids >= 0, ids * ep + source, -1)
    return keys.reshape(-1, recv_ids.shape[-1])


def overlapped_experts(send: jax.Array, recv_ids: jax.Array, recv_weights: jax.Array, w_gate_up: jax.Array,
                       w_down: jax.Array, workspace: nvlink.NvlinkWorkspace) -> jax.Array:
    """The rows `send` there, `moe_ffn` on them, their results back: the rows' exchange beside the own rows'
    gate_up GEMM, the results' push beside the own tokens' combine, and in the backward the results' cotangent
    there beside the own rows' gather and the rows' cotangent back beside the d_w_gate_up GEMM.

    Equals `nvlink.exchange(moe_ffn(nvlink.exchange(send, send_counts, recv_counts, workspace), recv_weights,
    recv_ids, ...), recv_counts, send_counts, workspace)` with the blocks flattened to rows for `moe_ffn`, bit for
    bit, forward and gradients (CUDA kernels, bf16). The copy engines move whole blocks, so no counts are needed:
    the rows past the live ones are zero going (`dispatch_rows`' fill), and so are their results and cotangents
    (they have no pairs; the source reads only its live rows), as the exchanges' fill.

    Args:
      send: `[ep, C, H]` bf16 rows for each destination: the live rows of block d first, the rest zero.
      recv_ids: `[ep, C, K]` the received rows' local expert ids (-1 for none).
      recv_weights: `[ep, C, K]` their routing weights.
      w_gate_up, w_down: this shard's experts, `[E_local, H, 2I]` and `[E_local, I, H]`, bf16.
      workspace: the `NvlinkWorkspace` of the expert axis.

    Returns the results of this shard's rows `[ep, C, H]`: block d from shard d, each row summed over its pairs
    there.
    """
    return _overlapped(*_operands(send, recv_ids, recv_weights, w_gate_up, w_down, workspace), workspace, False)


def overlapped_experts_on_tokens(x: jax.Array, recv_ids: jax.Array, recv_weights: jax.Array, w_gate_up: jax.Array,
                                 w_down: jax.Array, workspace: nvlink.NvlinkWorkspace) -> jax.Array:
    """`overlapped_experts` with `x [T, H]` itself as every destination's block, its results summed per token:
    `rows.sum_blocks(overlapped_experts(send, ...))` where `send[d]` is x with the rows not sent to d zeroed, bit
    for bit, without building `send` or, in the backward, the blocks of the results' cotangent. The handler adds the
    sources' results up itself, from the push slots where the peers' land.

    For uncompacted plans (`plan.make_plan(compact=False)`): token t is row t of every block, and a token not sent
    to d has no pairs there (`recv_ids` -1), so its row there is never read, and its result and cotangent there
    are zero, which is what the zeroed row would have given.
    """
    return _overlapped(*_operands(x[None], recv_ids, recv_weights, w_gate_up, w_down, workspace), workspace, True)


def _operands(blocks, recv_ids, recv_weights, w_gate_up, w_down, workspace):
    ep, capacity, _ = recv_ids.shape
    workspace.check_fits(capacity, blocks.shape[2] * blocks.dtype.itemsize)
    weights = recv_weights.reshape(ep * capacity, -1).astype(jnp.float32)
    return _ffi.vary_alike(blocks, fine_keys(recv_ids), weights, w_gate_up, w_down)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _overlapped(blocks, keys, weights, w_gate_up, w_down, workspace, summed):
    return _overlapped_fwd(blocks, keys, weights, w_gate_up, w_down, workspace, summed)[0]


def _overlapped_fwd(blocks, keys, weights, w_gate_up, w_down, workspace, summed):
    """`blocks` [ep, C, H], or [1, C, H] for one block that every destination gets; `summed` (with one block):
    return the results' sum over sources [C, H], which the handler adds up in `rows.sum_blocks`' order, instead of
    the blocks [ep, C, H]."""
    _, capacity, hidden = blocks.shape
    rows, top_k = weights.shape
    ep = rows // capacity
    local_experts, _, two_inter = w_gate_up.shape
    row_of_pair, pair_of_row, source_offsets = moe_layout(keys, local_experts * ep, "cuda")
    # Same row order as moe_layout(ids, E_local): a valid layout for moe_ffn's backward.
    layout = Layout(row_of_pair, pair_of_row, source_offsets[::ep])
    # The handler's temporaries: a trailing uint8 result XLA allocates (as for ops/moe.py's CUDA
    # handlers), dropped.
    workspace_bytes = _ffi.extension().cuda_workspace_bytes("nvlink_moe_forward", True, rows, top_k, hidden,
                                                            two_inter // 2, local_experts * ep)
    # With one block the handler returns the results already summed over the sources (one block too).
    shapes = (jax.ShapeDtypeStruct((ep, capacity, hidden), blocks.dtype),
              jax.ShapeDtypeStruct(blocks.shape, blocks.dtype),
              jax.ShapeDtypeStruct((rows * top_k, two_inter), blocks.dtype),
              jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8))
    recv_x, returned, gate_up, _ = _ffi.call(
        "cuda", "nvlink_moe_forward", shapes, blocks, weights, w_gate_up, w_down,
        row_of_pair, pair_of_row, source_offsets, layout.expert_offsets, vmap_method="broadcast_all",
        workspace=np.int64(workspace.id))
    out = returned[0] if summed else returned
    return out, (recv_x, weights, w_gate_up, w_down, gate_up, layout, source_offsets)


def _overlapped_bwd(workspace, summed, residuals, d_out):
    recv_x, weights, w_gate_up, w_down, gate_up, layout, source_offsets = residuals
    ep, capacity, hidden = recv_x.shape
    local_experts, _, two_inter = w_gate_up.shape
    top_k = weights.shape[1]
    # The sum's cotangent is every source's: one block of it serves them all.
    d_returned = (d_out[None] if summed else d_out).astype(recv_x.dtype)
    # dz, the gradient of gate_up, is written over the saved gate_up (operand 5, result 4), as in moe_backward.
    workspace_bytes = _ffi.extension().cuda_workspace_bytes("nvlink_moe_backward", True, ep * capacity, top_k, hidden,
                                                            two_inter // 2, local_experts)
    # With one block of d_returned, d_send is one block too: dx summed over the sources by the handler.
    shapes = (jax.ShapeDtypeStruct(d_returned.shape, recv_x.dtype), jax.ShapeDtypeStruct(weights.shape, weights.dtype),
              jax.ShapeDtypeStruct(w_gate_up.shape, w_gate_up.dtype), jax.ShapeDtypeStruct(w_down.shape, w_down.dtype),
              jax.ShapeDtypeStruct(gate_up.shape, gate_up.dtype), jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8))
    d_send, d_weights, d_w_gate_up, d_w_down, _, _ = _ffi.call(
        "cuda", "nvlink_moe_backward", shapes, d_returned, recv_x, weights, w_gate_up, w_down, gate_up,
        layout.row_of_pair, layout.pair_of_row, source_offsets, layout.expert_offsets, vmap_method="broadcast_all",
        input_output_aliases={5: 4}, workspace=np.int64(workspace.id), gemm_tiles=os.environ.get(GEMM_TILES_ENV, ""))
    return d_send, None, d_weights, d_w_gate_up, d_w_down


_overlapped.defvjp(_overlapped_fwd, _overlapped_bwd)
