// bf16 row-grouped GEMM for a few rows per expert (GemmTiles::kSmallRows), the decode-size path.
//
// With a handful of rows per expert the GEMM is bound by reading the touched experts' weights, and 128-row tensor-core
// tiles would be nearly all padding. Here each thread block owns one expert and a 128-column slice of its output: it
// streams that slice of B_e through shared memory (a cp.async pipeline of 64-deep stages) and multiplies it with the
// expert's rows, up to 64 at a time, on mma.sync m16n8k16 (bf16 operands, float32 accumulation); an expert with more
// rows streams its slice once per 64 rows. Blocks of empty experts exit at once. The blocks read disjoint slices, so
// every touched weight crosses DRAM once, spread over every SM.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/kernel_module.cuh"
#include "kernels/moe_kernels.h"

namespace jmm::cuda {
namespace {

using Bf16 = __nv_bfloat16;

constexpr int kRowsPerPass = 64;  // rows of one expert multiplied per pass over its weight slice
constexpr int kMTiles = kRowsPerPass / 16;
constexpr int kColumns = 128;  // output columns per block
constexpr int kDepth = 64;     // contraction per pipeline stage
constexpr int kStages = 4;
constexpr int kWarps = 4;  // warp w computes columns [32 w, 32 w + 32) of the block's slice
constexpr int kThreads = 32 * kWarps;
constexpr int kNTiles = kColumns / kWarps / 8;
constexpr int kChunk = 8;  // bf16 per 16-byte copy
constexpr int kAStage = kRowsPerPass * kDepth;
constexpr int kBStage = kDepth * kColumns;
constexpr int kStage = kAStage + kBStage;
constexpr size_t kSmemBytes = static_cast<size_t>(kStages) * kStage * sizeof(Bf16);

// Shared-memory tiles are rows of 16-byte chunks whose chunk index is XORed with the row's low 3 bits, so that the 8
// rows one ldmatrix phase reads at the same logical chunk sit in distinct banks.
__device__ __forceinline__ int Swizzled(int row, int chunk, int row_elems) {
  return row * row_elems + ((chunk ^ (row & 7)) * kChunk);
}

// 16 bytes from global to shared memory, or 16 zero bytes when !valid (nothing is read then).
__device__ __forceinline__ void CopyChunk(Bf16* smem, const Bf16* gmem, bool valid) {
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

template <bool kTransposed>
__device__ __forceinline__ void LoadMatrices(uint32_t (&r)[4], const Bf16* smem) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if constexpr (kTransposed) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
}

__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One pipeline stage: the pass's rows (m_tiles * 16 of them, zero past `rows`) and the block's weight slice, both over
// contraction [k0, k0 + kDepth) (zero past k). B_e is [k, n] row-major, or [n, k] row-major when kBTransposed; the
// shared B tile keeps the global layout: [kDepth][kColumns], or [kColumns][kDepth].
template <bool kBTransposed>
__device__ __forceinline__ void LoadStage(Bf16* sa, Bf16* sb, const Bf16* a_rows, int rows, int m_tiles, const Bf16* be,
                                          int64_t n, int64_t k, int64_t col0, int64_t k0) {
  constexpr int kAChunks = kDepth / kChunk;
  for (int i = threadIdx.x; i < m_tiles * 16 * kAChunks; i += kThreads) {
    const int r = i / kAChunks, c = i % kAChunks;
    const int64_t kc = k0 + c * kChunk;
    const bool valid = r < rows && kc < k;
    CopyChunk(sa + Swizzled(r, c, kDepth), valid ? a_rows + r * k + kc : a_rows, valid);
  }
  if constexpr (kBTransposed) {
    for (int i = threadIdx.x; i < kColumns * kAChunks; i += kThreads) {
      const int nr = i / kAChunks, c = i % kAChunks;
      const int64_t col = col0 + nr, kc = k0 + c * kChunk;
      const bool valid = col < n && kc < k;
      CopyChunk(sb + Swizzled(nr, c, kDepth), valid ? be + col * k + kc : be, valid);
    }
  } else {
    constexpr int kBChunks = kColumns / kChunk;
    for (int i = threadIdx.x; i < kDepth * kBChunks; i += kThreads) {
      const int kr = i / kBChunks, c = i % kBChunks;
      const int64_t kc = k0 + kr, col = col0 + c * kChunk;
      const bool valid = kc < k && col < n;
      CopyChunk(sb + Swizzled(kr, c, kColumns), valid ? be + kc * n + col : be, valid);
    }
  }
}

// blockIdx.x: the expert; blockIdx.y: the 128-column slice. d[rows of e] = a[rows of e] @ B_e.
template <bool kBTransposed>
__global__ void __launch_bounds__(kThreads)
    SmallRowsGemmKernel(const Bf16* a, const Bf16* b, Bf16* d, const int32_t* offsets, int64_t n, int64_t k) {
  const int e = blockIdx.x;
  const int64_t first = offsets[e];
  const int expert_rows = offsets[e + 1] - offsets[e];
  if (expert_rows <= 0) return;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  Bf16* smem = reinterpret_cast<Bf16*>(smem_bytes);
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kColumns;
  const Bf16* be = b + static_cast<int64_t>(e) * k * n;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k_tiles = static_cast<int>((k + kDepth - 1) / kDepth);

  for (int pass0 = 0; pass0 < expert_rows; pass0 += kRowsPerPass) {
    const int rows = min(kRowsPerPass, expert_rows - pass0);
    const int m_tiles = (rows + 15) / 16;
    const Bf16* a_rows = a + (first + pass0) * k;
    float acc[kMTiles][kNTiles][4] = {};

    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) {
        Bf16* sa = smem + s * kStage;
        LoadStage<kBTransposed>(sa, sa + kAStage, a_rows, rows, m_tiles, be, n, k, col0,
                                static_cast<int64_t>(s) * kDepth);
      }
      CommitCopies();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      WaitCopies<kStages - 2>();  // stage kt has landed (this thread's copies) ...
      __syncthreads();            // ... every thread's, and stage kt - 1 is free to refill
      if (const int next = kt + kStages - 1; next < k_tiles) {
        Bf16* sa = smem + (next % kStages) * kStage;
        LoadStage<kBTransposed>(sa, sa + kAStage, a_rows, rows, m_tiles, be, n, k, col0,
                                static_cast<int64_t>(next) * kDepth);
      }
      CommitCopies();
      const Bf16* sa = smem + (kt % kStages) * kStage;
      const Bf16* sb = sa + kAStage;
#pragma unroll
      for (int kk = 0; kk < kDepth / 16; ++kk) {
        uint32_t bf[kNTiles][2];
#pragma unroll
        for (int p = 0; p < kNTiles / 2; ++p) {  // n tiles 2p and 2p + 1: 16 columns
          const int ncol = warp * (kColumns / kWarps) + p * 16;
          uint32_t r[4];
          if constexpr (kBTransposed) {
            const int nr = ncol + (lane % 8) + 8 * (lane / 16);
            LoadMatrices<false>(r, sb + Swizzled(nr, kk * 2 + (lane / 8) % 2, kDepth));
          } else {
            const int kr = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
            LoadMatrices<true>(r, sb + Swizzled(kr, ncol / kChunk + lane / 16, kColumns));
          }
          bf[2 * p][0] = r[0];
          bf[2 * p][1] = r[1];
          bf[2 * p + 1][0] = r[2];
          bf[2 * p + 1][1] = r[3];
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          if (mt < m_tiles) {
            uint32_t af[4];
            const int row = mt * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
            LoadMatrices<false>(af, sa + Swizzled(row, kk * 2 + lane / 16, kDepth));
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) Mma(acc[mt][nt], af, bf[nt]);
          }
        }
      }
    }
    WaitCopies<0>();
    __syncthreads();  // the next pass refills every stage

