// How much of a row transfer hides behind the expert GEMM when the two share the GPU (nvlink stage 2, one GPU).
//
// The q30 gate_up GEMM of one GPU at EP = 2: 64 local experts, 1024 rows per (expert, source), K = 2048,
// N = 1536; source 0's rows are local, source 1's arrive by a copy kernel (here from local memory, so faster than
// NVLink would be) that releases a counter block by block. Timed with CUDA events, median of 20 after 3 warm-ups:
//   gemm          the GEMM alone on all SMs, nothing gated;
//   gemm_reserved the GEMM alone with `copy_blocks` SMs left free;
//   copy          the copy kernel alone;
//   overlapped    copy on a second stream and the gated GEMM (SMs reserved) started together, until both end.
// hidden = (gemm + copy - overlapped) / copy: the share of the copy that the overlap hides (1 = all of it).
// Two group orders: source-major (own rows' groups first, the peer's after: each expert's weights are read twice)
// and expert-major (each expert's two groups adjacent: weights once, but gated tiles early in the order).
// The copy's speed is set by its block count (local copies are faster than NVLink's ~0.4 TB/s per direction):
// few blocks make it NVLink-like and cost the GEMM few SMs. Usage: arrival_gemm_bench [copy_blocks...]
// (default 4 8 16).
#include <algorithm>
#include <cstdlib>

#include "arrival_gemm_common.cuh"

using namespace arrival_test;

constexpr int kExperts = 64, kSources = 2, kRowsPerGroup = 1024, kK = 2048, kN = 1536;

// Copies `chunks` 16-byte chunks; each block, when its share is stored, fences and adds 1 to `counter`.
__global__ void CopyAndRelease(const uint4* src, uint4* dst, int64_t chunks, uint64_t* counter) {
  const int64_t per_block = (chunks + gridDim.x - 1) / gridDim.x;
  const int64_t begin = blockIdx.x * per_block, end = begin + per_block < chunks ? begin + per_block : chunks;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) dst[i] = src[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(counter), "l"(uint64_t{1}) : "memory");
}

// Deterministic values in [-scale, scale) (only the timing matters here, not the numbers).
__global__ void FillPattern(Bf16* out, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    out[i] = Bf16(scale * (float(h & 0xFFFF) / 32768.0f - 1.0f));
  }
}

Bf16* DevicePattern(int64_t n, uint32_t seed, float scale) {
  Bf16* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, n * sizeof(Bf16)));
  FillPattern<<<1024, 256>>>(p, n, seed, scale);
  CHECK_CUDA(cudaGetLastError());
  return p;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of `body(iteration)` enqueued on `stream` between two events.
template <class Body>
float TimeMs(cudaStream_t stream, Body body) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int it = 0; it < 23; ++it) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    body(it);
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    if (it >= 3) ms.push_back(t);
  }
  return Median(ms);
}

// Buffers, streams and the release counter shared by every configuration.
struct Setup {
  int sms = 0;
  int64_t half_rows = 0, chunks = 0;
  Bf16 *a = nullptr, *b = nullptr, *peer_src = nullptr, *d = nullptr;
  uint64_t* counter = nullptr;
  uint64_t releases = 0;  // the counter's value: it only grows, so each overlapped run waits for its own copy
  cudaStream_t main_stream, copy_stream;
  cudaEvent_t fork, join;
};

void Copy(Setup& s, int copy_blocks, cudaStream_t stream) {
  CopyAndRelease<<<copy_blocks, 512, 0, stream>>>(reinterpret_cast<const uint4*>(s.peer_src),
                                                  reinterpret_cast<uint4*>(s.a + s.half_rows * kK), s.chunks,
                                                  s.counter);
  s.releases += copy_blocks;
}

