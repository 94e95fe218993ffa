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

// Four values, the first in the lowest byte, two per conversion; saturating to the largest finite e4m3 value is the
// rule's clip to +-448 (the same bytes as ToE4m3's, measured on q30's operands).
__device__ __forceinline__ uint32_t ToE4m3x4(float a, float b, float c, float d, float scale) {
  const uint32_t lo =
      __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(a, scale), __fdiv_rn(b, scale)), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi =
      __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(c, scale), __fdiv_rn(d, scale)), __NV_SATFINITE, __NV_E4M3);
  return lo | hi << 16;
}

// The max over each group of kLanes consecutive lanes (a power of two dividing 32), in every lane of the group.
template <int kLanes = 32>
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
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

// --- 1x128 row tiles: a half-warp per tile, 8 consecutive elements a lane, two tiles a warp. An Op loads a lane's
// inputs for row r, columns c..c+7 (`Load`) and makes its 8 values from them (`Compute`). One tile pair per warp
// beat two or four with their loads issued together (the Ops' registers then cap the warps resident; measured).
constexpr int kRowThreads = 256;
constexpr int kPerLane = 8;
constexpr int kLanesPerTile = kBlock / kPerLane;  // 16
constexpr int kTilesPerCta = kRowThreads / kLanesPerTile;

template <class Op>
__global__ void __launch_bounds__(kRowThreads)
    RowTilesKernel(Op op, int64_t tiles, int64_t tiles_per_row, __nv_fp8_storage_t* __restrict__ values,
                   float* __restrict__ scales) {
  const int64_t tile = (int64_t{blockIdx.x} * kRowThreads + threadIdx.x) / kLanesPerTile;
  const int64_t r = tile / tiles_per_row,
                c = (tile % tiles_per_row) * kBlock + (threadIdx.x % kLanesPerTile) * kPerLane;
  float v[kPerLane];
  op.Compute(tile < tiles ? op.Load(r, c) : typename Op::Loaded{}, v);
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) amax = fmaxf(amax, fabsf(v[j]));
  amax = WarpMax<kLanesPerTile>(amax);
  if (tile >= tiles) return;  // after the shuffles, which every lane takes part in
  const float scale = Fp8Scale(amax);
  Vec<__nv_fp8_storage_t, kPerLane> out;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) out.v[j] = ToE4m3(v[j], scale);
  *reinterpret_cast<Vec<__nv_fp8_storage_t, kPerLane>*>(values + r * tiles_per_row * kBlock + c) = out;
  if (threadIdx.x % kLanesPerTile == 0) scales[tile] = scale;
}

using Bf16x8 = Vec<__nv_bfloat16, kPerLane>;

// Row r is a[index[r]] (a zero row for an index outside [0, src_rows)).
struct IndexedRows {
  const __nv_bfloat16* a;
  int64_t src_rows, cols;
  const int32_t* index;
  struct Loaded {
    Bf16x8 a;
  };
  __device__ Loaded Load(int64_t r, int64_t c) const {
    const int64_t src = index[r];
    Loaded in = {};
    if (src >= 0 && src < src_rows) in.a = *reinterpret_cast<const Bf16x8*>(a + src * cols + c);
    return in;
  }
  __device__ void Compute(const Loaded& in, float (&v)[kPerLane]) const {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) v[j] = ToFloat(in.a.v[j]);
  }
};

// h = bf16(SwiGLU(gate_up[r, c..], gate_up[r, I + c..])); rows at or past *rows_used are zero.
struct SwigluRows {
  const __nv_bfloat16* gate_up;
  const int32_t* rows_used;
  int64_t inter;
  struct Loaded {
    Bf16x8 gate, up;
  };
  __device__ Loaded Load(int64_t r, int64_t c) const {
    Loaded in = {};
    if (r < *rows_used) {
      const __nv_bfloat16* row = gate_up + r * 2 * inter + c;
      in.gate = *reinterpret_cast<const Bf16x8*>(row);
      in.up = *reinterpret_cast<const Bf16x8*>(row + inter);
    }
    return in;
  }
  __device__ void Compute(const Loaded& in, float (&v)[kPerLane]) const {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) v[j] = Round<__nv_bfloat16>(Swiglu(ToFloat(in.gate.v[j]), ToFloat(in.up.v[j])));
  }
};

