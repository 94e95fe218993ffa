// What the arrival-gated GEMM's check and benchmark programs share: the kernel type (the MoE row GEMMs' default
// tiles, 128 x 256 x 64 cooperative without a cluster, with the gated mainloop), error checking, uploads, and the
// ptr-array arguments of one grouped problem. Not part of the library.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "jmm/arrival_mainloop_sm90.hpp"
#include "jmm/grouped_gemm_cutlass_cuda.h"

namespace arrival_test {

namespace cg = jmm::cuda::cutlass_gemm;
using cg::Bf16;

using Tiles = cg::TilesCooperative128x256Cluster1;
using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, cutlass::layout::RowMajor*, cg::kAlignment, Bf16,
    cutlass::layout::RowMajor*, cg::kAlignment, float, Tiles::TileShape, Tiles::ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<Tiles::kEpilogueSmemBytes>,
    Tiles::KernelSchedule>::CollectiveOp;
using Mainloop = cg::ArrivalGatedMainloop<BaseMainloop>;
using Kernel = cutlass::gemm::kernel::GemmUniversal<cg::ProblemShape, Mainloop, Tiles::CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using StrideA = Kernel::InternalStrideA;
using StrideB = Kernel::InternalStrideB;
using StrideD = Kernel::InternalStrideD;

#define CHECK_CUDA(expr)                                                                                   \
  do {                                                                                                     \
    cudaError_t err_ = (expr);                                                                             \
    if (err_ != cudaSuccess) {                                                                             \
      std::printf("CUDA error %s at %s:%d: %s\n", #expr, __FILE__, __LINE__, cudaGetErrorString(err_));   \
      std::exit(2);                                                                                        \
    }                                                                                                      \
  } while (0)

template <class T>
T* Upload(const std::vector<T>& host) {
  T* dev = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, std::max<size_t>(host.size(), 1) * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return dev;
}

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
                       {{}, nullptr, nullptr, Upload(ptr_d),
                        Upload(std::vector<StrideD>(groups, cg::LeadingStride<StrideD>(problem.n)))},
                       hw_info};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

// Initialises `gemm` for `args` on `stream` (workspace allocated here); exits on failure.
inline void Initialise(Gemm& gemm, const Gemm::Arguments& args, cudaStream_t stream) {
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) std::printf("cannot implement\n"), std::exit(2);
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, std::max<size_t>(Gemm::get_workspace_size(args), 1)));
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) std::printf("init failed\n"), std::exit(2);
}

__global__ void RecordTime(uint64_t* out) { *out = cg::detail::GlobalTimerNs(); }

}  // namespace arrival_test
