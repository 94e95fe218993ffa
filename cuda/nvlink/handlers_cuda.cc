// The nvlink transport's FFI handlers, thin adapters: read the buffers, check them, call the transport
// (nvlink/exchange.h, nvlink/fused.h), map its status to an ffi::Error.
//
//   jmm_cuda_nvlink_exchange      the plain block exchange (the routing's ids and weights, the weights' cotangent)
//   jmm_cuda_nvlink_moe_gate_up   the rows' push + gather + gated gate_up GEMM
//   jmm_cuda_nvlink_moe_down      SwiGLU, down GEMMs split by source, the results' push back and the combine
//   jmm_cuda_nvlink_moe_backward  the backward of both, with the cotangents' pushes
// Emulated workspaces (every shard on one GPU) get every shard's operands in one call, batched along a leading
// shard axis by jax.vmap (vmap_method "broadcast_all"); a ShardSet (nvlink/workspace.h) says which shards a call runs,
// and shard i's part of every batched buffer is its i-th slice. None of these is CUDA-graph compatible: the values
// their signals carry advance with every call, so a replayed graph would fall out of step with the peers.
#include <cuda_runtime.h>

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "ffi/cuda_handler.h"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"
#include "kernels/moe_kernels.h"
#include "nvlink/exchange.h"
#include "nvlink/fused.h"
#include "nvlink/workspace.h"

