// CUDA FFI handlers of the MoE op family (contract in jmm/handlers.h): argument checks, scratch buffers and
// the order of the kernels in cuda/kernels/. Everything is enqueued on XLA's stream; nothing waits on the
// host. Temporaries are carved out of a trailing `workspace` result that XLA allocates (sized by
// jmm/moe_host.h), never allocated by the handler, so XLA may capture the calls into CUDA graphs
// (command buffers), which replay the kernels a call enqueued when it was recorded.
//
// Forward, two calls: gate_up: gather x rows -> gate_up = x_perm @ W_gu;
//                    down:    h = swiglu(gate_up) -> out = h @ W_d -> y = weighted combine.
// Backward: gather dy rows -> g = dy @ W_d^T -> swiglu backward (w*h, dz, d_weights) -> d_W_d = (w*h)^T dy
//           -> dx rows = dz @ W_gu^T -> dx = combine; d_W_gu = x_perm^T dz per expert. dz is a result that
//           the caller aliases to gate_up (handlers.h), so it takes no scratch of its own.
// The row-grouped GEMMs' tile configuration is the value JMM_GEMM_TILES had when the calling function was
// traced, passed as the `gemm_tiles` attribute (jmm/gemm_tiles.h): part of the compiled program, so a call
// captured into a CUDA graph and its replays agree.
#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <string_view>

#include "jmm/cuda_handler.h"
#include "jmm/moe_backward_cuda.h"
#include "jmm/moe_bindings.h"
#include "jmm/handlers.h"
#include "jmm/moe_cuda.h"
#include "jmm/moe_host.h"

namespace jmm {
namespace {

std::atomic<int64_t> recorded_layout{0}, recorded_gate_up{0}, recorded_down{0}, recorded_backward{0};

// Counts the call if XLA is recording `stream` into a CUDA graph.
void CountIfRecorded(cudaStream_t stream, std::atomic<int64_t>& counter) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess && status == cudaStreamCaptureStatusActive) ++counter;
}

size_t GemmsScratchBytes(int gemms, bool tensor_cores, int64_t experts) {
  return tensor_cores ? gemms * cuda::GroupedGemmScratchBytes(experts) : 0;
}

// The backward stages gathered dy and then g (rows x H and rows x I elements) in d_w_gate_up's buffer
// (E x H x 2I), which nothing reads and only the last GEMM writes, when they fit: always at Qwen3-MoE sizes
// (rows = T*K). g starts at this byte offset, aligned for the kernels' vector loads.
size_t BackwardStagedGOffset(size_t rows, size_t hidden, size_t bytes) {
  return (rows * hidden * bytes + 255) / 256 * 256;
}
bool BackwardStagesInWeightGradient(size_t rows, size_t hidden, size_t intermediate, size_t experts,
                                    size_t bytes) {
  return BackwardStagedGOffset(rows, hidden, bytes) + rows * intermediate * bytes <=
         experts * hidden * 2 * intermediate * bytes;
}

}  // namespace

// The sums below follow the handlers' Scratch requests one by one (each rounded by ScratchFootprint).
size_t MoeLayoutWorkspaceBytes(int64_t num_pairs, int64_t num_experts) {
  return cuda::SortPairsScratchBytes(num_pairs, num_experts);
}

size_t MoeGateUpWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden,
                               int64_t intermediate, int64_t experts) {
  const cuda::Dtype dtype = bfloat16 ? cuda::Dtype::kBFloat16 : cuda::Dtype::kFloat32;
  const size_t rows = tokens * top_k, bytes = ElementBytes(dtype);
  return cuda::ScratchFootprint(rows * hidden * bytes) +
         GemmsScratchBytes(1, cuda::UseTensorCores(dtype, hidden, intermediate), experts);
}

