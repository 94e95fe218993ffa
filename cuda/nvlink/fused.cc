// The FFI handler `jmm_cuda_nvlink_moe_forward`: stage 2's overlapped forward of the nvlink transport
// (docs/nvlink_design.md, "Stage 2, first step"). One call per shard does what stage 1 does with an exchange of the
// token rows, `moe_forward` on the received rows and the reverse exchange of their results, with the same results bit
// for bit, but moves the rows and the results by the copy engines and gathers the peers' rows beside the expert GEMM:
//
//   XLA's stream S ─ fork ───────────────────────────────────────────────────────────────────── wait(join) ─▶
//     S:  gather own rows ─ gate_up GEMM: own groups at once, each peer group waits for its rows ─ SwiGLU ─ down
//         GEMM of the peers' rows ─ combine the peers' tokens ─ fork ─ down GEMM of the own rows ─ combine the own
//         tokens into `returned`'s own block
//     S2: wait: peers released my push slots ─ DMA my block d into peer d's push slot, stream-write `pushed` there ─
//         wait: every peer's rows pushed here ─ gather them group by group in the GEMM's order (one block on each of
//         the 16 SMs the GEMM leaves), counting each group's finished warps ─ DMA them into recv_x (the backward's
//         operand) ─ stream-write `released` into each peer ─ (after the second fork) the same protocol on the peers'
//         results: push result block d back to peer d, wait for the peers', DMA them into `returned` ─ join
//
// Both transfers are stage 2's push protocol (jmm/nvlink_push.h), one push call each: the copy engines move the
// blocks, stream writes of the call count f signal them, and the waits are bounded. The results' push overlaps the
// own rows' down GEMM. Both down GEMMs use one fixed tile configuration (the gated kernel's, 128 x 256 cooperative),
// not JMM_GEMM_TILES. The results of received rows past the live ones are zero (they have no pairs), as the reverse
// exchange's fill. A push moves a whole block (C rows; its size is fixed on the host): the rows past the live ones
// are dispatch_rows' zero fill, so recv_x equals the exchange's, fill included.
// `send` may also be one block, x itself, for every destination (an uncompacted plan, C = T): the rows of tokens not
// sent to a destination then carry data there, but no pair reads them, so their results are zero all the same.
// `returned` is then one block too, the results summed per token over the sources (rows.sum_blocks): S waits for the
// peers' result blocks after the own rows' down GEMM (join), combines the own tokens and adds the peers' blocks
// straight from the push slots in one pass (CombineRowsIntoSum), and only then does S2 release the slots (resume).
// The per-group counters live in the call's own workspace result, zeroed on S before the fork: nothing outside
// this call reads or writes them, so they need no epochs. The gate_up GEMM runs on all SMs but kSideSMs; its waits
// only lag when the side stream's do, and trap after the same bound.
// Emulated workspaces run every shard of the call: S2 holds all pushes, then each shard's wait, gather and release;
// S the shards' expert work one after another. S2 waits for S only to release push slots that S has read, after S
// has waited for every push of the call, so this cannot deadlock, and the GEMMs wait.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "jmm/cuda_handler.h"
#include "jmm/handlers.h"
#include "jmm/moe_host.h"
#include "jmm/nvlink_forward.h"
#include "jmm/nvlink_push.h"
#include "jmm/nvlink_workspace.h"

namespace jmm {

namespace {

// SMs left free of the GEMM for the side gather: at EP = 2, q30, 16 was the fastest of 4-32 (stage2_forward_bench,
// 2026-11-30, docs/nvlink_design.md). The gather's blocks each fill an SM, so it takes exactly these.
constexpr int kSideSMs = 16;

// The sum of the results takes one part per source (CombineRowsIntoSum).
static_assert(cuda::SummedBlocks::kMaxParts >= nvlink::kMaxRanks);

size_t ShardWorkspaceBytes(int64_t tokens, int64_t rows, int64_t hidden, int64_t intermediate, int64_t groups) {
  return cuda::ScratchFootprint(groups * sizeof(uint64_t)) + cuda::ScratchFootprint(tokens * hidden * 2) +
         cuda::ScratchFootprint(rows * hidden * 2) +
         cuda::ScratchFootprint(rows * intermediate * 2) +
         3 * cuda::SourceGroupsGemmScratchBytes(groups);  // gated gate_up, then the peers' and the own down GEMM
}

}  // namespace

size_t NvlinkForwardWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                   int64_t groups) {
  return ShardWorkspaceBytes(tokens, tokens * top_k, hidden, intermediate, groups);
}

