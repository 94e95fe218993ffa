// The problem sizes of one MoE call, shared by the CPU kernels and every FFI handler. No XLA here.
#pragma once

#include <cstdint>

namespace jmm {

struct MoeDims {
  int64_t tokens;        // T
  int64_t hidden;        // H
  int64_t intermediate;  // I
  int64_t experts;       // E (local experts held in the weights)
  int64_t top_k;         // K
};

}  // namespace jmm