size_t MoeDownWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                             int64_t experts) {
  const cuda::Dtype dtype = bfloat16 ? cuda::Dtype::kBFloat16 : cuda::Dtype::kFloat32;
  const size_t rows = tokens * top_k, bytes = ElementBytes(dtype);
  return cuda::ScratchFootprint(rows * intermediate * bytes) + cuda::ScratchFootprint(rows * hidden * bytes) +
         GemmsScratchBytes(1, cuda::UseTensorCores(dtype, hidden, intermediate), experts);
}

size_t MoeBackwardWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden,
                                 int64_t intermediate, int64_t experts) {
  const cuda::Dtype dtype = bfloat16 ? cuda::Dtype::kBFloat16 : cuda::Dtype::kFloat32;
  const size_t rows = tokens * top_k, bytes = ElementBytes(dtype);
  const size_t g = BackwardStagesInWeightGradient(rows, hidden, intermediate, experts, bytes)
                       ? 0
                       : cuda::ScratchFootprint(rows * intermediate * bytes);
  return cuda::ScratchFootprint(rows * hidden * bytes) + g +
         GemmsScratchBytes(4, cuda::UseTensorCores(dtype, hidden, intermediate), experts);
}

void* MoeBackward::GatheredDy() {
  if (rows_h_ != nullptr) return rows_h_;
  const MoeBackwardCall& c = call_;
  const int64_t rows = c.tokens * c.top_k, H = c.hidden, I = c.intermediate, E = c.experts;
  const size_t bytes = ElementBytes(c.dtype);
  // `rows_h` holds gathered dy (until the d_W_down GEMM), then the per-row dx; `x_rows` gathered x for the last
  // GEMM. rows_h and g live in d_w_gate_up's buffer until that GEMM writes it, when they fit, else in the
  // workspace with x_rows over rows_h (dead by then). The routing weight goes into h (rows x I), not into a
  // second copy of dy (rows x H); the SwiGLU backward is the last reader of g and of gate_up, and writes
  // w * h over g and dz over gate_up (when the caller aliased them, as jax_megamoe does).
  x_rows_ = scratch_(rows * H * bytes);
  void* rows_h = x_rows_;
  if (BackwardStagesInWeightGradient(rows, H, I, E, bytes)) {
    rows_h = c.d_w_gate_up;
    g_ = static_cast<char*>(rows_h) + BackwardStagedGOffset(rows, H, bytes);
  } else {
    g_ = scratch_(rows * I * bytes);
  }
  if (x_rows_ == nullptr || g_ == nullptr) return nullptr;
  return rows_h_ = rows_h;
}

ffi::Error MoeBackward::ThroughDx(cudaStream_t stream) {
  const MoeBackwardCall& c = call_;
  void* dy_rows = GatheredDy();
  if (dy_rows == nullptr) return Internal("backward", "out of scratch memory");
  JMM_CUDA_TRY("backward gather dy", cuda::GatherRows(c.dtype, c.dy, c.hidden, c.pair_of_row, c.expert_offsets,
                                                      c.experts, c.tokens * c.top_k, c.top_k, dy_rows, stream));
  return FromGatheredDy(stream);
}

