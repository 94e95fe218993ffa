// The "fp8_blockwise" recipe's quantisers (jax_megamoe/ops/fp8.py, the rule): per tile or block
// scale = amax / 448 (1 for an all-zero one), values = RNE(clip(a / scale, +-448)) in e4m3, both divisions
// correctly rounded. Each writes its operand in the layout its GEMM takes, in one pass over its input:
//   QuantizeWeightBlocks  128x128 blocks of each expert's matrix, as it is or transposed
//   QuantizeRows          1x128 tiles of rows gathered by index (the tokens' rows in the padded row layout)
//   SwigluQuantizeRows    h = SwiGLU(gate, up) rounded to bf16, then its 1x128 tiles
//   SwigluGradQuantizeRows  dz = SwiGLU'(gate, up) applied to weight * g in float32, then its 1x128 tiles
//   RequantizeTokenTiles  a row operand's dequantised values (times a per-row factor) in 1x128 tiles along the
//                         rows, transposed: the weight-gradient GEMMs' operands
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/device_math.cuh"
#include "kernels/fp8_kernels.h"
#include "kernels/kernel_module.cuh"

namespace jmm::cuda {
namespace {

constexpr int kBlock = 128;
constexpr float kFp8Max = 448.0f;

__device__ __forceinline__ float Fp8Scale(float amax) { return amax > 0.0f ? __fdiv_rn(amax, kFp8Max) : 1.0f; }

__device__ __forceinline__ __nv_fp8_storage_t ToE4m3(float v, float scale) {
  const float q = fminf(fmaxf(__fdiv_rn(v, scale), -kFp8Max), kFp8Max);
  return __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// --- 128x128 weight blocks: one CTA per block (blockIdx.x: block column, y: block row, z: expert).
constexpr int kBlockThreads = 256;
constexpr int kColsPerThread = 8;                             // one vector access per row and pass
constexpr int kThreadsPerRow = kBlock / kColsPerThread;       // 16
constexpr int kRowsPerPass = kBlockThreads / kThreadsPerRow;  // 16
constexpr int kPasses = kBlock / kRowsPerPass;                // 8

template <class T>
__global__ void __launch_bounds__(kBlockThreads)
    QuantizeBlocksKernel(const T* __restrict__ w, int64_t rows, int64_t cols, bool transpose,
                         __nv_fp8_storage_t* __restrict__ values, float* __restrict__ scales) {
  __shared__ float warp_amax[kBlockThreads / 32];
  __shared__ float block_scale;
  __shared__ __nv_fp8_storage_t tile[kBlock][kBlock + 1];  // an odd row stride: the transposed reads spread over banks
  const int64_t e = blockIdx.z, r0 = int64_t{blockIdx.y} * kBlock, c0 = int64_t{blockIdx.x} * kBlock;
  const int col = (threadIdx.x % kThreadsPerRow) * kColsPerThread, row = threadIdx.x / kThreadsPerRow;
  const T* base = w + (e * rows + r0) * cols + c0;

  // Every load issued before any is used: the pass is bound by how many bytes are in flight.
  Vec<T, kColsPerThread> v[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    v[p] = *reinterpret_cast<const Vec<T, kColsPerThread>*>(base + (row + p * kRowsPerPass) * cols + col);
  }
  float amax = 0.0f;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) amax = fmaxf(amax, fabsf(ToFloat(v[p].v[j])));
  }
  amax = WarpMax(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.0f;
    for (int i = 0; i < kBlockThreads / 32; ++i) m = fmaxf(m, warp_amax[i]);
    const float scale = Fp8Scale(m);
    block_scale = scale;
    const int64_t br = blockIdx.y, bc = blockIdx.x, nbr = rows / kBlock, nbc = cols / kBlock;
    scales[transpose ? (e * nbc + bc) * nbr + br : (e * nbr + br) * nbc + bc] = scale;
  }
  __syncthreads();
  const float scale = block_scale;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) tile[row + p * kRowsPerPass][col + j] = ToE4m3(ToFloat(v[p].v[j]), scale);
  }
  __syncthreads();
  // Out: 8 consecutive bytes per thread and pass, of the block as it is or transposed.
  const int64_t out_cols = transpose ? rows : cols;
  __nv_fp8_storage_t* out = values + e * rows * cols + (transpose ? c0 * out_cols + r0 : r0 * out_cols + c0);
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int i = row + p * kRowsPerPass;
    Vec<__nv_fp8_storage_t, kColsPerThread> bytes;
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) bytes.v[j] = transpose ? tile[col + j][i] : tile[i][col + j];
    *reinterpret_cast<Vec<__nv_fp8_storage_t, kColsPerThread>*>(out + i * out_cols + col) = bytes;
  }
}

