// MoeBackward (moe_backward.h): the order of the backward's kernels and where its temporaries live.
#include "kernels/moe_backward.h"

#include <string>

// Returns "`what`: <message>" from the calling method when a step fails.
#define JMM_STEP(what, expr)                                      \
  do {                                                            \
    if (::jmm::cuda::Status status_ = (expr); !status_.empty()) { \
      return std::string(what) + ": " + status_;                  \
    }                                                             \
  } while (0)

namespace jmm::cuda {
namespace {

// The backward stages gathered dy and then g (rows x H and rows x I elements) in d_w_gate_up's buffer
// (E x H x 2I), which nothing reads and only the last GEMM writes, when they fit: always at Qwen3-MoE sizes
// (rows = T*K). g starts at this byte offset, aligned for the kernels' vector loads.
size_t StagedGOffset(size_t rows, size_t hidden, size_t bytes) { return (rows * hidden * bytes + 255) / 256 * 256; }
bool StagesInWeightGradient(size_t rows, size_t hidden, size_t intermediate, size_t experts, size_t bytes) {
  return StagedGOffset(rows, hidden, bytes) + rows * intermediate * bytes <=
         experts * hidden * 2 * intermediate * bytes;
}

}  // namespace

size_t MoeBackward::ScratchBytes(Dtype dtype, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                 int64_t experts) {
  const size_t rows = tokens * top_k, bytes = ElementBytes(dtype);
  const size_t g = StagesInWeightGradient(rows, hidden, intermediate, experts, bytes)
                       ? 0
                       : ScratchFootprint(rows * intermediate * bytes);
  const size_t gemms = UseTensorCores(dtype, hidden, intermediate) ? 4 * GroupedGemmScratchBytes(experts) : 0;
  return ScratchFootprint(rows * hidden * bytes) + g + gemms;
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
  if (StagesInWeightGradient(rows, H, I, E, bytes)) {
    rows_h = c.d_w_gate_up;
    g_ = static_cast<char*>(rows_h) + StagedGOffset(rows, H, bytes);
  } else {
    g_ = scratch_(rows * I * bytes);
  }
  if (x_rows_ == nullptr || g_ == nullptr) return nullptr;
  return rows_h_ = rows_h;
}

Status MoeBackward::ThroughDx(cudaStream_t stream) {
  const MoeBackwardCall& c = call_;
  void* dy_rows = GatheredDy();
  if (dy_rows == nullptr) return "out of scratch memory";
  JMM_STEP("gather dy", GatherRows(c.dtype, c.dy, c.hidden, c.pair_of_row, c.expert_offsets, c.experts,
                                   c.tokens * c.top_k, c.top_k, dy_rows, stream));
  return FromGatheredDy(stream);
}

Status MoeBackward::FromGatheredDy(cudaStream_t stream) {
  const MoeBackwardCall& c = call_;
  const int64_t rows = c.tokens * c.top_k, H = c.hidden, I = c.intermediate, E = c.experts;
  const bool tc = UseTensorCores(c.dtype, H, I);
  if (rows_h_ == nullptr) return "FromGatheredDy must follow GatheredDy";
  void* weighted_h = g_;  // the SwiGLU backward writes w * h over g
  JMM_STEP("dy @ W_down^T GEMM", RowsGemm(c.dtype, tc, rows_h_, c.w_down, g_, c.expert_offsets, E, rows, I, H,
                                          /*b_transposed=*/true, c.bwd_down_tiles, scratch_, stream));
  JMM_STEP("swiglu", SwigluBackward(c.dtype, c.gate_up, g_, c.weights, c.pair_of_row, c.row_of_pair, c.expert_offsets,
                                    E, rows, I, weighted_h, c.dz, c.d_weights, stream));
  JMM_STEP("d_w_down GEMM",
           WeightGemm(c.dtype, tc, weighted_h, rows_h_, c.d_w_down, c.expert_offsets, E, rows, I, H, scratch_, stream));
  JMM_STEP("dz @ W_gate_up^T GEMM",
           RowsGemm(c.dtype, tc, c.dz, c.w_gate_up, rows_h_, c.expert_offsets, E, rows, H, 2 * I,
                    /*b_transposed=*/true, c.bwd_gate_up_tiles, scratch_, stream));
  JMM_STEP("dx combine", CombineRows(c.dtype, rows_h_, c.row_of_pair, nullptr, c.tokens, c.top_k, H, c.dx, stream));
  return {};
}

Status MoeBackward::GateUpWeightGradient(cudaStream_t stream) {
  const MoeBackwardCall& c = call_;
  const int64_t rows = c.tokens * c.top_k, H = c.hidden, I = c.intermediate, E = c.experts;
  if (x_rows_ == nullptr) return "the d_w_gate_up GEMM must follow ThroughDx";
  JMM_STEP("gather x", GatherRows(c.dtype, c.x, H, c.pair_of_row, c.expert_offsets, E, rows, c.top_k, x_rows_, stream));
  JMM_STEP("d_w_gate_up GEMM", WeightGemm(c.dtype, UseTensorCores(c.dtype, H, I), x_rows_, c.dz, c.d_w_gate_up,
                                          c.expert_offsets, E, rows, H, 2 * I, scratch_, stream));
  return {};
}

}  // namespace jmm::cuda
