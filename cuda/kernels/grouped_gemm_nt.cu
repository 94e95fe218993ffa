// bf16 row-grouped GEMM against transposed expert weights: dy @ W_down^T and dz @ W_gate_up^T.
#include "jmm/grouped_gemm_cutlass_cuda.h"

namespace jmm::cuda::cutlass_gemm {

Status RowsGemmNT(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts,
                  int64_t n, int64_t k, const Scratch& scratch, cudaStream_t stream) {
  // B_e is stored [n, k] row-major, i.e. the k x n operand in column-major order.
  using G = Bf16GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
  return RunGroupedGemm<G, Grouping::kRows>(a, b, d, offsets, num_experts, 0, n, k, /*ld_a=*/k, /*ld_b=*/k,
                                            scratch, stream);
}

}  // namespace jmm::cuda::cutlass_gemm
