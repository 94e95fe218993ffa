// Device functions of the transport's bounded waits: the GPU's global timer, which bounds every wait on a peer, and
// the system-scope acquire load of a counter that another GPU, or a copy engine's stream write, publishes.
#pragma once

#include <cstdint>

namespace jmm::nvlink {

// A counter another GPU (or the copy engine's stream write) publishes: acquire load at system scope.
__device__ __forceinline__ uint64_t LoadAcquireSystem(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Nanoseconds of the GPU's global timer.
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace jmm::nvlink