ffi::Error MoeBackward::FromGatheredDy(cudaStream_t stream) {
  const MoeBackwardCall& c = call_;
  const int64_t rows = c.tokens * c.top_k, H = c.hidden, I = c.intermediate, E = c.experts;
  const bool tc = cuda::UseTensorCores(c.dtype, H, I);
  if (rows_h_ == nullptr) return Internal("backward", "FromGatheredDy must follow GatheredDy");
  void* weighted_h = g_;  // the SwiGLU backward writes w * h over g
  JMM_CUDA_TRY("backward dy @ W_down^T GEMM", cuda::RowsGemm(c.dtype, tc, rows_h_, c.w_down, g_, c.expert_offsets, E,
                                                             rows, I, H, /*b_transposed=*/true, c.tiles.bwd_down,
                                                             scratch_, stream));
  JMM_CUDA_TRY("backward swiglu",
               cuda::SwigluBackward(c.dtype, c.gate_up, g_, c.weights, c.pair_of_row, c.row_of_pair, c.expert_offsets,
                                    E, rows, I, weighted_h, c.dz, c.d_weights, stream));
  JMM_CUDA_TRY("backward d_w_down GEMM", cuda::WeightGemm(c.dtype, tc, weighted_h, rows_h_, c.d_w_down,
                                                          c.expert_offsets, E, rows, I, H, scratch_, stream));
  JMM_CUDA_TRY("backward dz @ W_gate_up^T GEMM", cuda::RowsGemm(c.dtype, tc, c.dz, c.w_gate_up, rows_h_,
                                                                c.expert_offsets, E, rows, H, 2 * I,
                                                                /*b_transposed=*/true, c.tiles.bwd_gate_up, scratch_,
                                                                stream));
  JMM_CUDA_TRY("backward dx combine",
               cuda::CombineRows(c.dtype, rows_h_, c.row_of_pair, nullptr, c.tokens, c.top_k, H, c.dx, stream));
  return ffi::Error::Success();
}

ffi::Error MoeBackward::GateUpWeightGradient(cudaStream_t stream) {
  const MoeBackwardCall& c = call_;
  const int64_t rows = c.tokens * c.top_k, H = c.hidden, I = c.intermediate, E = c.experts;
  if (x_rows_ == nullptr) return Internal("backward", "the d_w_gate_up GEMM must follow ThroughDx");
  JMM_CUDA_TRY("backward gather x",
               cuda::GatherRows(c.dtype, c.x, H, c.pair_of_row, c.expert_offsets, E, rows, c.top_k, x_rows_, stream));
  JMM_CUDA_TRY("backward d_w_gate_up GEMM",
               cuda::WeightGemm(c.dtype, cuda::UseTensorCores(c.dtype, H, I), x_rows_, c.dz, c.d_w_gate_up,
                                c.expert_offsets, E, rows, H, 2 * I, scratch_, stream));
  return ffi::Error::Success();
}

MoeRecordedCalls MoeCallsRecordedIntoGraphs() {
  return {recorded_layout.load(), recorded_gate_up.load(), recorded_down.load(), recorded_backward.load()};
}

namespace {

ffi::Error MoeLayoutCuda(cudaStream_t stream, ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<ffi::S32> row_of_pair,
                         ffi::ResultBuffer<ffi::S32> pair_of_row, ffi::ResultBuffer<ffi::S32> expert_offsets,
                         int64_t num_experts, Workspace workspace) {
  if (expert_offsets->element_count() != static_cast<size_t>(num_experts + 1)) {
    return InvalidArgument("expert_offsets must hold num_experts + 1 entries");
  }
  const int64_t pairs = experts.element_count();
  if (auto err = CheckWorkspace("layout", workspace, MoeLayoutWorkspaceBytes(pairs, num_experts)); err.failure()) {
    return err;
  }
  CountIfRecorded(stream, recorded_layout);
  WorkspaceCursor cursor(workspace);
  JMM_CUDA_TRY("layout", cuda::SortPairsByExpert(experts.typed_data(), pairs, num_experts, row_of_pair->typed_data(),
                                                 pair_of_row->typed_data(), expert_offsets->typed_data(),
                                                 cursor.scratch(), stream));
  return ffi::Error::Success();
}

ffi::Error MoeGateUpCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w_gate_up,
                         ffi::Buffer<ffi::S32> pair_of_row, ffi::Buffer<ffi::S32> expert_offsets,
                         ffi::Result<ffi::AnyBuffer> gate_up, std::string_view gemm_tiles, Workspace workspace) {
  MoeDims d;
  if (auto err = ReadGateUpDims(x, w_gate_up, pair_of_row.element_count(), &d); err.failure()) return err;
  cuda::Dtype dtype;
  if (auto err = ReadDtype(x.element_type(), &dtype); err.failure()) return err;
  RowsGemmTiles tiles;
  if (auto err = ReadGemmTiles(gemm_tiles, &tiles); err.failure()) return err;
  const int64_t rows = d.tokens * d.top_k, H = d.hidden, I = d.intermediate, E = d.experts;
  const int32_t* offsets = expert_offsets.typed_data();
  if (auto err = CheckWorkspace("gate_up", workspace,
                                MoeGateUpWorkspaceBytes(dtype == cuda::Dtype::kBFloat16, d.tokens, d.top_k, H, I, E));
      err.failure()) {
    return err;
  }
  CountIfRecorded(stream, recorded_gate_up);
  WorkspaceCursor cursor(workspace);
  cuda::Scratch alloc = cursor.scratch();
  void* x_perm = alloc(rows * H * ElementBytes(dtype));
  if (x_perm == nullptr) return Internal("gate_up", "out of scratch memory");
  JMM_CUDA_TRY("forward gather", cuda::GatherRows(dtype, x.untyped_data(), H, pair_of_row.typed_data(), offsets,
                                                  E, rows, d.top_k, x_perm, stream));
  JMM_CUDA_TRY("forward gate_up GEMM", cuda::RowsGemm(dtype, cuda::UseTensorCores(dtype, H, I), x_perm,
                                                      w_gate_up.untyped_data(), gate_up->untyped_data(), offsets, E,
                                                      rows, 2 * I, H, /*b_transposed=*/false, tiles.fwd_gate_up, alloc,
                                                      stream));
  return ffi::Error::Success();
}

