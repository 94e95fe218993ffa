// Plain C++ MoE kernels behind the CPU FFI handlers (cuda/ffi/moe_cpu.cc): exact and deterministic, their work
// spread over threads by a ParallelFor. No XLA here. Rows are (token, k) pairs in expert-sorted order, as MoeLayout
// writes them.
#pragma once

#include <cstdint>

#include "cpu/parallel.h"
#include "cpu/scalar.h"
#include "moe_dims.h"

namespace jmm::cpu {

// Sorts (token, k) pairs by expert, stable in pair order; ids outside [0, E) are dropped.
void MoeLayout(const int32_t* experts, int64_t num_pairs, int64_t num_experts, int32_t* row_of_pair,
               int32_t* pair_of_row, int32_t* expert_offsets);

// The forward in two steps, so that a recomputation that needs only gate_up (jax.checkpoint) runs only the first.
template <typename T>
void MoeGateUp(const MoeDims& d, const T* x, const T* w_gate_up, const int32_t* pair_of_row,
               const int32_t* expert_offsets, T* gate_up, const ParallelFor& parallel);

template <typename T>
void MoeDown(const MoeDims& d, const T* gate_up, const typename Acc<T>::type* weights, const T* w_down,
             const int32_t* row_of_pair, const int32_t* expert_offsets, T* y, const ParallelFor& parallel);

template <typename T>
void MoeBackward(const MoeDims& d, const T* dy, const T* x, const typename Acc<T>::type* weights, const T* w_gate_up,
                 const T* w_down, const T* gate_up, const int32_t* row_of_pair, const int32_t* pair_of_row,
                 const int32_t* expert_offsets, T* dx, typename Acc<T>::type* d_weights, T* d_w_gate_up, T* d_w_down,
                 const ParallelFor& parallel);

}  // namespace jmm::cpu