// --- 1x128 row tiles: one warp per tile, 4 elements a lane.
constexpr int kRowThreads = 256;
constexpr int kTilesPerCta = kRowThreads / 32;
constexpr int kPerLane = kBlock / 32;

__device__ __forceinline__ void WriteTile(const float (&h)[kPerLane], int lane, __nv_fp8_storage_t* values,
                                          float* scale_out) {
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) amax = fmaxf(amax, fabsf(h[j]));
  const float scale = Fp8Scale(WarpMax(amax));
  Vec<__nv_fp8_storage_t, kPerLane> out;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) out.v[j] = ToE4m3(h[j], scale);
  *reinterpret_cast<Vec<__nv_fp8_storage_t, kPerLane>*>(values + lane * kPerLane) = out;
  if (lane == 0) *scale_out = scale;
}

// Tile (r, c) of the output: row r of a is a[index[r]] (a zero row for an index outside [0, src_rows)).
__global__ void __launch_bounds__(kRowThreads)
    QuantizeRowsKernel(const __nv_bfloat16* __restrict__ a, int64_t src_rows, const int32_t* __restrict__ index,
                       int64_t rows, int64_t cols, __nv_fp8_storage_t* __restrict__ values,
                       float* __restrict__ scales) {
  const int64_t tiles_per_row = cols / kBlock;
  const int64_t tile = int64_t{blockIdx.x} * kTilesPerCta + threadIdx.x / 32;
  if (tile >= rows * tiles_per_row) return;
  const int lane = threadIdx.x % 32;
  const int64_t r = tile / tiles_per_row, c = (tile % tiles_per_row) * kBlock;
  const int64_t src = index[r];
  float h[kPerLane] = {};
  if (src >= 0 && src < src_rows) {
    const auto in = *reinterpret_cast<const Vec<__nv_bfloat16, kPerLane>*>(a + src * cols + c + lane * kPerLane);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) h[j] = ToFloat(in.v[j]);
  }
  WriteTile(h, lane, values + r * cols + c, scales + tile);
}

// Tile (r, c) of h = bf16(SwiGLU(gate_up[r, c..], gate_up[r, I + c..])); rows at or past *rows_used are zero.
__global__ void __launch_bounds__(kRowThreads)
    SwigluQuantizeRowsKernel(const __nv_bfloat16* __restrict__ gate_up, const int32_t* __restrict__ rows_used,
                             int64_t rows, int64_t inter, __nv_fp8_storage_t* __restrict__ values,
                             float* __restrict__ scales) {
  const int64_t tiles_per_row = inter / kBlock;
  const int64_t tile = int64_t{blockIdx.x} * kTilesPerCta + threadIdx.x / 32;
  if (tile >= rows * tiles_per_row) return;
  const int lane = threadIdx.x % 32;
  const int64_t r = tile / tiles_per_row, c = (tile % tiles_per_row) * kBlock;
  float h[kPerLane] = {};
  if (r < *rows_used) {
    const __nv_bfloat16* gate_row = gate_up + r * 2 * inter + c + lane * kPerLane;
    const auto gate = *reinterpret_cast<const Vec<__nv_bfloat16, kPerLane>*>(gate_row);
    const auto up = *reinterpret_cast<const Vec<__nv_bfloat16, kPerLane>*>(gate_row + inter);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) h[j] = Round<__nv_bfloat16>(Swiglu(ToFloat(gate.v[j]), ToFloat(up.v[j])));
  }
  WriteTile(h, lane, values + r * inter + c, scales + tile);
}

