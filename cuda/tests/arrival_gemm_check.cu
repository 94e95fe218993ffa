// GPU check of the arrival-gated grouped GEMM (cuda/nvlink/arrival_mainloop_sm90.hpp), built and run by
// tests/test_arrival_gemm_gpu.py.
//
// `arrival_gemm_check overlap`: groups (expert, source), expert-major, some empty; the A rows of the peer groups
// (source 1) are NaN. A sender kernel on a second stream, launched first, sleeps 20 ms, then writes those rows and
// releases the peer counter; the gated GEMM on the main stream (one SM left to the sender) must wait for it: a
// tile that loaded its A rows early carries NaN into D. D is compared with a float32 SIMT reference computed
// afterwards from the final A. Prints "overlap ok", or the first failure, and exits non-zero.
// `arrival_gemm_check timeout`: the peer counter is never released; the GEMM must end by a trap after the
// 200 ms bound, leaving the failure record (a peer group, counter 0 < target 1): exit code 3 means exactly that.
#include <cmath>
#include <cstring>
#include <random>

#include "arrival_gemm_common.cuh"

using namespace arrival_test;

constexpr int kExperts = 5, kSources = 2, kGroups = kExperts * kSources;
constexpr int kK = 320, kN = 512;  // K: 5 k tiles of 64; N: 2 column tiles of 256

// Sleeps `delay_ns`, copies the rows flagged in `is_peer_row` into place, publishes them, releases `counter`.
__global__ void DelayedSender(const Bf16* rows_src, Bf16* rows_dst, const int8_t* is_peer_row, int64_t rows,
                              int64_t width, uint64_t delay_ns, uint64_t* counter) {
  const uint64_t start = jmm::nvlink::GlobalTimerNs();
  while (jmm::nvlink::GlobalTimerNs() - start < delay_ns) __nanosleep(1000);
  for (int64_t i = threadIdx.x; i < rows * width; i += blockDim.x) {
    if (is_peer_row[i / width]) rows_dst[i] = rows_src[i];
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(counter), "l"(uint64_t{1}) : "memory");
}

// d_ref[r, n] = sum_k a[r, k] * b_e[k, n] in float32, for the rows of each group.
__global__ void ReferenceGemm(const Bf16* a, const Bf16* b, const int* first, const int* rows, const int* expert,
                              float* d_ref) {
  const int g = blockIdx.y;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < rows[g] * kN; idx += gridDim.x * blockDim.x) {
    const int r = first[g] + idx / kN, n = idx % kN;
    float s = 0.0f;
    for (int k = 0; k < kK; ++k) s += float(a[int64_t(r) * kK + k]) * float(b[(int64_t(expert[g]) * kK + k) * kN + n]);
    d_ref[int64_t(r) * kN + n] = s;
  }
}

