// What the arrival-gated GEMM's check and benchmark programs share: the kernel type (the MoE row GEMMs' default
// tiles, 128 x 256 x 64 cooperative without a cluster, with the gated mainloop), the ptr-array arguments of one
// grouped problem and the copy loop of their copy kernels. Not part of the library.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/grouped_gemm_cutlass.cuh"
#include "nvlink/arrival_mainloop_sm90.hpp"
#include "nvlink/bounded_wait.cuh"
#include "test_util.cuh"

namespace arrival_test {

using namespace test_util;

namespace cg = jmm::cuda::cutlass_gemm;

using Tiles = cg::TilesCooperative128x256Cluster1;
using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, cutlass::layout::RowMajor*, cg::kAlignment, Bf16,
    cutlass::layout::RowMajor*, cg::kAlignment, float, Tiles::TileShape, Tiles::ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<Tiles::kEpilogueSmemBytes>, Tiles::KernelSchedule>::CollectiveOp;
using Mainloop = cg::ArrivalGatedMainloop<BaseMainloop>;
using Kernel = cutlass::gemm::kernel::GemmUniversal<cg::ProblemShape, Mainloop, Tiles::CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using StrideA = Kernel::InternalStrideA;
using StrideB = Kernel::InternalStrideB;
using StrideD = Kernel::InternalStrideD;

// Group g computes d[first[g] .. + rows[g]) = a[first[g] .. + rows[g]) @ b[expert[g]] with a [*, k], b [E, k, n],
// d [*, n] row-major.
struct GroupedProblem {
  std::vector<int> first, rows, expert;
  int k = 0, n = 0;
};

// Arguments of one gated grouped GEMM over `problem`; the device arrays stay allocated (these are test programs).
inline Gemm::Arguments MakeArguments(const GroupedProblem& problem, const Bf16* a, const Bf16* b, Bf16* d,
                                     const cg::GroupArrival& arrival, int sm_count) {
  const int groups = static_cast<int>(problem.rows.size());
  std::vector<cg::GroupShape> shapes(groups);
  std::vector<const Bf16*> ptr_a(groups), ptr_b(groups);
  std::vector<Bf16*> ptr_d(groups);
  for (int g = 0; g < groups; ++g) {
    shapes[g] = cg::GroupShape{problem.rows[g], problem.n, problem.k};
    ptr_a[g] = a + int64_t(problem.first[g]) * problem.k;
    ptr_b[g] = b + int64_t(problem.expert[g]) * problem.k * problem.n;
    ptr_d[g] = d + int64_t(problem.first[g]) * problem.n;
  }
  cutlass::KernelHardwareInfo hw_info;
  CHECK_CUDA(cudaGetDevice(&hw_info.device_id));
  hw_info.sm_count = sm_count;
  Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                       {groups, Upload(shapes), nullptr},  // shapes on the device only, as in the library
                       {{Upload(ptr_a), Upload(std::vector<StrideA>(groups, cg::LeadingStride<StrideA>(problem.k))),
                         Upload(ptr_b), Upload(std::vector<StrideB>(groups, cg::LeadingStride<StrideB>(problem.n)))},
                        arrival},
                       {{},
                        nullptr,
                        nullptr,
                        Upload(ptr_d),
                        Upload(std::vector<StrideD>(groups, cg::LeadingStride<StrideD>(problem.n)))},
                       hw_info};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

// dst[i] = src[source_index(i)] for i in [begin, end) step `step`, each thread keeping kLoadsInFlight 16-byte loads
// in flight before it stores: a copy on a few SMs is bound by bytes in flight per SM, not by instructions.
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

__global__ void RecordTime(uint64_t* out) { *out = jmm::nvlink::GlobalTimerNs(); }

}  // namespace arrival_test
