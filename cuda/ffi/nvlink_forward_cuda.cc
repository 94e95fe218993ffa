// The FFI handler `jmm_cuda_nvlink_moe_forward`: stage 2's overlapped forward of the nvlink transport
// (docs/nvlink_design.md, "Stage 2, first step"). One call per shard does what stage 1 does with an exchange of the
// token rows followed by `moe_forward` on the received rows, with the same results bit for bit, but lets the
// exchange run beside the expert GEMM:
//
//   XLA's stream S ─ fork ──────────────────────────────────────────────────────────── wait(join) ─▶
//     S:  gather own rows ─ gate_up GEMM: own groups at once, peer groups wait for `gathered` ─ SwiGLU ─ down ─ combine
//     S2: exchange (stage 1's kernels: send, receive into recv_x) ─ gather the peers' rows, bump `gathered` ─ join
//
// The GEMM runs on all SMs but kSideBlocks, which S2's kernels use; every wait is bounded (the exchange's, and
// the GEMM's on `gathered`, which only lags when the exchange does, whose own bounded wait reports first).
// Emulated workspaces run every shard of the call: S2 holds all the exchanges and all the peer gathers, S the
// shards' expert work one after another; S2 never waits for S, so this cannot deadlock, and the GEMMs really wait.
#include <cuda_runtime.h>

#include <string>
#include <string_view>
#include <vector>

#include "jmm/cuda_handler.h"
#include "jmm/handlers.h"
#include "jmm/moe_host.h"
#include "jmm/nvlink_forward.h"
#include "jmm/nvlink_workspace.h"

namespace jmm {

namespace {

// Thread blocks of the side gather, and SMs left free of the GEMM for it and the exchange. At EP = 2, q30, 16 was
// the fastest of 4-32 (stage2_forward_bench, 2026-11-30, docs/nvlink_design.md).
constexpr int kSideBlocks = 16;

size_t ShardWorkspaceBytes(int64_t rows, int64_t hidden, int64_t intermediate, int64_t groups) {
  return cuda::ScratchFootprint(rows * hidden * 2) + cuda::ScratchFootprint(rows * intermediate * 2) +
         cuda::GatedGateUpGemmScratchBytes(groups) + cuda::GroupedGemmScratchBytes(groups);
}

}  // namespace

size_t NvlinkForwardWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                   int64_t groups) {
  return ShardWorkspaceBytes(tokens * top_k, hidden, intermediate, groups);
}

