// The fused calls' sums over the sources (contract in nvlink/kernels.h): the own tokens' combine added to the peers'
// results straight from the push slots (CombineRowsIntoSum), and the sum of every source's dx (SumBlocks).
//
// Both follow rows.sum_blocks (jax_megamoe/parallel/rows.py) bit for bit: a float32 sum from zero in source order of
// parts in the storage dtype. The combined part is computed exactly as cuda::CombineRows computes a row (the same
// float32 expression, pair by pair in k order, rounded to the dtype), so that adding it here equals adding the row
// that CombineRows would have written.
#include <cuda_bf16.h>

#include <type_traits>

#include "kernels/device_math.cuh"
#include "kernels/kernel_module.cuh"
#include "nvlink/kernels.h"

namespace jmm::nvlink {
namespace {

using cuda::LaunchStatus;

using cuda::CombinePairs;
using cuda::FromFloat;
using cuda::kWideVec;
using cuda::Round;
using cuda::ToFloat;
using cuda::Vec;
using cuda::WithVectorWidth;

template <typename Fn>
Status WithType(Dtype dtype, Fn&& fn) {
  if (dtype == Dtype::kBFloat16) return fn(static_cast<__nv_bfloat16*>(nullptr));
  return fn(static_cast<float*>(nullptr));
}

// One block per token t. Part summed.own (if any) is the combine of t's pairs over row_values, rounded to T; every
// other part d is summed.rows[d][t]. The parts are added in float32 from zero in order d.
template <typename T, int V>
__global__ void SumPartsKernel(const T* row_values, const int32_t* row_of_pair, const float* weights, int top_k,
                               int64_t width, SummedBlocks summed, T* out) {
  const int64_t t = blockIdx.x;
  for (int64_t i = threadIdx.x; i < width / V; i += blockDim.x) {
    float acc[V];
    CombinePairs<T, V>(row_values, row_of_pair, weights, top_k, width, t, i, acc);
    float sum[V];
#pragma unroll
    for (int j = 0; j < V; ++j) sum[j] = 0.0f;
    for (int d = 0; d < summed.count; ++d) {
      if (d == summed.own) {
#pragma unroll
        for (int j = 0; j < V; ++j) sum[j] += Round<T>(acc[j]);
      } else {
        const Vec<T, V> v = reinterpret_cast<const Vec<T, V>*>(static_cast<const T*>(summed.rows[d]) + t * width)[i];
#pragma unroll
        for (int j = 0; j < V; ++j) sum[j] += ToFloat(v.v[j]);
      }
    }
    Vec<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = FromFloat<T>(sum[j]);
    reinterpret_cast<Vec<T, V>*>(out + t * width)[i] = o;
  }
}

Status LaunchSumParts(Dtype dtype, const void* row_values, const int32_t* row_of_pair, const float* weights,
                      int64_t tokens, int64_t top_k, int64_t width, const SummedBlocks& summed, void* out,
                      cudaStream_t stream) {
  if (tokens == 0) return {};
  return WithType(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return WithVectorWidth<T>(width, [&](auto v) {
      constexpr int V = decltype(v)::value;
      SumPartsKernel<T, V><<<tokens, 128, 0, stream>>>(static_cast<const T*>(row_values), row_of_pair, weights,
                                                       static_cast<int>(top_k), width, summed, static_cast<T*>(out));
      return LaunchStatus("sum over the sources");
    });
  });
}

}  // namespace

Status CombineRowsIntoSum(Dtype dtype, const void* row_values, const int32_t* row_of_pair, const float* weights,
                          int64_t tokens, int64_t top_k, int64_t width, const SummedBlocks& summed, void* out,
                          cudaStream_t stream) {
  if (summed.count < 1 || summed.count > SummedBlocks::kMaxParts || summed.own < 0 || summed.own >= summed.count) {
    return "CombineRowsIntoSum needs 1 to 8 parts, one of them the combined rows";
  }
  return LaunchSumParts(dtype, row_values, row_of_pair, weights, tokens, top_k, width, summed, out, stream);
}

Status SumBlocks(Dtype dtype, const SummedBlocks& summed, int64_t tokens, int64_t width, void* out,
                 cudaStream_t stream) {
  if (summed.count < 1 || summed.count > SummedBlocks::kMaxParts || summed.own != SummedBlocks::kNoCombinedPart) {
    return "SumBlocks needs 1 to 8 parts and no combined one";
  }
  // No pairs to combine: top_k 0, and no part is the combined rows.
  return LaunchSumParts(dtype, nullptr, nullptr, nullptr, tokens, 0, width, summed, out, stream);
}

}  // namespace jmm::nvlink
