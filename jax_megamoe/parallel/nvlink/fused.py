"""The nvlink transport's fused calls: the token rows' transfers fused with the expert forward and backward.

Three FFI calls per shard (cuda/nvlink/handlers_cuda.cc; streams and block layouts in cuda/nvlink/fused.h):
  jmm_cuda_nvlink_moe_gate_up   pushes the rows to the peers by the copy engines (DMA into the workspace's push
                                slots, signalled by stream writes), and runs the gate_up GEMM of the own rows and
                                then of each peer's, each peer group waiting (bounded) for its rows, which a side
                                stream gathers beside the GEMM. Returns the received rows (the backward's operand)
                                and the gate_up projections.
  jmm_cuda_nvlink_moe_down      SwiGLU and the down GEMM, split by source so that the peers' results are pushed
                                back while the own rows' GEMM runs, and the own tokens' combine.
  jmm_cuda_nvlink_moe_backward  the results' cotangent to the experts by the same pushes, moe_ffn's CUDA backward on
                                the received rows, and the rows' cotangent back while its last GEMM runs.
The GEMM's groups must be known before the rows arrive, so the local expert ids and routing weights travel first
(the plain exchange, `exchange.py`) and the pairs are laid out by the fine key (local expert, source shard): the rows
arrive in source order, so that layout has the plain expert layout's row order. Forward and gradients are bit for
bit "the rows' exchange, `moe_ffn` on the received rows, the results' reverse exchange" (CUDA kernels, bf16).

The forward is two calls, like `moe_ffn`'s, and its residuals carry `moe_ffn`'s checkpoint names plus one for what
the shard received: "moe_layout" (the fine layout), "moe_gate_up" (the projections) and "moe_rows" (the received rows
and their routing weights). Under `jax.checkpoint` with a policy saving those names nothing of the exchanges or the
experts is recomputed; with no policy the recomputation runs the gate_up call only (XLA drops the down call, whose
result nothing reads there). Every call is SPMD on every rank and makes the same pushes there, so the push
protocol's call counts agree whichever calls XLA keeps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_megamoe import _ffi, _targets
from jax_megamoe.ops.moe import GATE_UP_NAME, LAYOUT_NAME, moe_layout

# The checkpoint name of the rows and routing weights a shard received (the fused backward's operands).
ROWS_NAME = "moe_rows"


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


def fused_experts(
    send: jax.Array,
    recv_ids: jax.Array,
    recv_weights: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    workspace,
    gemm_config,
) -> jax.Array:
    """The rows `send` to their expert shards, the local experts on the rows that arrive, their results back.

    Equals `exchange(moe_ffn(exchange(send, send_counts, recv_counts), recv_weights, recv_ids, ...), recv_counts,
    send_counts)` with the blocks flattened to rows for `moe_ffn`, bit for bit, forward and gradients. The copy
    engines move whole blocks, so no counts are needed: the rows past the live ones are zero going (`dispatch_rows`'
    fill), and so are their results and cotangents (they have no pairs; the source reads only its live rows), as
    the exchanges' fill.

    Args:
      send: `[ep, C, H]` bf16 rows for each destination: the live rows of block d first, the rest zero.
      recv_ids: `[ep, C, K]` the received rows' local expert ids (-1 for none).
      recv_weights: `[ep, C, K]` their routing weights.
      w_gate_up, w_down: this shard's experts, `[E_local, H, 2I]` and `[E_local, I, H]`, bf16.
      workspace: the `NvlinkWorkspace` of the expert axis.
      gemm_config: a `GemmConfig`; the backward's row GEMMs take its `bwd_down` and `bwd_gate_up` tiles (the
        forward's GEMMs are the fused kernels' own, cooperative 128 x 256).

    Returns the results of this shard's rows `[ep, C, H]`: block d from shard d, each row summed over its pairs
    there.
    """
    operands = _operands(send, recv_ids, recv_weights, w_gate_up, w_down, workspace)
    return _fused(*operands, workspace.id, _backward_tiles(gemm_config))


def fused_experts_on_tokens(
    x: jax.Array,
    recv_ids: jax.Array,
    recv_weights: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    workspace,
    gemm_config,
) -> jax.Array:
    """`fused_experts` with `x [T, H]` itself as every destination's block, its results summed per token:
    `rows.sum_blocks(fused_experts(send, ...))` where `send[d]` is x with the rows not sent to d zeroed, bit for bit,
    without building `send` or, in the backward, the blocks of the results' cotangent. The down call adds the
    sources' results up itself, from the push slots where the peers' land.

    For uncompacted plans (`plan.make_plan(compact=False)`): token t is row t of every block, and a token not sent
    to d has no pairs there (`recv_ids` -1), so its row there is never read, and its result and cotangent there
    are zero, which is what the zeroed row would have given. Returns `y [T, H]`.
    """
    operands = _operands(x[None], recv_ids, recv_weights, w_gate_up, w_down, workspace)
    return _fused(*operands, workspace.id, _backward_tiles(gemm_config))[0]


def _backward_tiles(gemm_config) -> tuple[int, int]:
    """The backward's row-GEMM tiles, `(bwd_down, bwd_gate_up)`, as the handler's attributes take them."""
    return int(gemm_config.bwd_down), int(gemm_config.bwd_gate_up)


def _operands(blocks, recv_ids, recv_weights, w_gate_up, w_down, workspace):
    ep, capacity, _ = recv_ids.shape
    workspace.check_fits(capacity, blocks.shape[2] * blocks.dtype.itemsize)
    weights = recv_weights.reshape(ep * capacity, -1).astype(jnp.float32)
    return _ffi.vary_alike(blocks, fine_keys(recv_ids), weights, w_gate_up, w_down)


def _sizes(capacity, weights, w_gate_up) -> tuple[int, int, int, int, int, int]:
    """`(ep, tokens, top_k, hidden, intermediate, local experts)` of one shard's received problem."""
    tokens, top_k = weights.shape
    local_experts, hidden, two_inter = w_gate_up.shape
    return tokens // capacity, tokens, top_k, hidden, two_inter // 2, local_experts


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fused(blocks, keys, weights, w_gate_up, w_down, workspace_id, backward_tiles):
    """`blocks` [ep, C, H], or [1, C, H] for one block that every destination gets; the result has the blocks'
    shape: with one block, the results summed over the sources (`rows.sum_blocks`' order)."""
    return _fused_fwd(blocks, keys, weights, w_gate_up, w_down, workspace_id, backward_tiles)[0]