int main(int argc, char** argv) {
  LoadModulesEagerly();
  const bool timeout_mode = argc > 1 && std::strcmp(argv[1], "timeout") == 0;
  int device = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));

  // Group g = (expert g / kSources, source g % kSources); source 0 is local, source 1 a peer.
  GroupedProblem problem;
  problem.k = kK, problem.n = kN;
  problem.rows = {130, 7, 0, 256, 1, 0, 64, 300, 129, 128};
  int total_rows = 0;
  for (int g = 0; g < kGroups; ++g) {
    problem.first.push_back(total_rows);
    problem.expert.push_back(g / kSources);
    total_rows += problem.rows[g];
  }

  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<Bf16> a_true(size_t(total_rows) * kK), a_start(a_true.size()), b(size_t(kExperts) * kK * kN);
  std::vector<int8_t> is_peer_row(total_rows);
  for (auto& v : a_true) v = Bf16(normal(rng));
  for (auto& v : b) v = Bf16(normal(rng) / std::sqrt(float(kK)));
  for (int g = 0; g < kGroups; ++g) {
    for (int r = problem.first[g]; r < problem.first[g] + problem.rows[g]; ++r) is_peer_row[r] = g % kSources == 1;
  }
  for (size_t i = 0; i < a_true.size(); ++i) a_start[i] = is_peer_row[i / kK] ? Bf16(NAN) : a_true[i];

  Bf16* d_a = Upload(a_start);
  Bf16* d_a_true = Upload(a_true);
  Bf16* d_b = Upload(b);
  int8_t* d_is_peer_row = Upload(is_peer_row);
  Bf16* d_d = nullptr;
  float* d_ref = nullptr;
  CHECK_CUDA(cudaMalloc(&d_d, size_t(total_rows) * kN * sizeof(Bf16)));
  CHECK_CUDA(cudaMemset(d_d, 0xFF, size_t(total_rows) * kN * sizeof(Bf16)));  // poisoned output (NaN)
  CHECK_CUDA(cudaMalloc(&d_ref, size_t(total_rows) * kN * sizeof(float)));
  uint64_t* d_counter = Upload(std::vector<uint64_t>{0});
  uint64_t* d_times = Upload(std::vector<uint64_t>(2, 0));

  // Peer groups wait for the peer counter to reach 1; local groups do not wait. The failure record lives in
  // host-mapped memory: readable here after a trap has ended the CUDA context.
  std::vector<const uint64_t*> counter_of(kGroups);
  for (int g = 0; g < kGroups; ++g) counter_of[g] = g % kSources == 1 ? d_counter : nullptr;
  cg::ArrivalFailure* failure = nullptr;
  CHECK_CUDA(cudaHostAlloc(&failure, sizeof(cg::ArrivalFailure), cudaHostAllocMapped));
  std::memset(failure, 0, sizeof(*failure));
  cg::ArrivalFailure* failure_on_device = nullptr;
  CHECK_CUDA(cudaHostGetDevicePointer(&failure_on_device, failure, 0));
  const cg::GroupArrival arrival{Upload(counter_of), Upload(std::vector<uint64_t>(kGroups, 1)),
                                 timeout_mode ? 200'000'000ull : 10'000'000'000ull, failure_on_device};

  cudaStream_t main_stream, send_stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&send_stream, cudaStreamNonBlocking));
  Gemm gemm;
  Initialise(gemm, MakeArguments(problem, d_a, d_b, d_d, arrival, sms - 1), main_stream);  // one SM for the sender

  const uint64_t delay_ns = 20'000'000;  // 20 ms: far longer than the GEMM takes ungated
  if (!timeout_mode) {
    DelayedSender<<<1, 256, 0, send_stream>>>(d_a_true, d_a, d_is_peer_row, total_rows, kK, delay_ns, d_counter);
  }
  RecordTime<<<1, 1, 0, main_stream>>>(d_times);
  Run(gemm, main_stream);
  RecordTime<<<1, 1, 0, main_stream>>>(d_times + 1);
  if (cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) {  // the timeout mode ends here
    const volatile cg::ArrivalFailure* f = failure;
    std::printf("GEMM failed: %s; arrival failure record: failed %u, group %d, counter %llu < target %llu\n",
                cudaGetErrorString(err), f->failed, f->group, static_cast<unsigned long long>(f->seen),
                static_cast<unsigned long long>(f->target));
    return timeout_mode && f->failed == 1 && f->group % kSources == 1 ? 3 : 1;
  }
  if (timeout_mode) return std::printf("timeout mode: the GEMM returned without trapping\n"), 1;

  std::vector<uint64_t> times(2);
  CHECK_CUDA(cudaMemcpy(times.data(), d_times, 2 * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  const uint64_t waited_ns = times[1] - times[0];
  ReferenceGemm<<<dim3(64, kGroups), 256>>>(d_a, d_b, Upload(problem.first), Upload(problem.rows),
                                            Upload(problem.expert), d_ref);
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
                         i / kN, i % kN, v),
             1;
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
