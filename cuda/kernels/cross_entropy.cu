// The cross-entropy rows of a logits chunk in one kernel (kernels/cross_entropy.h): one block per row, a pass
// reading the row for its running maximum and sum of exponentials, then a pass reading it again to write
// the gradient. Reading a row twice costs less than it seems: the rows the blocks in flight hold mostly stay in L2
// between the two passes.
#include <cuda_bf16.h>

#include <cmath>

#include "kernels/cross_entropy.h"
#include "kernels/device_math.cuh"
#include "kernels/kernel_module.cuh"

namespace jmm::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// A running maximum and the sum of exp(x - m) over the values seen.
struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum Combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ __forceinline__ MaxSum WarpCombine(MaxSum v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = Combine(v, {__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.s, offset)});
  }
  return v;
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    CrossEntropyRowsKernel(const T* logits, const int32_t* labels, const float* scale_ptr, int64_t vocab, float* loss,
                           T* grad) {
  using P = Vec<T, kVec>;  // kVec = 1 when the row width does not allow 16-byte accesses
  const int64_t row = blockIdx.x;
  const int32_t label = labels[row];
  const P* in = reinterpret_cast<const P*>(logits + row * vocab);
  P* out = reinterpret_cast<P*>(grad + row * vocab);
  const int64_t packs = vocab / kVec;

  if (label < 0 || label >= vocab) {
    P zero;
#pragma unroll
    for (int j = 0; j < kVec; ++j) zero.v[j] = FromFloat<T>(0.f);
    for (int64_t i = threadIdx.x; i < packs; i += kThreads) out[i] = zero;
    if (threadIdx.x == 0) loss[row] = 0.f;
    return;
  }

  MaxSum acc{-INFINITY, 0.f};
  for (int64_t i = threadIdx.x; i < packs; i += kThreads) {
    const P p = in[i];
    float x[kVec];
    float top = -INFINITY;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      x[j] = ToFloat(p.v[j]);
      top = fmaxf(top, x[j]);
    }
    const float m = fmaxf(acc.m, top);
    if (m == -INFINITY) continue;
    float s = acc.s * __expf(acc.m - m);
#pragma unroll
    for (int j = 0; j < kVec; ++j) s += __expf(x[j] - m);
    acc = {m, s};
  }

  __shared__ MaxSum partial[kWarps];
  __shared__ float row_lse;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  acc = WarpCombine(acc);
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = WarpCombine(lane < kWarps ? partial[lane] : MaxSum{-INFINITY, 0.f});
    if (lane == 0) {
      const float lse = acc.m + __logf(acc.s);
      row_lse = lse;
      loss[row] = lse - ToFloat(logits[row * vocab + label]);  // read before the barrier: grad may be logits
    }
  }
  __syncthreads();

  const float lse = row_lse;
  const float scale = *scale_ptr;
  for (int64_t i = threadIdx.x; i < packs; i += kThreads) {
    const P p = in[i];
    P q;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float g = __expf(ToFloat(p.v[j]) - lse) * scale;
      if (i * kVec + j == label) g -= scale;
      q.v[j] = FromFloat<T>(g);
    }
    out[i] = q;
  }
}

template <typename T>
void Launch(const void* logits, const int32_t* labels, const float* scale, int64_t rows, int64_t vocab, float* loss,
            void* grad, cudaStream_t stream) {
  constexpr int kVec = kWideVec<T>;
  const auto* in = static_cast<const T*>(logits);
  auto* out = static_cast<T*>(grad);
  if (vocab % kVec == 0) {
    CrossEntropyRowsKernel<T, kVec><<<rows, kThreads, 0, stream>>>(in, labels, scale, vocab, loss, out);
  } else {
    CrossEntropyRowsKernel<T, 1><<<rows, kThreads, 0, stream>>>(in, labels, scale, vocab, loss, out);
  }
}

}  // namespace

Status CrossEntropyRows(Dtype dtype, const void* logits, const int32_t* labels, const float* scale, int64_t rows,
                        int64_t vocab, float* loss, void* grad, cudaStream_t stream) {
  if (rows == 0) return {};
  if (rows > 0x7fffffff) return "CrossEntropyRows: more rows than a grid holds";
  if (dtype == Dtype::kBFloat16) {
    Launch<__nv_bfloat16>(logits, labels, scale, rows, vocab, loss, grad, stream);
  } else {
    Launch<float>(logits, labels, scale, rows, vocab, loss, grad, stream);
  }
  return LaunchStatus("CrossEntropyRows");
}

}  // namespace jmm::cuda
