// The nvlink transport's workspaces (docs/expert_parallelism.md): memory outside XLA on every GPU of an expert group,
// which the peers store into directly, and the registry through which the handlers (cuda/nvlink/handlers_cuda.cc)
// and the extension (nvlink_create, ..., cuda/ffi/extension.h) reach it. No XLA header: plain CUDA programs can use
// it too.
//
// Per GPU (rank r) of a group:
//   staging  2 * ranks blocks of block_bytes: first the plain exchange's blocks (block s receives rank s's rows,
//            exchange.h), then the push slots (slot s receives rank s's pushes, push.h)
//   signals  u64 counters that only grow: [0] epoch, [1 + s] arrived from s, [1 + ranks + d] freed by d (the
//            exchange), [PushedSignal(s)] s's block is in my push slot, [ReleasedSignal(d)] d is done with my block
//            (the push protocol)
// The exchange's epochs and `freed` never meet the push protocol's `pushed` and `released`, so the two protocols
// share the memory without knowing of each other.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jmm::nvlink {

// An empty message means success (the same type as jmm::cuda::Status).
using Status = std::string;

constexpr int kMaxRanks = 8;
constexpr int kRemote = -1;  // the device of a rank that another process owns

// The signal and block addressing below is shared by host code and the exchange's kernels.
#if defined(__CUDACC__)
#define JMM_NVLINK_HOST_DEVICE __host__ __device__
#else
#define JMM_NVLINK_HOST_DEVICE
#endif

// Device pointers of every rank of a group, as seen from the calling rank's device.
struct Peers {
  char* staging[kMaxRanks];
  uint64_t* signals[kMaxRanks];
};

JMM_NVLINK_HOST_DEVICE inline int EpochSignal() { return 0; }
JMM_NVLINK_HOST_DEVICE inline int ArrivedSignal(int source) { return 1 + source; }
JMM_NVLINK_HOST_DEVICE inline int FreedSignal(int ranks, int dest) { return 1 + ranks + dest; }
JMM_NVLINK_HOST_DEVICE inline int PushedSignal(int ranks, int source) { return 1 + 2 * ranks + source; }
JMM_NVLINK_HOST_DEVICE inline int ReleasedSignal(int ranks, int dest) { return 1 + 3 * ranks + dest; }
inline size_t SignalBytes(int ranks) { return sizeof(uint64_t) * (1 + 4 * static_cast<size_t>(ranks)); }
inline size_t StagingBytes(int ranks, int64_t block_bytes) { return 2 * static_cast<size_t>(ranks) * block_bytes; }

// Where rank `dest` receives rank `source`'s block of a plain exchange, and of a push.
JMM_NVLINK_HOST_DEVICE inline char* ExchangeBlock(const Peers& peers, int64_t block_bytes, int dest, int source) {
  return peers.staging[dest] + source * block_bytes;
}
JMM_NVLINK_HOST_DEVICE inline char* PushSlot(const Peers& peers, int ranks, int64_t block_bytes, int dest, int source) {
  return peers.staging[dest] + (ranks + source) * block_bytes;
}

struct Group {
  std::vector<int> devices;    // device of each rank; kRemote for a rank of another process
  Peers peers{};               // staging and signals of each rank (remote ones mapped through CUDA IPC)
  std::vector<bool> imported;  // per rank: mapped from another process (closed, not freed)
  // Per rank, made for the local ones: the push protocol's side stream, its fork and join events, and how many push
  // calls the rank has enqueued (the value its `pushed` and `released` signals carry).
  std::vector<cudaStream_t> side_streams;
  std::vector<cudaEvent_t> forks, joins;
  std::vector<uint64_t> push_calls;
};

struct Workspace {
  bool emulated = false;
  int ranks = 0;
  int64_t block_bytes = 0;
  int blocks_per_peer = 0;  // thread blocks per peer in the exchange's copy kernels
  uint64_t timeout_ns = 0;  // the bound of every wait on a peer
  std::vector<Group> groups;
};