// One group order: groups (expert, source), source-major (own rows' groups first) or expert-major.
void MeasureOrder(Setup& s, int copy_blocks, float copy_ms, bool source_major) {
  GroupedProblem problem;
  problem.k = kK, problem.n = kN;
  std::vector<int> source_of;
  for (int i = 0; i < kExperts * kSources; ++i) {
    const int e = source_major ? i % kExperts : i / kSources, src = source_major ? i / kExperts : i % kSources;
    problem.first.push_back(int(src * s.half_rows + e * kRowsPerGroup));
    problem.rows.push_back(kRowsPerGroup);
    problem.expert.push_back(e);
    source_of.push_back(src);
  }
  const int groups = int(source_of.size());
  std::vector<const uint64_t*> counter_of(groups);
  for (int g = 0; g < groups; ++g) counter_of[g] = source_of[g] == 1 ? s.counter : nullptr;
  uint64_t* d_targets = Upload(std::vector<uint64_t>(groups, 0));
  const cg::GroupArrival gate{Upload(counter_of), d_targets};

  Gemm plain, reserved, gated;
  Initialise(plain, MakeArguments(problem, s.a, s.b, s.d, cg::GroupArrival{}, s.sms), s.main_stream);
  Initialise(reserved, MakeArguments(problem, s.a, s.b, s.d, cg::GroupArrival{}, s.sms - copy_blocks), s.main_stream);
  Initialise(gated, MakeArguments(problem, s.a, s.b, s.d, gate, s.sms - copy_blocks), s.main_stream);
  auto run = [&](Gemm& gemm) {
    if (gemm.run(s.main_stream) != cutlass::Status::kSuccess) std::printf("launch failed\n"), std::exit(2);
  };
  const float gemm_ms = TimeMs(s.main_stream, [&](int) { run(plain); });
  const float reserved_ms = TimeMs(s.main_stream, [&](int) { run(reserved); });
  std::vector<uint64_t> targets(groups);
  const float overlapped_ms = TimeMs(s.main_stream, [&](int) {
    for (int g = 0; g < groups; ++g) targets[g] = source_of[g] == 1 ? s.releases + copy_blocks : 0;
    CHECK_CUDA(cudaMemcpyAsync(d_targets, targets.data(), groups * sizeof(uint64_t), cudaMemcpyHostToDevice,
                               s.main_stream));
    CHECK_CUDA(cudaEventRecord(s.fork, s.main_stream));
    CHECK_CUDA(cudaStreamWaitEvent(s.copy_stream, s.fork));
    Copy(s, copy_blocks, s.copy_stream);
    run(gated);
    CHECK_CUDA(cudaEventRecord(s.join, s.copy_stream));
    CHECK_CUDA(cudaStreamWaitEvent(s.main_stream, s.join));
  });
  std::printf("  %s: gemm %.3f ms, gemm_reserved %.3f ms, overlapped %.3f ms (gemm + copy %.3f), hidden %.2f\n",
              source_major ? "source-major" : "expert-major", gemm_ms, reserved_ms, overlapped_ms, gemm_ms + copy_ms,
              (gemm_ms + copy_ms - overlapped_ms) / copy_ms);
}

int main(int argc, char** argv) {
  std::vector<int> copy_block_counts;
  for (int i = 1; i < argc; ++i) copy_block_counts.push_back(std::atoi(argv[i]));
  if (copy_block_counts.empty()) copy_block_counts = {4, 8, 16};
  Setup s;
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, device));

  // A holds source 0's rows (expert by expert) and then source 1's: the copy is one contiguous half.
  s.half_rows = int64_t(kExperts) * kRowsPerGroup;
  const int64_t rows = kSources * s.half_rows;
  s.a = DevicePattern(rows * kK, 1, 1.0f);
  s.b = DevicePattern(int64_t(kExperts) * kK * kN, 2, 0.02f);
  s.peer_src = DevicePattern(s.half_rows * kK, 3, 1.0f);
  CHECK_CUDA(cudaMalloc(&s.d, size_t(rows) * kN * sizeof(Bf16)));
  s.counter = Upload(std::vector<uint64_t>{0});
  s.chunks = s.half_rows * kK * int64_t(sizeof(Bf16)) / 16;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s.main_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&s.copy_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
  CHECK_CUDA(cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming));

  std::printf("q30 gate_up GEMM at EP = 2 on one GPU: %d experts x %d sources x %d rows, K %d, N %d; the copy "
              "moves %.0f MB; %d SMs\n", kExperts, kSources, kRowsPerGroup, kK, kN, s.chunks * 16 / 1e6, s.sms);
  for (const int copy_blocks : copy_block_counts) {
    const float copy_ms = TimeMs(s.main_stream, [&](int) { Copy(s, copy_blocks, s.main_stream); });
    std::printf("copy with %d blocks alone: %.3f ms (%.2f TB/s)\n", copy_blocks, copy_ms,
                s.chunks * 16 / (copy_ms * 1e9));
    for (const bool source_major : {true, false}) MeasureOrder(s, copy_blocks, copy_ms, source_major);
  }
  return 0;
}