namespace nvlink {
namespace {

ffi::Error Invalid(const std::string& message) { return InvalidArgument("nvlink overlapped forward: " + message); }

// One shard's operands and results.
struct ShardCall {
  const char* send;      // block d at send + d * send_stride
  int64_t send_stride;   // 0 when one block goes to every destination
  const float* weights;
  const char *w_gate_up, *w_down;
  const int32_t *row_of_pair, *pair_of_row, *source_offsets, *expert_offsets;
  char *recv_x, *returned, *gate_up;
  uint8_t* scratch;
};

ffi::Error NvlinkMoeForward(cudaStream_t stream, int32_t device, ffi::AnyBuffer send,
                            ffi::AnyBuffer weights, ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                            ffi::Buffer<ffi::S32> row_of_pair, ffi::Buffer<ffi::S32> pair_of_row,
                            ffi::Buffer<ffi::S32> source_offsets, ffi::Buffer<ffi::S32> expert_offsets,
                            ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> returned,
                            ffi::Result<ffi::AnyBuffer> gate_up, ffi::Result<ffi::Buffer<ffi::U8>> scratch,
                            int64_t workspace_id) {
  OverlappedShape shape;
  if (auto err = ReadOverlappedShape(workspace_id, device, send, weights, w_gate_up, w_down,
                                     "nvlink overlapped forward", "send", /*one_block_allowed=*/true, &shape);
      err.failure()) {
    return err;
  }
  const int ep = shape.ep, shards = shape.shards;
  const int64_t capacity = shape.capacity, H = shape.hidden, K = shape.top_k, E = shape.experts;
  const int64_t I = shape.intermediate, tokens = shape.tokens(), rows = shape.rows(), groups = ep * E;
  if (row_of_pair.element_count() != static_cast<size_t>(shards * rows) ||
      pair_of_row.element_count() != static_cast<size_t>(shards * rows) ||
      source_offsets.element_count() != static_cast<size_t>(shards * (groups + 1)) ||
      expert_offsets.element_count() != static_cast<size_t>(shards * (E + 1)) ||
      returned->size_bytes() != send.size_bytes() ||
      send.size_bytes() * (shape.one_block ? ep : 1) != recv_x->size_bytes() ||
      gate_up->element_count() != static_cast<size_t>(shards * rows * 2 * I)) {
    return Invalid("the layout or result shapes disagree with send [ep or 1, C, H] (returned: the same) and "
                   "weights [ep*C, K]");
  }
  const size_t shard_bytes = ShardWorkspaceBytes(tokens, rows, H, I, groups);
  if (scratch->element_count() < shards * shard_bytes) {
    return Invalid("the workspace result holds " + std::to_string(scratch->element_count()) + " bytes, the call needs " +
                   std::to_string(shards * shard_bytes));
  }
  if (send.size_bytes() == 0) return ffi::Error::Success();

  const int64_t block = capacity * H * 2, send_stride = shape.one_block ? 0 : block;
  std::vector<ShardCall> calls(shards);
  for (int i = 0; i < shards; ++i) {
    calls[i] = ShardCall{static_cast<const char*>(send.untyped_data()) + i * (shape.one_block ? 1 : ep) * block,
                         send_stride,
                         static_cast<const float*>(weights.untyped_data()) + i * tokens * K,
                         static_cast<const char*>(w_gate_up.untyped_data()) + i * E * H * 2 * I * 2,
                         static_cast<const char*>(w_down.untyped_data()) + i * E * I * H * 2,
                         row_of_pair.typed_data() + i * rows,
                         pair_of_row.typed_data() + i * rows,
                         source_offsets.typed_data() + i * (groups + 1),
                         expert_offsets.typed_data() + i * (E + 1),
                         static_cast<char*>(recv_x->untyped_data()) + i * ep * block,
                         static_cast<char*>(returned->untyped_data()) + i * (shape.one_block ? 1 : ep) * block,
                         static_cast<char*>(gate_up->untyped_data()) + i * rows * 2 * I * 2,
                         scratch->typed_data() + i * shard_bytes};
  }

  DeviceGuard guard;
  if (cudaSetDevice(device) != cudaSuccess) return Invalid("cannot select GPU " + std::to_string(device));
  // Each shard's temporaries, and its per-group counters zeroed before the side stream forks off.
  std::vector<WorkspaceCursor> cursors;
  std::vector<uint64_t*> group_counters(shards);
  std::vector<void*> x_perms(shards), hs(shards);
  std::vector<char*> ys(shards);  // each received token's result, summed over its pairs: the blocks that go back
  cursors.reserve(shards);
  for (int i = 0; i < shards; ++i) {
    cursors.emplace_back(calls[i].scratch, shard_bytes);
    cuda::Scratch alloc = cursors[i].scratch();
    group_counters[i] = static_cast<uint64_t*>(alloc(groups * sizeof(uint64_t)));
    x_perms[i] = alloc(rows * H * 2);
    hs[i] = alloc(rows * I * 2);
    ys[i] = static_cast<char*>(alloc(tokens * H * 2));
    if (group_counters[i] == nullptr || x_perms[i] == nullptr || hs[i] == nullptr || ys[i] == nullptr) {
      return Internal("nvlink forward", "out of scratch memory");
    }
    if (cudaMemsetAsync(group_counters[i], 0, groups * sizeof(uint64_t), stream) != cudaSuccess) {
      return Internal("nvlink forward", "cannot zero the group counters");
    }
  }
  PushCall push(*shape.workspace, *shape.group, shape.first_rank, shards, block, "nvlink forward rows");
  if (auto err = push.Fork(stream); err.failure()) return err;
  // Side stream: every shard's push, then each shard's wait for its peers' rows, their gather for the GEMM, their
  // copy into recv_x (the backward's operand) and their release.
  for (int i = 0; i < shards; ++i) {
    if (auto err = push.Push(i, calls[i].send, calls[i].send_stride); err.failure()) return err;
  }
  for (int i = 0; i < shards; ++i) {
    if (auto err = push.AwaitPushes(i); err.failure()) return err;
    if (auto err = push.GatherPeerRows(i, H, K, calls[i].pair_of_row, calls[i].source_offsets, E, x_perms[i],
                                       kSideSMs, group_counters[i]);
        err.failure()) {
      return err;
    }
    if (auto err = push.CopyOutAndRelease(i, calls[i].send + push.rank(i) * calls[i].send_stride, calls[i].recv_x);
        err.failure()) {
      return err;
    }
  }

  // XLA's stream: each shard's expert forward, its own rows first, on the SMs the side stream leaves.
  const int sm_count = shape.sms - kSideSMs;
  for (int i = 0; i < shards; ++i) {
    const ShardCall& c = calls[i];
    const int me = shape.first_rank + i;
    cuda::Scratch alloc = cursors[i].scratch();
    cuda::SourceBlocks own{};
    own.rows[me] = c.send + me * c.send_stride;
    JMM_CUDA_TRY("nvlink forward own gather",
                 cuda::GatherSourceRows(own, 1u << me, ep, me, capacity, H, K, c.pair_of_row, c.source_offsets, E,
                                        x_perms[i], shape.sms - kPushSMs, nullptr, stream));
    JMM_CUDA_TRY("nvlink forward gate_up GEMM",
                 cuda::GatedGateUpGemm(x_perms[i], c.w_gate_up, c.gate_up, c.source_offsets, ep, me, E, 2 * I, H,
                                       group_counters[i], cuda::GatherArrivalsPerGroup(kSideSMs),
                                       shape.workspace->timeout_ns, sm_count, alloc, stream));
    JMM_CUDA_TRY("nvlink forward swiglu", cuda::SwigluForward(cuda::Dtype::kBFloat16, c.gate_up, hs[i],
                                                              c.expert_offsets, E, rows, I, stream));
    void* row_out = x_perms[i];  // x_perm is dead after the gate_up GEMM
    JMM_CUDA_TRY("nvlink forward peers' down GEMM",
                 cuda::SourceRowsGemm(hs[i], c.w_down, row_out, c.source_offsets, ep, me, E, /*own=*/false, H, I,
                                      shape.sms, alloc, stream));
    for (int s = 0; s < ep; ++s) {
      if (s == me) continue;
      JMM_CUDA_TRY("nvlink forward combine",
                   cuda::CombineRows(cuda::Dtype::kBFloat16, row_out, c.row_of_pair + s * capacity * K,
                                     c.weights + s * capacity * K, capacity, K, H, ys[i] + s * block, stream));
    }
  }
  // The peers' results travel back while the own rows' down GEMM runs, on all SMs but the one that the side stream's
  // waits need (kPushSMs).
  PushCall back(*shape.workspace, *shape.group, shape.first_rank, shards, block, "nvlink forward results");
  const auto own_down_gemm = [&](int i) -> ffi::Error {
    const ShardCall& c = calls[i];
    cuda::Scratch alloc = cursors[i].scratch();
    JMM_CUDA_TRY("nvlink forward own down GEMM",
                 cuda::SourceRowsGemm(hs[i], c.w_down, x_perms[i], c.source_offsets, ep, back.rank(i), E,
                                      /*own=*/true, H, I, shape.sms - kPushSMs, alloc, stream));
    return ffi::Error::Success();
  };
  const auto own_pairs = [&](int i) { return calls[i].row_of_pair + back.rank(i) * capacity * K; };
  const auto own_weights = [&](int i) { return calls[i].weights + back.rank(i) * capacity * K; };
  if (!shape.one_block) {
    // `returned` gets every source's block: the peers' by the side stream, the own combined here.
    std::vector<const char*> y_blocks(ys.begin(), ys.end()), no_own(shards, nullptr);
    std::vector<char*> returned_blocks(shards);
    for (int i = 0; i < shards; ++i) returned_blocks[i] = calls[i].returned;
    if (auto err = back.PushAndCopyOut(stream, y_blocks, no_own, returned_blocks); err.failure()) return err;
    for (int i = 0; i < shards; ++i) {
      if (auto err = own_down_gemm(i); err.failure()) return err;
      JMM_CUDA_TRY("nvlink forward own combine",
                   cuda::CombineRows(cuda::Dtype::kBFloat16, x_perms[i], own_pairs(i), own_weights(i), capacity, K, H,
                                     calls[i].returned + back.rank(i) * block, stream));
    }
  } else {
    // x was every destination's block: `returned` is the results summed per token, which the own combine adds up
    // straight from the push slots once they are in; then the side stream releases them.
    if (auto err = back.Fork(stream); err.failure()) return err;
    for (int i = 0; i < shards; ++i) {
      if (auto err = back.Push(i, ys[i], block); err.failure()) return err;
    }
    for (int i = 0; i < shards; ++i) {
      if (auto err = back.AwaitPushes(i); err.failure()) return err;
    }
    for (int i = 0; i < shards; ++i) {
      if (auto err = own_down_gemm(i); err.failure()) return err;
    }
    if (auto err = back.Join(stream); err.failure()) return err;
    for (int i = 0; i < shards; ++i) {
      cuda::SummedBlocks parts;
      parts.count = ep;
      parts.own = back.rank(i);
      for (int s = 0; s < ep; ++s) parts.rows[s] = s == parts.own ? nullptr : back.Received(i, s);
      JMM_CUDA_TRY("nvlink forward own combine and sum",
                   cuda::CombineRowsIntoSum(cuda::Dtype::kBFloat16, x_perms[i], own_pairs(i), own_weights(i),
                                            capacity, K, H, parts, calls[i].returned, stream));
    }
    if (auto err = back.Resume(stream); err.failure()) return err;
    for (int i = 0; i < shards; ++i) {
      if (auto err = back.Release(i); err.failure()) return err;
    }
  }
  if (auto err = push.Join(stream); err.failure()) return err;
  return back.Join(stream);
}

}  // namespace
}  // namespace nvlink
}  // namespace jmm

// Not CUDA-graph compatible, like the exchange: the values its signals carry advance with every call.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_nvlink_moe_forward, jmm::nvlink::NvlinkMoeForward,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()                // send [ep or 1, C, H]
                                  .Arg<xla::ffi::AnyBuffer>()                // weights [ep*C, K] f32
                                  .Arg<xla::ffi::AnyBuffer>()                // w_gate_up [E, H, 2I]
                                  .Arg<xla::ffi::AnyBuffer>()                // w_down [E, I, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // row_of_pair
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // pair_of_row
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // source_offsets [E*ep + 1]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // expert_offsets [E + 1]
                                  .Ret<xla::ffi::AnyBuffer>()                // recv_x [ep, C, H]
                                  .Ret<xla::ffi::AnyBuffer>()                // returned [ep, C, H]
                                  .Ret<xla::ffi::AnyBuffer>()                // gate_up [ep*C*K, 2I]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()     // workspace (temporaries)
                                  .Attr<int64_t>("workspace"));
