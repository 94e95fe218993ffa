// Device functions that several kernels must evaluate identically. The SwiGLU math of the passes
// (moe_elementwise.cu): a kernel that fuses it elsewhere must match them bit for bit (branch swiglu-epilogue's
// epilogues do), so it takes these expressions. The global timer and the system-scope acquire load of the bounded waits.
#pragma once

#include <cstdint>

namespace jmm::cuda {

__device__ __forceinline__ float Sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// silu(gate) * up in float32 (the caller rounds).
__device__ __forceinline__ float Swiglu(float gate, float up) { return gate * Sigmoid(gate) * up; }

// dact times the derivative of silu(zg) * zu: with respect to zg, and with respect to zu.
__device__ __forceinline__ float SwigluGateGrad(float zg, float zu, float dact) {
  const float sig = Sigmoid(zg);
  return dact * zu * sig * (1.0f + zg * (1.0f - sig));
}
__device__ __forceinline__ float SwigluUpGrad(float zg, float dact) { return dact * (zg * Sigmoid(zg)); }

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

}  // namespace jmm::cuda
