// bf16 expert-grouped weight-gradient GEMM, contraction over each expert's rows: x_perm^T @ dz, h^T @ w*dy.
#include "kernels/grouped_gemm_cutlass.cuh"
#include "kernels/kernel_module.cuh"

namespace jmm::cuda::cutlass_gemm {

Status WeightGemmTN(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts, int64_t m,
                    int64_t n, const Scratch& scratch, cudaStream_t stream) {
  // a [rows, m] row-major is the m x rows operand in column-major order; b [rows, n] is rows x n row-major.
  using G = Bf16GroupedGemm<TilesCooperative128x256Cluster2, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  return RunGroupedGemm<G, Grouping::kWeight>(a, b, d, offsets, num_experts, m, n, 0, /*ld_a=*/m, /*ld_b=*/n, scratch,
                                              stream);
}

}  // namespace jmm::cuda::cutlass_gemm
