// Kernels of the nvlink transport's plain block exchange and of the push protocol's waits (nvlink/exchange.h).
#include <cuda/atomic>

#include <cstdio>

#include "kernels/kernel_module.cuh"
#include "nvlink/bounded_wait.cuh"
#include "nvlink/exchange.h"

namespace jmm::nvlink {
namespace {

// The send and receive grids are (blocks_per_peer, ranks): gridDim.x blocks per peer. The signal targets
// count blocks, so every rank of a workspace uses its one blocks_per_peer.
constexpr int kThreads = 512;

using SystemCounter = ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_system>;

// Spins until *counter >= target, for at most timeout_ns; then reports and traps (never hangs).
__device__ void WaitAtLeast(uint64_t* counter, uint64_t target, uint64_t timeout_ns, const char* phase, int rank,
                            int peer, uint64_t epoch) {
  SystemCounter ref(*reinterpret_cast<unsigned long long*>(counter));
  if (ref.load(::cuda::memory_order_acquire) >= target) return;
  const uint64_t start = GlobalTimerNs();
  while (ref.load(::cuda::memory_order_acquire) < target) {
    if (GlobalTimerNs() - start > timeout_ns) {
      printf(
          "jax_megamoe nvlink: shard %d timed out after %llu ms in phase '%s' waiting for shard %d "
          "(epoch %llu, counter %llu < %llu)\n",
          rank, static_cast<unsigned long long>(timeout_ns / 1000000), phase, peer,
          static_cast<unsigned long long>(epoch), ref.load(::cuda::memory_order_relaxed),
          static_cast<unsigned long long>(target));
      __trap();
    }
    __nanosleep(256);
  }
}

__device__ void SignalAdd(uint64_t* counter) {
  __threadfence_system();
  SystemCounter(*reinterpret_cast<unsigned long long*>(counter)).fetch_add(1, ::cuda::memory_order_release);
}

__device__ void BadCount(const char* what, int rank, int peer, int count, int64_t capacity) {
  printf("jax_megamoe nvlink: shard %d got %s %d for shard %d, outside [0, %lld]\n", rank, what, count, peer,
         static_cast<long long>(capacity));
  __trap();
}

// Copies `bytes` from src to dst with this block's share of `parts` equal parts, in the widest unit the
// alignment allows. `Load` reads from L2 (.cg) when the source was written by another GPU.
template <bool kFromPeer>
__device__ void CopyShare(char* dst, const char* src, int64_t bytes, int part, int parts) {
  const uintptr_t align =
      reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes);
  const int64_t stride = static_cast<int64_t>(parts) * blockDim.x;
  const int64_t first = static_cast<int64_t>(part) * blockDim.x + threadIdx.x;
  if (align % 16 == 0) {
    const int64_t n = bytes / 16;
    auto* d = reinterpret_cast<uint4*>(dst);
    const auto* s = reinterpret_cast<const uint4*>(src);
    for (int64_t i = first; i < n; i += stride) d[i] = kFromPeer ? __ldcg(s + i) : s[i];
  } else if (align % 4 == 0) {
    const int64_t n = bytes / 4;
    auto* d = reinterpret_cast<uint32_t*>(dst);
    const auto* s = reinterpret_cast<const uint32_t*>(src);
    for (int64_t i = first; i < n; i += stride) d[i] = kFromPeer ? __ldcg(s + i) : s[i];
  } else {
    for (int64_t i = first; i < bytes; i += stride) {
      dst[i] = kFromPeer ? static_cast<char>(__ldcg(reinterpret_cast<const signed char*>(src) + i)) : src[i];
    }
  }
}

__device__ void FillShare(char* dst, int64_t bytes, unsigned char value, int part, int parts) {
  const int64_t stride = static_cast<int64_t>(parts) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(part) * blockDim.x + threadIdx.x; i < bytes; i += stride) {
    dst[i] = static_cast<char>(value);
  }
}

__global__ void AdvanceEpochs(Peers peers, int first_rank, int count) {
  const int rank = first_rank + threadIdx.x;
  if (threadIdx.x < count) peers.signals[rank][EpochSignal()] += 1;
}

