// The CUDA backward's kernel sequence (cuda/ffi/moe_cuda.cc), in two halves so that a caller can hang work on dx
// between them: the nvlink transport's overlapped backward (cuda/ffi/nvlink_backward_cuda.cc) sends dx to the peers
// while the second half, the d_w_gate_up GEMM, runs. The moe_backward handler runs both halves back to back.
#pragma once

#include <cstdint>
#include <utility>

#include "jmm/cuda_handler.h"

namespace jmm {

// One backward's sizes, GEMM tiles and buffers (the moe_backward contract of jmm/handlers.h). dz may be gate_up
// (aliased): the SwiGLU backward is gate_up's last reader.
struct MoeBackwardCall {
  cuda::Dtype dtype;
  int64_t tokens, top_k, hidden, intermediate, experts;
  RowsGemmTiles tiles;
  const void *dy, *x;
  const float* weights;
  const void *w_gate_up, *w_down, *gate_up;
  const int32_t *row_of_pair, *pair_of_row, *expert_offsets;
  void *dx, *d_w_gate_up, *d_w_down, *dz;
  float* d_weights;
};

class MoeBackward {
 public:
  // `scratch` hands out the temporaries: MoeBackwardWorkspaceBytes (jmm/moe_host.h) of the call's sizes.
  MoeBackward(const MoeBackwardCall& call, cuda::Scratch scratch) : call_(call), scratch_(std::move(scratch)) {}

  // gather dy -> g = dy @ W_d^T -> SwiGLU backward (w*h, dz, d_weights) -> d_W_d -> dx rows = dz @ W_gu^T -> dx.
  ffi::Error ThroughDx(cudaStream_t stream);
  // Where ThroughDx gathers dy: rows x H in the layout's row order, null when out of scratch. A caller whose dy
  // is not one [tokens, H] array (the nvlink backward's blocks arrive from several GPUs) gathers the rows there
  // itself, then calls FromGatheredDy instead of ThroughDx. call.dy is not read then.
  void* GatheredDy();
  // ThroughDx after its gather.
  ffi::Error FromGatheredDy(cudaStream_t stream);
  // gather x -> d_W_gu = x_perm^T dz per expert. After ThroughDx, on the same stream.
  ffi::Error GateUpWeightGradient(cudaStream_t stream);

 private:
  MoeBackwardCall call_;
  cuda::Scratch scratch_;
  void* x_rows_ = nullptr;  // gathered x, for the last GEMM
  void* rows_h_ = nullptr;  // gathered dy, then the per-row dx
  void* g_ = nullptr;       // dy @ W_d^T, then w * h
};

}  // namespace jmm
