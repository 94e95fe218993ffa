// Every FFI handler symbol of the extension; registrations.cc maps each target name to the symbol of the same name.
//
// The MoE op contract (identical on every platform; the Python side: jax_megamoe/ops/moe.py, jax_megamoe/_targets.py):
//   moe_layout(experts [T,K] s32; attr num_experts) ->
//       row_of_pair [T*K] s32    sorted row of pair p = t*K + k, or -1 when its id is outside [0, E)
//       pair_of_row [T*K] s32    pair held by sorted row r, or -1 for r >= expert_offsets[E]
//       expert_offsets [E+1] s32 rows of expert e are [offsets[e], offsets[e+1]); stable in pair order
//   moe_gate_up(x [T,H], w_gate_up [E,H,2I], pair_of_row, expert_offsets) -> gate_up [T*K, 2I] (x's dtype, in
//               sorted row order, saved for the backward)
//   moe_down(gate_up, weights [T,K] f32 (f64 for f64 x), w_down [E,I,H], row_of_pair, expert_offsets) -> y [T,H]
//   (the forward is two calls so that a recomputation needing only gate_up, under jax.checkpoint, runs only the
//   first: XLA drops the second, whose y nothing reads there)
//   moe_backward(dy [T,H], x, weights, w_gate_up, w_down, gate_up, row_of_pair, pair_of_row,
//                expert_offsets) -> dx [T,H], d_weights [T,K] (weights' dtype), d_w_gate_up, d_w_down
// The CUDA handlers return one more result, last: workspace [bytes] u8, their temporaries (sized by the
// `<target>_workspace_bytes` queries of extension.h; its contents are garbage), which lets XLA capture them into
// CUDA graphs. The CUDA gate_up, down and backward take the GEMM tiles of their row-grouped GEMMs as int64
// attributes holding cuda::GemmTiles values (kernels/moe_kernels.h): gate_up fwd_gate_up_tiles, down
// fwd_down_tiles, backward bwd_down_tiles and bwd_gate_up_tiles. The CUDA backward returns dz [T*K, 2I] before the
// workspace, the gradient of gate_up (garbage to the caller), which the caller aliases to the gate_up operand: dz
// is written over gate_up, its last reader being the backward.
#pragma once

#include "xla/ffi/api/ffi.h"

// cuda/ffi/moe_cpu.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cpu_moe_layout);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cpu_moe_gate_up);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cpu_moe_down);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cpu_moe_backward);

// linear_cross_entropy's rows (jax_megamoe/losses.py), cuda/ffi/cross_entropy_cpu.cc and cross_entropy_cuda.cc:
//   cross_entropy_rows(logits [R,V] bf16|f32, labels [R] s32, scale [] f32) -> loss [R] f32, grad [R,V] (logits'
//                      dtype)
//   loss[r] = logsumexp(logits[r]) - logits[r, labels[r]], grad[r] = scale * (softmax(logits[r]) - onehot), both
//   zero for a label outside [0, V); grad may be written over logits (the caller aliases them).
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cpu_cross_entropy_rows);

#ifdef JMM_WITH_CUDA
// cuda/ffi/moe_cuda.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_moe_layout);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_moe_gate_up);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_moe_down);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_moe_backward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_cross_entropy_rows);
// The nvlink transport, cuda/nvlink/
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_nvlink_exchange);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_nvlink_moe_gate_up);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_nvlink_moe_down);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_nvlink_moe_backward);
// The "fp8_blockwise" recipe, cuda/ffi/fp8_cuda.cc:
//   fp8_rows_gemm(a [R,K] f8e4m3fn, sfa [R,K/128] f32, b [E,N,K] f8e4m3fn, sfb [E,N/128,K/128] f32,
//                 expert_offsets [E+1] s32) -> d [R,N] bf16|f32, workspace
//   d[rows of e] = (a * sfa)[rows of e] @ (b_e * sfb_e)^T (1x128 tiles of a, 128x128 blocks of b_e).
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_fp8_rows_gemm);
//   fp8_weight_gemm(a [M,P] f8e4m3fn, sfa [P/128,M] f32, b [N,P] f8e4m3fn, sfb [P/128,N] f32,
//                   token_offsets [E+1] s32) -> d [E,M,N] bf16|f32, workspace
//   d_e = (a * sfa)_e @ (b * sfb)_e^T over expert e's padded tokens [token_offsets[e], token_offsets[e+1]) (1x128
//   tiles along the tokens, the scale of a[i, 128 t ..] at sfa[t, i]; see kernels/fp8_kernels.h).
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_fp8_weight_gemm);
//   fp8_quantize_blocks(w [E,A,B] bf16|f32; transpose) -> values [E,A,B] (transposed: [E,B,A]) f8e4m3fn,
//                       scales [E,A/128,B/128] (transposed: [E,B/128,A/128]) f32
//   the recipe's 128x128-block quantiser of the expert weights (kernels/fp8_kernels.h).
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_fp8_quantize_blocks);
//   fp8_quantize_rows(a [T,C] bf16, index [R] s32) -> values [R,C] f8e4m3fn, scales [R,C/128] f32
//   rows a[index[r]] (zero outside [0, T)) in 1x128 tiles.
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_fp8_quantize_rows);
//   fp8_swiglu_rows(gate_up [R,2I] bf16, offsets [E+1] s32) -> values [R,I] f8e4m3fn, scales [R,I/128] f32
//   h = bf16(SwiGLU(gate_up)) in 1x128 tiles, rows at or past offsets[E] zero.
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_fp8_swiglu_rows);
//   fp8_token_tiles(values [R,C] f8e4m3fn, scales [R,C/128] f32, row_factor [R] f32)
//                   -> out [C,R] f8e4m3fn, out_scales [R/128,C] f32
//   row_factor * dequantised values, requantised in 1x128 tiles along the rows, transposed.
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_fp8_token_tiles);
//   fp8_swiglu_grad_rows(gate_up [R,2I] bf16, g [R,I] f32, row_weight [R] f32, offsets [E+1] s32)
//                        -> values [R,2I] f8e4m3fn, scales [R,2I/128] f32
//   dz = SwiGLU'(gate_up) applied to row_weight * g, in 1x128 tiles, rows at or past offsets[E] zero.
XLA_FFI_DECLARE_HANDLER_SYMBOL(jmm_cuda_fp8_swiglu_grad_rows);
#endif
