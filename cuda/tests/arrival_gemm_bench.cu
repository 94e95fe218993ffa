// How much of a row transfer hides behind the expert GEMM when the two run together (the nvlink transport's fused
// gate_up call).
//
// The q30 gate_up GEMM of one GPU at EP = 2: 64 local experts, 1024 rows per (expert, source), K = 2048,
// N = 1536. Source 0's rows are local; source 1's (268 MB) arrive during the GEMM, from GPU 1 over NVLink when
// there are two GPUs (from this GPU's memory otherwise), by one of two transfers:
//   kernel:b  a copy kernel of b blocks (b SMs left free for it) that releases a counter block by block;
//   ce        the copy engine (cudaMemcpyAsync, no SM) followed by cuStreamWriteValue64 of the counter, which
//             fences before writing: no SM is left free except none at all.
// Timed with CUDA events, median of 20 after 3 warm-ups:
//   copy           the transfer alone;
//   gemm           the GEMM alone on all SMs, nothing gated;
//   gemm_reserved  the GEMM alone on the SMs the transfer leaves;
//   overlapped     transfer on a second stream and the gated GEMM started together, until both end;
//   hidden = (gemm + copy - overlapped) / copy: the share of the transfer the overlap hides (1 = all of it).
// Two group orders: source-major (own rows' groups first, the peer's after: each expert's weights read twice) and
// expert-major (each expert's two groups adjacent: weights once, but gated tiles early in the order).
// Usage: arrival_gemm_bench [copy kernel block counts...] (default 4 8 16; the copy engine always runs).
#include <cstdlib>
#include <string>

#include "arrival_gemm_common.cuh"

using namespace arrival_test;

constexpr int kExperts = 64, kSources = 2, kRowsPerGroup = 1024, kK = 2048, kN = 1536;

// Copies `chunks` 16-byte chunks; each block, when its share is stored, fences and adds 1 to `counter`.
__global__ void __launch_bounds__(1024)
    CopyAndRelease(const uint4* src, uint4* dst, int64_t chunks, uint64_t* counter) {
  const int64_t per_block = (chunks + gridDim.x - 1) / gridDim.x;
  const int64_t begin = blockIdx.x * per_block, end = begin + per_block < chunks ? begin + per_block : chunks;
  CopyChunks(src, dst, begin + threadIdx.x, end, blockDim.x, [](int64_t i) { return i; });
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0)
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(counter), "l"(uint64_t{1}) : "memory");
}

// Buffers and streams shared by every configuration.
struct Setup {
  int sms = 0;
  int64_t half_rows = 0;
  size_t peer_bytes = 0;
  Bf16 *a = nullptr, *b = nullptr, *peer_src = nullptr, *d = nullptr;
  cudaStream_t main_stream, copy_stream;
  cudaEvent_t fork, join;
  StreamWriteValue64 stream_write_value = nullptr;
};

// One way of moving the peer's rows into the second half of A and releasing `counter` when they are there.
struct Transfer {
  std::string name;
  int blocks = 0;  // copy kernel blocks (SMs left to it); 0: the copy engine
  uint64_t* counter = nullptr;
  uint64_t value = 0;  // the counter after the last transfer: it only grows, so each run waits for its own copy

  uint64_t next_value() const { return value + (blocks > 0 ? blocks : 1); }

