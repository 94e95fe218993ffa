// The plain block exchange of the nvlink transport (docs/expert_parallelism.md), what moves the routing's expert ids
// and weights (and the weights' cotangent) between the GPUs of an expert group, by direct stores into the peers'
// staging (nvlink/workspace.h); and the push protocol's bounded wait kernel. Called by cuda/nvlink/handlers_cuda.cc
// (`jmm_cuda_nvlink_exchange`) and nvlink/push.h.
//
// Exchange semantics (those of `ragged_all_to_all` on `[ranks, C, row]` blocks): block d of rank s's send buffer,
// first send_counts[d] rows, lands in block s of rank d's output; the rest of every output block (rows past
// recv_counts[s]) is filled with `fill_byte`.
//
// Protocol of one exchange on rank r (epoch e, a per-rank device counter that only increases):
//   advance   e = ++epoch[r]
//   send      to each peer d: wait freed[r][d] >= (e-1)*G  (d has consumed r's block of the last epoch),
//             store the rows into d's exchange block for r, fence, arrived[d][r] += 1 per block (G blocks per
//             peer, the workspace's blocks_per_peer)
//   receive   from each peer s: wait arrived[r][s] >= e*G, copy r's exchange block from s to the output, fill the
//             tail, then freed[s][r] += 1 per block
// Counters only grow, so a stale value never satisfies a later wait, and `freed` lets the next exchange reuse the
// blocks without double buffering. Every wait is bounded (the workspace's timeout): on expiry the kernel prints the
// rank, phase, peer and epoch and traps, which fails the XLA computation instead of hanging it. Send and receive
// counts are checked against the capacity on the device (out of range traps with a message instead of writing out of
// bounds).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "nvlink/workspace.h"

namespace jmm::nvlink {

// One shard's exchange: where its data is and how big the blocks are.
struct Exchange {
  const char* send;            // [ranks, C, row_bytes]
  const int32_t* send_counts;  // [ranks] rows live in each send block
  const int32_t* recv_counts;  // [ranks] rows live in each received block
  char* out;                   // [ranks, C, row_bytes]
  int64_t capacity;            // C
  int64_t row_bytes;
  unsigned char fill_byte;
};

// Enqueues one exchange of every shard of `shards` on `stream` (`calls[i]` is shard i's): all advances, then every
// shard's send, then every shard's receive (the ordering rule of ShardSet, nvlink/workspace.h).
Status EnqueueExchange(const ShardSet& shards, const std::vector<Exchange>& calls, cudaStream_t stream);

// Enqueues one single-block kernel that waits (bounded by `timeout_ns`; on expiry it prints the rank, the phase, the
// peer and `call`, and traps) until counters[i] >= target for every i; peers[i] names counter i's writer.
// `rows_arrive` picks the phase named: the push protocol's "push (rows arrive)" or "push (peer releases its push
// slot)".
Status EnqueueWaitForPeers(const std::vector<const uint64_t*>& counters, const std::vector<int>& peers, uint64_t target,
                           int rank, bool rows_arrive, uint64_t timeout_ns, cudaStream_t stream);

}  // namespace jmm::nvlink