// Tile (r, t) of dz [rows, 2 * inter]: tiles t < inter / 128 are the gate half's, the rest the up half's (inter a
// multiple of 128, so no tile straddles them); dz = SwiGLU'(gate_up[r]) applied to dh = row_weight[r] * g[r] in
// float32; rows at or past *rows_used are zero.
__global__ void __launch_bounds__(kRowThreads)
    SwigluGradQuantizeRowsKernel(const __nv_bfloat16* __restrict__ gate_up, const float* __restrict__ g,
                                 const float* __restrict__ row_weight, const int32_t* __restrict__ rows_used,
                                 int64_t rows, int64_t inter, __nv_fp8_storage_t* __restrict__ values,
                                 float* __restrict__ scales) {
  const int64_t tiles_per_row = 2 * inter / kBlock;
  const int64_t tile = int64_t{blockIdx.x} * kTilesPerCta + threadIdx.x / 32;
  if (tile >= rows * tiles_per_row) return;
  const int lane = threadIdx.x % 32;
  const int64_t r = tile / tiles_per_row, t = tile % tiles_per_row;
  const bool gate_half = t < tiles_per_row / 2;
  const int64_t c = (gate_half ? t : t - tiles_per_row / 2) * kBlock + lane * kPerLane;  // column within a half
  float dz[kPerLane] = {};
  if (r < *rows_used) {
    const __nv_bfloat16* row = gate_up + r * 2 * inter;
    const auto gate = *reinterpret_cast<const Vec<__nv_bfloat16, kPerLane>*>(row + c);
    const auto gr = *reinterpret_cast<const Vec<float, kPerLane>*>(g + r * inter + c);
    const float w = row_weight[r];
    if (gate_half) {
      const auto up = *reinterpret_cast<const Vec<__nv_bfloat16, kPerLane>*>(row + inter + c);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) dz[j] = SwigluGateGrad(ToFloat(gate.v[j]), ToFloat(up.v[j]), w * gr.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) dz[j] = SwigluUpGrad(ToFloat(gate.v[j]), w * gr.v[j]);
    }
  }
  WriteTile(dz, lane, values + r * 2 * inter + t * kBlock, scales + tile);
}

// --- Token tiles: one CTA per 128x128 tile (blockIdx.x: column tile, y: row tile), a column's 128 rows per thread
// pair: thread t handles column t % 128, rows (t / 128) * 64 .. + 63.
constexpr int kTokenThreads = 256;
constexpr int kRowsPerThread = kBlock * kBlock / kTokenThreads;  // 64

__global__ void __launch_bounds__(kTokenThreads)
    RequantizeTokenTilesKernel(const __nv_fp8_storage_t* __restrict__ values, const float* __restrict__ scales,
                               const float* __restrict__ row_factor, int64_t rows, int64_t cols,
                               __nv_fp8_storage_t* __restrict__ out, float* __restrict__ out_scales) {
  __shared__ float half_amax[2][kBlock];
  __shared__ __nv_fp8_storage_t tile[kBlock][kBlock + 4];  // [column][row]: written by column, read by row
  const int64_t r0 = int64_t{blockIdx.y} * kBlock, c0 = int64_t{blockIdx.x} * kBlock;
  const int col = threadIdx.x % kBlock, half = threadIdx.x / kBlock;
  const int64_t c = c0 + col;
  float d[kRowsPerThread];
  float amax = 0.0f;
#pragma unroll 8
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = r0 + half * kRowsPerThread + i;
    // the row GEMM's dequantised value, as XLA's dequantize computes it, then the factor
    float v = __half2float(__nv_cvt_fp8_to_halfraw(values[r * cols + c], __NV_E4M3)) *
              scales[r * (cols / kBlock) + c / kBlock];
    if (row_factor != nullptr) v = row_factor[r] * v;
    d[i] = v;
    amax = fmaxf(amax, fabsf(v));
  }
  half_amax[half][col] = amax;
  __syncthreads();
  const float scale = Fp8Scale(fmaxf(half_amax[0][col], half_amax[1][col]));
  if (half == 0) out_scales[int64_t{blockIdx.y} * cols + c] = scale;
