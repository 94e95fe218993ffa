// The push protocol (docs/expert_parallelism.md): how the fused calls of the nvlink transport (nvlink/fused.h) move one
// block of C rows per peer by the copy engines, on the rank's side stream, so that the transfer takes no SMs from
// the expert GEMMs:
//
//   fork off XLA's stream ─ per shard: wait until every peer d has released its push slot for me of my last call ─
//   DMA my block d into that slot, stream-write pushed[me] = f into d's signals ─ per shard: wait until pushed[s] >= f
//   for every peer s ─ (the caller's work on the slots: gathers, copies out) ─ stream-write released[me] = f into
//   every peer ─ join
//
// f counts the push calls that the rank has enqueued: the same on every rank, since every fused call is SPMD and
// makes the same push calls on every rank, and the value of every signal the call writes, so the counters only grow.
// The push slots and the `pushed` and `released` signals are the protocol's own (nvlink/workspace.h). Every wait is a
// bounded single-block kernel that prints the shard, the phase, the peer and f, then traps. A DMA's size is fixed on
// the host, so a push moves a whole block of C rows. Stream writes with default flags are fenced after the stream's
// earlier DMAs (checked across two H200s by cuda/tests/peer_push_check.cu), and a wait kernel's acquire orders what
// follows it after the rows.
//
// Start enqueues every shard's pushes before Receive can enqueue any shard's wait: the ordering rule of ShardSet
// (nvlink/workspace.h, with the argument why no call can deadlock), implemented here once for every fused call.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "nvlink/stream_write.h"
#include "nvlink/workspace.h"

namespace jmm::nvlink {

// SMs that a kernel launched on XLA's stream beside a push call's waits leaves free: the waits are one-block kernels
// on the side stream, and a gather on all SMs launched first keeps the dy push's wait off the GPU until the gather
// ends, so the push starts late and its peer waits for it.
inline constexpr int kPushSMs = 1;

class PushCall {
 public:
  // One push call of `shards`, moving blocks of `block` bytes. `what` names the call in errors. The device must be
  // current.
  PushCall(const ShardSet& shards, int64_t block, std::string what);

  // Forks the side stream off `stream`, after the work already enqueued there, advances every shard's call count,
  // then enqueues every shard's push: once every peer d has released its push slot for this rank's last call, DMA
  // block d of blocks(i) (block d at blocks(i) + d * stride; stride 0 sends one block to every peer) into it and
  // signal it.
  Status Start(cudaStream_t stream, const std::function<const char*(int shard)>& blocks, int64_t stride);
  // Side stream, shard by shard, after Start: wait until every peer's block of this call is in the shard's push
  // slots, then run `use(i)` when given (the shard's work on the slots, enqueued on side()), then, with `release`,
  // release the slots to their peers.
  Status Receive(const std::function<Status(int shard)>& use, bool release);
  // Side stream, every shard: release the push slots to their peers, once what is enqueued before has read them.
  Status ReleaseAll();
  // Side stream, shard i: DMA every source's block into `out` ([ranks, C, row], source order), the peers' from the
  // push slots and the own from `own` (null: the caller writes out's own block itself).
  Status CopyOut(int shard, const char* own, char* out);
  // Makes `stream` wait for everything enqueued on the side stream.
  Status Join(cudaStream_t stream);
  // Makes the side stream wait for what is enqueued on `stream`, within the same call: after a Join, so that the
  // caller's work on `stream` can read the push slots before the side stream releases them.
  Status Resume(cudaStream_t stream);
  // Shard i's push slot for `source`'s block, valid from its Receive until its release.
  const char* Received(int shard, int source) const;

  int rank(int shard) const { return shards_.rank(shard); }
  cudaStream_t side() const { return side_; }

 private:
  std::vector<int> PeersOf(int me) const;
  uint64_t* Signal(int owner, int index) const { return shards_.group->peers.signals[owner] + index; }
  bool Write(uint64_t* counter, uint64_t value) const;
  Status Push(int shard, const char* blocks, int64_t stride);
  Status Release(int shard);
  Status Fail(const std::string& message) const { return what_ + ": " + message; }

  ShardSet shards_;
  int ep_;
  int64_t block_;
  std::string what_;
  cudaStream_t side_;
  StreamWriteValue64 write_value_ = nullptr;
  std::vector<uint64_t> call_;  // f of each shard, set by Start
};

}  // namespace jmm::nvlink
