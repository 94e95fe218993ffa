// CUDA FFI handlers of the MoE op family (contract in targets.h): they read and check the buffers, carve the
// temporaries out of the trailing `workspace` result XLA allocates (sized by the *WorkspaceBytes functions below),
// and enqueue the kernels of cuda/kernels/ on XLA's stream. Nothing waits on the host and nothing is allocated, so
// XLA may capture the calls into CUDA graphs (command buffers), which replay the kernels a call enqueued when it was
// recorded.
//
// Forward, two calls: gate_up: gather x rows -> gate_up = x_perm @ W_gu;
//                    down:    h = swiglu(gate_up) -> out = h @ W_d -> y = weighted combine.
// Backward: cuda::MoeBackward (kernels/moe_backward.h). dz is a result that the caller aliases to gate_up
// (targets.h), so it takes no scratch of its own.
// The row-grouped GEMMs' tiles are int64 attributes (cuda::GemmTiles values), part of the compiled program, so a
// call captured into a CUDA graph and its replays agree.
#include <cuda_runtime.h>

#include "ffi/cuda_handler.h"
#include "ffi/extension.h"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"
#include "kernels/moe_backward.h"
#include "kernels/moe_kernels.h"

namespace jmm {
namespace {

cuda::Dtype DtypeOf(bool bfloat16) { return bfloat16 ? cuda::Dtype::kBFloat16 : cuda::Dtype::kFloat32; }

size_t GemmScratchBytes(cuda::Dtype dtype, int64_t hidden, int64_t intermediate, int64_t experts) {
  return cuda::UseTensorCores(dtype, hidden, intermediate) ? cuda::GroupedGemmScratchBytes(experts) : 0;
}

}  // namespace

// The sums below follow the handlers' Scratch requests one by one (each rounded by ScratchFootprint).
size_t MoeLayoutWorkspaceBytes(int64_t num_pairs, int64_t num_experts) {
  return cuda::SortPairsScratchBytes(num_pairs, num_experts);
}

size_t MoeGateUpWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                               int64_t experts) {
  const cuda::Dtype dtype = DtypeOf(bfloat16);
  const size_t rows = tokens * top_k, bytes = cuda::ElementBytes(dtype);
  return cuda::ScratchFootprint(rows * hidden * bytes) + GemmScratchBytes(dtype, hidden, intermediate, experts);
}

size_t MoeDownWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                             int64_t experts) {
  const cuda::Dtype dtype = DtypeOf(bfloat16);
  const size_t rows = tokens * top_k, bytes = cuda::ElementBytes(dtype);
  return cuda::ScratchFootprint(rows * intermediate * bytes) + cuda::ScratchFootprint(rows * hidden * bytes) +
         GemmScratchBytes(dtype, hidden, intermediate, experts);
}

size_t MoeBackwardWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                 int64_t experts) {
  return cuda::MoeBackward::ScratchBytes(DtypeOf(bfloat16), tokens, top_k, hidden, intermediate, experts);
}