  void Enqueue(const Setup& s, cudaStream_t stream) {
    Bf16* dst = s.a + s.half_rows * kK;
    if (blocks > 0) {
      CopyAndRelease<<<blocks, 1024, 0, stream>>>(reinterpret_cast<const uint4*>(s.peer_src),
                                                  reinterpret_cast<uint4*>(dst), int64_t(s.peer_bytes / 16), counter);
    } else {
      CHECK_CUDA(cudaMemcpyAsync(dst, s.peer_src, s.peer_bytes, cudaMemcpyDefault, stream));
      if (s.stream_write_value(stream, reinterpret_cast<CUdeviceptr>(counter), next_value(),
                               CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
        std::printf("cuStreamWriteValue64 failed\n"), std::exit(2);
      }
    }
    value = next_value();
  }
};

// One group order: groups (expert, source), source-major (own rows' groups first) or expert-major.
void MeasureOrder(Setup& s, Transfer& transfer, float copy_ms, bool source_major) {
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
  for (int g = 0; g < groups; ++g) counter_of[g] = source_of[g] == 1 ? transfer.counter : nullptr;
  uint64_t* d_targets = Upload(std::vector<uint64_t>(groups, 0));
  const cg::GroupArrival gate{Upload(counter_of), d_targets};
  const int gemm_sms = s.sms - transfer.blocks;

  Gemm plain, reserved, gated;
  Initialise(plain, MakeArguments(problem, s.a, s.b, s.d, cg::GroupArrival{}, s.sms), s.main_stream);
  Initialise(reserved, MakeArguments(problem, s.a, s.b, s.d, cg::GroupArrival{}, gemm_sms), s.main_stream);
  Initialise(gated, MakeArguments(problem, s.a, s.b, s.d, gate, gemm_sms), s.main_stream);
  const float gemm_ms = MedianMs(s.main_stream, [] {}, [&] { Run(plain, s.main_stream); });
  const float reserved_ms = MedianMs(s.main_stream, [] {}, [&] { Run(reserved, s.main_stream); });
  std::vector<uint64_t> targets(groups);
  const float overlapped_ms = MedianMs(
      s.main_stream, [] {},
      [&] {
        for (int g = 0; g < groups; ++g) targets[g] = source_of[g] == 1 ? transfer.next_value() : 0;
        CHECK_CUDA(cudaMemcpyAsync(d_targets, targets.data(), groups * sizeof(uint64_t), cudaMemcpyHostToDevice,
                                   s.main_stream));
        CHECK_CUDA(cudaEventRecord(s.fork, s.main_stream));
        CHECK_CUDA(cudaStreamWaitEvent(s.copy_stream, s.fork));
        transfer.Enqueue(s, s.copy_stream);
        Run(gated, s.main_stream);
        CHECK_CUDA(cudaEventRecord(s.join, s.copy_stream));
        CHECK_CUDA(cudaStreamWaitEvent(s.main_stream, s.join));
      });
  std::printf("  %s, %s: gemm %.3f ms, gemm on %d SMs %.3f ms, overlapped %.3f ms (gemm + copy %.3f), hidden %.2f\n",
              transfer.name.c_str(), source_major ? "source-major" : "expert-major", gemm_ms, gemm_sms, reserved_ms,
              overlapped_ms, gemm_ms + copy_ms, (gemm_ms + copy_ms - overlapped_ms) / copy_ms);
}

int main(int argc, char** argv) {
  LoadModulesEagerly();
  Setup s;
  int devices = 0;
  CHECK_CUDA(cudaGetDeviceCount(&devices));
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, 0));

  // A holds source 0's rows (expert by expert) and then source 1's: the transfer is one contiguous half.
  s.half_rows = int64_t(kExperts) * kRowsPerGroup;
  s.peer_bytes = size_t(s.half_rows) * kK * sizeof(Bf16);
  const int64_t rows = kSources * s.half_rows;
  s.a = DevicePattern(rows * kK, 1, 1.0f);
  s.b = DevicePattern(int64_t(kExperts) * kK * kN, 2, 0.02f);
  CHECK_CUDA(cudaMalloc(&s.d, size_t(rows) * kN * sizeof(Bf16)));
  const bool over_nvlink = devices > 1;
  if (over_nvlink) {  // the peer's rows live on GPU 1 and cross NVLink, as they would in the fused transport
    CHECK_CUDA(cudaSetDevice(1));
    s.peer_src = DevicePattern(s.half_rows * kK, 3, 1.0f);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaDeviceEnablePeerAccess(1, 0));
  } else {
    s.peer_src = DevicePattern(s.half_rows * kK, 3, 1.0f);
  }
  CHECK_CUDA(cudaStreamCreateWithFlags(&s.main_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&s.copy_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
  CHECK_CUDA(cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming));
  s.stream_write_value = LoadStreamWriteValue64();

  std::vector<Transfer> transfers{{"ce", 0}};
  for (int i = 1; i < argc; ++i) transfers.push_back({"kernel:" + std::string(argv[i]), std::atoi(argv[i])});
  if (argc == 1) {
    for (const int blocks : {4, 8, 16}) transfers.push_back({"kernel:" + std::to_string(blocks), blocks});
  }
  std::printf(
      "q30 gate_up GEMM at EP = 2: %d experts x %d sources x %d rows, K %d, N %d, %d SMs; the peer's "
      "%.0f MB of rows come %s\n",
      kExperts, kSources, kRowsPerGroup, kK, kN, s.sms, s.peer_bytes / 1e6,
      over_nvlink ? "from GPU 1 over NVLink" : "from this GPU's memory (one GPU)");
  for (Transfer& transfer : transfers) {
    transfer.counter = Upload(std::vector<uint64_t>{0});
    const float copy_ms = MedianMs(s.main_stream, [] {}, [&] { transfer.Enqueue(s, s.main_stream); });
    std::printf("%s alone: %.3f ms (%.2f TB/s)\n", transfer.name.c_str(), copy_ms, s.peer_bytes / (copy_ms * 1e9));
    for (const bool source_major : {true, false}) MeasureOrder(s, transfer, copy_ms, source_major);
  }
  return 0;
}
