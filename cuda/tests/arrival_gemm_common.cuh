// What the arrival-gated GEMM's check and benchmark programs share: the kernel type (the MoE row GEMMs' default
// tiles, 128 x 256 x 64 cooperative without a cluster, with the gated mainloop), error checking, uploads, the
// ptr-array arguments of one grouped problem, timing, fill patterns and the stream-write signal. Not part of the
// library.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
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

// Call first in main. With CUDA's default lazy module loading, the first launch of a kernel loads it, and that load
// waited for the kernels already running (05:49 UTC on an H200: the gated GEMM's launch waited out the 20 ms
// sender, so it never had to wait itself). Kernels meant to run side by side must be loaded before either starts.
inline void LoadModulesEagerly() { setenv("CUDA_MODULE_LOADING", "EAGER", 1); }

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

// Deterministic values in [-scale, scale) (for the benchmarks, where only the timing matters).
__global__ void FillPattern(Bf16* out, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    out[i] = Bf16(scale * (float(h & 0xFFFF) / 32768.0f - 1.0f));
  }
}

// n elements of FillPattern on the current device.
inline Bf16* DevicePattern(int64_t n, uint32_t seed, float scale) {
  Bf16* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, n * sizeof(Bf16)));
  FillPattern<<<1024, 256>>>(p, n, seed, scale);
  CHECK_CUDA(cudaGetLastError());
  return p;
}

// Median milliseconds of `body()` enqueued on `stream` between two events, over 20 runs after 3 warm-ups; each
// run is preceded (untimed) by `prepare()`.
template <class Prepare, class Body>
float MedianMs(cudaStream_t stream, Prepare prepare, Body body) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int it = 0; it < 23; ++it) {
    prepare();
    CHECK_CUDA(cudaEventRecord(start, stream));
    body();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    if (it >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// cuStreamWriteValue64 through the runtime's driver entry point, so that the programs need no -lcuda. Its default
// flags fence before the write: prior work on the stream is visible before the value.
using StreamWriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

inline StreamWriteValue64 LoadStreamWriteValue64() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) std::printf("no cuStreamWriteValue64\n"), std::exit(2);
  return reinterpret_cast<StreamWriteValue64>(fn);
}

__global__ void RecordTime(uint64_t* out) { *out = cg::detail::GlobalTimerNs(); }

}  // namespace arrival_test
