// The FFI handler `jmm_cuda_nvlink_moe_backward`: stage 2's overlapped backward of the nvlink transport
// (docs/nvlink_design.md, "Stage 2, second step" and "third step"). One call per shard does what stage 1 does with
// the exchange of the results' cotangent to the experts, `moe_backward` on the received rows and the reverse exchange
// of their dx, with the same results bit for bit, but moves both by the copy engines: dy while XLA's stream gathers
// the own rows' dy, dx while the last GEMM of the backward runs:
//
//   XLA's stream S ─ fork ─ gather own dy rows ─ wait(join) ─ backward from dy rows through dx ─ fork ── wait(join) ─▶
//     S2: push my d_returned block d to peer d ─ wait for the peers' ─ gather their dy rows from the push slots (on
//         every SM) ─ release the slots ─ join
//     S:  gather x ─ d_w_gate_up GEMM (all SMs: with one block of x, the side stream's wait below follows it)
//     S2: wait: peers released my push slots ─ DMA my dx block d into peer d's push slot, stream-write `pushed`
//         there ─ wait: every peer's dx pushed here ─ DMA them and my own block into d_send (or S sums them) ─
//         stream-write `released` into each peer ─ join
//
// Both transfers are stage 2's push protocol (jmm/nvlink_push.h), one push call each. d_returned may be one block
// for every source (the cotangent of the results' sum, when the forward took x itself as every destination's block):
// then that block goes to every peer, and d_send is one block too, x's cotangent: dx summed over the sources in
// rows.sum_blocks' order, which XLA's stream adds up from the own block and the push slots after the last GEMM
// (join), before the side stream releases the slots (resume). The dy rows are gathered from their source blocks as
// the forward gathers x's (GatherSourceRows, by source_offsets), into the rows MoeBackward would gather them to, so
// nothing copies the blocks out first. A push moves a whole block of C rows: the cotangent of a returned row past the
// live ones is zero (the source's combine reads only live rows), and the received rows past the live ones have no
// pairs (their ids are the exchange's -1 fill), so their dx is zero: both as the exchanges' fill. Emulated workspaces run every shard of the call: each push call's pushes for every
// shard before any shard's wait, S each shard's backward through dx, then each shard's d_w_gate_up GEMM.
#include <cuda_runtime.h>

#include <string>
#include <string_view>
#include <vector>

#include "jmm/cuda_handler.h"
#include "jmm/handlers.h"
#include "jmm/moe_backward_cuda.h"
#include "jmm/moe_host.h"
#include "jmm/nvlink_forward.h"
#include "jmm/nvlink_push.h"
#include "jmm/nvlink_workspace.h"

namespace jmm {

namespace {

// dx [tokens, H] bf16 first, then the moe_backward's own temporaries.
size_t ShardWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate, int64_t experts) {
  return cuda::ScratchFootprint(tokens * hidden * 2) +
         MoeBackwardWorkspaceBytes(true, tokens, top_k, hidden, intermediate, experts);
}

}  // namespace

size_t NvlinkBackwardWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                    int64_t experts) {
  return ShardWorkspaceBytes(tokens, top_k, hidden, intermediate, experts);
}