ffi::Error MoeDownCuda(cudaStream_t stream, ffi::AnyBuffer gate_up, ffi::AnyBuffer weights, ffi::AnyBuffer w_down,
                       ffi::Buffer<ffi::S32> row_of_pair, ffi::Buffer<ffi::S32> expert_offsets,
                       ffi::Result<ffi::AnyBuffer> y, std::string_view gemm_tiles, Workspace workspace) {
  MoeDims d;
  if (auto err = ReadDownDims(gate_up, weights, w_down, &d); err.failure()) return err;
  cuda::Dtype dtype;
  if (auto err = ReadDtype(gate_up.element_type(), &dtype); err.failure()) return err;
  RowsGemmTiles tiles;
  if (auto err = ReadGemmTiles(gemm_tiles, &tiles); err.failure()) return err;
  const int64_t rows = d.tokens * d.top_k, H = d.hidden, I = d.intermediate, E = d.experts;
  const int32_t* offsets = expert_offsets.typed_data();
  if (auto err = CheckWorkspace("down", workspace,
                                MoeDownWorkspaceBytes(dtype == cuda::Dtype::kBFloat16, d.tokens, d.top_k, H, I, E));
      err.failure()) {
    return err;
  }
  CountIfRecorded(stream, recorded_down);
  WorkspaceCursor cursor(workspace);
  cuda::Scratch alloc = cursor.scratch();
  void* h = alloc(rows * I * ElementBytes(dtype));
  void* row_out = alloc(rows * H * ElementBytes(dtype));
  if (h == nullptr || row_out == nullptr) return Internal("down", "out of scratch memory");
  JMM_CUDA_TRY("forward swiglu", cuda::SwigluForward(dtype, gate_up.untyped_data(), h, offsets, E, rows, I, stream));
  JMM_CUDA_TRY("forward down GEMM", cuda::RowsGemm(dtype, cuda::UseTensorCores(dtype, H, I), h,
                                                   w_down.untyped_data(), row_out, offsets, E, rows, H, I,
                                                   /*b_transposed=*/false, tiles.fwd_down, alloc, stream));
  JMM_CUDA_TRY("forward combine",
               cuda::CombineRows(dtype, row_out, row_of_pair.typed_data(),
                                 static_cast<const float*>(weights.untyped_data()), d.tokens, d.top_k, H,
                                 y->untyped_data(), stream));
  return ffi::Error::Success();
}

