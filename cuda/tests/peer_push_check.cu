// The push protocol of the nvlink transport between two GPUs, with its whole handshake (docs/expert_parallelism.md).
// Per round e (epochs only grow):
//   receiver (GPU 0) stream: poison the landing rows -> stream write ready = e into GPU 1's memory ->
//                            one-block bounded wait for arrived >= e -> compare every byte with the expected rows;
//   sender (GPU 1) stream:   one-block bounded wait for ready >= e (a DMA cannot wait itself) -> DMA of the rows
//                            into GPU 0's memory -> stream write arrived = e into GPU 0's memory.
// Both streams are enqueued for every round up front, so the counters are the only order between the GPUs. The
// receiver starts late in odd rounds and the sender in even rounds, so that each wait really waits.
// Usage: peer_push_check [timeout]. Prints "peer push ok" with the push's time and rate (median of the rounds), or
// the failure. `timeout`: the receiver never frees round 2; the sender's wait must end in a trap after its 200 ms
// bound, leaving its failure record (phase "ready", round 2): exit code 3 means exactly that. Needs two GPUs with
// peer access both ways.
#include <cstdio>
#include <cstring>
#include <vector>

#include "nvlink/bounded_wait.cuh"
#include "test_util.cuh"

using namespace test_util;
using jmm::nvlink::GlobalTimerNs;
using jmm::nvlink::LoadAcquireSystem;

constexpr int64_t kBytes = 64ll << 20;  // q30's tokens of one shard at EP = 2: 16384 x 2048 bf16
constexpr int kRounds = 7;
constexpr uint64_t kWaitNs = 10'000'000'000ull, kShortWaitNs = 200'000'000ull;

// What a bounded wait leaves behind when it gives up: in host-mapped memory, readable after its trap.
struct WaitFailure {
  int failed;
  int phase;  // 0: the sender waiting for ready, 1: the receiver waiting for arrived
  unsigned long long seen, target;
};
const char* const kPhases[] = {"sender waiting for ready", "receiver waiting for arrived"};

__global__ void Sleep(uint64_t ns) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < ns) __nanosleep(1000);
}

// One thread: returns once *counter >= target (acquire, system scope: a peer's stream write sets it); after
// timeout_ns records the failure and traps.
__global__ void WaitCounter(const uint64_t* counter, uint64_t target, uint64_t timeout_ns, int phase,
                            WaitFailure* failure) {
  const uint64_t start = GlobalTimerNs();
  uint64_t seen;
  while (true) {
    seen = LoadAcquireSystem(counter);
    if (seen >= target) return;
    if (GlobalTimerNs() - start > timeout_ns) break;
    __nanosleep(1000);
  }
  *failure = WaitFailure{1, phase, seen, target};
  __threadfence_system();
  __trap();
}

// Counts the 16-byte chunks where got (a peer's DMA wrote it: read through L2) differs from want.
__global__ void Compare(const uint4* got, const uint4* want, int64_t chunks, unsigned long long* mismatches) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < chunks; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 a = __ldcg(got + i), b = want[i];
    local += a.x != b.x || a.y != b.y || a.z != b.z || a.w != b.w;
  }
  if (local > 0) atomicAdd(mismatches, local);
}

