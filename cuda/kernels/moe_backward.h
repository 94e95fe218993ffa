// The CUDA backward's kernel sequence, in two halves so that a caller can hang work on dx between them: the
// moe_backward handler (cuda/ffi/moe_cuda.cc) runs both halves back to back; the nvlink transport's backward sends
// dx to the peers while the second half, the d_w_gate_up GEMM, runs.
//
// ThroughDx:            gather dy -> g = dy @ W_d^T -> SwiGLU backward (w*h, dz, d_weights) -> d_W_d = (w*h)^T dy
//                       -> dx rows = dz @ W_gu^T -> dx = combine.
// GateUpWeightGradient: gather x -> d_W_gu = x_perm^T dz per expert.
// Every step only enqueues work on the stream; temporaries come from the caller's Scratch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "kernels/moe_kernels.h"

namespace jmm::cuda {

// One backward's sizes, GEMM tiles and buffers: x [tokens, hidden], weights [tokens, top_k] (float32),
// w_gate_up [experts, hidden, 2 * intermediate], w_down [experts, intermediate, hidden], gate_up
// [tokens * top_k, 2 * intermediate] in row order, the layout of SortPairsByExpert, and the results of the same
// shapes (dx like x, d_weights like weights, d_w_* like w_*, dz like gate_up). dz may be gate_up (the same
// pointer): the SwiGLU backward is gate_up's last reader.
struct MoeBackwardCall {
  Dtype dtype;
  int64_t tokens, top_k, hidden, intermediate, experts;
  GemmTiles bwd_down_tiles;     // dy @ W_down^T
  GemmTiles bwd_gate_up_tiles;  // dz @ W_gate_up^T
  const void *dy, *x;
  const float* weights;
  const void *w_gate_up, *w_down, *gate_up;
  const int32_t *row_of_pair, *pair_of_row, *expert_offsets;
  void *dx, *d_w_gate_up, *d_w_down, *dz;
  float* d_weights;
};

class MoeBackward {
 public:
  // What one backward of these sizes takes from its Scratch, at most (the sum of its requests, each rounded by
  // ScratchFootprint). Queries the current device.
  static size_t ScratchBytes(Dtype dtype, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                             int64_t experts);

  // `scratch` hands out the temporaries: ScratchBytes of the call's sizes.
  MoeBackward(const MoeBackwardCall& call, Scratch scratch) : call_(call), scratch_(std::move(scratch)) {}

  Status ThroughDx(cudaStream_t stream);
  // Where ThroughDx gathers dy: rows x H in the layout's row order, null when out of scratch. A caller whose dy
  // is not one [tokens, H] array (the nvlink backward's blocks arrive from several GPUs) gathers the rows there
  // itself, then calls FromGatheredDy instead of ThroughDx. call.dy is not read then.
  void* GatheredDy();
  // ThroughDx after its gather.
  Status FromGatheredDy(cudaStream_t stream);
  // After ThroughDx (or FromGatheredDy), on the same stream.
  Status GateUpWeightGradient(cudaStream_t stream);

 private:
  MoeBackwardCall call_;
  Scratch scratch_;
  void* x_rows_ = nullptr;  // gathered x, for the last GEMM
  void* rows_h_ = nullptr;  // gathered dy, then the per-row dx
  void* g_ = nullptr;       // dy @ W_d^T, then w * h
};

}  // namespace jmm::cuda