def _fused_fwd(blocks, keys, weights, w_gate_up, w_down, workspace_id, backward_tiles):
    del backward_tiles
    capacity = blocks.shape[1]
    ep, tokens, top_k, hidden, inter, local_experts = _sizes(capacity, weights, w_gate_up)
    groups = local_experts * ep
    # Same row order as moe_layout(ids, E_local): a valid layout for moe_ffn's backward.
    row_of_pair, pair_of_row, source_offsets = (
        checkpoint_name(a, LAYOUT_NAME) for a in moe_layout(keys, groups, "cuda")
    )
    attrs = {"workspace": np.int64(workspace_id)}
    sizes = (tokens, top_k, hidden, inter, groups)
    recv_x, gate_up = _ffi.call(
        _targets.NVLINK_MOE_GATE_UP,
        (
            jax.ShapeDtypeStruct((ep, capacity, hidden), blocks.dtype),
            jax.ShapeDtypeStruct((tokens * top_k, 2 * inter), blocks.dtype),
        ),
        blocks,
        w_gate_up,
        pair_of_row,
        source_offsets,
        workspace_args=sizes,
        **attrs,
    )
    [returned] = _ffi.call(
        _targets.NVLINK_MOE_DOWN,
        (jax.ShapeDtypeStruct(blocks.shape, blocks.dtype),),
        gate_up,
        weights,
        w_down,
        row_of_pair,
        source_offsets,
        source_offsets[::ep],
        workspace_args=sizes,
        **attrs,
    )
    residuals = (
        checkpoint_name(recv_x, ROWS_NAME),
        checkpoint_name(weights, ROWS_NAME),
        w_gate_up,
        w_down,
        checkpoint_name(gate_up, GATE_UP_NAME),
        row_of_pair,
        pair_of_row,
        source_offsets,
    )
    return returned, residuals


def _fused_bwd(workspace_id, backward_tiles, residuals, d_returned):
    recv_x, weights, w_gate_up, w_down, gate_up, row_of_pair, pair_of_row, source_offsets = residuals
    capacity = recv_x.shape[1]
    ep, tokens, top_k, hidden, inter, local_experts = _sizes(capacity, weights, w_gate_up)
    bwd_down, bwd_gate_up = backward_tiles
    # With one block of d_returned (the cotangent of the results' sum, every source's), d_send is one block too: x's
    # cotangent, dx summed over the sources. dz, the gradient of gate_up, is written over the saved gate_up (operand
    # 5, result 4), as in moe_backward.
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (d_returned, weights, w_gate_up, w_down, gate_up)]
    d_send, d_weights, d_w_gate_up, d_w_down = _ffi.call(
        _targets.NVLINK_MOE_BACKWARD,
        shapes,
        d_returned.astype(recv_x.dtype),
        recv_x,
        weights,
        w_gate_up,
        w_down,
        gate_up,
        row_of_pair,
        pair_of_row,
        source_offsets,
        source_offsets[::ep],
        workspace_args=(tokens, top_k, hidden, inter, local_experts),
        workspace=np.int64(workspace_id),
        bwd_down_tiles=np.int64(bwd_down),
        bwd_gate_up_tiles=np.int64(bwd_gate_up),
    )[:4]
    return d_send, None, d_weights, d_w_gate_up, d_w_down


_fused.defvjp(_fused_fwd, _fused_bwd)
