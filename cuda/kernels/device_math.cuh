// Device functions that several kernels must evaluate identically: the storage-type conversions and vector accesses of
// the memory-bound passes (moe_elementwise.cu, nvlink/sums.cu), and their SwiGLU math. A kernel that fuses SwiGLU or
// a sum elsewhere must match those passes bit for bit, so it takes these expressions.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

namespace jmm::cuda {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// v rounded to the storage type T, back in float32.
template <typename T>
__device__ __forceinline__ float Round(float v) {
  return ToFloat(FromFloat<T>(v));
}

// V consecutive elements moved as one access (16 bytes when the row width allows it).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T>
constexpr int kWideVec = 16 / sizeof(T);

// Token t's combine over its pairs at vector i of the row: acc[j] = sum over k (in k order, from zero, in float32) of
// weights[t, k] (1 without weights) times row_values[row_of_pair[t, k], i * V + j], pairs without a row (-1)
// skipped. CombineRows rounds it to the storage type; nvlink's sums add it to the peers' parts, bit for bit the row
// CombineRows would have written.
template <typename T, int V>
__device__ __forceinline__ void CombinePairs(const T* row_values, const int32_t* row_of_pair, const float* weights,
                                             int top_k, int64_t width, int64_t t, int64_t i, float (&acc)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    const int32_t r = row_of_pair[t * top_k + k];
    if (r < 0) continue;
    const float w = weights ? weights[t * top_k + k] : 1.0f;
    const Vec<T, V> v = reinterpret_cast<const Vec<T, V>*>(row_values + r * width)[i];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] += w * ToFloat(v.v[j]);
  }
}

// Calls fn(std::integral_constant<int, V>) with the widest V that divides `width`.
template <typename T, typename Fn>
auto WithVectorWidth(int64_t width, Fn&& fn) {
  if (width % kWideVec<T> == 0) return fn(std::integral_constant<int, kWideVec<T>>{});
  return fn(std::integral_constant<int, 1>{});
}

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