namespace nvlink {
namespace {

ffi::Error Invalid(const std::string& message) { return InvalidArgument("nvlink overlapped backward: " + message); }

ffi::Error NvlinkMoeBackward(cudaStream_t stream, int32_t device, ffi::AnyBuffer d_returned, ffi::AnyBuffer recv_x,
                             ffi::AnyBuffer weights, ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                             ffi::AnyBuffer gate_up, ffi::Buffer<ffi::S32> row_of_pair,
                             ffi::Buffer<ffi::S32> pair_of_row, ffi::Buffer<ffi::S32> source_offsets,
                             ffi::Buffer<ffi::S32> expert_offsets,
                             ffi::Result<ffi::AnyBuffer> d_send, ffi::Result<ffi::AnyBuffer> d_weights,
                             ffi::Result<ffi::AnyBuffer> d_w_gate_up, ffi::Result<ffi::AnyBuffer> d_w_down,
                             ffi::Result<ffi::AnyBuffer> dz, ffi::Result<ffi::Buffer<ffi::U8>> scratch,
                             int64_t workspace_id, std::string_view gemm_tiles) {
  OverlappedShape shape;
  if (auto err = ReadOverlappedShape(workspace_id, device, recv_x, weights, w_gate_up, w_down,
                                     "nvlink overlapped backward", "recv_x", /*one_block_allowed=*/false, &shape);
      err.failure()) {
    return err;
  }
  RowsGemmTiles tiles;
  if (auto err = ReadGemmTiles(gemm_tiles, &tiles); err.failure()) return err;
  const int ep = shape.ep, shards = shape.shards;
  const int64_t capacity = shape.capacity, H = shape.hidden, K = shape.top_k, E = shape.experts;
  const int64_t I = shape.intermediate, tokens = shape.tokens(), rows = shape.rows();
  for (const ffi::AnyBuffer* b : {&d_returned, &gate_up}) {
    if (b->element_type() != ffi::BF16) return Invalid("d_returned and gate_up must be bfloat16");
  }
  // d_returned holds a block per source, or one for all of them (the cotangent of their sum).
  const bool one_dy_block = ep > 1 && d_returned.size_bytes() * ep == recv_x.size_bytes();
  if ((d_returned.size_bytes() != recv_x.size_bytes() && !one_dy_block) ||
      gate_up.element_count() != static_cast<size_t>(shards * rows * 2 * I) ||
      row_of_pair.element_count() != static_cast<size_t>(shards * rows) ||
      pair_of_row.element_count() != static_cast<size_t>(shards * rows) ||
      source_offsets.element_count() != static_cast<size_t>(shards * (ep * E + 1)) ||
      expert_offsets.element_count() != static_cast<size_t>(shards * (E + 1)) ||
      d_send->size_bytes() != d_returned.size_bytes() || d_weights->size_bytes() != weights.size_bytes() ||
      d_w_gate_up->size_bytes() != w_gate_up.size_bytes() || d_w_down->size_bytes() != w_down.size_bytes() ||
      dz->size_bytes() != gate_up.size_bytes()) {
    return Invalid("d_returned [ep or 1, C, H] (d_send: the same), the layout or the result shapes disagree with "
                   "recv_x [ep, C, H], weights [ep*C, K] and the expert weights");
  }
  const size_t shard_bytes = ShardWorkspaceBytes(tokens, K, H, I, E);
  if (scratch->element_count() < shards * shard_bytes) {
    return Invalid("the workspace result holds " + std::to_string(scratch->element_count()) + " bytes, the call needs " +
                   std::to_string(shards * shard_bytes));
  }
  if (recv_x.size_bytes() == 0) return ffi::Error::Success();

  DeviceGuard guard;
  if (cudaSetDevice(device) != cudaSuccess) return Invalid("cannot select GPU " + std::to_string(device));
  const int64_t block = capacity * H * 2;
  const auto at = [](const auto& buffer, int shard, int64_t shard_bytes) {
    return static_cast<char*>(const_cast<void*>(buffer.untyped_data())) + shard * shard_bytes;
  };
  std::vector<WorkspaceCursor> cursors;
  std::vector<MoeBackward> backwards;
  std::vector<char*> dxs(shards);
  std::vector<void*> dy_rows(shards);
  cursors.reserve(shards);
  backwards.reserve(shards);
  for (int i = 0; i < shards; ++i) {
    cursors.emplace_back(scratch->typed_data() + i * shard_bytes, shard_bytes);
    cuda::Scratch alloc = cursors[i].scratch();
    dxs[i] = static_cast<char*>(alloc(tokens * H * 2));
    if (dxs[i] == nullptr) return Internal("nvlink backward", "out of scratch memory");
    const MoeBackwardCall call{cuda::Dtype::kBFloat16, tokens, K, H, I, E, tiles,
                               /*dy=*/nullptr, at(recv_x, i, ep * block),
                               reinterpret_cast<const float*>(at(weights, i, tokens * K * 4)),
                               at(w_gate_up, i, E * H * 2 * I * 2), at(w_down, i, E * I * H * 2),
                               at(gate_up, i, rows * 2 * I * 2),
                               row_of_pair.typed_data() + i * rows, pair_of_row.typed_data() + i * rows,
                               expert_offsets.typed_data() + i * (E + 1),
                               dxs[i], at(*d_w_gate_up, i, E * H * 2 * I * 2), at(*d_w_down, i, E * I * H * 2),
                               at(*dz, i, rows * 2 * I * 2),
                               reinterpret_cast<float*>(at(*d_weights, i, tokens * K * 4))};
    backwards.emplace_back(call, alloc);
    dy_rows[i] = backwards[i].GatheredDy();
    if (dy_rows[i] == nullptr) return Internal("nvlink backward", "out of scratch memory");
  }

  // The results' cotangent to the experts. Side stream: the pushes, then each shard's wait for its peers' blocks,
  // the gather of their dy rows on every SM, and the release. XLA's stream meanwhile gathers the own rows' dy.
  const auto rows_of = [&](int i) { return pair_of_row.typed_data() + i * rows; };
  const auto source_offsets_of = [&](int i) { return source_offsets.typed_data() + i * (ep * E + 1); };
  const int64_t dy_stride = one_dy_block ? 0 : block;
  const auto dy_blocks = [&](int i) { return at(d_returned, i, (one_dy_block ? 1 : ep) * block); };
  PushCall there(*shape.workspace, *shape.group, shape.first_rank, shards, block, "nvlink backward dy");
  if (auto err = there.Fork(stream); err.failure()) return err;
  for (int i = 0; i < shards; ++i) {
    if (auto err = there.Push(i, dy_blocks(i), dy_stride); err.failure()) return err;
  }
  for (int i = 0; i < shards; ++i) {
    if (auto err = there.AwaitPushes(i); err.failure()) return err;
    if (auto err = there.GatherPeerRows(i, H, K, rows_of(i), source_offsets_of(i), E, dy_rows[i], shape.sms, nullptr);
        err.failure()) {
      return err;
    }
    if (auto err = there.Release(i); err.failure()) return err;
  }
  for (int i = 0; i < shards; ++i) {
    const int me = there.rank(i);
    cuda::SourceBlocks own{};
    own.rows[me] = dy_blocks(i) + me * dy_stride;
    JMM_CUDA_TRY("nvlink backward own dy gather",
                 cuda::GatherSourceRows(own, 1u << me, ep, me, capacity, H, K, rows_of(i), source_offsets_of(i), E,
                                        dy_rows[i], shape.sms - kPushSMs, nullptr, stream));
  }
  if (auto err = there.Join(stream); err.failure()) return err;
  // XLA's stream: each shard's backward up to its dx. Then the side stream sends the dx blocks back.
  for (MoeBackward& backward : backwards) {
    if (auto err = backward.FromGatheredDy(stream); err.failure()) return err;
  }
  PushCall push(*shape.workspace, *shape.group, shape.first_rank, shards, block, "nvlink backward dx");
  const auto last_gemms = [&]() -> ffi::Error {  // XLA's stream, beside the dx push: each shard's d_w_gate_up GEMM
    for (MoeBackward& backward : backwards) {
      if (auto err = backward.GateUpWeightGradient(stream); err.failure()) return err;
    }
    return ffi::Error::Success();
  };
  if (!one_dy_block) {
    std::vector<const char*> dx_blocks(shards), own_dx(shards);
    std::vector<char*> d_sends(shards);
    for (int i = 0; i < shards; ++i) {
      dx_blocks[i] = dxs[i];
      own_dx[i] = dxs[i] + push.rank(i) * block;
      d_sends[i] = at(*d_send, i, ep * block);
    }
    if (auto err = push.PushAndCopyOut(stream, dx_blocks, own_dx, d_sends); err.failure()) return err;
    if (auto err = last_gemms(); err.failure()) return err;
    return push.Join(stream);
  }
  // One block of x went to every destination: d_send is its cotangent, dx summed over the sources, which XLA's
  // stream adds up straight from the push slots once the last GEMM is done and the peers' blocks are in; then the
  // side stream releases the slots. The side stream waits for the peers' blocks only after the last GEMM: that GEMM
  // takes every SM, and a wait kernel spinning beside it (while a late peer's block is on its way) would hold one
  // of them and delay the GEMM's last tiles by as long (180 us on one GPU in the timeline of 2026-11-30 16:28 UTC).
  if (auto err = push.Fork(stream); err.failure()) return err;
  for (int i = 0; i < shards; ++i) {
    if (auto err = push.Push(i, dxs[i], block); err.failure()) return err;
  }
  if (auto err = last_gemms(); err.failure()) return err;
  if (auto err = push.Resume(stream); err.failure()) return err;
  for (int i = 0; i < shards; ++i) {
    if (auto err = push.AwaitPushes(i); err.failure()) return err;
  }
  if (auto err = push.Join(stream); err.failure()) return err;
  for (int i = 0; i < shards; ++i) {
    cuda::SummedBlocks parts;
    parts.count = ep;
    for (int s = 0; s < ep; ++s) parts.rows[s] = s == push.rank(i) ? dxs[i] + s * block : push.Received(i, s);
    JMM_CUDA_TRY("nvlink backward dx sum",
                 cuda::SumBlocks(cuda::Dtype::kBFloat16, parts, capacity, H, at(*d_send, i, block), stream));
  }
  if (auto err = push.Resume(stream); err.failure()) return err;
  for (int i = 0; i < shards; ++i) {
    if (auto err = push.Release(i); err.failure()) return err;
  }
  return push.Join(stream);
}

}  // namespace
}  // namespace nvlink
}  // namespace jmm