namespace {

ffi::Error MoeLayoutCuda(cudaStream_t stream, ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<ffi::S32> row_of_pair,
                         ffi::ResultBuffer<ffi::S32> pair_of_row, ffi::ResultBuffer<ffi::S32> expert_offsets,
                         Workspace workspace, int64_t num_experts) {
  if (expert_offsets->element_count() != static_cast<size_t>(num_experts + 1)) {
    return InvalidArgument("expert_offsets must hold num_experts + 1 entries");
  }
  const int64_t pairs = experts.element_count();
  if (auto err = CheckWorkspace("layout", workspace, MoeLayoutWorkspaceBytes(pairs, num_experts)); err.failure()) {
    return err;
  }
  WorkspaceCursor cursor(workspace);
  JMM_CUDA_TRY("layout", cuda::SortPairsByExpert(experts.typed_data(), pairs, num_experts, row_of_pair->typed_data(),
                                                 pair_of_row->typed_data(), expert_offsets->typed_data(),
                                                 cursor.scratch(), stream));
  return ffi::Error::Success();
}

ffi::Error MoeGateUpCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w_gate_up,
                         ffi::Buffer<ffi::S32> pair_of_row, ffi::Buffer<ffi::S32> expert_offsets,
                         ffi::Result<ffi::AnyBuffer> gate_up, Workspace workspace, int64_t fwd_gate_up_tiles) {
  MoeDims d;
  if (auto err = ReadGateUpDims(x, w_gate_up, pair_of_row.element_count(), &d); err.failure()) return err;
  cuda::Dtype dtype;
  if (auto err = ReadDtype(x.element_type(), &dtype); err.failure()) return err;
  cuda::GemmTiles tiles;
  if (auto err = ReadGemmTiles("fwd_gate_up_tiles", fwd_gate_up_tiles, &tiles); err.failure()) return err;
  const int64_t rows = d.tokens * d.top_k, H = d.hidden, I = d.intermediate, E = d.experts;
  const int32_t* offsets = expert_offsets.typed_data();
  if (auto err = CheckWorkspace("gate_up", workspace,
                                MoeGateUpWorkspaceBytes(dtype == cuda::Dtype::kBFloat16, d.tokens, d.top_k, H, I, E));
      err.failure()) {
    return err;
  }
  WorkspaceCursor cursor(workspace);
  cuda::Scratch alloc = cursor.scratch();
  void* x_perm = alloc(rows * H * cuda::ElementBytes(dtype));
  if (x_perm == nullptr) return Internal("gate_up", "out of scratch memory");
  JMM_CUDA_TRY("forward gather", cuda::GatherRows(dtype, x.untyped_data(), H, pair_of_row.typed_data(), offsets, E,
                                                  rows, d.top_k, x_perm, stream));
  JMM_CUDA_TRY("forward gate_up GEMM", cuda::RowsGemm(dtype, cuda::UseTensorCores(dtype, H, I), x_perm,
                                                      w_gate_up.untyped_data(), gate_up->untyped_data(), offsets, E,
                                                      rows, 2 * I, H, /*b_transposed=*/false, tiles, alloc, stream));
  return ffi::Error::Success();
}

ffi::Error MoeDownCuda(cudaStream_t stream, ffi::AnyBuffer gate_up, ffi::AnyBuffer weights, ffi::AnyBuffer w_down,
                       ffi::Buffer<ffi::S32> row_of_pair, ffi::Buffer<ffi::S32> expert_offsets,
                       ffi::Result<ffi::AnyBuffer> y, Workspace workspace, int64_t fwd_down_tiles) {
  MoeDims d;
  if (auto err = ReadDownDims(gate_up, weights, w_down, &d); err.failure()) return err;
  cuda::Dtype dtype;
  if (auto err = ReadDtype(gate_up.element_type(), &dtype); err.failure()) return err;
  cuda::GemmTiles tiles;
  if (auto err = ReadGemmTiles("fwd_down_tiles", fwd_down_tiles, &tiles); err.failure()) return err;
  const int64_t rows = d.tokens * d.top_k, H = d.hidden, I = d.intermediate, E = d.experts;
  const int32_t* offsets = expert_offsets.typed_data();
  if (auto err = CheckWorkspace("down", workspace,
                                MoeDownWorkspaceBytes(dtype == cuda::Dtype::kBFloat16, d.tokens, d.top_k, H, I, E));
      err.failure()) {
    return err;
  }
  WorkspaceCursor cursor(workspace);
  cuda::Scratch alloc = cursor.scratch();
  void* h = alloc(rows * I * cuda::ElementBytes(dtype));
  void* row_out = alloc(rows * H * cuda::ElementBytes(dtype));
  if (h == nullptr || row_out == nullptr) return Internal("down", "out of scratch memory");
  JMM_CUDA_TRY("forward swiglu", cuda::SwigluForward(dtype, gate_up.untyped_data(), h, offsets, E, rows, I, stream));
  JMM_CUDA_TRY("forward down GEMM", cuda::RowsGemm(dtype, cuda::UseTensorCores(dtype, H, I), h, w_down.untyped_data(),
                                                   row_out, offsets, E, rows, H, I,
                                                   /*b_transposed=*/false, tiles, alloc, stream));
  JMM_CUDA_TRY("forward combine", cuda::CombineRows(dtype, row_out, row_of_pair.typed_data(),
                                                    static_cast<const float*>(weights.untyped_data()), d.tokens,
                                                    d.top_k, H, y->untyped_data(), stream));
  return ffi::Error::Success();
}

