// Grouped GEMM entry points: CUTLASS tensor-core kernels for aligned bf16, an exact SIMT kernel otherwise
// (float32 inputs, or any H / I that is not a multiple of 8). The SIMT kernel accumulates in float32 with
// plain FMAs (no tf32), so float32 results match the CPU kernels to float32 rounding.
#include <cuda_bf16.h>

#include "kernels/device_math.cuh"
#include "kernels/kernel_module.cuh"
#include "kernels/moe_kernels.h"

namespace jmm::cuda {
namespace {

constexpr int kTile = 64;   // output tile edge
constexpr int kDepth = 16;  // contraction step held in shared memory
constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ void Store(T* p, float v) {
  *p = FromFloat<T>(v);
}

// Each thread owns a 4 x 4 block of the 64 x 64 tile: rows ty + 16*i, columns tx + 16*j.
struct TileAcc {
  float v[4][4] = {};

  __device__ void Accumulate(const float (&a)[kDepth][kTile + 1], const float (&b)[kDepth][kTile + 1], int ty, int tx) {
#pragma unroll
    for (int kk = 0; kk < kDepth; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = a[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = b[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) v[i][j] = fmaf(av[i], bv[j], v[i][j]);
    }
  }

  // Writes the tile to d (row-major, n columns), whose rows row0.. and columns col0.. it covers; rows at or
  // past row_end and columns at or past n are outside the output and skipped.
  template <typename T>
  __device__ void StoreTile(T* d, int64_t row0, int64_t row_end, int64_t col0, int64_t n, int ty, int tx) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = row0 + ty + 16 * i;
      if (row >= row_end) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t col = col0 + tx + 16 * j;
        if (col < n) Store(d + row * n + col, v[i][j]);
      }
    }
  }
};

// Row-grouped: blockIdx.x enumerates (expert, 64-row tile) pairs in expert order (extra blocks exit);
// blockIdx.y is the column tile.
template <typename T, bool kBTransposed>
__global__ void __launch_bounds__(kThreads)
    RowsGemmSimt(const T* a, const T* b, T* d, const int32_t* offsets, int num_experts, int64_t n, int64_t k) {
  __shared__ int tile_expert;
  __shared__ int64_t tile_row0, tile_row_end;
  if (threadIdx.x == 0) {
    int remaining = blockIdx.x;
    tile_expert = -1;
    for (int e = 0; e < num_experts; ++e) {
      const int rows = offsets[e + 1] - offsets[e];
      const int tiles = (rows + kTile - 1) / kTile;
      if (remaining < tiles) {
        tile_expert = e;
        tile_row0 = offsets[e] + static_cast<int64_t>(remaining) * kTile;
        tile_row_end = offsets[e + 1];
        break;
      }
      remaining -= tiles;
    }
  }
  __syncthreads();
  if (tile_expert < 0) return;
  const int e = tile_expert;
  const int64_t row0 = tile_row0, row_end = tile_row_end;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const T* be = b + static_cast<int64_t>(e) * k * n;

  __shared__ float as[kDepth][kTile + 1];
  __shared__ float bs[kDepth][kTile + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  TileAcc acc;
  for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
    for (int idx = threadIdx.x; idx < kDepth * kTile; idx += kThreads) {
      const int kk = idx % kDepth, mm = idx / kDepth;  // consecutive threads walk a's contiguous k
      const int64_t row = row0 + mm, kc = k0 + kk;
      as[kk][mm] = (row < row_end && kc < k) ? ToFloat(a[row * k + kc]) : 0.0f;
    }
    for (int idx = threadIdx.x; idx < kDepth * kTile; idx += kThreads) {
      int kk, nn;
      if (kBTransposed) {
        kk = idx % kDepth, nn = idx / kDepth;
      } else {
        nn = idx % kTile, kk = idx / kTile;
      }
      const int64_t kc = k0 + kk, col = col0 + nn;
      float v = 0.0f;
      if (kc < k && col < n) v = ToFloat(kBTransposed ? be[col * k + kc] : be[kc * n + col]);
      bs[kk][nn] = v;
    }
    __syncthreads();
    acc.Accumulate(as, bs, ty, tx);
    __syncthreads();
  }
  acc.StoreTile(d, row0, row_end, col0, n, ty, tx);
}

