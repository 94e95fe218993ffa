// The push of nvlink stage 2 between two GPUs (docs/nvlink_design.md, "Two points the benches did not exercise"):
// the *sending* GPU enqueues a DMA of rows into the receiving GPU's memory and then a stream write of a counter
// that also lives in the receiving GPU's memory; a kernel on the receiving GPU, running before the push starts,
// waits (bounded) for the counter and then compares every byte with the expected rows. The rows are poisoned
// before every round, and the counter only grows (round r waits for r + 1).
// Usage: peer_push_check. Needs two GPUs with peer access. Prints "peer push ok" with the push's time and rate
// (median of the rounds), or the failure, and exits non-zero on failure.
#include <cstdio>
#include <vector>

#include "test_util.cuh"

using namespace test_util;

constexpr int64_t kBytes = 64ll << 20;  // q30's tokens of one shard at EP = 2: 16384 x 2048 bf16
constexpr int kRounds = 7;

__device__ __forceinline__ uint64_t NowNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void Sleep(uint64_t ns) {
  const uint64_t start = NowNs();
  while (NowNs() - start < ns) __nanosleep(1000);
}

// Every block waits (one thread, at most 10 s) until *counter >= target, then counts its share of the 16-byte
// chunks where got differs from want (read through L2: a peer's DMA wrote them). A timeout sets *timed_out.
__global__ void WaitThenCompare(const uint64_t* counter, uint64_t target, const uint4* got, const uint4* want,
                                int64_t chunks, unsigned long long* mismatches, int* timed_out) {
  __shared__ bool arrived;
  if (threadIdx.x == 0) {
    const uint64_t start = NowNs();
    uint64_t seen;
    do {
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(seen) : "l"(counter) : "memory");
    } while (seen < target && NowNs() - start < 10'000'000'000ull && (__nanosleep(1000), true));
    arrived = seen >= target;
    if (!arrived) atomicExch(timed_out, 1);
  }
  __syncthreads();
  if (!arrived) return;
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < chunks; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 a = __ldcg(got + i), b = want[i];
    local += a.x != b.x || a.y != b.y || a.z != b.z || a.w != b.w;
  }
  if (local > 0) atomicAdd(mismatches, local);
}

int main() {
  LoadModulesEagerly();
  int devices = 0;
  CHECK_CUDA(cudaGetDeviceCount(&devices));
  if (devices < 2) return std::printf("needs two GPUs, found %d\n", devices), 4;
  int can = 0;
  CHECK_CUDA(cudaDeviceCanAccessPeer(&can, 1, 0));
  if (!can) return std::printf("GPU 1 cannot access GPU 0's memory\n"), 4;
  const StreamWriteValue64 stream_write_value = LoadStreamWriteValue64();
  const int64_t elements = kBytes / sizeof(Bf16);

  // Receiver (GPU 0): the landing rows, the expected rows (the same pattern), the counter and the results.
  CHECK_CUDA(cudaSetDevice(0));
  Bf16* landing = AllocateFilled<Bf16>(elements, 0);
  Bf16* expected = DevicePattern(elements, 5, 1.0f);
  uint64_t* counter = AllocateFilled<uint64_t>(1, 0);
  auto* mismatches = AllocateFilled<unsigned long long>(1, 0);
  int* timed_out = AllocateFilled<int>(1, 0);
  cudaStream_t receive_stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&receive_stream, cudaStreamNonBlocking));
  cudaEvent_t poisoned;
  CHECK_CUDA(cudaEventCreateWithFlags(&poisoned, cudaEventDisableTiming));
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

  // Sender (GPU 1): the rows, a stream, its timing events; peer access to GPU 0's memory.
  CHECK_CUDA(cudaSetDevice(1));
  CHECK_CUDA(cudaDeviceEnablePeerAccess(0, 0));
  Bf16* rows = DevicePattern(elements, 5, 1.0f);
  cudaStream_t send_stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&send_stream, cudaStreamNonBlocking));
  cudaEvent_t push_start, push_end;
  CHECK_CUDA(cudaEventCreate(&push_start));
  CHECK_CUDA(cudaEventCreate(&push_end));
  CHECK_CUDA(cudaDeviceSynchronize());

  std::vector<float> push_ms;
  for (int round = 0; round < kRounds; ++round) {
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaMemsetAsync(landing, 0xFF, kBytes, receive_stream));  // poison: NaN rows
    CHECK_CUDA(cudaEventRecord(poisoned, receive_stream));
    WaitThenCompare<<<2 * sms, 256, 0, receive_stream>>>(counter, round + 1, reinterpret_cast<const uint4*>(landing),
                                                         reinterpret_cast<const uint4*>(expected), kBytes / 16,
                                                         mismatches, timed_out);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaSetDevice(1));
    CHECK_CUDA(cudaStreamWaitEvent(send_stream, poisoned));
    Sleep<<<1, 1, 0, send_stream>>>(5'000'000);  // the receiver is waiting before the push starts
    CHECK_CUDA(cudaEventRecord(push_start, send_stream));
    CHECK_CUDA(cudaMemcpyAsync(landing, rows, kBytes, cudaMemcpyDefault, send_stream));
    if (stream_write_value(send_stream, reinterpret_cast<CUdeviceptr>(counter), round + 1,
                           CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
      return std::printf("FAILED: cuStreamWriteValue64 into GPU 0's memory from GPU 1's stream was refused\n"), 1;
    }
    CHECK_CUDA(cudaEventRecord(push_end, send_stream));
    CHECK_CUDA(cudaStreamSynchronize(send_stream));
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaStreamSynchronize(receive_stream));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, push_start, push_end));
    push_ms.push_back(ms);
  }
  CHECK_CUDA(cudaSetDevice(0));
  const unsigned long long wrong = Download(mismatches, 1)[0];
  const int timeouts = Download(timed_out, 1)[0];
  if (timeouts) return std::printf("FAILED: the receiver never saw the counter (stream write into peer memory)\n"), 1;
  if (wrong) return std::printf("FAILED: %llu of %lld 16-byte chunks differ after the signal\n", wrong, kBytes / 16), 1;
  std::sort(push_ms.begin(), push_ms.end());
  const float median = push_ms[push_ms.size() / 2];
  std::printf("peer push ok: %d rounds of %lld MB, DMA + stream write %.3f ms (%.2f TB/s), every byte as expected\n",
              kRounds, kBytes >> 20, median, kBytes / (median * 1e-3) / 1e12);
  return 0;
}
