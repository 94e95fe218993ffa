// The front half of the nvlink transport's fused forward (the gate_up call, docs/expert_parallelism.md) on the GPU that
// receives, against the sequential order (the rows there first, then the gather and the GEMM).
//
// q30 at EP = 2 as one GPU sees it: 16384 own tokens and 16384 of the peer's (H = 2048), each token with 4 of
// this GPU's 64 experts (1024 rows per expert and source), the gate_up GEMM (N = 1536).
//   sequential order: the peer's tokens arrive (copy engine, 64 MB, from GPU 1 over NVLink when there are two GPUs),
//     then one gather of all rows into expert order, then the GEMM: one after another, all SMs each.
//   fused order: a "peer" stream pushes the tokens (copy engine) and signals `arrived` (cuStreamWriteValue64); a
//     side stream's gather of the peer's rows waits for `arrived` on the device (bounded), then releases
//     `gathered`; the main stream gathers the own rows and runs the gated GEMM over source-major groups, the
//     peer's groups waiting for `gathered`, on the SMs the side gather leaves.
// Both produce the same D bit for bit (checked); the program prints both times (median of 20 after 3 warm-ups) and
// the saving, per side-gather block count. Usage: fused_forward_bench [side gather blocks...] (default 4 8 16)
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>

#include "arrival_gemm_common.cuh"

using namespace arrival_test;

constexpr int kTokens = 16384, kExperts = 64, kSources = 2, kPerToken = 4, kK = 2048, kN = 1536;
constexpr int kRowsPerSource = kTokens * kPerToken, kRowsPerGroup = kRowsPerSource / kExperts;

// dst[r] = src[token_of[r]] for rows [0, rows), 16-byte chunks; when `arrived` is set, first waits (bounded, 10 s)
// until *arrived >= target; when `gathered` is set, each block adds 1 to it after its rows are stored.
__global__ void __launch_bounds__(1024) GatherRows(const uint4* src, const int32_t* token_of, int64_t rows, uint4* dst,
                                                   const uint64_t* arrived, uint64_t target, uint64_t* gathered) {
  constexpr int kChunks = kK * sizeof(Bf16) / 16;
  if (arrived != nullptr) {
    if (threadIdx.x == 0) {
      const uint64_t start = jmm::nvlink::GlobalTimerNs();
      while (jmm::nvlink::LoadAcquireSystem(arrived) < target) {
        if (jmm::nvlink::GlobalTimerNs() - start > 10'000'000'000ull) __trap();
        __nanosleep(256);
      }
    }
    __syncthreads();
  }
  CopyChunks(src, dst, blockIdx.x * int64_t(blockDim.x) + threadIdx.x, rows * kChunks, int64_t(gridDim.x) * blockDim.x,
             [token_of](int64_t i) { return int64_t(token_of[i / kChunks]) * kChunks + i % kChunks; });
  if (gathered != nullptr) {
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0)
      asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(gathered), "l"(uint64_t{1}) : "memory");
  }
}

// Adds to *count the number of non-finite bf16 values among n (exponent bits all ones).
__global__ void CountNonFinite(const uint16_t* values, int64_t n, unsigned long long* count) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    local += (values[i] & 0x7F80u) == 0x7F80u;
  }
  if (local > 0) atomicAdd(count, local);
}