// dz [rows, 2I]: columns c < I are the gate half's, the rest the up half's (I a multiple of 128, so no tile
// straddles them); dz = SwiGLU'(gate_up[r]) applied to dh = row_weight[r] * g[r] in float32; rows at or past
// *rows_used are zero.
struct SwigluGradRows {
  const __nv_bfloat16* gate_up;
  const float* g;
  const float* row_weight;
  const int32_t* rows_used;
  int64_t inter;
  struct Loaded {
    Bf16x8 gate, up;
    Vec<float, kPerLane> g;
    float weight;
    bool gate_half;
  };
  __device__ Loaded Load(int64_t r, int64_t c) const {
    Loaded in = {};
    in.gate_half = c < inter;
    const int64_t col = in.gate_half ? c : c - inter;
    if (r < *rows_used) {
      const __nv_bfloat16* row = gate_up + r * 2 * inter;
      in.gate = *reinterpret_cast<const Bf16x8*>(row + col);
      if (in.gate_half) in.up = *reinterpret_cast<const Bf16x8*>(row + inter + col);
      in.g = *reinterpret_cast<const Vec<float, kPerLane>*>(g + r * inter + col);
      in.weight = row_weight[r];
    }
    return in;
  }
  __device__ void Compute(const Loaded& in, float (&v)[kPerLane]) const {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const float dh = in.weight * in.g.v[j], gate = ToFloat(in.gate.v[j]);
      v[j] = in.gate_half ? SwigluGateGrad(gate, ToFloat(in.up.v[j]), dh) : SwigluUpGrad(gate, dh);
    }
  }
};

// --- Token tiles: one CTA per 128x128 tile (blockIdx.x: column tile, y: row tile). Thread t reads rows
// 4q .. 4q+3 (q = t / 8) of columns 16k .. 16k+15 (k = t % 8) with four 16-byte loads, so the four bytes of a column
// that it writes to the transposed tile are one word. The tile's words are swizzled (row quad q of column c at
// q ^ 4 (c / 16 % 8)): both the word stores and the 16-byte reads of the transposed rows touch 32 banks.
constexpr int kTokenThreads = 256;
constexpr int kTokenCols = 16;  // per thread
constexpr int kTokenRows = 4;   // per thread
static_assert(kTokenRows == 4, "a column's rows are one ToE4m3x4 word");

__device__ __forceinline__ int TileWord(int quad, int col) { return quad ^ (4 * (col / kTokenCols % 8)); }