namespace jmm::nvlink {
namespace {

// The trailing uint8 result XLA allocates for a call's temporaries (jmm::Workspace; nvlink::Workspace is the
// transport's memory).
using WorkspaceResult = ffi::Result<ffi::Buffer<ffi::U8>>;

// Shard i's slice of a buffer batched over the call's shards (the whole buffer when the call runs one shard).
template <class T = char>
T* Slice(const ffi::AnyBuffer& buffer, const ShardSet& shards, int shard) {
  char* base = static_cast<char*>(const_cast<void*>(buffer.untyped_data()));
  return reinterpret_cast<T*>(base + shard * (buffer.size_bytes() / shards.count));
}

// A buffer's dimensions per shard: after the shard axis, which an emulated call's buffers lead with. Null when the
// buffer does not have `rank` such dimensions (or its shard axis is not the shard count).
bool PerShard(const ffi::AnyBuffer& buffer, const ShardSet& shards, size_t rank, std::vector<int64_t>* dims) {
  const auto all = buffer.dimensions();
  const size_t lead = shards.workspace->emulated ? 1 : 0;
  if (all.size() != lead + rank || (lead && all[0] != shards.count)) return false;
  dims->assign(all.begin() + lead, all.end());
  return true;
}

// Opens the call's shards on `device` and makes the device current (restored by the caller's DeviceGuard).
ffi::Error Open(int64_t workspace_id, int device, const std::string& what, ShardSet* shards) {
  if (Status status = OpenShards(workspace_id, device, shards); !status.empty()) {
    return InvalidArgument(what + ": " + status);
  }
  if (cudaSetDevice(device) != cudaSuccess)
    return InvalidArgument(what + ": cannot select GPU " + std::to_string(device));
  return ffi::Error::Success();
}

ffi::Error NotBatched(const std::string& what, const ShardSet& shards, const std::string& shapes) {
  return InvalidArgument(what + ": " +
                         (shards.workspace->emulated
                              ? "an emulated workspace of " + std::to_string(shards.ranks()) +
                                    " shards needs every operand batched over the shards (jax.vmap)"
                              : "the operands must be " + shapes));
}

ffi::Error AllBf16(const std::string& what, std::initializer_list<const ffi::AnyBuffer*> buffers) {
  for (const ffi::AnyBuffer* b : buffers) {
    if (b->element_type() != ffi::BF16)
      return InvalidArgument(what + ": the row blocks and expert weights must be bfloat16");
  }
  return ffi::Error::Success();
}

// Each (element count, wanted per shard) pair agrees.
ffi::Error Counted(const std::string& what, std::initializer_list<std::pair<size_t, int64_t>> wanted,
                   const ShardSet& shards, const std::string& shapes) {
  for (const auto& [count, per_shard] : wanted) {
    if (count != static_cast<size_t>(per_shard * shards.count)) {
      return InvalidArgument(what + ": shapes disagree with " + shapes);
    }
  }
  return ffi::Error::Success();
}

// What every fused call checks once its shapes agree: bf16 tensor-core GEMMs, the device's SM count (read into `d`),
// and a workspace result of `per_shard(d)` bytes for each of the call's shards.
ffi::Error CheckFused(const std::string& what, int device, const ShardSet& shards, WorkspaceResult& workspace,
                      size_t (*per_shard)(const FusedDims&), FusedDims* d) {
  if (!cuda::UseTensorCores(cuda::Dtype::kBFloat16, d->hidden, d->intermediate)) {
    return InvalidArgument(what + ": H and I must be multiples of 8");
  }
  if (cudaDeviceGetAttribute(&d->sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || d->sms <= 0) {
    return InvalidArgument(what + ": cannot read GPU " + std::to_string(device) + "'s multiprocessor count");
  }
  const size_t needed = shards.count * per_shard(*d);
  if (workspace->element_count() >= needed) return ffi::Error::Success();
  return InvalidArgument(what + ": the workspace result holds " + std::to_string(workspace->element_count()) +
                         " bytes, the call needs " + std::to_string(needed));
}

ffi::Error Done(const std::string& what, const Status& status) {
  return status.empty() ? ffi::Error::Success() : Internal(what, status);
}

// --- the dimensions of each call, read from its buffers and checked -------------------------------------------------

// An exchange's block capacity C and row bytes (0 when the buffer is empty).
ffi::Error ReadExchangeDims(const std::string& what, const ShardSet& shards, const ffi::AnyBuffer& send,
                            size_t send_counts, size_t recv_counts, const ffi::AnyBuffer& out, int64_t fill_byte,
                            int64_t* capacity, int64_t* row_bytes) {
  const int ranks = shards.ranks();
  // [shards, ranks (blocks), C, ...] emulated, else [ranks (blocks), C, ...].
  const auto dims = send.dimensions();
  const size_t lead = shards.workspace->emulated ? 1 : 0;
  if (dims.size() < lead + 2 || dims[lead] != ranks || (lead && dims[0] != shards.count)) {
    return NotBatched(what, shards, "[" + std::to_string(ranks) + ", C, ...] (one block per shard)");
  }
  if (out.element_type() != send.element_type() || out.size_bytes() != send.size_bytes()) {
    return InvalidArgument(what + ": the output must match the buffer");
  }
  if (send_counts != static_cast<size_t>(ranks * shards.count) ||
      recv_counts != static_cast<size_t>(ranks * shards.count)) {
    return InvalidArgument(what + ": send_counts and recv_counts must hold one count per shard");
  }
  if (fill_byte < 0 || fill_byte > 255) return InvalidArgument(what + ": fill_byte must be in [0, 255]");
  *capacity = dims[lead + 1];
  *row_bytes = send.size_bytes() == 0
                   ? 0
                   : static_cast<int64_t>(send.size_bytes()) / (int64_t{ranks} * shards.count * *capacity);
  if (*capacity * *row_bytes > shards.workspace->block_bytes) {
    return InvalidArgument(what + ": a block of " + std::to_string(*capacity) + " rows of " +
                           std::to_string(*row_bytes) + " bytes needs " + std::to_string(*capacity * *row_bytes) +
                           " bytes, the workspace holds " + std::to_string(shards.workspace->block_bytes) +
                           " per block: create it with a larger max_tokens");
  }
  return ffi::Error::Success();
}

ffi::Error ReadGateUpDims(const std::string& what, const ShardSet& shards, int device, const ffi::AnyBuffer& blocks,
                          const ffi::AnyBuffer& w_gate_up, size_t pair_of_row, size_t source_offsets,
                          const ffi::AnyBuffer& recv_x, const ffi::AnyBuffer& gate_up, WorkspaceResult& workspace,
                          FusedDims* d) {
  const std::string shapes =
      "blocks [ep or 1, C, H], w_gate_up [E, H, 2I], pair_of_row [ep*C*K], source_offsets "
      "[ep*E + 1], recv_x [ep, C, H] and gate_up [ep*C*K, 2I]";
  std::vector<int64_t> bd, gd, rd, zd;
  if (!PerShard(blocks, shards, 3, &bd) || !PerShard(w_gate_up, shards, 3, &gd) || !PerShard(recv_x, shards, 3, &rd) ||
      !PerShard(gate_up, shards, 2, &zd)) {
    return NotBatched(what, shards, shapes);
  }
  if (auto err = AllBf16(what, {&blocks, &w_gate_up, &recv_x, &gate_up}); err.failure()) return err;
  d->ep = shards.ranks();
  d->capacity = bd[1];
  d->hidden = bd[2];
  d->experts = gd[0];
  d->intermediate = gd[2] / 2;
  d->one_block = bd[0] == 1 && d->ep > 1;
  const int64_t pairs = static_cast<int64_t>(pair_of_row) / shards.count;
  d->top_k = d->tokens() > 0 ? pairs / d->tokens() : 0;
  if (!(bd[0] == d->ep || d->one_block) || gd[1] != d->hidden || gd[2] % 2 != 0 ||
      rd != std::vector<int64_t>{d->ep, d->capacity, d->hidden} ||
      zd != std::vector<int64_t>{d->rows(), 2 * d->intermediate} || d->rows() != pairs) {
    return InvalidArgument(what + ": shapes disagree with " + shapes);
  }
  if (auto err = Counted(what, {{source_offsets, d->groups() + 1}}, shards, shapes); err.failure()) return err;
  return CheckFused(what, device, shards, workspace, GateUpWorkspaceBytes, d);
}

ffi::Error ReadDownDims(const std::string& what, const ShardSet& shards, int device, const ffi::AnyBuffer& gate_up,
                        const ffi::AnyBuffer& weights, const ffi::AnyBuffer& w_down, size_t row_of_pair,
                        size_t source_offsets, size_t expert_offsets, const ffi::AnyBuffer& returned,
                        WorkspaceResult& workspace, FusedDims* d) {
  const std::string shapes =
      "gate_up [ep*C*K, 2I], weights [ep*C, K] float32, w_down [E, I, H], row_of_pair "
      "[ep*C*K], source_offsets [ep*E + 1], expert_offsets [E + 1] and returned [ep or 1, C, H]";
  std::vector<int64_t> zd, wd, dd, yd;
  if (!PerShard(gate_up, shards, 2, &zd) || !PerShard(weights, shards, 2, &wd) || !PerShard(w_down, shards, 3, &dd) ||
      !PerShard(returned, shards, 3, &yd)) {
    return NotBatched(what, shards, shapes);
  }
  if (auto err = AllBf16(what, {&gate_up, &w_down, &returned}); err.failure()) return err;
  if (weights.element_type() != ffi::F32) return InvalidArgument(what + ": weights must be float32");
  d->ep = shards.ranks();
  d->capacity = wd[0] / d->ep;
  d->top_k = wd[1];
  d->experts = dd[0];
  d->intermediate = dd[1];
  d->hidden = dd[2];
  d->one_block = yd[0] == 1 && d->ep > 1;
  if (wd[0] % d->ep != 0 || zd != std::vector<int64_t>{d->rows(), 2 * d->intermediate} ||
      !(yd[0] == d->ep || d->one_block) || yd[1] != d->capacity || yd[2] != d->hidden) {
    return InvalidArgument(what + ": shapes disagree with " + shapes);
  }
  if (auto err =
          Counted(what, {{row_of_pair, d->rows()}, {source_offsets, d->groups() + 1}, {expert_offsets, d->experts + 1}},
                  shards, shapes);
      err.failure()) {
    return err;
  }
  return CheckFused(what, device, shards, workspace, DownWorkspaceBytes, d);
}

ffi::Error ReadBackwardDims(const std::string& what, const ShardSet& shards, int device,
                            const ffi::AnyBuffer& d_returned, const ffi::AnyBuffer& recv_x,
                            const ffi::AnyBuffer& weights, const ffi::AnyBuffer& w_gate_up,
                            const ffi::AnyBuffer& w_down, const ffi::AnyBuffer& gate_up, size_t row_of_pair,
                            size_t pair_of_row, size_t source_offsets, size_t expert_offsets,
                            const ffi::AnyBuffer& d_send, const ffi::AnyBuffer& d_weights,
                            const ffi::AnyBuffer& d_w_gate_up, const ffi::AnyBuffer& d_w_down, const ffi::AnyBuffer& dz,
                            WorkspaceResult& workspace, FusedDims* d) {
  const std::string shapes =
      "d_returned [ep or 1, C, H] (d_send: the same), recv_x [ep, C, H], weights [ep*C, K] "
      "float32, w_gate_up [E, H, 2I], w_down [E, I, H], gate_up [ep*C*K, 2I] (dz: the same), "
      "the layout and the gradients of the same shapes";
  std::vector<int64_t> yd, xd, wd, gd, dd;
  if (!PerShard(d_returned, shards, 3, &yd) || !PerShard(recv_x, shards, 3, &xd) ||
      !PerShard(weights, shards, 2, &wd) || !PerShard(w_gate_up, shards, 3, &gd) || !PerShard(w_down, shards, 3, &dd)) {
    return NotBatched(what, shards, shapes);
  }
  if (auto err = AllBf16(what, {&d_returned, &recv_x, &w_gate_up, &w_down, &gate_up}); err.failure()) return err;
  if (weights.element_type() != ffi::F32) return InvalidArgument(what + ": weights must be float32");
  d->ep = shards.ranks();
  d->capacity = xd[1];
  d->hidden = xd[2];
  d->top_k = wd[1];
  d->experts = gd[0];
  d->intermediate = gd[2] / 2;
  d->one_block = yd[0] == 1 && d->ep > 1;  // the cotangent of the results' sum: one block for every source
  if (xd[0] != d->ep || !(yd[0] == d->ep || d->one_block) || yd[1] != d->capacity || yd[2] != d->hidden ||
      wd[0] != d->tokens() || gd[1] != d->hidden || gd[2] % 2 != 0 ||
      dd != std::vector<int64_t>{d->experts, d->intermediate, d->hidden} ||
      d_send.size_bytes() != d_returned.size_bytes() || d_weights.size_bytes() != weights.size_bytes() ||
      d_w_gate_up.size_bytes() != w_gate_up.size_bytes() || d_w_down.size_bytes() != w_down.size_bytes() ||
      dz.size_bytes() != gate_up.size_bytes()) {
    return InvalidArgument(what + ": shapes disagree with " + shapes);
  }
  if (auto err = Counted(what,
                         {{gate_up.element_count(), d->rows() * 2 * d->intermediate},
                          {row_of_pair, d->rows()},
                          {pair_of_row, d->rows()},
                          {source_offsets, d->groups() + 1},
                          {expert_offsets, d->experts + 1}},
                         shards, shapes);
      err.failure()) {
    return err;
  }
  return CheckFused(what, device, shards, workspace, BackwardWorkspaceBytes, d);
}

// --- the handlers: open the call's shards, read its dimensions, run the transport on every shard's slices ---------

ffi::Error NvlinkExchange(cudaStream_t stream, int32_t device, ffi::AnyBuffer send, ffi::Buffer<ffi::S32> send_counts,
                          ffi::Buffer<ffi::S32> recv_counts, ffi::Result<ffi::AnyBuffer> out, int64_t workspace_id,
                          int64_t fill_byte) {
  const std::string what = "nvlink exchange";
  DeviceGuard guard;
  ShardSet shards;
  int64_t capacity = 0, row_bytes = 0;
  if (auto err = Open(workspace_id, device, what, &shards); err.failure()) return err;
  if (auto err = ReadExchangeDims(what, shards, send, send_counts.element_count(), recv_counts.element_count(), *out,
                                  fill_byte, &capacity, &row_bytes);
      err.failure()) {
    return err;
  }
  if (send.size_bytes() == 0) return ffi::Error::Success();  // same static shapes on every shard: all skip
  const int ranks = shards.ranks();
  std::vector<Exchange> calls(shards.count);
  shards.ForEach([&](int i) -> Status {
    calls[i] = Exchange{Slice(send, shards, i),
                        send_counts.typed_data() + i * ranks,
                        recv_counts.typed_data() + i * ranks,
                        Slice(*out, shards, i),
                        capacity,
                        row_bytes,
                        static_cast<unsigned char>(fill_byte)};
    return {};
  });
  return Done(what, EnqueueExchange(shards, calls, stream));
}

ffi::Error NvlinkMoeGateUp(cudaStream_t stream, int32_t device, ffi::AnyBuffer blocks, ffi::AnyBuffer w_gate_up,
                           ffi::Buffer<ffi::S32> pair_of_row, ffi::Buffer<ffi::S32> source_offsets,
                           ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> gate_up,
                           WorkspaceResult workspace, int64_t workspace_id) {
  const std::string what = "nvlink moe_gate_up";
  DeviceGuard guard;
  ShardSet shards;
  FusedDims d;
  if (auto err = Open(workspace_id, device, what, &shards); err.failure()) return err;
  if (auto err = ReadGateUpDims(what, shards, device, blocks, w_gate_up, pair_of_row.element_count(),
                                source_offsets.element_count(), *recv_x, *gate_up, workspace, &d);
      err.failure()) {
    return err;
  }
  if (blocks.size_bytes() == 0) return ffi::Error::Success();  // same static shapes on every shard: all skip
  std::vector<GateUpShard> calls(shards.count);
  shards.ForEach([&](int i) -> Status {
    calls[i] = GateUpShard{Slice(blocks, shards, i),
                           Slice(w_gate_up, shards, i),
                           pair_of_row.typed_data() + i * d.rows(),
                           source_offsets.typed_data() + i * (d.groups() + 1),
                           Slice(*recv_x, shards, i),
                           Slice(*gate_up, shards, i),
                           workspace->typed_data() + i * (workspace->element_count() / shards.count)};
    return {};
  });
  return Done(what, FusedGateUp(shards, d, calls, stream));
}

ffi::Error NvlinkMoeDown(cudaStream_t stream, int32_t device, ffi::AnyBuffer gate_up, ffi::AnyBuffer weights,
                         ffi::AnyBuffer w_down, ffi::Buffer<ffi::S32> row_of_pair, ffi::Buffer<ffi::S32> source_offsets,
                         ffi::Buffer<ffi::S32> expert_offsets, ffi::Result<ffi::AnyBuffer> returned,
                         WorkspaceResult workspace, int64_t workspace_id) {
  const std::string what = "nvlink moe_down";
  DeviceGuard guard;
  ShardSet shards;
  FusedDims d;
  if (auto err = Open(workspace_id, device, what, &shards); err.failure()) return err;
  if (auto err = ReadDownDims(what, shards, device, gate_up, weights, w_down, row_of_pair.element_count(),
                              source_offsets.element_count(), expert_offsets.element_count(), *returned, workspace, &d);
      err.failure()) {
    return err;
  }
  if (returned->size_bytes() == 0) return ffi::Error::Success();
  std::vector<DownShard> calls(shards.count);
  shards.ForEach([&](int i) -> Status {
    calls[i] = DownShard{Slice(gate_up, shards, i),
                         Slice<const float>(weights, shards, i),
                         Slice(w_down, shards, i),
                         row_of_pair.typed_data() + i * d.rows(),
                         source_offsets.typed_data() + i * (d.groups() + 1),
                         expert_offsets.typed_data() + i * (d.experts + 1),
                         Slice(*returned, shards, i),
                         workspace->typed_data() + i * (workspace->element_count() / shards.count)};
    return {};
  });
  return Done(what, FusedDown(shards, d, calls, stream));
}

ffi::Error NvlinkMoeBackward(cudaStream_t stream, int32_t device, ffi::AnyBuffer d_returned, ffi::AnyBuffer recv_x,
                             ffi::AnyBuffer weights, ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                             ffi::AnyBuffer gate_up, ffi::Buffer<ffi::S32> row_of_pair,
                             ffi::Buffer<ffi::S32> pair_of_row, ffi::Buffer<ffi::S32> source_offsets,
                             ffi::Buffer<ffi::S32> expert_offsets, ffi::Result<ffi::AnyBuffer> d_send,
                             ffi::Result<ffi::AnyBuffer> d_weights, ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                             ffi::Result<ffi::AnyBuffer> d_w_down, ffi::Result<ffi::AnyBuffer> dz,
                             WorkspaceResult workspace, int64_t workspace_id, int64_t bwd_down_tiles,
                             int64_t bwd_gate_up_tiles) {
  const std::string what = "nvlink moe_backward";
  cuda::GemmTiles down_tiles, gate_up_tiles;
  if (auto err = ReadGemmTiles("bwd_down_tiles", bwd_down_tiles, &down_tiles); err.failure()) return err;
  if (auto err = ReadGemmTiles("bwd_gate_up_tiles", bwd_gate_up_tiles, &gate_up_tiles); err.failure()) return err;
  DeviceGuard guard;
  ShardSet shards;
  FusedDims d;
  if (auto err = Open(workspace_id, device, what, &shards); err.failure()) return err;
  if (auto err = ReadBackwardDims(what, shards, device, d_returned, recv_x, weights, w_gate_up, w_down, gate_up,
                                  row_of_pair.element_count(), pair_of_row.element_count(),
                                  source_offsets.element_count(), expert_offsets.element_count(), *d_send, *d_weights,
                                  *d_w_gate_up, *d_w_down, *dz, workspace, &d);
      err.failure()) {
    return err;
  }
  if (recv_x.size_bytes() == 0) return ffi::Error::Success();
  std::vector<BackwardShard> calls(shards.count);
  shards.ForEach([&](int i) -> Status {
    calls[i] = BackwardShard{Slice(d_returned, shards, i),
                             Slice(recv_x, shards, i),
                             Slice<const float>(weights, shards, i),
                             Slice(w_gate_up, shards, i),
                             Slice(w_down, shards, i),
                             Slice(gate_up, shards, i),
                             row_of_pair.typed_data() + i * d.rows(),
                             pair_of_row.typed_data() + i * d.rows(),
                             source_offsets.typed_data() + i * (d.groups() + 1),
                             expert_offsets.typed_data() + i * (d.experts + 1),
                             Slice(*d_send, shards, i),
                             Slice<float>(*d_weights, shards, i),
                             Slice(*d_w_gate_up, shards, i),
                             Slice(*d_w_down, shards, i),
                             Slice(*dz, shards, i),
                             workspace->typed_data() + i * (workspace->element_count() / shards.count)};
    return {};
  });
  return Done(what, FusedBackward(shards, d, down_tiles, gate_up_tiles, calls, stream));
}

}  // namespace
}  // namespace jmm::nvlink

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_nvlink_exchange, jmm::nvlink::NvlinkExchange,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()              // send [ranks, C, ...]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // send_counts [ranks]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // recv_counts [ranks]
                                  .Ret<xla::ffi::AnyBuffer>()              // out [ranks, C, ...]
                                  .Attr<int64_t>("workspace")
                                  .Attr<int64_t>("fill_byte"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_nvlink_moe_gate_up, jmm::nvlink::NvlinkMoeGateUp,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()              // blocks [ep or 1, C, H] bf16
                                  .Arg<xla::ffi::AnyBuffer>()              // w_gate_up [E, H, 2I] bf16
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // pair_of_row [ep*C*K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // source_offsets [ep*E + 1]
                                  .Ret<xla::ffi::AnyBuffer>()              // recv_x [ep, C, H]
                                  .Ret<xla::ffi::AnyBuffer>()              // gate_up [ep*C*K, 2I]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // workspace (temporaries)
                                  .Attr<int64_t>("workspace"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_nvlink_moe_down, jmm::nvlink::NvlinkMoeDown,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()              // gate_up [ep*C*K, 2I] bf16
                                  .Arg<xla::ffi::AnyBuffer>()              // weights [ep*C, K] f32
                                  .Arg<xla::ffi::AnyBuffer>()              // w_down [E, I, H] bf16
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_of_pair [ep*C*K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // source_offsets [ep*E + 1]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_offsets [E + 1]
                                  .Ret<xla::ffi::AnyBuffer>()              // returned [ep, C, H], or [1, C, H] summed
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // workspace (temporaries)
                                  .Attr<int64_t>("workspace"));

// dz is written over gate_up (the caller aliases operand 5 to result 4), as in moe_backward.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_nvlink_moe_backward, jmm::nvlink::NvlinkMoeBackward,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()              // d_returned [ep or 1, C, H]
                                  .Arg<xla::ffi::AnyBuffer>()              // recv_x [ep, C, H]
                                  .Arg<xla::ffi::AnyBuffer>()              // weights [ep*C, K] f32
                                  .Arg<xla::ffi::AnyBuffer>()              // w_gate_up [E, H, 2I]
                                  .Arg<xla::ffi::AnyBuffer>()              // w_down [E, I, H]
                                  .Arg<xla::ffi::AnyBuffer>()              // gate_up [ep*C*K, 2I]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_of_pair
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // pair_of_row
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // source_offsets [ep*E + 1]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_offsets [E + 1]
                                  .Ret<xla::ffi::AnyBuffer>()              // d_send [ep or 1, C, H]
                                  .Ret<xla::ffi::AnyBuffer>()              // d_weights [ep*C, K] f32
                                  .Ret<xla::ffi::AnyBuffer>()              // d_w_gate_up [E, H, 2I]
                                  .Ret<xla::ffi::AnyBuffer>()              // d_w_down [E, I, H]
                                  .Ret<xla::ffi::AnyBuffer>()              // dz [ep*C*K, 2I] (aliased to gate_up)
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // workspace (temporaries)
                                  .Attr<int64_t>("workspace")
                                  .Attr<int64_t>("bwd_down_tiles")
                                  .Attr<int64_t>("bwd_gate_up_tiles"));