int main(int argc, char** argv) {
  LoadModulesEagerly();
  std::vector<int> side_block_counts;
  for (int i = 1; i < argc; ++i) side_block_counts.push_back(std::atoi(argv[i]));
  if (side_block_counts.empty()) side_block_counts = {4, 8, 16};
  int devices = 0, sms = 0;
  CHECK_CUDA(cudaGetDeviceCount(&devices));
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const StreamWriteValue64 stream_write_value = LoadStreamWriteValue64();

  // Tokens: own on this GPU, the peer's on GPU 1 (if there is one) and their landing buffer here.
  const size_t token_bytes = size_t(kTokens) * kK * sizeof(Bf16);
  Bf16* own_x = DevicePattern(int64_t(kTokens) * kK, 1, 1.0f);
  Bf16* peer_x = nullptr;
  const bool over_nvlink = devices > 1;
  if (over_nvlink) {
    CHECK_CUDA(cudaSetDevice(1));
    peer_x = DevicePattern(int64_t(kTokens) * kK, 2, 1.0f);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaDeviceEnablePeerAccess(1, 0));
  } else {
    peer_x = DevicePattern(int64_t(kTokens) * kK, 2, 1.0f);
  }
  Bf16* received_x = nullptr;
  CHECK_CUDA(cudaMalloc(&received_x, token_bytes));
  Bf16* w = DevicePattern(int64_t(kExperts) * kK * kN, 3, 0.02f);

  // Expert order: row j of source s, expert e holds token token_of[s][e * kRowsPerGroup + j]; every token appears
  // kPerToken times per source (a shuffled pattern, as routing gives).
  std::mt19937 rng(11);
  std::vector<int32_t> token_of[kSources];
  for (auto& t : token_of) {
    t.resize(kRowsPerSource);
    std::iota(t.begin(), t.end(), 0);
    std::shuffle(t.begin(), t.end(), rng);
    for (auto& v : t) v %= kTokens;
  }
  int32_t* own_rows = Upload(token_of[0]);
  int32_t* peer_rows = Upload(token_of[1]);
  Bf16 *x_perm = nullptr, *d_sequential = nullptr, *d_fused = nullptr;
  CHECK_CUDA(cudaMalloc(&x_perm, size_t(kSources) * kRowsPerSource * kK * sizeof(Bf16)));
  CHECK_CUDA(cudaMalloc(&d_sequential, size_t(kSources) * kRowsPerSource * kN * sizeof(Bf16)));
  CHECK_CUDA(cudaMalloc(&d_fused, size_t(kSources) * kRowsPerSource * kN * sizeof(Bf16)));
  uint4* own_perm = reinterpret_cast<uint4*>(x_perm);
  uint4* peer_perm = reinterpret_cast<uint4*>(x_perm + int64_t(kRowsPerSource) * kK);

  // Groups source-major: (own, e) for every e, then (peer, e); the peer's groups wait for `gathered`.
  GroupedProblem problem;
  problem.k = kK, problem.n = kN;
  for (int s = 0; s < kSources; ++s) {
    for (int e = 0; e < kExperts; ++e) {
      problem.first.push_back(s * kRowsPerSource + e * kRowsPerGroup);
      problem.rows.push_back(kRowsPerGroup);
      problem.expert.push_back(e);
    }
  }
  const int groups = kSources * kExperts;
  uint64_t* counters = Upload(std::vector<uint64_t>{0, 0});  // arrived, gathered
  uint64_t *arrived = counters, *gathered = counters + 1;
  std::vector<const uint64_t*> counter_of(groups, nullptr);
  for (int g = kExperts; g < groups; ++g) counter_of[g] = gathered;
  uint64_t* targets = Upload(std::vector<uint64_t>(groups, 0));
  const cg::GroupArrival gate{Upload(counter_of), targets};

  cudaStream_t main_stream, side_stream, peer_stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&side_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&peer_stream, cudaStreamNonBlocking));
  cudaEvent_t fork, side_done, peer_done;
  for (cudaEvent_t* e : {&fork, &side_done, &peer_done})
    CHECK_CUDA(cudaEventCreateWithFlags(e, cudaEventDisableTiming));

  Gemm sequential_gemm;
  Initialise(sequential_gemm, MakeArguments(problem, x_perm, w, d_sequential, cg::GroupArrival{}, sms), main_stream);

  const float sequential_ms = MedianMs(
      main_stream, [] {},
      [&] {
        CHECK_CUDA(cudaMemcpyAsync(received_x, peer_x, token_bytes, cudaMemcpyDefault, main_stream));
        GatherRows<<<2 * sms, 256, 0, main_stream>>>(reinterpret_cast<const uint4*>(own_x), own_rows, kRowsPerSource,
                                                     own_perm, nullptr, 0, nullptr);
        GatherRows<<<2 * sms, 256, 0, main_stream>>>(reinterpret_cast<const uint4*>(received_x), peer_rows,
                                                     kRowsPerSource, peer_perm, nullptr, 0, nullptr);
        Run(sequential_gemm, main_stream);
      });

  const size_t d_bytes = size_t(kSources) * kRowsPerSource * kN * sizeof(Bf16);
  std::vector<char> d1(d_bytes), d2(d_bytes);
  CHECK_CUDA(cudaMemcpy(d1.data(), d_sequential, d_bytes, cudaMemcpyDeviceToHost));
  std::printf("q30 EP = 2 front half, peer tokens %s: sequential order %.3f ms\n",
              over_nvlink ? "from GPU 1 over NVLink" : "from this GPU's memory", sequential_ms);

  unsigned long long* nonfinite = nullptr;
  CHECK_CUDA(cudaMalloc(&nonfinite, sizeof(*nonfinite)));
  uint64_t arrived_value = 0, gathered_value = 0;  // both counters only grow: each run waits for its own epoch
  std::vector<uint64_t> host_targets(groups, 0);
  bool all_same = true;
  for (const int side_blocks : side_block_counts) {
    Gemm fused_gemm;
    Initialise(fused_gemm, MakeArguments(problem, x_perm, w, d_fused, gate, sms - side_blocks), main_stream);
    // The peer's half of x_perm is NaN before every run, so a peer tile read before `gathered` puts NaN into D;
    // D's non-finite values are counted after every run (before the next one's poison; the last run below).
    CHECK_CUDA(cudaMemset(d_fused, 0, d_bytes));
    CHECK_CUDA(cudaMemset(nonfinite, 0, sizeof(*nonfinite)));
    const auto count_and_poison = [&] {
      CountNonFinite<<<2 * sms, 256, 0, main_stream>>>(reinterpret_cast<const uint16_t*>(d_fused),
                                                       int64_t(d_bytes / sizeof(Bf16)), nonfinite);
      CHECK_CUDA(cudaMemsetAsync(peer_perm, 0xFF, size_t(kRowsPerSource) * kK * sizeof(Bf16), main_stream));
    };
    const float fused_ms = MedianMs(main_stream, count_and_poison, [&] {
      ++arrived_value;
      gathered_value += side_blocks;
      std::fill(host_targets.begin() + kExperts, host_targets.end(), gathered_value);
      CHECK_CUDA(cudaMemcpyAsync(targets, host_targets.data(), groups * sizeof(uint64_t), cudaMemcpyHostToDevice,
                                 main_stream));
      CHECK_CUDA(cudaEventRecord(fork, main_stream));
      CHECK_CUDA(cudaStreamWaitEvent(peer_stream, fork));
      CHECK_CUDA(cudaStreamWaitEvent(side_stream, fork));
      CHECK_CUDA(cudaMemcpyAsync(received_x, peer_x, token_bytes, cudaMemcpyDefault, peer_stream));
      if (stream_write_value(peer_stream, reinterpret_cast<CUdeviceptr>(arrived), arrived_value,
                             CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
        std::printf("cuStreamWriteValue64 failed\n"), std::exit(2);
      }
      GatherRows<<<side_blocks, 1024, 0, side_stream>>>(reinterpret_cast<const uint4*>(received_x), peer_rows,
                                                        kRowsPerSource, peer_perm, arrived, arrived_value, gathered);
      GatherRows<<<2 * sms, 256, 0, main_stream>>>(reinterpret_cast<const uint4*>(own_x), own_rows, kRowsPerSource,
                                                   own_perm, nullptr, 0, nullptr);
      Run(fused_gemm, main_stream);
      CHECK_CUDA(cudaEventRecord(side_done, side_stream));
      CHECK_CUDA(cudaEventRecord(peer_done, peer_stream));
      CHECK_CUDA(cudaStreamWaitEvent(main_stream, side_done));
      CHECK_CUDA(cudaStreamWaitEvent(main_stream, peer_done));
    });

    CountNonFinite<<<2 * sms, 256, 0, main_stream>>>(reinterpret_cast<const uint16_t*>(d_fused),
                                                     int64_t(d_bytes / sizeof(Bf16)), nonfinite);
    unsigned long long early_reads = 0;
    CHECK_CUDA(cudaMemcpy(&early_reads, nonfinite, sizeof(early_reads), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(d2.data(), d_fused, d_bytes, cudaMemcpyDeviceToHost));
    const bool same = std::memcmp(d1.data(), d2.data(), d_bytes) == 0 && early_reads == 0;
    all_same = all_same && same;
    std::printf(
        "  fused order, side gather on %d blocks (GEMM on %d SMs): %.3f ms, saving %.3f ms; non-finite "
        "values over all runs: %llu; D bit for bit equal to the sequential order's: %s\n",
        side_blocks, sms - side_blocks, fused_ms, sequential_ms - fused_ms, early_reads, same ? "yes" : "NO");
  }
  return all_same ? 0 : 1;
}
