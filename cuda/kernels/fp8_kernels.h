// Host entry points of the CUDA kernels of the "fp8_blockwise" recipe (jax_megamoe/ops/fp8.py): nothing here
// depends on XLA; conventions as in moe_kernels.h (work only enqueued on `stream`, temporaries from `Scratch`).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe_kernels.h"

namespace jmm::cuda::cutlass_gemm {

// What Fp8RowsGemm takes from Scratch at most (group arrays and CUTLASS's workspace).
size_t Fp8RowsGemmScratchBytes(int64_t num_experts);

// d[rows of e] (bf16, [rows, n] row-major) = (a * sfa)[rows of e] @ (b_e * sfb_e)^T for every expert e, rows of e
// being [offsets[e], offsets[e + 1]). a: e4m3 [rows, k] row-major; sfa: float32 [rows, k / 128] row-major (1x128
// tiles); b: e4m3 [E, n, k] row-major; sfb: float32 [E, n / 128, k / 128] row-major (128x128 blocks). n and k
// multiples of 128.
Status Fp8RowsGemm(const void* a, const float* sfa, const void* b, const float* sfb, void* d, const int32_t* offsets,
                   int64_t num_experts, int64_t n, int64_t k, const Scratch& scratch, cudaStream_t stream);

}  // namespace jmm::cuda::cutlass_gemm