// Expert-grouped weight GEMM: blockIdx.z = expert, contraction over that expert's rows.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    WeightGemmSimt(const T* a, const T* b, T* d, const int32_t* offsets, int64_t m, int64_t n) {
  const int e = blockIdx.z;
  const int64_t first = offsets[e], last = offsets[e + 1];
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile, n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  __shared__ float as[kDepth][kTile + 1];
  __shared__ float bs[kDepth][kTile + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  TileAcc acc;
  for (int64_t r0 = first; r0 < last; r0 += kDepth) {
    for (int idx = threadIdx.x; idx < kDepth * kTile; idx += kThreads) {
      const int mm = idx % kTile, kk = idx / kTile;
      const int64_t r = r0 + kk;
      as[kk][mm] = (r < last && m0 + mm < m) ? ToFloat(a[r * m + m0 + mm]) : 0.0f;
      bs[kk][mm] = (r < last && n0 + mm < n) ? ToFloat(b[r * n + n0 + mm]) : 0.0f;
    }
    __syncthreads();
    acc.Accumulate(as, bs, ty, tx);
    __syncthreads();
  }
  acc.StoreTile(d + static_cast<int64_t>(e) * m * n, m0, m, n0, n, ty, tx);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T>
Status RowsGemmSimtLaunch(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts,
                          int64_t rows, int64_t n, int64_t k, bool b_transposed, cudaStream_t stream) {
  // Every expert wastes at most one partial tile, so rows/64 + E bounds the tile count.
  const dim3 grid(CeilDiv(rows, kTile) + num_experts, CeilDiv(n, kTile));
  const auto* ta = static_cast<const T*>(a);
  const auto* tb = static_cast<const T*>(b);
  auto* td = static_cast<T*>(d);
  if (b_transposed) {
    RowsGemmSimt<T, true><<<grid, kThreads, 0, stream>>>(ta, tb, td, offsets, num_experts, n, k);
  } else {
    RowsGemmSimt<T, false><<<grid, kThreads, 0, stream>>>(ta, tb, td, offsets, num_experts, n, k);
  }
  return LaunchStatus("SIMT row-grouped GEMM");
}

using CutlassRowsGemm = Status (*)(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts,
                                   int64_t n, int64_t k, const Scratch& scratch, cudaStream_t stream);

// The instantiation for (tiles, layout of B_e); null for a value that is not built.
CutlassRowsGemm FindRowsGemm(GemmTiles tiles, bool b_transposed) {
  switch (tiles) {
    case GemmTiles::kCooperative128x256:
      return b_transposed ? cutlass_gemm::RowsGemmNT : cutlass_gemm::RowsGemmNN;
    case GemmTiles::kSmallRows:
      break;  // not CUTLASS: RowsGemm launches SmallRowsGemm
  }
  return nullptr;
}

}  // namespace

size_t GroupedGemmScratchBytes(int64_t num_experts) {
  int device = 0, sm_count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  return ScratchFootprint(cutlass_gemm::GroupArraysBound(num_experts)) +
         ScratchFootprint(cutlass_gemm::CutlassWorkspaceBound(sm_count));
}

bool UseTensorCores(Dtype dtype, int64_t hidden, int64_t intermediate) {
  return dtype == Dtype::kBFloat16 && hidden % 8 == 0 && intermediate % 8 == 0;
}

Status RowsGemm(Dtype dtype, bool tensor_cores, const void* a, const void* b, void* d, const int32_t* expert_offsets,
                int64_t num_experts, int64_t rows, int64_t n, int64_t k, bool b_transposed, GemmTiles tiles,
                const Scratch& scratch, cudaStream_t stream) {
  if (rows == 0 || n == 0) return {};
  if (tensor_cores) {
    if (tiles == GemmTiles::kSmallRows) {
      return SmallRowsGemm(a, b, d, expert_offsets, num_experts, n, k, b_transposed, stream);
    }
    const CutlassRowsGemm gemm = FindRowsGemm(tiles, b_transposed);
    if (gemm == nullptr) return "GEMM tiles " + std::to_string(static_cast<int64_t>(tiles)) + " are not built";
    return gemm(a, b, d, expert_offsets, num_experts, n, k, scratch, stream);
  }
  if (dtype == Dtype::kBFloat16) {
    return RowsGemmSimtLaunch<__nv_bfloat16>(a, b, d, expert_offsets, num_experts, rows, n, k, b_transposed, stream);
  }
  return RowsGemmSimtLaunch<float>(a, b, d, expert_offsets, num_experts, rows, n, k, b_transposed, stream);
}

Status WeightGemm(Dtype dtype, bool tensor_cores, const void* a, const void* b, void* d, const int32_t* expert_offsets,
                  int64_t num_experts, int64_t rows, int64_t m, int64_t n, const Scratch& scratch,
                  cudaStream_t stream) {
  if (m == 0 || n == 0 || num_experts == 0) return {};
  if (tensor_cores) {
    if (Status s = cutlass_gemm::WeightGemmTN(a, b, d, expert_offsets, num_experts, m, n, scratch, stream);
        !s.empty()) {
      return s;
    }
    return ZeroEmptyExperts(dtype, expert_offsets, num_experts, m * n, d, stream);
  }
  const dim3 grid(CeilDiv(n, kTile), CeilDiv(m, kTile), num_experts);
  if (dtype == Dtype::kBFloat16) {
    WeightGemmSimt<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(a),
                                                                 static_cast<const __nv_bfloat16*>(b),
                                                                 static_cast<__nv_bfloat16*>(d), expert_offsets, m, n);
  } else {
    WeightGemmSimt<float><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(a), static_cast<const float*>(b),
                                                         static_cast<float*>(d), expert_offsets, m, n);
  }
  return LaunchStatus("SIMT weight GEMM");
}

}  // namespace jmm::cuda
