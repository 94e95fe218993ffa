// The copy loop of kernels that move rows on a few SMs beside a GEMM (stage 2's side gather, and the arrival-gated
// GEMM's test senders in cuda/tests).
#pragma once

#include <cstdint>

namespace jmm::cuda {

// dst[i] = src[source_index(i)] for i in [begin, end) step `step`, each thread keeping kLoadsInFlight 16-byte loads
// in flight before it stores: a copy on a few SMs is bound by bytes in flight per SM, not by instructions (one load
// per thread moved 0.03 TB/s on 4 blocks, 2026-11-30, docs/nvlink_design.md).
template <class SourceIndex>
__device__ __forceinline__ void CopyChunks(const uint4* src, uint4* dst, int64_t begin, int64_t end, int64_t step,
                                           SourceIndex source_index) {
  constexpr int kLoadsInFlight = 8;
  for (int64_t i = begin; i < end; i += kLoadsInFlight * step) {
    uint4 v[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      if (i + u * step < end) v[u] = src[source_index(i + u * step)];
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      if (i + u * step < end) dst[i + u * step] = v[u];
    }
  }
}

}  // namespace jmm::cuda
