// Stage 2's push protocol (contract and diagram in jmm/nvlink_push.h).
#include "jmm/nvlink_push.h"

#include "jmm/nvlink_forward.h"

#include <cuda.h>

#include <utility>

namespace jmm::nvlink {

ffi::Error ReadOverlappedShape(int64_t workspace_id, int device, const ffi::AnyBuffer& blocks,
                               const ffi::AnyBuffer& weights, const ffi::AnyBuffer& w_gate_up,
                               const ffi::AnyBuffer& w_down, const std::string& what, const std::string& blocks_name,
                               bool one_block_allowed, OverlappedShape* shape) {
  const auto invalid = [&](const std::string& message) { return InvalidArgument(what + ": " + message); };
  Workspace* workspace = FindOpen(workspace_id);
  if (workspace == nullptr) return invalid("workspace " + std::to_string(workspace_id) + " is closed or unknown");
  if (!Ready(*workspace)) return invalid("the workspace's peers in other processes are not attached yet");
  int rank = 0;
  Group* group = GroupOf(*workspace, device, &rank);
  if (group == nullptr) return invalid("GPU " + std::to_string(device) + " is not part of this workspace's mesh axis");

  // Emulated calls carry every shard: a leading [ranks] on every operand and result.
  const int ep = workspace->ranks;
  const size_t lead = workspace->emulated ? 1 : 0;
  const auto bd = blocks.dimensions(), wd = weights.dimensions(), gd = w_gate_up.dimensions(), dd = w_down.dimensions();
  if (bd.size() != lead + 3 || wd.size() != lead + 2 || gd.size() != lead + 3 || dd.size() != lead + 3 ||
      (lead && (bd[0] != ep || wd[0] != ep || gd[0] != ep || dd[0] != ep)) ||
      !(bd[lead] == ep || (one_block_allowed && bd[lead] == 1))) {
    return invalid(workspace->emulated ? "an emulated workspace of " + std::to_string(ep) +
                                             " shards needs every operand batched over the shards (jax.vmap)"
                                       : blocks_name + " must be [" + std::to_string(ep) + ", C, H]" +
                                             (one_block_allowed ? " or [1, C, H]" : ""));
  }
  OverlappedShape s;
  s.workspace = workspace;
  s.group = group;
  s.first_rank = workspace->emulated ? 0 : rank;
  s.ep = ep;
  s.shards = workspace->emulated ? ep : 1;
  s.one_block = bd[lead] == 1 && ep > 1;
  if (cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || s.sms <= 0) {
    return invalid("cannot read GPU " + std::to_string(device) + "'s multiprocessor count");
  }
  s.capacity = bd[lead + 1];
  s.hidden = bd[lead + 2];
  s.top_k = wd[lead + 1];
  s.experts = gd[lead];
  s.intermediate = gd[lead + 2] / 2;
  for (const ffi::AnyBuffer* b : {&blocks, &w_gate_up, &w_down}) {
    if (b->element_type() != ffi::BF16) return invalid(blocks_name + ", w_gate_up and w_down must be bfloat16");
  }
  if (weights.element_type() != ffi::F32) return invalid("weights must be float32");
  if (!cuda::UseTensorCores(cuda::Dtype::kBFloat16, s.hidden, s.intermediate)) {
    return invalid("H and I must be multiples of 8");
  }
  if (wd[lead] != s.tokens() || gd[lead + 1] != s.hidden || gd[lead + 2] != 2 * s.intermediate ||
      dd[lead] != s.experts || dd[lead + 1] != s.intermediate || dd[lead + 2] != s.hidden) {
    return invalid("operand shapes disagree with " + blocks_name + " [ep, C, H], weights [ep*C, K], w_gate_up " +
                   "[E, H, 2I] and w_down [E, I, H]");
  }
  *shape = s;
  return ffi::Error::Success();
}

PushCall::PushCall(Workspace& workspace, Group& group, int first_rank, int shards, int64_t block, std::string what)
    : workspace_(workspace),
      group_(group),
      first_rank_(first_rank),
      shards_(shards),
      ep_(workspace.ranks),
      block_(block),
      what_(std::move(what)),
      side_(group.side_streams[first_rank]) {}

std::vector<int> PushCall::PeersOf(int me) const {
  std::vector<int> peers;
  for (int p = 0; p < ep_; ++p) {
    if (p != me) peers.push_back(p);
  }
  return peers;
}

char* PushCall::PushSlot(int dest, int source) const {
  return group_.peers.staging[dest] + (ep_ + source) * workspace_.block_bytes;
}

ffi::Error PushCall::GatherPeerRows(int shard, int64_t hidden, int64_t top_k, const int32_t* pair_of_row,
                                    const int32_t* source_offsets, int64_t local_experts, void* rows_out, int sms,
                                    uint64_t* group_counters) {
  const int me = rank(shard);
  cuda::SourceBlocks slots{};
  for (int s : PeersOf(me)) slots.rows[s] = PushSlot(me, s);
  const cuda::Status status =
      cuda::GatherSourceRows(slots, ((1u << ep_) - 1) & ~(1u << me), ep_, me, block_ / (hidden * 2), hidden, top_k,
                             pair_of_row, source_offsets, local_experts, rows_out, sms, group_counters, side_);
  return status.empty() ? ffi::Error::Success() : Fail("gathering the peers' rows: " + status);
}

bool PushCall::Write(uint64_t* counter, uint64_t value) const {
  // DEFAULT flags: the write is fenced after the DMAs enqueued before it on the side stream.
  return write_value_(reinterpret_cast<CUstream>(side_), reinterpret_cast<CUdeviceptr>(counter), value,
                      CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS;
}

ffi::Error PushCall::Fork(cudaStream_t stream) {
  if (!workspace_.overlap) return Fail("the workspace was created with overlap=False (no push slots)");
  if (block_ > workspace_.block_bytes) {
    return Fail("a block of " + std::to_string(block_) + " bytes does not fit the workspace's " +
                std::to_string(workspace_.block_bytes) + ": create it with a larger max_tokens");
  }
  write_value_ = cuda::LoadStreamWriteValue64();
  if (write_value_ == nullptr) return Fail("the driver has no cuStreamWriteValue64");
  call_.resize(shards_);
  for (int i = 0; i < shards_; ++i) call_[i] = ++group_.push_calls[rank(i)];
  return Resume(stream);
}

ffi::Error PushCall::Push(int shard, const char* blocks, int64_t stride) {
  const int me = rank(shard);
  const uint64_t f = call_[shard];
  std::vector<const uint64_t*> released;
  for (int d : PeersOf(me)) released.push_back(Signal(me, ReleasedSignal(ep_, d)));
  if (std::string status = EnqueueWaitForPeers(released, PeersOf(me), f - 1, me, false, workspace_.timeout_ns, side_);
      !status.empty()) {
    return Fail("waiting for the peers' push slots: " + status);
  }
  for (int d : PeersOf(me)) {
    if (cudaMemcpyAsync(PushSlot(d, me), blocks + d * stride, block_, cudaMemcpyDefault, side_) != cudaSuccess ||
        !Write(Signal(d, PushedSignal(ep_, me)), f)) {
      return Fail("cannot enqueue the push to shard " + std::to_string(d));
    }
  }
  return ffi::Error::Success();
}

ffi::Error PushCall::AwaitPushes(int shard) {
  const int me = rank(shard);
  std::vector<const uint64_t*> pushed;
  for (int s : PeersOf(me)) pushed.push_back(Signal(me, PushedSignal(ep_, s)));
  if (std::string status =
          EnqueueWaitForPeers(pushed, PeersOf(me), call_[shard], me, true, workspace_.timeout_ns, side_);
      !status.empty()) {
    return Fail("waiting for the peers' rows: " + status);
  }
  return ffi::Error::Success();
}

ffi::Error PushCall::CopyOutAndRelease(int shard, const char* own, char* out) {
  const int me = rank(shard);
  for (int s = 0; s < ep_; ++s) {
    const char* from = s == me ? own : PushSlot(me, s);
    if (from == nullptr) continue;
    if (cudaMemcpyAsync(out + s * block_, from, block_, cudaMemcpyDefault, side_) != cudaSuccess) {
      return Fail("cannot enqueue the copy of the received rows");
    }
  }
  return Release(shard);
}

ffi::Error PushCall::Release(int shard) {
  const int me = rank(shard);
  for (int s : PeersOf(me)) {
    if (!Write(Signal(s, ReleasedSignal(ep_, me)), call_[shard])) {
      return Fail("cannot release shard " + std::to_string(s) + "'s push slot");
    }
  }
  return ffi::Error::Success();
}

ffi::Error PushCall::PushAndCopyOut(cudaStream_t stream, const std::vector<const char*>& blocks,
                                    const std::vector<const char*>& owns, const std::vector<char*>& outs) {
  if (auto err = Fork(stream); err.failure()) return err;
  for (int i = 0; i < shards_; ++i) {
    if (auto err = Push(i, blocks[i], block_); err.failure()) return err;
  }
  for (int i = 0; i < shards_; ++i) {
    if (auto err = AwaitPushes(i); err.failure()) return err;
    if (auto err = CopyOutAndRelease(i, owns[i], outs[i]); err.failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::Error PushCall::Join(cudaStream_t stream) {
  if (cudaEventRecord(group_.joins[first_rank_], side_) != cudaSuccess ||
      cudaStreamWaitEvent(stream, group_.joins[first_rank_]) != cudaSuccess) {
    return Fail("cannot join the side stream");
  }
  return ffi::Error::Success();
}

ffi::Error PushCall::Resume(cudaStream_t stream) {
  if (cudaEventRecord(group_.forks[first_rank_], stream) != cudaSuccess ||
      cudaStreamWaitEvent(side_, group_.forks[first_rank_]) != cudaSuccess) {
    return Fail("cannot make the side stream wait for XLA's stream");
  }
  return ffi::Error::Success();
}

}  // namespace jmm::nvlink
