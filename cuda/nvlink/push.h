// Stage 2's push protocol (docs/nvlink_design.md): how an overlapped call of the nvlink transport (the forward,
// cuda/ffi/nvlink_forward_cuda.cc, and the backward, cuda/ffi/nvlink_backward_cuda.cc) moves one block of C rows per
// peer by the copy engines, on the rank's side stream, so that the transfer takes no SMs from the expert GEMMs:
//
//   fork off XLA's stream ─ per shard: wait until every peer d has released its push slot for me of my last call ─
//   DMA my block d into that slot, stream-write pushed[me] = f into d's signals ─ per shard: wait until pushed[s] >= f
//   for every peer s ─ (the caller's own work on the slots) ─ DMA the blocks out in source order ─ stream-write
//   released[me] = f into every peer ─ join
//
// f counts the overlapped calls, forward and backward, that the rank has enqueued: the same on every rank (the program
// is SPMD), and the value of every signal the call writes, so the counters only grow. The push slots are the
// workspace's second staging half, and `pushed` and `released` signal slots of their own, so the exchanges' protocol
// (epochs, `freed`) never meets this one. Every wait is a bounded single-block kernel that prints the shard, the
// phase, the peer and f, then traps. Emulated workspaces (every rank on one GPU) run the shards' pushes before any
// shard's wait, all on one side stream, so every wait is on work enqueued before it and cannot deadlock.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "jmm/cuda_handler.h"
#include "jmm/nvlink_workspace.h"
#include "jmm/stream_write.h"

namespace jmm::nvlink {

// SMs that a kernel launched on XLA's stream beside a push call's waits leaves free. The waits are one-block
// kernels on the side stream; the gathers fill every SM they are given (one 1024-thread block each), so a gather on
// all SMs launched first kept the dy push's wait off the GPU until the gather ended (2026-11-30 14:20 UTC timeline:
// the push 150 us late on one GPU, its peer waiting 119 us for it).
inline constexpr int kPushSMs = 1;

// What both overlapped calls' handlers read first: the workspace, the device's group, and the shard sizes.
struct OverlappedShape {
  Workspace* workspace = nullptr;
  Group* group = nullptr;
  int first_rank = 0;  // the rank of shard 0: 0 when emulated, else the device's rank
  int ep = 0, shards = 0;
  int sms = 0;  // the device's multiprocessors
  bool one_block = false;  // the row blocks' operand holds one block, the same for every destination
  int64_t capacity = 0, hidden = 0, top_k = 0, experts = 0, intermediate = 0;
  int64_t tokens() const { return ep * capacity; }
  int64_t rows() const { return tokens() * top_k; }
};

// Finds the open workspace `workspace_id` and `device`'s group in it, and reads the sizes from the row blocks
// `blocks` ([ep, C, H] bf16, or [1, C, H] when `one_block_allowed`; named `blocks_name` in errors), `weights`
// ([ep * C, K] f32), `w_gate_up` ([E, H, 2I] bf16) and `w_down` ([E, I, H] bf16), each with a leading [ep] when the
// workspace is emulated. Checks their dtypes, that they agree, and that H and I suit the tensor-core GEMMs. `what`
// begins every error message.
ffi::Error ReadOverlappedShape(int64_t workspace_id, int device, const ffi::AnyBuffer& blocks,
                               const ffi::AnyBuffer& weights, const ffi::AnyBuffer& w_gate_up,
                               const ffi::AnyBuffer& w_down, const std::string& what, const std::string& blocks_name,
                               bool one_block_allowed, OverlappedShape* shape);

class PushCall {
 public:
  // One overlapped call of `shards` ranks from `first_rank` (emulation: every rank of the group; else the device's
  // one) moving blocks of `block` bytes. `what` names the call in errors. The device must be current.
  PushCall(Workspace& workspace, Group& group, int first_rank, int shards, int64_t block, std::string what);

  // Checks the workspace has push slots, advances each shard's call count and forks the side stream off `stream`,
  // after the work already enqueued there.
  ffi::Error Fork(cudaStream_t stream);
  // Shard i: once every peer d has released its push slot for this rank's last call, DMA block d of `blocks`
  // (block d at blocks + d * stride: stride 0 sends one block to every peer) into it and signal it.
  ffi::Error Push(int shard, const char* blocks, int64_t stride);
  // Shard i: waits until every peer's block of this call is in this rank's push slots.
  ffi::Error AwaitPushes(int shard);
  // Shard i, on the side stream after AwaitPushes: gathers the rows of every (local expert, peer source) group
  // from the push slots into `rows_out` (cuda::GatherSourceRows, jmm/nvlink_forward.h; blocks of C rows of `hidden`
  // bf16), on `sms` SMs, counting each group's finished warps in `group_counters` when not null.
  ffi::Error GatherPeerRows(int shard, int64_t hidden, int64_t top_k, const int32_t* pair_of_row,
                            const int32_t* source_offsets, int64_t local_experts, void* rows_out, int sms,
                            uint64_t* group_counters);
  // Shard i: DMA every block into `out` ([ep, C, row], source order), the peers' from the push slots and the own
  // from `own` (null: the caller writes out's own block itself), then release the slots to their peers.
  ffi::Error CopyOutAndRelease(int shard, const char* own, char* out);
  // Shard i: release the push slots to their peers, once what the side stream has enqueued has read them.
  ffi::Error Release(int shard);
  // The whole call for blocks that only travel (the forward's results, the backward's dx): Fork off `stream`, every
  // shard's Push of `blocks[i]`, then every shard's AwaitPushes and CopyOutAndRelease(i, owns[i], outs[i]). The
  // caller's work on `stream` runs beside it until Join.
  ffi::Error PushAndCopyOut(cudaStream_t stream, const std::vector<const char*>& blocks,
                            const std::vector<const char*>& owns, const std::vector<char*>& outs);
  // Makes `stream` wait for everything enqueued on the side stream.
  ffi::Error Join(cudaStream_t stream);
  // Makes the side stream wait for what is enqueued on `stream`, in the same call (Fork starts a new one): after a
  // Join, so that the caller's work on `stream` can read the push slots before the side stream releases them.
  ffi::Error Resume(cudaStream_t stream);
  // Shard i's push slot for `source`'s block, valid from AwaitPushes(i) until Release(i).
  const char* Received(int shard, int source) const { return PushSlot(rank(shard), source); }

  int rank(int shard) const { return first_rank_ + shard; }
  cudaStream_t side() const { return side_; }

 private:
  std::vector<int> PeersOf(int me) const;
  char* PushSlot(int dest, int source) const;
  uint64_t* Signal(int owner, int index) const { return group_.peers.signals[owner] + index; }
  bool Write(uint64_t* counter, uint64_t value) const;
  ffi::Error Fail(const std::string& message) const { return Internal(what_, message); }

  Workspace& workspace_;
  Group& group_;
  int first_rank_, shards_, ep_;
  int64_t block_;
  std::string what_;
  cudaStream_t side_;
  cuda::StreamWriteValue64 write_value_ = nullptr;
  std::vector<uint64_t> call_;  // f of each shard
};

}  // namespace jmm::nvlink
