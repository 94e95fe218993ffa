// The "fp8_blockwise" recipe's weight quantiser (jax_megamoe/ops/fp8.py, the rule): each expert's [rows, cols]
// matrix in 128x128 blocks, scale = amax / 448 (1 for an all-zero block), values = RNE(clip(w / scale, +-448)) in
// e4m3, written in the layout the rows GEMM takes as its K-major operand: as it is, or transposed. One pass over the
// weights (XLA's reduction over a block's two axes, then a transposing cast, took several).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/device_math.cuh"
#include "kernels/fp8_kernels.h"
#include "kernels/kernel_module.cuh"

namespace jmm::cuda {
namespace {

constexpr int kBlock = 128;
constexpr int kThreads = 256;
constexpr int kColsPerThread = 8;                        // one 16-byte bf16 load (two float32 loads)
constexpr int kThreadsPerRow = kBlock / kColsPerThread;  // 16
constexpr int kRowsPerPass = kThreads / kThreadsPerRow;  // 16
constexpr int kPasses = kBlock / kRowsPerPass;           // 8
constexpr float kFp8Max = 448.0f;

// One CTA per block (blockIdx.x: block column, y: block row, z: expert).
template <class T>
__global__ void __launch_bounds__(kThreads)
    QuantizeBlocksKernel(const T* __restrict__ w, int64_t rows, int64_t cols, bool transpose,
                         __nv_fp8_storage_t* __restrict__ values, float* __restrict__ scales) {
  __shared__ float warp_amax[kThreads / 32];
  __shared__ float block_scale;
  __shared__ __nv_fp8_storage_t tile[kBlock][kBlock + 1];  // an odd row stride: the transposed reads spread over banks
  const int64_t e = blockIdx.z, r0 = int64_t{blockIdx.y} * kBlock, c0 = int64_t{blockIdx.x} * kBlock;
  const int col = (threadIdx.x % kThreadsPerRow) * kColsPerThread, row = threadIdx.x / kThreadsPerRow;
  const T* base = w + (e * rows + r0) * cols + c0;

  float v[kPasses][kColsPerThread];
  float amax = 0.0f;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const T* src = base + (row + p * kRowsPerPass) * cols + col;
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
      v[p][j] = ToFloat(src[j]);
      amax = fmaxf(amax, fabsf(v[p][j]));
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.0f;
    for (int i = 0; i < kThreads / 32; ++i) m = fmaxf(m, warp_amax[i]);
    const float scale = m > 0.0f ? __fdiv_rn(m, kFp8Max) : 1.0f;
    block_scale = scale;
    const int64_t br = blockIdx.y, bc = blockIdx.x, nbr = rows / kBlock, nbc = cols / kBlock;
    scales[transpose ? (e * nbc + bc) * nbr + br : (e * nbr + br) * nbc + bc] = scale;
  }
  __syncthreads();
  const float scale = block_scale;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
      const float q = fminf(fmaxf(__fdiv_rn(v[p][j], scale), -kFp8Max), kFp8Max);
      tile[row + p * kRowsPerPass][col + j] = __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
    }
  }
  __syncthreads();
  // Out: 8 consecutive bytes per thread and pass, of the block as it is or transposed.
  const int64_t out_cols = transpose ? rows : cols;
  __nv_fp8_storage_t* out = values + e * rows * cols + (transpose ? c0 * out_cols + r0 : r0 * out_cols + c0);
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int i = row + p * kRowsPerPass;
    alignas(8) __nv_fp8_storage_t bytes[kColsPerThread];
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) bytes[j] = transpose ? tile[col + j][i] : tile[i][col + j];
    *reinterpret_cast<uint2*>(out + i * out_cols + col) = *reinterpret_cast<const uint2*>(bytes);
  }
}

}  // namespace

Status QuantizeWeightBlocks(const void* w, bool w_float32, int64_t experts, int64_t rows, int64_t cols, bool transpose,
                            void* values, float* scales, cudaStream_t stream) {
  if (rows % kBlock != 0 || cols % kBlock != 0) return "QuantizeWeightBlocks: rows and cols must be multiples of 128";
  if (experts == 0 || rows == 0 || cols == 0) return {};
  if (experts > 65535 || rows / kBlock > 65535) return "QuantizeWeightBlocks: too many experts or block rows";
  const dim3 grid(static_cast<unsigned>(cols / kBlock), static_cast<unsigned>(rows / kBlock),
                  static_cast<unsigned>(experts));
  auto* out = static_cast<__nv_fp8_storage_t*>(values);
  if (w_float32) {
    QuantizeBlocksKernel<<<grid, kThreads, 0, stream>>>(static_cast<const float*>(w), rows, cols, transpose, out,
                                                        scales);
  } else {
    QuantizeBlocksKernel<<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(w), rows, cols, transpose,
                                                        out, scales);
  }
  return LaunchStatus("QuantizeWeightBlocks");
}

}  // namespace jmm::cuda
