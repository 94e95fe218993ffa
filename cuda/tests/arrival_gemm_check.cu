// GPU check of the arrival-gated grouped GEMM (cuda/include/jmm/arrival_mainloop_sm90.hpp), built and run by
// tests/test_arrival_gemm_gpu.py.
//
// `arrival_gemm_check overlap`: G groups (experts x sources, expert-major, some empty), A rows of the "peer"
// groups poisoned with NaN. A sender kernel on a second stream, launched first, sleeps, then writes those rows and
// releases one counter per source; the gated GEMM on the main stream (one SM left to the sender) must wait for
// them: any tile that loaded A early carries NaN into D. D is compared with a float32 SIMT reference computed
// afterwards from the final A. Prints "overlap ok" and the GEMM's wait, or the first mismatch.
// `arrival_gemm_check timeout`: a counter that is never released must end the launch by a trap after the
// bounded wait, leaving the failure record (a peer group, its counter and target); exit code 3 means exactly that.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "jmm/arrival_mainloop_sm90.hpp"
#include "jmm/grouped_gemm_cutlass_cuda.h"

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

#define CHECK_CUDA(expr)                                                                    \
  do {                                                                                      \
    cudaError_t err_ = (expr);                                                              \
    if (err_ != cudaSuccess) {                                                              \
      std::printf("CUDA error %s at %s:%d: %s\n", #expr, __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

constexpr int kExperts = 5, kSources = 2, kGroups = kExperts * kSources;
constexpr int kK = 320, kN = 512;  // K: 5 k tiles of 64; N: 2 column tiles of 256

// Sleeps `delay_ns`, copies the peer rows into place, publishes them, releases every source's counter.
__global__ void DelayedSender(const Bf16* rows_src, Bf16* rows_dst, int64_t elements, uint64_t delay_ns,
                              uint64_t* counters, int sources) {
  const uint64_t start = cg::detail::GlobalTimerNs();
  while (cg::detail::GlobalTimerNs() - start < delay_ns) __nanosleep(1000);
  for (int64_t i = threadIdx.x; i < elements; i += blockDim.x) rows_dst[i] = rows_src[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < sources) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(counters + threadIdx.x), "l"(uint64_t{1}) : "memory");
  }
}

// d_ref[r, n] = sum_k a[r, k] * b_g[k, n] in float32, for the rows of each group.
__global__ void ReferenceGemm(const Bf16* a, const Bf16* b, const int* group_first_row, const int* group_rows,
                              float* d_ref) {
  const int g = blockIdx.y, e = g / kSources;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < group_rows[g] * kN; idx += gridDim.x * blockDim.x) {
    const int r = group_first_row[g] + idx / kN, n = idx % kN;
    float s = 0.0f;
    for (int k = 0; k < kK; ++k) {
      s += float(a[int64_t(r) * kK + k]) * float(b[(int64_t(e) * kK + k) * kN + n]);
    }
    d_ref[int64_t(r) * kN + n] = s;
  }
}

__global__ void Now(uint64_t* out) { *out = cg::detail::GlobalTimerNs(); }

