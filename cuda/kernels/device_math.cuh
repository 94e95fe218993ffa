// Device functions that several kernels must evaluate identically: the SwiGLU math of the memory-bound passes
// (moe_elementwise.cu). A kernel that fuses SwiGLU elsewhere must match those passes bit for bit, so it takes these
// expressions.
#pragma once

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

}  // namespace jmm::cuda