// grid (blocks_per_peer, ranks): blockIdx.y is the destination.
__global__ void __launch_bounds__(kThreads)
    SendBlocks(Peers peers, int ranks, int rank, Exchange call, int64_t block_bytes, uint64_t timeout_ns) {
  const int dest = blockIdx.y;
  uint64_t* mine = peers.signals[rank];
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(mine + EpochSignal());
  const int count = call.send_counts[dest];
  if (count < 0 || count > call.capacity) BadCount("send count", rank, dest, count, call.capacity);
  if (threadIdx.x == 0) {
    WaitAtLeast(mine + FreedSignal(ranks, dest), (epoch - 1) * gridDim.x, timeout_ns, "send (peer frees staging)", rank,
                dest, epoch);
  }
  __syncthreads();
  CopyShare<false>(ExchangeBlock(peers, block_bytes, dest, rank), call.send + dest * call.capacity * call.row_bytes,
                   count * call.row_bytes, blockIdx.x, gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0) SignalAdd(peers.signals[dest] + ArrivedSignal(rank));
}

// grid (blocks_per_peer, ranks): blockIdx.y is the source.
__global__ void __launch_bounds__(kThreads)
    ReceiveBlocks(Peers peers, int ranks, int rank, Exchange call, int64_t block_bytes, uint64_t timeout_ns) {
  const int source = blockIdx.y;
  uint64_t* mine = peers.signals[rank];
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(mine + EpochSignal());
  const int count = call.recv_counts[source];
  if (count < 0 || count > call.capacity) BadCount("receive count", rank, source, count, call.capacity);
  if (threadIdx.x == 0) {
    WaitAtLeast(mine + ArrivedSignal(source), epoch * gridDim.x, timeout_ns, "receive (rows arrive)", rank, source,
                epoch);
  }
  __syncthreads();
  const int64_t live = count * call.row_bytes;
  const int64_t block = call.capacity * call.row_bytes;
  char* out = call.out + source * block;
  CopyShare<true>(out, ExchangeBlock(peers, block_bytes, rank, source), live, blockIdx.x, gridDim.x);
  FillShare(out + live, block - live, call.fill_byte, blockIdx.x, gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0) SignalAdd(peers.signals[source] + FreedSignal(ranks, rank));
}

struct PeerCounters {
  const uint64_t* counters[kMaxRanks];
  int peers[kMaxRanks];
  int count;
};

__global__ void WaitForPeers(PeerCounters wait, uint64_t target, int rank, bool rows_arrive, uint64_t timeout_ns) {
  if (threadIdx.x != 0) return;
  for (int i = 0; i < wait.count; ++i) {
    WaitAtLeast(const_cast<uint64_t*>(wait.counters[i]), target, timeout_ns,
                rows_arrive ? "push (rows arrive)" : "push (peer releases its push slot)", rank, wait.peers[i], target);
  }
}

}  // namespace

Status EnqueueWaitForPeers(const std::vector<const uint64_t*>& counters, const std::vector<int>& peers, uint64_t target,
                           int rank, bool rows_arrive, uint64_t timeout_ns, cudaStream_t stream) {
  PeerCounters wait{};
  wait.count = static_cast<int>(counters.size());
  if (wait.count > kMaxRanks || peers.size() != counters.size()) return "bad peer wait";
  for (int i = 0; i < wait.count; ++i) {
    wait.counters[i] = counters[i];
    wait.peers[i] = peers[i];
  }
  WaitForPeers<<<1, 32, 0, stream>>>(wait, target, rank, rows_arrive, timeout_ns);
  const cudaError_t status = cudaGetLastError();
  return status == cudaSuccess ? std::string() : std::string(cudaGetErrorString(status));
}

Status EnqueueExchange(const ShardSet& shards, const std::vector<Exchange>& calls, cudaStream_t stream) {
  if (static_cast<int>(calls.size()) != shards.count) return "one exchange per shard";
  const Workspace& w = *shards.workspace;
  const Peers& peers = shards.group->peers;
  const dim3 grid(w.blocks_per_peer, w.ranks);
  AdvanceEpochs<<<1, kMaxRanks, 0, stream>>>(peers, shards.first_rank, shards.count);
  for (int i = 0; i < shards.count; ++i) {
    SendBlocks<<<grid, kThreads, 0, stream>>>(peers, w.ranks, shards.rank(i), calls[i], w.block_bytes, w.timeout_ns);
  }
  for (int i = 0; i < shards.count; ++i) {
    ReceiveBlocks<<<grid, kThreads, 0, stream>>>(peers, w.ranks, shards.rank(i), calls[i], w.block_bytes, w.timeout_ns);
  }
  const cudaError_t status = cudaGetLastError();
  return status == cudaSuccess ? std::string() : std::string(cudaGetErrorString(status));
}

}  // namespace jmm::nvlink