void StreamWrite(StreamWriteValue64 write, cudaStream_t stream, uint64_t* counter, uint64_t value) {
  if (write(stream, reinterpret_cast<CUdeviceptr>(counter), value, CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
    std::printf("FAILED: cuStreamWriteValue64 into the peer GPU's memory was refused\n");
    std::exit(1);
  }
}

int main(int argc, char** argv) {
  LoadModulesEagerly();
  const bool timeout_mode = argc > 1 && std::strcmp(argv[1], "timeout") == 0;
  int devices = 0;
  CHECK_CUDA(cudaGetDeviceCount(&devices));
  if (devices < 2) return std::printf("needs two GPUs, found %d\n", devices), 4;
  int can_0_to_1 = 0, can_1_to_0 = 0;
  CHECK_CUDA(cudaDeviceCanAccessPeer(&can_0_to_1, 0, 1));
  CHECK_CUDA(cudaDeviceCanAccessPeer(&can_1_to_0, 1, 0));
  if (!can_0_to_1 || !can_1_to_0) return std::printf("GPUs 0 and 1 lack peer access\n"), 4;
  const StreamWriteValue64 stream_write_value = LoadStreamWriteValue64();
  const int64_t elements = kBytes / sizeof(Bf16);
  WaitFailure* failure = nullptr;
  CHECK_CUDA(cudaHostAlloc(&failure, sizeof(WaitFailure), cudaHostAllocMapped | cudaHostAllocPortable));
  *failure = WaitFailure{0, -1, 0, 0};

  // Receiver (GPU 0): the landing rows, the expected rows (the same pattern), the arrived counter, the result.
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaDeviceEnablePeerAccess(1, 0));
  Bf16* landing = AllocateFilled<Bf16>(elements, 0);
  Bf16* expected = DevicePattern(elements, 5, 1.0f);
  uint64_t* arrived = AllocateFilled<uint64_t>(1, 0);
  auto* mismatches = AllocateFilled<unsigned long long>(1, 0);
  cudaStream_t receive_stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&receive_stream, cudaStreamNonBlocking));
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

  // Sender (GPU 1): the rows, the ready counter, a stream and its timing events.
  CHECK_CUDA(cudaSetDevice(1));
  CHECK_CUDA(cudaDeviceEnablePeerAccess(0, 0));
  Bf16* rows = DevicePattern(elements, 5, 1.0f);
  uint64_t* ready = AllocateFilled<uint64_t>(1, 0);
  cudaStream_t send_stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&send_stream, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> push_start(kRounds), push_end(kRounds);
  for (int i = 0; i < kRounds; ++i) {
    CHECK_CUDA(cudaEventCreate(&push_start[i]));
    CHECK_CUDA(cudaEventCreate(&push_end[i]));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaDeviceSynchronize());

  const int rounds = timeout_mode ? 2 : kRounds;
  for (uint64_t e = 1; e <= static_cast<uint64_t>(rounds); ++e) {
    if (!(timeout_mode && e == 2)) {  // in timeout mode the receiver never frees round 2
      CHECK_CUDA(cudaSetDevice(0));
      if (e % 2 == 1) Sleep<<<1, 1, 0, receive_stream>>>(3'000'000);
      CHECK_CUDA(cudaMemsetAsync(landing, 0xFF, kBytes, receive_stream));  // poison: NaN rows
      StreamWrite(stream_write_value, receive_stream, ready, e);
      WaitCounter<<<1, 1, 0, receive_stream>>>(arrived, e, kWaitNs, 1, failure);
      Compare<<<2 * sms, 256, 0, receive_stream>>>(reinterpret_cast<const uint4*>(landing),
                                                   reinterpret_cast<const uint4*>(expected), kBytes / 16, mismatches);
      CHECK_CUDA(cudaGetLastError());
    }
    CHECK_CUDA(cudaSetDevice(1));
    if (e % 2 == 0) Sleep<<<1, 1, 0, send_stream>>>(3'000'000);
    WaitCounter<<<1, 1, 0, send_stream>>>(ready, e, timeout_mode ? kShortWaitNs : kWaitNs, 0, failure);
    CHECK_CUDA(cudaEventRecord(push_start[e - 1], send_stream));
    CHECK_CUDA(cudaMemcpyAsync(landing, rows, kBytes, cudaMemcpyDefault, send_stream));
    StreamWrite(stream_write_value, send_stream, arrived, e);
    CHECK_CUDA(cudaEventRecord(push_end[e - 1], send_stream));
    CHECK_CUDA(cudaGetLastError());
  }

  CHECK_CUDA(cudaSetDevice(1));
  const cudaError_t sent = cudaStreamSynchronize(send_stream);
  CHECK_CUDA(cudaSetDevice(0));
  const cudaError_t received = cudaStreamSynchronize(receive_stream);
  if (failure->failed) {
    std::printf("bounded wait failed: %s in round %llu, counter %llu < %llu (sender: %s, receiver: %s)\n",
                kPhases[failure->phase], failure->target, failure->seen, failure->target, cudaGetErrorString(sent),
                cudaGetErrorString(received));
    return timeout_mode && failure->phase == 0 && failure->target == 2 ? 3 : 1;
  }
  if (timeout_mode) return std::printf("timeout mode: the sender's wait returned without trapping\n"), 1;
  CHECK_CUDA(sent);
  CHECK_CUDA(received);
  const unsigned long long wrong = Download(mismatches, 1)[0];
  if (wrong)
    return std::printf("FAILED: %llu of %lld x %d 16-byte chunks differ\n", wrong, static_cast<long long>(kBytes / 16),
                       kRounds),
           1;
  CHECK_CUDA(cudaSetDevice(1));
  std::vector<float> push_ms(kRounds);
  for (int i = 0; i < kRounds; ++i) CHECK_CUDA(cudaEventElapsedTime(&push_ms[i], push_start[i], push_end[i]));
  std::sort(push_ms.begin(), push_ms.end());
  const float median = push_ms[push_ms.size() / 2];
  std::printf(
      "peer push ok: %d rounds of %lld MB, each waited for by both sides, DMA + stream write %.3f ms "
      "(%.2f TB/s), every byte as expected\n",
      kRounds, static_cast<long long>(kBytes >> 20), median, kBytes / (median * 1e-3) / 1e12);
  return 0;
}
