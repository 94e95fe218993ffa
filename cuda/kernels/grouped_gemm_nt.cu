// bf16 row-grouped GEMM against transposed expert weights (dy @ W_down^T, dz @ W_gate_up^T), tiles
// GemmTiles::kCooperative128x256.
#include "kernels/grouped_gemm_cutlass.cuh"
#include "kernels/kernel_module.cuh"

namespace jmm::cuda::cutlass_gemm {

Status RowsGemmNT(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts, int64_t n,
                  int64_t k, const Scratch& scratch, cudaStream_t stream) {
  return RowsGemmWith<TilesCooperative128x256Cluster1, cutlass::layout::ColumnMajor>(a, b, d, offsets, num_experts, n,
                                                                                     k, scratch, stream);
}

}  // namespace jmm::cuda::cutlass_gemm