    Bf16* d_rows = d + (first + pass0) * n;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if (mt >= m_tiles) continue;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int64_t col = col0 + warp * (kColumns / kWarps) + nt * 8 + 2 * (lane % 4);
        if (col >= n) continue;  // n is a multiple of 8, so col + 1 < n too
        const int row = mt * 16 + lane / 4;
        if (row < rows) {
          *reinterpret_cast<__nv_bfloat162*>(d_rows + row * n + col) =
              __floats2bfloat162_rn(acc[mt][nt][0], acc[mt][nt][1]);
        }
        if (row + 8 < rows) {
          *reinterpret_cast<__nv_bfloat162*>(d_rows + (row + 8) * n + col) =
              __floats2bfloat162_rn(acc[mt][nt][2], acc[mt][nt][3]);
        }
      }
    }
  }
}

template <bool kBTransposed>
Status Launch(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts, int64_t n, int64_t k,
              cudaStream_t stream) {
  const auto kernel = SmallRowsGemmKernel<kBTransposed>;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      err != cudaSuccess) {
    return std::string("small-row grouped GEMM shared memory: ") + cudaGetErrorString(err);
  }
  const dim3 grid(static_cast<unsigned>(num_experts), static_cast<unsigned>((n + kColumns - 1) / kColumns));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(static_cast<const Bf16*>(a), static_cast<const Bf16*>(b),
                                                 static_cast<Bf16*>(d), offsets, n, k);
  return LaunchStatus("small-row grouped GEMM");
}

}  // namespace

Status SmallRowsGemm(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts, int64_t n,
                     int64_t k, bool b_transposed, cudaStream_t stream) {
  if (num_experts == 0) return {};
  if ((n + kColumns - 1) / kColumns > 65535) return "small-row grouped GEMM: more than 65535 column slices";
  return b_transposed ? Launch<true>(a, b, d, offsets, num_experts, n, k, stream)
                      : Launch<false>(a, b, d, offsets, num_experts, n, k, stream);
}

}  // namespace jmm::cuda
