// Host entry point of the CUDA cross-entropy kernel of jax_megamoe.losses.linear_cross_entropy: nothing here depends
// on XLA; conventions as in moe_kernels.h (work only enqueued on `stream`).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe_kernels.h"

namespace jmm::cuda {

// For each row r of logits [rows, vocab] (bf16 or float32, row-major) with label l = labels[r] in [0, vocab):
//   loss[r] = logsumexp(logits[r]) - logits[r, l]
//   grad[r] = *scale * (softmax(logits[r]) - onehot(l))   (logits' dtype)
// and for a label outside [0, vocab) (a token that does not count) loss[r] = 0 and grad[r] = 0. The math runs in
// float32. grad may be the logits buffer itself: each row is read whole before any of it is written. scale is a
// device pointer to one float32.
Status CrossEntropyRows(Dtype dtype, const void* logits, const int32_t* labels, const float* scale, int64_t rows,
                        int64_t vocab, float* loss, void* grad, cudaStream_t stream);

}  // namespace jmm::cuda
