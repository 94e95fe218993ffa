// The push protocol (contract and diagram in nvlink/push.h).
#include "nvlink/push.h"

#include <cuda.h>

#include <utility>

#include "nvlink/exchange.h"

namespace jmm::nvlink {

PushCall::PushCall(const ShardSet& shards, int64_t block, std::string what)
    : shards_(shards),
      ep_(shards.ranks()),
      block_(block),
      what_(std::move(what)),
      side_(shards.group->side_streams[shards.first_rank]) {}

std::vector<int> PushCall::PeersOf(int me) const {
  std::vector<int> peers;
  for (int p = 0; p < ep_; ++p) {
    if (p != me) peers.push_back(p);
  }
  return peers;
}

const char* PushCall::Received(int shard, int source) const {
  return PushSlot(shards_.group->peers, ep_, shards_.workspace->block_bytes, rank(shard), source);
}

bool PushCall::Write(uint64_t* counter, uint64_t value) const {
  // DEFAULT flags: the write is fenced after the DMAs enqueued before it on the side stream.
  return write_value_(reinterpret_cast<CUstream>(side_), reinterpret_cast<CUdeviceptr>(counter), value,
                      CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS;
}

Status PushCall::Start(cudaStream_t stream, const std::function<const char*(int)>& blocks, int64_t stride) {
  if (block_ > shards_.workspace->block_bytes) {
    return Fail("a block of " + std::to_string(block_) + " bytes does not fit the workspace's " +
                std::to_string(shards_.workspace->block_bytes) + ": create it with a larger max_tokens");
  }
  write_value_ = LoadStreamWriteValue64();
  if (write_value_ == nullptr) return Fail("the driver has no cuStreamWriteValue64");
  call_.resize(shards_.count);
  for (int i = 0; i < shards_.count; ++i) call_[i] = ++shards_.group->push_calls[rank(i)];
  if (Status status = Resume(stream); !status.empty()) return status;
  return shards_.ForEach([&](int i) { return Push(i, blocks(i), stride); });
}

Status PushCall::Push(int shard, const char* blocks, int64_t stride) {
  const int me = rank(shard);
  const uint64_t f = call_[shard];
  const std::vector<int> peers = PeersOf(me);
  std::vector<const uint64_t*> released;
  for (int d : peers) released.push_back(Signal(me, ReleasedSignal(ep_, d)));
  if (Status status =
          EnqueueWaitForPeers(released, peers, f - 1, me, /*rows_arrive=*/false, shards_.workspace->timeout_ns, side_);
      !status.empty()) {
    return Fail("waiting for the peers' push slots: " + status);
  }
  for (int d : peers) {
    char* slot = PushSlot(shards_.group->peers, ep_, shards_.workspace->block_bytes, d, me);
    if (cudaMemcpyAsync(slot, blocks + d * stride, block_, cudaMemcpyDefault, side_) != cudaSuccess ||
        !Write(Signal(d, PushedSignal(ep_, me)), f)) {
      return Fail("cannot enqueue the push to shard " + std::to_string(d));
    }
  }
  return {};
}

Status PushCall::Receive(const std::function<Status(int)>& use, bool release) {
  if (call_.size() != static_cast<size_t>(shards_.count)) return Fail("Receive before Start");
  return shards_.ForEach([&](int i) -> Status {
    const int me = rank(i);
    const std::vector<int> peers = PeersOf(me);
    std::vector<const uint64_t*> pushed;
    for (int s : peers) pushed.push_back(Signal(me, PushedSignal(ep_, s)));
    if (Status status = EnqueueWaitForPeers(pushed, peers, call_[i], me, /*rows_arrive=*/true,
                                            shards_.workspace->timeout_ns, side_);
        !status.empty()) {
      return Fail("waiting for the peers' rows: " + status);
    }
    if (use) {
      if (Status status = use(i); !status.empty()) return status;
    }
    return release ? Release(i) : Status{};
  });
}

Status PushCall::ReleaseAll() {
  if (call_.size() != static_cast<size_t>(shards_.count)) return Fail("ReleaseAll before Start");
  return shards_.ForEach([&](int i) { return Release(i); });
}

Status PushCall::Release(int shard) {
  const int me = rank(shard);
  for (int s : PeersOf(me)) {
    if (!Write(Signal(s, ReleasedSignal(ep_, me)), call_[shard])) {
      return Fail("cannot release shard " + std::to_string(s) + "'s push slot");
    }
  }
  return {};
}

Status PushCall::CopyOut(int shard, const char* own, char* out) {
  const int me = rank(shard);
  for (int s = 0; s < ep_; ++s) {
    const char* from = s == me ? own : Received(shard, s);
    if (from == nullptr) continue;
    if (cudaMemcpyAsync(out + s * block_, from, block_, cudaMemcpyDefault, side_) != cudaSuccess) {
      return Fail("cannot enqueue the copy of the received rows");
    }
  }
  return {};
}

Status PushCall::Join(cudaStream_t stream) {
  cudaEvent_t join = shards_.group->joins[shards_.first_rank];
  if (cudaEventRecord(join, side_) != cudaSuccess || cudaStreamWaitEvent(stream, join) != cudaSuccess) {
    return Fail("cannot join the side stream");
  }
  return {};
}

Status PushCall::Resume(cudaStream_t stream) {
  cudaEvent_t fork = shards_.group->forks[shards_.first_rank];
  if (cudaEventRecord(fork, stream) != cudaSuccess || cudaStreamWaitEvent(side_, fork) != cudaSuccess) {
    return Fail("cannot make the side stream wait for XLA's stream");
  }
  return {};
}

}  // namespace jmm::nvlink