// The shards that one handler call runs on its device: every rank of the group when the workspace is emulated (the
// call then holds every shard's operands, batched along a leading axis by jax.vmap), else the device's own rank.
//
// How a call runs its shards, and why that cannot deadlock. Every protocol step on a peer is a signal (a store or a
// stream write into the peer's counters) or a bounded wait for one; no kernel waits for another block of its own
// launch, so no launch needs all of its blocks resident. A call enqueues, for every shard, everything that signals
// the peers (the exchange's sends, the push protocol's pushes) before any shard's wait for a peer's signal of the
// same call (the receives, the waits for pushed rows). With one shard per device, each rank's waits then follow its
// own signals, and every rank runs the same SPMD sequence of calls, so each wait is for a signal its peer enqueues
// without waiting on anything later in the call. Emulated, all shards share one device and one stream per role, and
// every wait follows, in stream order, the signals of every shard it can wait for. The push protocol's side stream
// waits for XLA's stream only where XLA's stream has already waited for every push of the call (to release push
// slots XLA's stream read), and XLA's stream waits for the side stream only through the gated GEMM's tiles and the
// joins, so neither stream can wait on the other in a cycle. ShardSet::ForEach, EnqueueExchange (exchange.h) and
// PushCall (push.h) are the only places that order shards; handlers do not loop over shards themselves.
struct ShardSet {
  Workspace* workspace = nullptr;
  Group* group = nullptr;
  int first_rank = 0;  // the rank of shard 0: 0 when emulated, else the device's rank
  int count = 0;       // shards in this call: ranks when emulated, else 1

  int ranks() const { return workspace->ranks; }
  int rank(int shard) const { return first_rank + shard; }

  // Runs fn(i) for shard i = 0, 1, ... (work that only enqueues on one stream: no ordering rule applies), stopping
  // at the first failure.
  template <class Fn>
  Status ForEach(Fn&& fn) const {
    for (int i = 0; i < count; ++i) {
      if (Status status = fn(i); !status.empty()) return status;
    }
    return {};
  }
};

// Finds the open workspace `id` and the shards of it that CUDA device `device` runs. Fails when the workspace is
// closed or unknown, when its peers in other processes are not attached yet, or when the device is not in it.
Status OpenShards(int64_t id, int device, ShardSet* shards);

// Creates a workspace over groups of CUDA devices; returns its id. `groups[g][r]` is the device of rank r of group g
// (the expert axis of each combination of the other mesh axes); kRemote marks another process's rank (a group
// spanning processes holds exactly one GPU of this process). Emulated: one group whose ranks all live on one device.
// It enables peer access, allocates every local rank's staging and signals (zeroed), its side stream and events, and
// loads every kernel of the library on the devices (kernels/kernel_modules.h). Throws std::runtime_error with a
// message for the user (no peer access, out of memory, bad arguments). The declaration the extension binds is in
// ffi/extension.h.
int64_t CreateWorkspace(const std::vector<std::vector<int>>& groups, bool emulated, int64_t block_bytes,
                        int64_t timeout_ms, int blocks_per_peer);
// Waits for the workspace's devices to finish their work, then frees its memory. Unknown ids are ignored.
void DestroyWorkspace(int64_t id);
// One process per GPU: per group, this process's rank's staging and signal CUDA IPC handles (2 x 64 bytes), which
// the processes swap (through the jax.distributed key-value store, in Python); AttachPeer opens a remote rank's. The
// handlers refuse a workspace until every rank is attached.
std::vector<std::string> ExportHandles(int64_t id);
void AttachPeer(int64_t id, int group, int rank, const std::string& handles);

// Restores the calling thread's current device on scope exit (XLA's threads keep their own).
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&saved_); }
  ~DeviceGuard() { cudaSetDevice(saved_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int saved_ = 0;
};

}  // namespace jmm::nvlink