namespace nvlink {
namespace {

ffi::Error Invalid(const std::string& message) { return InvalidArgument("nvlink overlapped forward: " + message); }

int MultiprocessorCount(int device) {
  int count = 0;
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count;
}

// One shard's operands and results.
struct ShardCall {
  const char* send;
  const int32_t *send_counts, *recv_counts;
  const float* weights;
  const char *w_gate_up, *w_down;
  const int32_t *row_of_pair, *pair_of_row, *source_offsets, *expert_offsets;
  char *recv_x, *y, *gate_up;
  uint8_t* scratch;
};

ffi::Error NvlinkMoeForward(cudaStream_t stream, int32_t device, ffi::AnyBuffer send,
                            ffi::Buffer<ffi::S32> send_counts, ffi::Buffer<ffi::S32> recv_counts,
                            ffi::AnyBuffer weights, ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                            ffi::Buffer<ffi::S32> row_of_pair, ffi::Buffer<ffi::S32> pair_of_row,
                            ffi::Buffer<ffi::S32> source_offsets, ffi::Buffer<ffi::S32> expert_offsets,
                            ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> gate_up, ffi::Result<ffi::Buffer<ffi::U8>> scratch,
                            int64_t workspace_id, std::string_view gemm_tiles) {
  Workspace* workspace = FindOpen(workspace_id);
  if (workspace == nullptr) return Invalid("workspace " + std::to_string(workspace_id) + " is closed or unknown");
  if (!Ready(*workspace)) return Invalid("the workspace's peers in other processes are not attached yet");
  int rank = 0;
  Group* group = GroupOf(*workspace, device, &rank);
  if (group == nullptr) return Invalid("GPU " + std::to_string(device) + " is not part of this workspace's mesh axis");
  RowsGemmTiles tiles;
  if (auto err = ReadGemmTiles(gemm_tiles, &tiles); err.failure()) return err;

  // Sizes; emulated calls carry every shard: a leading [ranks] on every operand and result.
  const int ep = workspace->ranks;
  const int shards = workspace->emulated ? ep : 1;
  const size_t lead = workspace->emulated ? 1 : 0;
  const auto sd = send.dimensions(), wd = weights.dimensions(), gd = w_gate_up.dimensions();
  if (sd.size() != lead + 3 || wd.size() != lead + 2 || gd.size() != lead + 3 || w_down.dimensions().size() != lead + 3 ||
      (lead && (sd[0] != ep || wd[0] != ep || gd[0] != ep)) || sd[lead] != ep) {
    return Invalid(workspace->emulated ? "an emulated workspace of " + std::to_string(ep) +
                                             " shards needs every operand batched over the shards (jax.vmap)"
                                       : "send must be [" + std::to_string(ep) + ", C, H]");
  }
  const int64_t capacity = sd[lead + 1], H = sd[lead + 2], K = wd[lead + 1], E = gd[lead];
  const int64_t I = gd[lead + 2] / 2, tokens = ep * capacity, rows = tokens * K, groups = ep * E;
  for (const ffi::AnyBuffer* b : {&send, &w_gate_up, &w_down}) {
    if (b->element_type() != ffi::BF16) return Invalid("send, w_gate_up and w_down must be bfloat16");
  }
  if (weights.element_type() != ffi::F32) return Invalid("weights must be float32");
  if (!cuda::UseTensorCores(cuda::Dtype::kBFloat16, H, I)) return Invalid("H and I must be multiples of 8");
  if (wd[lead] != tokens || gd[lead + 1] != H || gd[lead + 2] != 2 * I ||
      w_down.element_count() != static_cast<size_t>(shards * E * I * H) ||
      row_of_pair.element_count() != static_cast<size_t>(shards * rows) ||
      pair_of_row.element_count() != static_cast<size_t>(shards * rows) ||
      source_offsets.element_count() != static_cast<size_t>(shards * (groups + 1)) ||
      expert_offsets.element_count() != static_cast<size_t>(shards * (E + 1)) ||
      send_counts.element_count() != static_cast<size_t>(shards * ep) ||
      recv_counts.element_count() != static_cast<size_t>(shards * ep) ||
      recv_x->size_bytes() != send.size_bytes() || y->size_bytes() != send.size_bytes() ||
      gate_up->element_count() != static_cast<size_t>(shards * rows * 2 * I)) {
    return Invalid("operand or result shapes disagree with send [ep, C, H], weights [ep*C, K] and the weights");
  }
  const size_t shard_bytes = ShardWorkspaceBytes(rows, H, I, groups);
  if (scratch->element_count() < shards * shard_bytes) {
    return Invalid("the workspace result holds " + std::to_string(scratch->element_count()) + " bytes, the call needs " +
                   std::to_string(shards * shard_bytes));
  }
  if (capacity * H * 2 > workspace->block_bytes) {
    return Invalid("a block of " + std::to_string(capacity) + " rows of " + std::to_string(H * 2) +
                   " bytes does not fit the workspace's " + std::to_string(workspace->block_bytes) +
                   ": create it with a larger max_tokens");
  }
  if (send.size_bytes() == 0) return ffi::Error::Success();

  const int64_t block = capacity * H * 2;
  std::vector<ShardCall> calls(shards);
  std::vector<Exchange> exchanges(shards);
  for (int i = 0; i < shards; ++i) {
    calls[i] = ShardCall{static_cast<const char*>(send.untyped_data()) + i * ep * block,
                         send_counts.typed_data() + i * ep,
                         recv_counts.typed_data() + i * ep,
                         static_cast<const float*>(weights.untyped_data()) + i * tokens * K,
                         static_cast<const char*>(w_gate_up.untyped_data()) + i * E * H * 2 * I * 2,
                         static_cast<const char*>(w_down.untyped_data()) + i * E * I * H * 2,
                         row_of_pair.typed_data() + i * rows,
                         pair_of_row.typed_data() + i * rows,
                         source_offsets.typed_data() + i * (groups + 1),
                         expert_offsets.typed_data() + i * (E + 1),
                         static_cast<char*>(recv_x->untyped_data()) + i * ep * block,
                         static_cast<char*>(y->untyped_data()) + i * ep * block,
                         static_cast<char*>(gate_up->untyped_data()) + i * rows * 2 * I * 2,
                         scratch->typed_data() + i * shard_bytes};
    exchanges[i] = Exchange{calls[i].send, calls[i].send_counts, calls[i].recv_counts, calls[i].recv_x, capacity,
                            H * 2, 0};
  }
  const int first_rank = workspace->emulated ? 0 : rank;
  // The gated GEMMs' target: each forward call's side gather adds kSideBlocks to its shard's `gathered`.
  std::vector<uint64_t> targets(shards);
  for (int i = 0; i < shards; ++i) targets[i] = ++group->forward_calls[first_rank + i] * kSideBlocks;

  DeviceGuard guard;
  if (cudaSetDevice(device) != cudaSuccess) return Invalid("cannot select GPU " + std::to_string(device));
  cudaStream_t side = group->side_streams[rank];
  if (cudaEventRecord(group->forks[rank], stream) != cudaSuccess ||
      cudaStreamWaitEvent(side, group->forks[rank]) != cudaSuccess) {
    return Internal("nvlink forward", "cannot fork the side stream");
  }
  // Side stream: the rows' exchange for every shard of the call, then each shard's gather of its peers' rows.
  if (std::string status = EnqueueExchange(group->peers, ep, first_rank, exchanges, workspace->block_bytes,
                                           workspace->blocks_per_peer, workspace->timeout_ns, side);
      !status.empty()) {
    return Internal("nvlink forward exchange", status);
  }
  std::vector<WorkspaceCursor> cursors;
  std::vector<void*> x_perms(shards), hs(shards);
  cursors.reserve(shards);
  for (int i = 0; i < shards; ++i) {
    cursors.emplace_back(calls[i].scratch, shard_bytes);
    cuda::Scratch alloc = cursors[i].scratch();
    x_perms[i] = alloc(rows * H * 2);
    hs[i] = alloc(rows * I * 2);
    if (x_perms[i] == nullptr || hs[i] == nullptr) return Internal("nvlink forward", "out of scratch memory");
    const int me = first_rank + i;
    cuda::SourceBlocks received{};
    for (int s = 0; s < ep; ++s) received.rows[s] = calls[i].recv_x + s * block;
    uint64_t* gathered = group->peers.signals[me] + GatheredSignal(ep);
    JMM_CUDA_TRY("nvlink forward peer gather",
                 cuda::GatherSourceRows(received, ((1u << ep) - 1) & ~(1u << me), ep, capacity, H, K,
                                        calls[i].pair_of_row, calls[i].source_offsets, E, x_perms[i], kSideBlocks,
                                        gathered, side));
  }
  if (cudaEventRecord(group->joins[rank], side) != cudaSuccess) {
    return Internal("nvlink forward", "cannot record the join event");
  }

  // XLA's stream: each shard's expert forward, its own rows first, on the SMs the side stream leaves.
  const int sm_count = MultiprocessorCount(device) - kSideBlocks;
  for (int i = 0; i < shards; ++i) {
    const ShardCall& c = calls[i];
    const int me = first_rank + i;
    cuda::Scratch alloc = cursors[i].scratch();
    cuda::SourceBlocks own{};
    own.rows[me] = c.send + me * block;
    JMM_CUDA_TRY("nvlink forward own gather",
                 cuda::GatherSourceRows(own, 1u << me, ep, capacity, H, K, c.pair_of_row, c.source_offsets, E,
                                        x_perms[i], 2 * MultiprocessorCount(device), nullptr, stream));
    JMM_CUDA_TRY("nvlink forward gate_up GEMM",
                 cuda::GatedGateUpGemm(x_perms[i], c.w_gate_up, c.gate_up, c.source_offsets, ep, me, E, 2 * I, H,
                                       group->peers.signals[me] + GatheredSignal(ep), targets[i],
                                       workspace->timeout_ns, sm_count, alloc, stream));
    JMM_CUDA_TRY("nvlink forward swiglu", cuda::SwigluForward(cuda::Dtype::kBFloat16, c.gate_up, hs[i],
                                                              c.expert_offsets, E, rows, I, stream));
    void* row_out = x_perms[i];  // x_perm is dead after the gate_up GEMM
    JMM_CUDA_TRY("nvlink forward down GEMM",
                 cuda::RowsGemm(cuda::Dtype::kBFloat16, true, hs[i], c.w_down, row_out, c.expert_offsets, E, rows, H,
                                I, /*b_transposed=*/false, tiles.fwd_down, alloc, stream));
    JMM_CUDA_TRY("nvlink forward combine", cuda::CombineRows(cuda::Dtype::kBFloat16, row_out, c.row_of_pair,
                                                             c.weights, tokens, K, H, c.y, stream));
  }
  if (cudaStreamWaitEvent(stream, group->joins[rank]) != cudaSuccess) {
    return Internal("nvlink forward", "cannot join the side stream");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nvlink
}  // namespace jmm

// Not CUDA-graph compatible, like the exchange: its epochs and `gathered` targets advance with every call.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_nvlink_moe_forward, jmm::nvlink::NvlinkMoeForward,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()                // send [ep, C, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // send_counts [ep]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // recv_counts [ep]
                                  .Arg<xla::ffi::AnyBuffer>()                // weights [ep*C, K] f32
                                  .Arg<xla::ffi::AnyBuffer>()                // w_gate_up [E, H, 2I]
                                  .Arg<xla::ffi::AnyBuffer>()                // w_down [E, I, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // row_of_pair
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // pair_of_row
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // source_offsets [E*ep + 1]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // expert_offsets [E + 1]
                                  .Ret<xla::ffi::AnyBuffer>()                // recv_x [ep, C, H]
                                  .Ret<xla::ffi::AnyBuffer>()                // y [ep*C, H]
                                  .Ret<xla::ffi::AnyBuffer>()                // gate_up [ep*C*K, 2I]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()     // workspace (temporaries)
                                  .Attr<int64_t>("workspace")
                                  .Attr<std::string_view>("gemm_tiles"));