int main(int argc, char** argv) {
  const bool timeout_mode = argc > 1 && std::strcmp(argv[1], "timeout") == 0;
  int device = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));

  // Group g = (expert g / kSources, source g % kSources), expert-major; source 0 is local, source 1 a peer.
  const int rows_of[kGroups] = {130, 7, 0, 256, 1, 0, 64, 300, 129, 128};
  std::vector<int> first(kGroups), rows(rows_of, rows_of + kGroups);
  int total_rows = 0;
  for (int g = 0; g < kGroups; ++g) first[g] = total_rows, total_rows += rows[g];

  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<Bf16> a_true(size_t(total_rows) * kK), a_start(a_true.size()), b(size_t(kExperts) * kK * kN);
  for (auto& v : a_true) v = Bf16(normal(rng));
  for (auto& v : b) v = Bf16(normal(rng) / std::sqrt(float(kK)));
  for (int g = 0; g < kGroups; ++g) {
    const bool peer = g % kSources == 1;
    for (int64_t i = int64_t(first[g]) * kK; i < int64_t(first[g] + rows[g]) * kK; ++i) {
      a_start[i] = peer ? Bf16(NAN) : a_true[i];
    }
  }

  Bf16 *d_a, *d_a_true, *d_b, *d_d;
  float* d_ref;
  uint64_t *d_counters, *d_targets, *d_times;
  const uint64_t** d_counter_of;
  CHECK_CUDA(cudaMalloc(&d_a, a_true.size() * sizeof(Bf16)));
  CHECK_CUDA(cudaMalloc(&d_a_true, a_true.size() * sizeof(Bf16)));
  CHECK_CUDA(cudaMalloc(&d_b, b.size() * sizeof(Bf16)));
  CHECK_CUDA(cudaMalloc(&d_d, size_t(total_rows) * kN * sizeof(Bf16)));
  CHECK_CUDA(cudaMalloc(&d_ref, size_t(total_rows) * kN * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&d_counters, kSources * sizeof(uint64_t)));
  CHECK_CUDA(cudaMalloc(&d_targets, kGroups * sizeof(uint64_t)));
  CHECK_CUDA(cudaMalloc(&d_counter_of, kGroups * sizeof(uint64_t*)));
  CHECK_CUDA(cudaMalloc(&d_times, 2 * sizeof(uint64_t)));
  CHECK_CUDA(cudaMemcpy(d_a, a_start.data(), a_start.size() * sizeof(Bf16), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_a_true, a_true.data(), a_true.size() * sizeof(Bf16), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_b, b.data(), b.size() * sizeof(Bf16), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(d_d, 0xFF, size_t(total_rows) * kN * sizeof(Bf16)));  // poisoned output (NaN)
  CHECK_CUDA(cudaMemset(d_counters, 0, kSources * sizeof(uint64_t)));

  // Peer groups wait for their source's counter to reach 1; local groups do not wait.
  std::vector<const uint64_t*> counter_of(kGroups);
  std::vector<uint64_t> targets(kGroups, 1);
  for (int g = 0; g < kGroups; ++g) counter_of[g] = g % kSources == 1 ? d_counters + 1 : nullptr;
  CHECK_CUDA(cudaMemcpy(d_counter_of, counter_of.data(), kGroups * sizeof(uint64_t*), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_targets, targets.data(), kGroups * sizeof(uint64_t), cudaMemcpyHostToDevice));

  // Group arrays for the ptr-array GEMM (host-known shapes: this is a test).
  std::vector<cg::GroupShape> shapes(kGroups);
  std::vector<const Bf16*> ptr_a(kGroups), ptr_b(kGroups);
  std::vector<Bf16*> ptr_d(kGroups);
  std::vector<StrideA> stride_a(kGroups, cg::LeadingStride<StrideA>(kK));
  std::vector<StrideB> stride_b(kGroups, cg::LeadingStride<StrideB>(kN));
  std::vector<StrideD> stride_d(kGroups, cg::LeadingStride<StrideD>(kN));
  for (int g = 0; g < kGroups; ++g) {
    shapes[g] = cg::GroupShape{rows[g], kN, kK};
    ptr_a[g] = d_a + int64_t(first[g]) * kK;
    ptr_b[g] = d_b + int64_t(g / kSources) * kK * kN;
    ptr_d[g] = d_d + int64_t(first[g]) * kN;
  }
  auto upload = [](const auto& host) {
    using T = typename std::decay_t<decltype(host)>::value_type;
    T* dev;
    CHECK_CUDA(cudaMalloc(&dev, host.size() * sizeof(T)));
    CHECK_CUDA(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return dev;
  };
  auto* dev_shapes = upload(shapes);
  auto* dev_a = upload(ptr_a);
  auto* dev_b = upload(ptr_b);
  auto* dev_d = upload(ptr_d);
  auto* dev_sa = upload(stride_a);
  auto* dev_sb = upload(stride_b);
  auto* dev_sd = upload(stride_d);

  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = sms - 1;  // the sender's SM
  // The failure record lives in host-mapped memory: readable here after a trap has ended the CUDA context.
  cg::ArrivalFailure* failure = nullptr;
  CHECK_CUDA(cudaHostAlloc(&failure, sizeof(cg::ArrivalFailure), cudaHostAllocMapped));
  std::memset(failure, 0, sizeof(*failure));
  cg::ArrivalFailure* failure_on_device = nullptr;
  CHECK_CUDA(cudaHostGetDevicePointer(&failure_on_device, failure, 0));
  const cg::GroupArrival arrival{d_counter_of, d_targets, timeout_mode ? 200'000'000ull : 10'000'000'000ull,
                                 failure_on_device};
  Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                       {kGroups, dev_shapes, shapes.data()},
                       {{dev_a, dev_sa, dev_b, dev_sb}, arrival},
                       {{}, nullptr, nullptr, dev_d, dev_sd},
                       hw_info};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;

  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return std::printf("cannot implement\n"), 2;
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, std::max<size_t>(Gemm::get_workspace_size(args), 1)));

  cudaStream_t main_stream, send_stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&send_stream, cudaStreamNonBlocking));
  if (gemm.initialize(args, workspace, main_stream) != cutlass::Status::kSuccess) return std::printf("init failed\n"), 2;

  const uint64_t delay_ns = 20'000'000;  // 20 ms: far longer than the GEMM takes ungated
  if (!timeout_mode) {
    DelayedSender<<<1, 256, 0, send_stream>>>(d_a_true, d_a, int64_t(total_rows) * kK, delay_ns, d_counters, kSources);
  }
  Now<<<1, 1, 0, main_stream>>>(d_times);
  if (gemm.run(main_stream) != cutlass::Status::kSuccess) return std::printf("launch failed\n"), 2;
  Now<<<1, 1, 0, main_stream>>>(d_times + 1);
  if (cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) {  // the timeout mode ends here
    const volatile cg::ArrivalFailure* f = failure;
    std::printf("GEMM failed: %s; arrival failure record: failed %u, group %d, counter %llu < target %llu\n",
                cudaGetErrorString(err), f->failed, f->group, static_cast<unsigned long long>(f->seen),
                static_cast<unsigned long long>(f->target));
    return timeout_mode && f->failed == 1 && f->group % kSources == 1 ? 3 : 1;
  }
  if (timeout_mode) return std::printf("timeout mode: the GEMM returned without trapping\n"), 1;

  uint64_t times[2];
  CHECK_CUDA(cudaMemcpy(times, d_times, sizeof(times), cudaMemcpyDeviceToHost));
  const uint64_t waited_ns = times[1] - times[0];

  int* d_first = upload(first);
  int* d_rows = upload(rows);
  ReferenceGemm<<<dim3(64, kGroups), 256>>>(d_a, d_b, d_first, d_rows, d_ref);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<Bf16> got(size_t(total_rows) * kN);
  std::vector<float> want(got.size());
  CHECK_CUDA(cudaMemcpy(got.data(), d_d, got.size() * sizeof(Bf16), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(want.data(), d_ref, want.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float v = float(got[i]);
    if (!std::isfinite(v)) {
      return std::printf("FAILED: D[%zu, %zu] = %f (a tile read its A rows before they arrived, or was not written)\n",
                         i / kN, i % kN, v), 1;
    }
    err += (double(v) - want[i]) * (double(v) - want[i]);
    norm += double(want[i]) * want[i];
  }
  const double rel = std::sqrt(err / norm);
  std::printf("gated GEMM finished %.2f ms after its launch (the sender released the rows after %.2f ms)\n",
              waited_ns * 1e-6, delay_ns * 1e-6);
  if (rel > 1e-2) return std::printf("FAILED: normwise relative error %.3g > 1e-2\n", rel), 1;
  if (waited_ns < delay_ns / 2) return std::printf("FAILED: the GEMM did not wait for the rows\n"), 1;
  std::printf("overlap ok: %d rows in %d groups, relative error %.3g\n", total_rows, kGroups, rel);
  return 0;
}