ffi::Error MoeBackwardCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weights,
                           ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down, ffi::AnyBuffer gate_up,
                           ffi::Buffer<ffi::S32> row_of_pair, ffi::Buffer<ffi::S32> pair_of_row,
                           ffi::Buffer<ffi::S32> expert_offsets, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> d_weights, ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                           ffi::Result<ffi::AnyBuffer> d_w_down, ffi::Result<ffi::AnyBuffer> dz, Workspace workspace,
                           int64_t bwd_down_tiles, int64_t bwd_gate_up_tiles) {
  MoeDims d;
  if (auto err = ReadMoeDims(x, weights, w_gate_up, w_down, &d); err.failure()) return err;
  cuda::Dtype dtype;
  if (auto err = ReadDtype(x.element_type(), &dtype); err.failure()) return err;
  if (dy.element_type() != x.element_type() || gate_up.element_type() != x.element_type() ||
      dz->element_type() != x.element_type() || dz->element_count() != gate_up.element_count()) {
    return InvalidArgument("dy, gate_up and the dz result must have x's dtype, dz gate_up's size");
  }
  cuda::GemmTiles down_tiles, gate_up_tiles;
  if (auto err = ReadGemmTiles("bwd_down_tiles", bwd_down_tiles, &down_tiles); err.failure()) return err;
  if (auto err = ReadGemmTiles("bwd_gate_up_tiles", bwd_gate_up_tiles, &gate_up_tiles); err.failure()) return err;
  if (auto err = CheckWorkspace("backward", workspace,
                                MoeBackwardWorkspaceBytes(dtype == cuda::Dtype::kBFloat16, d.tokens, d.top_k, d.hidden,
                                                          d.intermediate, d.experts));
      err.failure()) {
    return err;
  }
  WorkspaceCursor cursor(workspace);
  const cuda::MoeBackwardCall call{dtype,
                                   d.tokens,
                                   d.top_k,
                                   d.hidden,
                                   d.intermediate,
                                   d.experts,
                                   down_tiles,
                                   gate_up_tiles,
                                   dy.untyped_data(),
                                   x.untyped_data(),
                                   static_cast<const float*>(weights.untyped_data()),
                                   w_gate_up.untyped_data(),
                                   w_down.untyped_data(),
                                   gate_up.untyped_data(),
                                   row_of_pair.typed_data(),
                                   pair_of_row.typed_data(),
                                   expert_offsets.typed_data(),
                                   dx->untyped_data(),
                                   d_w_gate_up->untyped_data(),
                                   d_w_down->untyped_data(),
                                   dz->untyped_data(),
                                   static_cast<float*>(d_weights->untyped_data())};
  cuda::MoeBackward backward(call, cursor.scratch());
  JMM_CUDA_TRY("backward", backward.ThroughDx(stream));
  JMM_CUDA_TRY("backward", backward.GateUpWeightGradient(stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_moe_layout, jmm::MoeLayoutCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // experts
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // row_of_pair
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // pair_of_row
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_offsets
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // workspace
                                  .Attr<int64_t>("num_experts"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_moe_gate_up, jmm::MoeGateUpCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Arg<xla::ffi::AnyBuffer>()              // w_gate_up
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // pair_of_row
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_offsets
                                  .Ret<xla::ffi::AnyBuffer>()              // gate_up
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // workspace
                                  .Attr<int64_t>("fwd_gate_up_tiles"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_moe_down, jmm::MoeDownCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // gate_up
                                  .Arg<xla::ffi::AnyBuffer>()              // weights
                                  .Arg<xla::ffi::AnyBuffer>()              // w_down
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_of_pair
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_offsets
                                  .Ret<xla::ffi::AnyBuffer>()              // y
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // workspace
                                  .Attr<int64_t>("fwd_down_tiles"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_moe_backward, jmm::MoeBackwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // dy
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Arg<xla::ffi::AnyBuffer>()              // weights
                                  .Arg<xla::ffi::AnyBuffer>()              // w_gate_up
                                  .Arg<xla::ffi::AnyBuffer>()              // w_down
                                  .Arg<xla::ffi::AnyBuffer>()              // gate_up
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_of_pair
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // pair_of_row
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_offsets
                                  .Ret<xla::ffi::AnyBuffer>()              // dx
                                  .Ret<xla::ffi::AnyBuffer>()              // d_weights
                                  .Ret<xla::ffi::AnyBuffer>()              // d_w_gate_up
                                  .Ret<xla::ffi::AnyBuffer>()              // d_w_down
                                  .Ret<xla::ffi::AnyBuffer>()              // dz (aliased to gate_up)
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // workspace
                                  .Attr<int64_t>("bwd_down_tiles")
                                  .Attr<int64_t>("bwd_gate_up_tiles"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