// Not CUDA-graph compatible, like the exchange: the values its signals carry advance with every call. dz is
// written over gate_up (the caller aliases them), as in the moe_backward contract (jmm/handlers.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_nvlink_moe_backward, jmm::nvlink::NvlinkMoeBackward,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()                // d_returned [ep or 1, C, H]
                                  .Arg<xla::ffi::AnyBuffer>()                // recv_x [ep, C, H]
                                  .Arg<xla::ffi::AnyBuffer>()                // weights [ep*C, K] f32
                                  .Arg<xla::ffi::AnyBuffer>()                // w_gate_up [E, H, 2I]
                                  .Arg<xla::ffi::AnyBuffer>()                // w_down [E, I, H]
                                  .Arg<xla::ffi::AnyBuffer>()                // gate_up [ep*C*K, 2I]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // row_of_pair
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // pair_of_row
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // source_offsets [E*ep + 1]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // expert_offsets [E + 1]
                                  .Ret<xla::ffi::AnyBuffer>()                // d_send [ep, C, H]
                                  .Ret<xla::ffi::AnyBuffer>()                // d_weights [ep*C, K] f32
                                  .Ret<xla::ffi::AnyBuffer>()                // d_w_gate_up [E, H, 2I]
                                  .Ret<xla::ffi::AnyBuffer>()                // d_w_down [E, I, H]
                                  .Ret<xla::ffi::AnyBuffer>()                // dz (aliased to gate_up)
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()     // workspace (temporaries)
                                  .Attr<int64_t>("workspace")
                                  .Attr<std::string_view>("gemm_tiles"));