__global__ void __launch_bounds__(kTokenThreads, 3)
    RequantizeTokenTilesKernel(const __nv_fp8_storage_t* __restrict__ values, const float* __restrict__ scales,
                               const float* __restrict__ row_factor, int64_t rows, int64_t cols,
                               __nv_fp8_storage_t* __restrict__ out, float* __restrict__ out_scales) {
  __shared__ float warp_amax[kTokenThreads / 32][kBlock];
  __shared__ uint32_t tile[kBlock][kBlock / 4];  // [column][row quad]
  const int64_t r0 = int64_t{blockIdx.y} * kBlock, c0 = int64_t{blockIdx.x} * kBlock;
  const int lane = threadIdx.x % 32, quad = threadIdx.x / 8, col = (threadIdx.x % 8) * kTokenCols;
  Vec<__nv_fp8_storage_t, kTokenCols> raw[kTokenRows];
  float row_scale[kTokenRows], factor[kTokenRows];
#pragma unroll
  for (int i = 0; i < kTokenRows; ++i) {
    const int64_t r = r0 + quad * kTokenRows + i;
    raw[i] = *reinterpret_cast<const Vec<__nv_fp8_storage_t, kTokenCols>*>(values + r * cols + c0 + col);
    row_scale[i] = scales[r * (cols / kBlock) + c0 / kBlock];
    factor[i] = row_factor != nullptr ? row_factor[r] : 1.0f;
  }
  // the row GEMM's dequantised value, as XLA's dequantize computes it, then the factor
  auto value = [&](int i, int j) {
    const float v = __half2float(__nv_cvt_fp8_to_halfraw(raw[i].v[j], __NV_E4M3)) * row_scale[i];
    return row_factor != nullptr ? factor[i] * v : v;
  };
  float amax[kTokenCols];
#pragma unroll
  for (int j = 0; j < kTokenCols; ++j) {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < kTokenRows; ++i) m = fmaxf(m, fabsf(value(i, j)));
    // the warp's four row quads of this column: lanes 8 apart
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
    amax[j] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
  }
  if (lane < 8) {
#pragma unroll
    for (int j = 0; j < kTokenCols; ++j) warp_amax[threadIdx.x / 32][col + j] = amax[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kTokenCols; ++j) {
    float m = 0.0f;
#pragma unroll
    for (int w = 0; w < kTokenThreads / 32; ++w) m = fmaxf(m, warp_amax[w][col + j]);
    const float scale = Fp8Scale(m);
    if (quad == 0) out_scales[int64_t{blockIdx.y} * cols + c0 + col + j] = scale;
    tile[col + j][TileWord(quad, col + j)] = ToE4m3x4(value(0, j), value(1, j), value(2, j), value(3, j), scale);
  }
  __syncthreads();
  // out [cols, rows]: row c0 + c of the output is the tile's column c; 16 bytes (four row quads) per thread and pass.
#pragma unroll
  for (int p = 0; p < kBlock * kBlock / 16 / kTokenThreads; ++p) {
    const int c = threadIdx.x / 8 + p * (kTokenThreads / 8), quads = (threadIdx.x % 8) * 4;
    const uint4 bytes = *reinterpret_cast<const uint4*>(&tile[c][TileWord(quads, c)]);
    *reinterpret_cast<uint4*>(out + (c0 + c) * rows + r0 + quads * kTokenRows) = bytes;
  }
}

template <class Op>
Status LaunchRowTiles(const char* name, const Op& op, int64_t rows, int64_t cols, void* values, float* scales,
                      cudaStream_t stream) {
  const int64_t tiles = rows * (cols / kBlock);
  if (tiles == 0) return {};
  const auto grid = static_cast<unsigned>((tiles + kTilesPerCta - 1) / kTilesPerCta);
  RowTilesKernel<<<grid, kRowThreads, 0, stream>>>(op, tiles, cols / kBlock, static_cast<__nv_fp8_storage_t*>(values),
                                                   scales);
  return LaunchStatus(name);
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
  const IndexedRows op{static_cast<const __nv_bfloat16*>(a), src_rows, cols, index};
  return LaunchRowTiles("QuantizeRows", op, rows, cols, values, scales, stream);
}

Status SwigluQuantizeRows(const void* gate_up, const int32_t* rows_used, int64_t rows, int64_t inter, void* values,
                          float* scales, cudaStream_t stream) {
  if (inter % kBlock != 0) return "SwigluQuantizeRows: I must be a multiple of 128";
  const SwigluRows op{static_cast<const __nv_bfloat16*>(gate_up), rows_used, inter};
  return LaunchRowTiles("SwigluQuantizeRows", op, rows, inter, values, scales, stream);
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
  const SwigluGradRows op{static_cast<const __nv_bfloat16*>(gate_up), g, row_weight, rows_used, inter};
  return LaunchRowTiles("SwigluGradQuantizeRows", op, rows, 2 * inter, values, scales, stream);
}

}  // namespace jmm::cuda
