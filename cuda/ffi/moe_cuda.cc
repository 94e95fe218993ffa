// CUDA FFI handlers of the MoE op family (contract in jmm/handlers.h): argument checks, scratch buffers and
// the order of the kernels in cuda/kernels/. Everything is enqueued on XLA's stream; nothing waits on the
// host. Temporaries come from XLA's scratch allocator, which is why the handlers do not claim CUDA-graph
// (command buffer) compatibility.
//
// Forward:  gather x rows -> gate_up = x_perm @ W_gu -> h = swiglu -> out = h @ W_d -> y = weighted combine.
// Backward: gather dy rows -> g = dy @ W_d^T -> swiglu backward (w*h, dz, d_weights) -> d_W_d = (w*h)^T dy
//           -> dx rows = dz @ W_gu^T -> dx = combine; d_W_gu = x_perm^T dz per expert.
// The row-grouped GEMMs' tile configuration comes from JMM_GEMM_TILES, read on every call (jmm/gemm_tiles.h).
#include <cuda_runtime.h>

#include <cstdlib>

#include "jmm/ffi_common.h"
#include "jmm/gemm_tiles.h"
#include "jmm/moe_bindings.h"
#include "jmm/handlers.h"
#include "jmm/moe_cuda.h"

namespace jmm {
namespace {

ffi::Error Internal(const std::string& stage, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInternal, "jax_megamoe CUDA " + stage + ": " + message);
}

cuda::Scratch ScratchFrom(ffi::ScratchAllocator& allocator) {
  return [&allocator](size_t bytes) -> void* {
    // XLA accepts alignments up to 16; its device allocations are 256-byte aligned regardless.
    auto ptr = allocator.Allocate(bytes == 0 ? 1 : bytes, 16);
    return ptr.has_value() ? *ptr : nullptr;
  };
}

#define JMM_CUDA_TRY(stage, expr)                                    \
  do {                                                               \
    if (cuda::Status status_ = (expr); !status_.empty()) {           \
      return Internal(stage, status_);                               \
    }                                                                \
  } while (0)

ffi::Error ReadDtype(ffi::DataType type, cuda::Dtype* dtype) {
  switch (type) {
    case ffi::BF16: *dtype = cuda::Dtype::kBFloat16; return ffi::Error::Success();
    case ffi::F32: *dtype = cuda::Dtype::kFloat32; return ffi::Error::Success();
    default: return InvalidArgument("the CUDA MoE kernels support bfloat16 and float32 only");
  }
}

// Read per call rather than once per process, so that a benchmark or test can switch tiles between calls.
ffi::Error ReadGemmTiles(RowsGemmTiles* tiles) {
  if (std::string err = ParseGemmTiles(std::getenv(kGemmTilesEnv), tiles); !err.empty()) {
    return InvalidArgument(err);
  }
  return ffi::Error::Success();
}

size_t ElementBytes(cuda::Dtype dtype) { return dtype == cuda::Dtype::kBFloat16 ? 2 : 4; }

ffi::Error MoeLayoutCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::S32> experts,
                         ffi::ResultBuffer<ffi::S32> row_of_pair, ffi::ResultBuffer<ffi::S32> pair_of_row,
                         ffi::ResultBuffer<ffi::S32> expert_offsets, int64_t num_experts) {
  if (expert_offsets->element_count() != static_cast<size_t>(num_experts + 1)) {
    return InvalidArgument("expert_offsets must hold num_experts + 1 entries");
  }
  JMM_CUDA_TRY("layout", cuda::SortPairsByExpert(experts.typed_data(), experts.element_count(), num_experts,
                                                 row_of_pair->typed_data(), pair_of_row->typed_data(),
                                                 expert_offsets->typed_data(), ScratchFrom(scratch), stream));
  return ffi::Error::Success();
}

ffi::Error MoeForwardCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                          ffi::AnyBuffer weights, ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                          ffi::Buffer<ffi::S32> row_of_pair, ffi::Buffer<ffi::S32> pair_of_row,
                          ffi::Buffer<ffi::S32> expert_offsets, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> gate_up) {
  MoeDims d;
  if (auto err = ReadMoeDims(x, weights, w_gate_up, w_down, &d); err.failure()) return err;
  cuda::Dtype dtype;
  if (auto err = ReadDtype(x.element_type(), &dtype); err.failure()) return err;
  RowsGemmTiles tiles;
  if (auto err = ReadGemmTiles(&tiles); err.failure()) return err;
  const int64_t rows = d.tokens * d.top_k, H = d.hidden, I = d.intermediate, E = d.experts;
  const bool tc = cuda::UseTensorCores(dtype, H, I);
  const int32_t* offsets = expert_offsets.typed_data();
  cuda::Scratch alloc = ScratchFrom(scratch);

  // x_perm [rows, H] is dead after the first GEMM, so the per-row outputs reuse it.
  void* x_perm = alloc(rows * H * ElementBytes(dtype));
  void* h = alloc(rows * I * ElementBytes(dtype));
  if (x_perm == nullptr || h == nullptr) return Internal("forward", "out of scratch memory");
  void* row_out = x_perm;

  JMM_CUDA_TRY("forward gather", cuda::GatherRows(dtype, x.untyped_data(), H, pair_of_row.typed_data(), offsets,
                                                  E, rows, d.top_k, x_perm, stream));
  JMM_CUDA_TRY("forward gate_up GEMM", cuda::RowsGemm(dtype, tc, x_perm, w_gate_up.untyped_data(),
                                                      gate_up->untyped_data(), offsets, E, rows, 2 * I, H,
                                                      /*b_transposed=*/false, tiles.fwd_gate_up, alloc, stream));
  JMM_CUDA_TRY("forward swiglu",
               cuda::SwigluForward(dtype, gate_up->untyped_data(), h, offsets, E, rows, I, stream));
  JMM_CUDA_TRY("forward down GEMM", cuda::RowsGemm(dtype, tc, h, w_down.untyped_data(), row_out, offsets, E,
                                                   rows, H, I, /*b_transposed=*/false, tiles.fwd_down, alloc,
                                                   stream));
  JMM_CUDA_TRY("forward combine",
               cuda::CombineRows(dtype, row_out, row_of_pair.typed_data(), static_cast<const float*>(weights.untyped_data()), d.tokens,
                                 d.top_k, H, y->untyped_data(), stream));
  return ffi::Error::Success();
}