ffi::Error MoeBackwardCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weights,
                           ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down, ffi::AnyBuffer gate_up,
                           ffi::Buffer<ffi::S32> row_of_pair, ffi::Buffer<ffi::S32> pair_of_row,
                           ffi::Buffer<ffi::S32> expert_offsets, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> d_weights, ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                           ffi::Result<ffi::AnyBuffer> d_w_down, ffi::Result<ffi::AnyBuffer> dz_result,
                           std::string_view gemm_tiles, Workspace workspace) {
  MoeDims d;
  if (auto err = ReadMoeDims(x, weights, w_gate_up, w_down, &d); err.failure()) return err;
  cuda::Dtype dtype;
  if (auto err = ReadDtype(x.element_type(), &dtype); err.failure()) return err;
  if (dy.element_type() != x.element_type() || gate_up.element_type() != x.element_type() ||
      dz_result->element_type() != x.element_type() || dz_result->element_count() != gate_up.element_count()) {
    return InvalidArgument("dy, gate_up and the dz result must have x's dtype, dz gate_up's size");
  }
  RowsGemmTiles tiles;
  if (auto err = ReadGemmTiles(gemm_tiles, &tiles); err.failure()) return err;
  if (auto err = CheckWorkspace("backward", workspace,
                                MoeBackwardWorkspaceBytes(dtype == cuda::Dtype::kBFloat16, d.tokens, d.top_k, d.hidden,
                                                          d.intermediate, d.experts));
      err.failure()) {
    return err;
  }
  CountIfRecorded(stream, recorded_backward);
  WorkspaceCursor cursor(workspace);
  const MoeBackwardCall call{dtype, d.tokens, d.top_k, d.hidden, d.intermediate, d.experts, tiles,
                             dy.untyped_data(), x.untyped_data(), static_cast<const float*>(weights.untyped_data()),
                             w_gate_up.untyped_data(), w_down.untyped_data(), gate_up.untyped_data(),
                             row_of_pair.typed_data(), pair_of_row.typed_data(), expert_offsets.typed_data(),
                             dx->untyped_data(), d_w_gate_up->untyped_data(), d_w_down->untyped_data(),
                             dz_result->untyped_data(), static_cast<float*>(d_weights->untyped_data())};
  MoeBackward backward(call, cursor.scratch());
  if (auto err = backward.ThroughDx(stream); err.failure()) return err;
  return backward.GateUpWeightGradient(stream);
}

// Every CUDA handler runs on XLA's stream; its temporaries come from its trailing workspace result.
auto CudaBinding() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

template <typename Binding>
auto WithWorkspace(Binding binding) {
  return std::move(binding).template Ret<ffi::Buffer<ffi::U8>>();
}

template <typename Binding>
auto WithTilesAndWorkspace(Binding binding) {
  return WithWorkspace(std::move(binding).template Attr<std::string_view>("gemm_tiles"));
}

}  // namespace
}  // namespace jmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_moe_layout, jmm::MoeLayoutCuda,
                              jmm::WithWorkspace(jmm::BindMoeLayout(jmm::CudaBinding())),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_moe_gate_up, jmm::MoeGateUpCuda,
                              jmm::WithTilesAndWorkspace(jmm::BindMoeGateUp(jmm::CudaBinding())),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_moe_down, jmm::MoeDownCuda,
                              jmm::WithTilesAndWorkspace(jmm::BindMoeDown(jmm::CudaBinding())),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_moe_backward, jmm::MoeBackwardCuda,
                              jmm::WithTilesAndWorkspace(jmm::BindMoeBackward(jmm::CudaBinding())
                                                             .Ret<xla::ffi::AnyBuffer>()),  // dz (on gate_up)
                              {xla::ffi::Traits::kCmdBufferCompatible});