#pragma unroll 8
  for (int i = 0; i < kRowsPerThread; ++i) tile[col][half * kRowsPerThread + i] = ToE4m3(d[i], scale);
  __syncthreads();
  // out [cols, rows]: row c0 + j of the output holds the tile's column j; 8 bytes per thread per step.
  for (int idx = threadIdx.x; idx < kBlock * kBlock / 8; idx += kTokenThreads) {
    const int j = idx / (kBlock / 8), k = (idx % (kBlock / 8)) * 8;
    Vec<__nv_fp8_storage_t, 8> bytes;
#pragma unroll
    for (int q = 0; q < 8; ++q) bytes.v[q] = tile[j][k + q];
    *reinterpret_cast<Vec<__nv_fp8_storage_t, 8>*>(out + (c0 + j) * rows + r0 + k) = bytes;
  }
}

unsigned RowGrid(int64_t tiles) { return static_cast<unsigned>((tiles + kTilesPerCta - 1) / kTilesPerCta); }

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
    QuantizeBlocksKernel<<<grid, kBlockThreads, 0, stream>>>(static_cast<const float*>(w), rows, cols, transpose, out,
                                                             scales);
  } else {
    QuantizeBlocksKernel<<<grid, kBlockThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(w), rows, cols,
                                                             transpose, out, scales);
  }
  return LaunchStatus("QuantizeWeightBlocks");
}

Status QuantizeRows(const void* a, int64_t src_rows, const int32_t* index, int64_t rows, int64_t cols, void* values,
                    float* scales, cudaStream_t stream) {
  if (cols % kBlock != 0) return "QuantizeRows: the row width must be a multiple of 128";
  const int64_t tiles = rows * (cols / kBlock);
  if (tiles == 0) return {};
  QuantizeRowsKernel<<<RowGrid(tiles), kRowThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(a), src_rows, index,
                                                                 rows, cols, static_cast<__nv_fp8_storage_t*>(values),
                                                                 scales);
  return LaunchStatus("QuantizeRows");
}

Status SwigluQuantizeRows(const void* gate_up, const int32_t* rows_used, int64_t rows, int64_t inter, void* values,
                          float* scales, cudaStream_t stream) {
  if (inter % kBlock != 0) return "SwigluQuantizeRows: I must be a multiple of 128";
  const int64_t tiles = rows * (inter / kBlock);
  if (tiles == 0) return {};
  SwigluQuantizeRowsKernel<<<RowGrid(tiles), kRowThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(gate_up), rows_used, rows, inter, static_cast<__nv_fp8_storage_t*>(values),
      scales);
  return LaunchStatus("SwigluQuantizeRows");
}

Status RequantizeTokenTiles(const void* values, const float* scales, const float* row_factor, int64_t rows,
                            int64_t cols, void* out, float* out_scales, cudaStream_t stream) {
  if (rows % kBlock != 0 || cols % kBlock != 0) return "RequantizeTokenTiles: rows and cols must be multiples of 128";
  if (rows == 0 || cols == 0) return {};
  if (rows / kBlock > 65535) return "RequantizeTokenTiles: too many row tiles";
  const dim3 grid(static_cast<unsigned>(cols / kBlock), static_cast<unsigned>(rows / kBlock));
  RequantizeTokenTilesKernel<<<grid, kTokenThreads, 0, stream>>>(static_cast<const __nv_fp8_storage_t*>(values), scales,
                                                                 row_factor, rows, cols,
                                                                 static_cast<__nv_fp8_storage_t*>(out), out_scales);
  return LaunchStatus("RequantizeTokenTiles");
}

Status SwigluGradQuantizeRows(const void* gate_up, const float* g, const float* row_weight, const int32_t* rows_used,
                              int64_t rows, int64_t inter, void* values, float* scales, cudaStream_t stream) {
  if (inter % kBlock != 0) return "SwigluGradQuantizeRows: I must be a multiple of 128";
  const int64_t tiles = rows * (2 * inter / kBlock);
  if (tiles == 0) return {};
  SwigluGradQuantizeRowsKernel<<<RowGrid(tiles), kRowThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(gate_up), g, row_weight, rows_used, rows, inter,
      static_cast<__nv_fp8_storage_t*>(values), scales);
  return LaunchStatus("SwigluGradQuantizeRows");
}

}  // namespace jmm::cuda