ffi::Error MoeBackwardCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer dy,
                           ffi::AnyBuffer x, ffi::AnyBuffer weights, ffi::AnyBuffer w_gate_up,
                           ffi::AnyBuffer w_down, ffi::AnyBuffer gate_up, ffi::Buffer<ffi::S32> row_of_pair,
                           ffi::Buffer<ffi::S32> pair_of_row, ffi::Buffer<ffi::S32> expert_offsets,
                           ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> d_weights,
                           ffi::Result<ffi::AnyBuffer> d_w_gate_up, ffi::Result<ffi::AnyBuffer> d_w_down) {
  MoeDims d;
  if (auto err = ReadMoeDims(x, weights, w_gate_up, w_down, &d); err.failure()) return err;
  cuda::Dtype dtype;
  if (auto err = ReadDtype(x.element_type(), &dtype); err.failure()) return err;
  if (dy.element_type() != x.element_type() || gate_up.element_type() != x.element_type()) {
    return InvalidArgument("dy and gate_up must have x's dtype");
  }
  RowsGemmTiles tiles;
  if (auto err = ReadGemmTiles(&tiles); err.failure()) return err;
  const int64_t rows = d.tokens * d.top_k, H = d.hidden, I = d.intermediate, E = d.experts, K = d.top_k;
  const bool tc = cuda::UseTensorCores(dtype, H, I);
  const int32_t* offsets = expert_offsets.typed_data();
  const int32_t* pairs = pair_of_row.typed_data();
  const float* w = static_cast<const float*>(weights.untyped_data());
  cuda::Scratch alloc = ScratchFrom(scratch);
  const size_t bytes = ElementBytes(dtype);

  // `rows_h` holds gathered dy (until the d_W_down GEMM), then the per-row dx, then gathered x (each dead
  // before the next). The routing weight goes into h (rows x I), not into a second copy of dy (rows x H),
  // and w * h is written over g, which the SwiGLU backward is the last to read.
  void* rows_h = alloc(rows * H * bytes);
  void* g = alloc(rows * I * bytes);
  void* dz = alloc(rows * 2 * I * bytes);
  if (!rows_h || !g || !dz) return Internal("backward", "out of scratch memory");
  void* weighted_h = g;

  JMM_CUDA_TRY("backward gather dy",
               cuda::GatherRows(dtype, dy.untyped_data(), H, pairs, offsets, E, rows, K, rows_h, stream));
  JMM_CUDA_TRY("backward dy @ W_down^T GEMM", cuda::RowsGemm(dtype, tc, rows_h, w_down.untyped_data(), g,
                                                             offsets, E, rows, I, H, /*b_transposed=*/true,
                                                             tiles.bwd_down, alloc, stream));
  JMM_CUDA_TRY("backward swiglu",
               cuda::SwigluBackward(dtype, gate_up.untyped_data(), g, w, pairs, row_of_pair.typed_data(), offsets,
                                    E, rows, I, weighted_h, dz, static_cast<float*>(d_weights->untyped_data()),
                                    stream));
  JMM_CUDA_TRY("backward d_w_down GEMM", cuda::WeightGemm(dtype, tc, weighted_h, rows_h, d_w_down->untyped_data(),
                                                          offsets, E, rows, I, H, alloc, stream));
  JMM_CUDA_TRY("backward dz @ W_gate_up^T GEMM", cuda::RowsGemm(dtype, tc, dz, w_gate_up.untyped_data(), rows_h,
                                                                offsets, E, rows, H, 2 * I,
                                                                /*b_transposed=*/true, tiles.bwd_gate_up, alloc,
                                                                stream));
  JMM_CUDA_TRY("backward dx combine", cuda::CombineRows(dtype, rows_h, row_of_pair.typed_data(), nullptr,
                                                        d.tokens, K, H, dx->untyped_data(), stream));
  JMM_CUDA_TRY("backward gather x",
               cuda::GatherRows(dtype, x.untyped_data(), H, pairs, offsets, E, rows, K, rows_h, stream));
  JMM_CUDA_TRY("backward d_w_gate_up GEMM", cuda::WeightGemm(dtype, tc, rows_h, dz, d_w_gate_up->untyped_data(),
                                                             offsets, E, rows, H, 2 * I, alloc, stream));
  return ffi::Error::Success();
}

#undef JMM_CUDA_TRY

// Every CUDA handler runs on XLA's stream and takes its temporaries from XLA's scratch allocator.
auto CudaBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::ScratchAllocator>();
}

}  // namespace
}  // namespace jmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_moe_layout, jmm::MoeLayoutCuda,
                              jmm::BindMoeLayout(jmm::CudaBinding()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_moe_forward, jmm::MoeForwardCuda,
                              jmm::BindMoeForward(jmm::CudaBinding()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_moe_backward, jmm::MoeBackwardCuda,
                              jmm::BindMoeBackward(jmm::CudaBinding()));
