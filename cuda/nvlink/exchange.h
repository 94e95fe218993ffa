// The NVLink transport of expert parallelism (docs/nvlink_design.md): a block exchange across the GPUs
// of one expert group done with direct stores into the peers' memory, plus the registry of the
// symmetric workspaces those stores land in. Called by cuda/ffi/nvlink_cuda.cc and the Python module.
//
// Exchange semantics (those of `ragged_all_to_all` on `[ranks, C, row]` blocks): block d of rank s's
// send buffer, first send_counts[d] rows, lands in block s of rank d's output; the rest of every output
// block (rows past recv_counts[s]) is filled with `fill_byte`.
//
// Protocol of one exchange on rank r (epoch e, a per-rank device counter that only increases):
//   advance   e = ++epoch[r]
//   send      to each peer d: wait freed[r][d] >= (e-1)*G  (d has consumed r's block of the last epoch),
//             store the rows into staging[d][r], fence, arrived[d][r] += 1 per block (G blocks per peer,
//             the workspace's blocks_per_peer)
//   receive   from each peer s: wait arrived[r][s] >= e*G, copy staging[r][s] to the output, fill the
//             tail, then freed[s][r] += 1 per block
// Every wait is bounded (`timeout_ns`): on expiry the kernel prints the rank, phase, peer and epoch and
// traps, which fails the XLA computation instead of hanging it. No kernel waits on another block of its
// own launch, so no launch needs all of its blocks resident (NCCL kernels may hold SMs meanwhile).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jmm::nvlink {

constexpr int kMaxRanks = 8;

// Device pointers of every rank of a group, as seen from the calling rank's device.
struct Peers {
  // staging[d] + s * block_bytes: rows from rank s at rank d (the exchange); with stage 2's push protocol, followed
  // by as many push slots: staging[d] + (ranks + s) * block_bytes, rows s pushes to d by DMA.
  char* staging[kMaxRanks];
  uint64_t* signals[kMaxRanks];  // [0] epoch, [1 + s] arrived from s, [1 + ranks + d] freed by d
};

// One exchange call of one rank: where its data is and how big the blocks are.
struct Exchange {
  const char* send;            // [ranks, C, row_bytes]
  const int32_t* send_counts;  // [ranks] rows live in each send block
  const int32_t* recv_counts;  // [ranks] rows live in each received block
  char* out;                   // [ranks, C, row_bytes]
  int64_t capacity;            // C
  int64_t row_bytes;
  unsigned char fill_byte;
};

// Enqueues the three phases of one exchange for `rank` on `stream`. With `ranks_here` > 1 (emulation:
// every rank's memory on this one device) `calls[i]` is rank i's call and the phases run rank by rank:
// all advances, all sends, all receives, so every wait is on work already enqueued before it.
std::string EnqueueExchange(const Peers& peers, int ranks, int first_rank, const std::vector<Exchange>& calls,
                            int64_t block_bytes, int blocks_per_peer, uint64_t timeout_ns, cudaStream_t stream);

// One rank's signal array: [0] epoch, [1 + s] arrived from s, [1 + ranks + d] freed by d (the exchange), then stage
// 2's push protocol's (jmm/nvlink_push.h), whose values are overlapped-call counts f (the same on every rank; written
// by stream writes of that value): [PushedSignal(s)] s's rows are in my push slot for call f, [ReleasedSignal(d)] d
// is done with my rows of call f.
inline int PushedSignal(int ranks, int source) { return 1 + 2 * ranks + source; }
inline int ReleasedSignal(int ranks, int dest) { return 1 + 3 * ranks + dest; }
inline size_t SignalBytes(int ranks) { return sizeof(uint64_t) * (1 + 4 * static_cast<size_t>(ranks)); }

// Enqueues one single-block kernel that waits (bounded, like the exchange's waits: on expiry it prints the rank, the
// phase, the peer and `call`, and traps) until counters[i] >= target for every i; peers[i] names counter i's writer.
// `rows_arrive` picks the phase named: the push protocol's "push (rows arrive)" or "push (peer releases its push
// slot)".
std::string EnqueueWaitForPeers(const std::vector<const uint64_t*>& counters, const std::vector<int>& peers,
                                uint64_t target, int rank, bool rows_arrive, uint64_t timeout_ns, cudaStream_t stream);

// Workspace registry (cuda/ffi/nvlink_cuda.cc). A workspace holds one or more groups (the expert axis
// of each combination of the other mesh axes); `groups[g][r]` is the CUDA device of rank r of group g.
// Emulated: one group whose ranks all live on one device (the exchange is then called under jax.vmap
// with every rank's data in one call). Creating enables peer access and allocates, on every rank,
// `ranks * block_bytes` of staging and the signal array (zeroed). Throws std::runtime_error with a
// message for the user (no peer access, out of memory, bad arguments).
// `overlap` also allocates stage 2's push slots (twice the staging).
int64_t CreateWorkspace(const std::vector<std::vector<int>>& groups, bool emulated, int64_t block_bytes,
                        int64_t timeout_ms, int blocks_per_peer, bool overlap);
// Waits for the workspace's devices to finish their work, then frees its memory. Unknown ids are ignored.
void DestroyWorkspace(int64_t id);

// One process per GPU: `groups[g][r] = -1` marks rank r as another process's. Such a group must hold
// exactly one GPU of this process; CreateWorkspace allocates only the local ranks. The processes then
// swap CUDA IPC handles (through the jax.distributed key-value store, in Python): ExportHandles gives,
// per group, this process's rank's staging and signal handles (2 x 64 bytes), and AttachPeer opens a
// remote rank's. The exchange handler refuses a workspace until every rank is attached.
std::vector<std::string> ExportHandles(int64_t id);
void AttachPeer(int64_t id, int group, int rank, const std::string& handles);

}  // namespace jmm::nvlink
