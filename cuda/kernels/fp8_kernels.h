// Host entry points of the CUDA kernels of the "fp8_blockwise" recipe (jax_megamoe/ops/fp8.py): nothing here
// depends on XLA; conventions as in moe_kernels.h (work only enqueued on `stream`, temporaries from `Scratch`).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe_kernels.h"

namespace jmm::cuda::cutlass_gemm {

// The element type of d: bf16, or float32 (gradients kept at the accumulator's precision, float32 master weights).
enum class Fp8Out { kBf16, kFloat32 };

// What one Fp8RowsGemm or Fp8WeightGemm takes from Scratch at most (group arrays and CUTLASS's workspace).
size_t Fp8GroupedGemmScratchBytes(int64_t num_experts);

// d[rows of e] ([rows, n] row-major, d_type) = (a * sfa)[rows of e] @ (b_e * sfb_e)^T for every expert e, rows of e
// being [offsets[e], offsets[e + 1]). a: e4m3 [rows, k] row-major; sfa: float32 [rows, k / 128] row-major (1x128
// tiles); b: e4m3 [E, n, k] row-major; sfb: float32 [E, n / 128, k / 128] row-major (128x128 blocks). n and k
// multiples of 128.
Status Fp8RowsGemm(const void* a, const float* sfa, const void* b, const float* sfb, void* d, Fp8Out d_type,
                   const int32_t* offsets, int64_t num_experts, int64_t n, int64_t k, const Scratch& scratch,
                   cudaStream_t stream);

// d_e ([m, n] row-major, d [E, m, n], d_type) = (a_e * sfa_e) @ (b_e * sfb_e)^T for every expert e, contracting over
// its padded token range [token_offsets[e], token_offsets[e + 1]) (each a multiple of 128, token_offsets[E] at most
// tokens, the columns past it unread): a e4m3 [m, tokens] and b e4m3 [n, tokens] row-major (the transposed,
// token-contiguous operands); scales float32 sfa [tokens/128, m] and sfb [tokens/128, n] row-major, the scale of a[i,
// 128 t .. 128 t + 127] at sfa[t, i] (1x128 tiles along the tokens, counted from each expert's first row). Experts
// without tokens get zeros. m, n multiples of 128.
Status Fp8WeightGemm(const void* a, const float* sfa, const void* b, const float* sfb, void* d, Fp8Out d_type,
                     const int32_t* token_offsets, int64_t num_experts, int64_t m, int64_t n, int64_t tokens,
                     const Scratch& scratch, cudaStream_t stream);

}  // namespace jmm::cuda::cutlass_gemm

namespace jmm::cuda {

// The weights w [experts, rows, cols] (bf16, or float32 with w_float32) quantised in 128x128 blocks by the recipe's
// rule: values e4m3 [experts, rows, cols], or [experts, cols, rows] with `transpose`, and scales float32
// [experts, rows/128, cols/128] (transposed likewise). rows and cols multiples of 128.
Status QuantizeWeightBlocks(const void* w, bool w_float32, int64_t experts, int64_t rows, int64_t cols, bool transpose,
                            void* values, float* scales, cudaStream_t stream);

// Rows of bf16 a [src_rows, cols] gathered by index [rows] (row r is a[index[r]], a zero row for an index outside
// [0, src_rows)) and quantised in 1x128 tiles: values e4m3 [rows, cols], scales float32 [rows, cols / 128]. cols a
// multiple of 128.
Status QuantizeRows(const void* a, int64_t src_rows, const int32_t* index, int64_t rows, int64_t cols, void* values,
                    float* scales, cudaStream_t stream);

// h = SwiGLU(gate_up [rows, 2 * inter] bf16) rounded to bf16 (device_math.cuh's Swiglu, as the bf16 path's), rows at
// or past *rows_used (a device scalar) zero, quantised in 1x128 tiles: values e4m3 [rows, inter], scales float32
// [rows, inter / 128]. inter a multiple of 128.
Status SwigluQuantizeRows(const void* gate_up, const int32_t* rows_used, int64_t rows, int64_t inter, void* values,
                          float* scales, cudaStream_t stream);

// dz = SwiGLU'(gate_up [rows, 2 * inter] bf16) applied to dh = row_weight[r] * g[r] (g float32 [rows, inter]) in
// float32 (device_math.cuh's SwigluGateGrad / SwigluUpGrad), rows at or past *rows_used zero, quantised in 1x128
// tiles: values e4m3 [rows, 2 * inter], scales float32 [rows, 2 * inter / 128]. inter a multiple of 128.
Status SwigluGradQuantizeRows(const void* gate_up, const float* g, const float* row_weight, const int32_t* rows_used,
                              int64_t rows, int64_t inter, void* values, float* scales, cudaStream_t stream);

// The weight-gradient GEMMs' operand from a row operand (values e4m3 [rows, cols], scales float32 [rows, cols/128]):
// d = row_factor[r] * (values * scale) in float32 (row_factor may be null: 1), requantised in 1x128 tiles along the
// rows: out e4m3 [cols, rows] (transposed), out_scales float32 [rows/128, cols]. rows and cols multiples of 128.
Status RequantizeTokenTiles(const void* values, const float* scales, const float* row_factor, int64_t rows,
                            int64_t cols, void* out, float* out_scales, cudaStream_t stream);

}  // namespace jmm::cuda
