// The CPU kernel of jax_megamoe.losses.linear_cross_entropy's cross-entropy rows (no XLA include): the same
// contract as cuda::CrossEntropyRows (kernels/cross_entropy.h), with scale a host value.
#pragma once

#include <cstdint>

namespace jmm::cpu {

// T is float or BFloat16 (cpu/scalar.h); the math runs in float32.
template <typename T>
void CrossEntropyRows(const T* logits, const int32_t* labels, float scale, int64_t rows, int64_t vocab, float* loss,
                      T* grad);

}  // namespace jmm::cpu
