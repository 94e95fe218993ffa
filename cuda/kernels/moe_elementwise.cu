// Memory-bound MoE kernels: row gather, SwiGLU forward/backward, the fixed-order combine, zero fills.
// Rounding points follow cuda/cpu/moe.cc: values are rounded to the storage type where it stores them.
#include <cuda_bf16.h>

#include "kernels/device_math.cuh"
#include "kernels/kernel_module.cuh"
#include "kernels/moe_kernels.h"

namespace jmm::cuda {
namespace {

template <typename T, int V>
__global__ void GatherRowsKernel(const T* src, int64_t width, const int32_t* pair_of_row, const int32_t* kept_rows,
                                 int top_k, T* dst) {
  const int64_t r = blockIdx.x;
  if (r >= *kept_rows) return;
  const int32_t pair = pair_of_row[r];
  const auto* in = reinterpret_cast<const Vec<T, V>*>(src + static_cast<int64_t>(pair / top_k) * width);
  auto* out = reinterpret_cast<Vec<T, V>*>(dst + r * width);
  for (int64_t i = threadIdx.x; i < width / V; i += blockDim.x) out[i] = in[i];
}

template <typename T, int V>
__global__ void SwigluForwardKernel(T* gate_up, T* h, const int32_t* kept_rows, int64_t intermediate) {
  const int64_t r = blockIdx.x;
  auto* z = reinterpret_cast<Vec<T, V>*>(gate_up + r * 2 * intermediate);
  const int64_t n = intermediate / V;
  if (r >= *kept_rows) {
    Vec<T, V> zero;
#pragma unroll
    for (int j = 0; j < V; ++j) zero.v[j] = FromFloat<T>(0.0f);
    for (int64_t i = threadIdx.x; i < 2 * n; i += blockDim.x) z[i] = zero;
    return;
  }
  auto* out = reinterpret_cast<Vec<T, V>*>(h + r * intermediate);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const Vec<T, V> gate = z[i], up = z[n + i];
    Vec<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = ToFloat(gate.v[j]);
      o.v[j] = FromFloat<T>(Swiglu(g, ToFloat(up.v[j])));
    }
    out[i] = o;
  }
}

template <typename T, int V>
__global__ void CombineRowsKernel(const T* row_values, const int32_t* row_of_pair, const float* weights, int top_k,
                                  int64_t width, T* out) {
  const int64_t t = blockIdx.x;
  for (int64_t i = threadIdx.x; i < width / V; i += blockDim.x) {
    float acc[V];
    CombinePairs<T, V>(row_values, row_of_pair, weights, top_k, width, t, i, acc);
    Vec<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = FromFloat<T>(acc[j]);
    reinterpret_cast<Vec<T, V>*>(out + t * width)[i] = o;
  }
}

// d_weights[pair] = <g, h> is summed in one fixed order (deterministic): "summation thread" t of 256 adds the
// products of vectors t, t + 256, ... of the row in sequence, each group of 32 summation threads is reduced by a
// butterfly, and the 8 group sums are added in group order: the order of a 256-thread block per row, kept by the
// warp-per-row mapping below so that d_weights does not depend on how rows are mapped to threads.
constexpr int kSumThreads = 256;
constexpr int kSumGroups = kSumThreads / 32;

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// One warp per row, warps striding over the kept rows, so that every lane has work at model widths
// (bf16, I = 768: 96 vectors of 16 bytes per row, 3 per lane). Lane l plays summation threads l, 32 + l, ...
constexpr int kBackwardThreads = 256;
constexpr int kBackwardWarps = kBackwardThreads / 32;
// Vectors per lane whose loads are issued before any of them is used (memory-level parallelism): bf16 I = 768
// needs 3 per lane, I = 1536 needs 6.
constexpr int kLoadBatch = 4;
static_assert(kSumGroups % kLoadBatch == 0, "a load batch must not straddle two rounds of summation threads");

template <typename T, int V>
__global__ void __launch_bounds__(kBackwardThreads)
    SwigluBackwardKernel(const T* gate_up, const T* g, const float* __restrict__ weights,
                         const int32_t* __restrict__ pair_of_row, const int32_t* __restrict__ kept_rows,
                         int64_t intermediate, T* weighted_h, T* dz, float* __restrict__ d_weights) {
  // g and weighted_h may be one buffer, and gate_up and dz another (no __restrict__ on them): every vector of
  // g and gate_up is loaded by the lane that later stores that vector of weighted_h and dz, and a lane past
  // the row's end discards the vectors it loads.
  const int lane = threadIdx.x % 32;
  const int64_t kept = *kept_rows;
  const int64_t n = intermediate / V;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kBackwardWarps;
  // r is uniform per warp, so the whole warp reaches WarpSum's shuffles together. Each row's pair index is
  // loaded one row ahead, so that weights[pair] and the row's data are fetched together.
  int64_t r = static_cast<int64_t>(blockIdx.x) * kBackwardWarps + threadIdx.x / 32;
  int32_t pair = r < kept ? pair_of_row[r] : 0;
  for (; r < kept; r += warps) {
    const float w = weights[pair];
    const int32_t next_pair = r + warps < kept ? pair_of_row[r + warps] : 0;
    const auto* z = reinterpret_cast<const Vec<T, V>*>(gate_up + r * 2 * intermediate);
    const auto* grad_row = reinterpret_cast<const Vec<T, V>*>(g + r * intermediate);
    auto* weighted_h_row = reinterpret_cast<Vec<T, V>*>(weighted_h + r * intermediate);
    auto* dz_row = reinterpret_cast<Vec<T, V>*>(dz + r * 2 * intermediate);
    float dw[kSumGroups] = {};  // dw[s]: the running sum of summation thread 32 * s + lane
    for (int64_t base = 0; base < n; base += kSumThreads) {
#pragma unroll
      for (int s0 = 0; s0 < kSumGroups; s0 += kLoadBatch) {
        if (base + 32 * s0 >= n) break;  // uniform per warp
        Vec<T, V> gate[kLoadBatch], up[kLoadBatch], grad[kLoadBatch];
#pragma unroll
        for (int b = 0; b < kLoadBatch; ++b) {
          // A lane past the row's end loads the row's last vector (fetched by another lane anyway) instead of
          // branching, so that the batch's loads issue back to back.
          const int64_t i = min(base + 32 * (s0 + b) + lane, n - 1);
          gate[b] = z[i];
          up[b] = z[n + i];
          grad[b] = grad_row[i];
        }
#pragma unroll
        for (int b = 0; b < kLoadBatch; ++b) {
          const int64_t i = base + 32 * (s0 + b) + lane;
          if (i >= n) break;
          Vec<T, V> weighted_act, dgate, dup;
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float zg = ToFloat(gate[b].v[j]), zu = ToFloat(up[b].v[j]), gr = ToFloat(grad[b].v[j]);
            const float act = Round<T>(Swiglu(zg, zu));
            weighted_act.v[j] = FromFloat<T>(w * act);
            dw[s0 + b] += gr * act;
            const float dact = w * gr;
            dgate.v[j] = FromFloat<T>(SwigluGateGrad(zg, zu, dact));
            dup.v[j] = FromFloat<T>(SwigluUpGrad(zg, dact));
          }
          weighted_h_row[i] = weighted_act;
          dz_row[i] = dgate;
          dz_row[n + i] = dup;
        }
      }
    }
    float total = 0.0f;
#pragma unroll
    for (int s = 0; s < kSumGroups; ++s) {
      // A group past the row's end holds +0 in every lane, whose butterfly sum is +0: skip the shuffles.
      total += 32 * s < n ? WarpSum(dw[s]) : dw[s];
    }
    if (lane == 0) d_weights[pair] = total;
    pair = next_pair;
  }
}

// Blocks of `kernel` that are resident on the current device at once (at least 1).
template <typename Kernel>
Status ResidentBlocks(Kernel kernel, int threads, int64_t* blocks) {
  int device = 0, multiprocessors = 0, per_multiprocessor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, threads, 0);
  }
  if (err != cudaSuccess) return std::string("occupancy query failed: ") + cudaGetErrorString(err);
  *blocks = std::max<int64_t>(1, static_cast<int64_t>(multiprocessors) * per_multiprocessor);
  return {};
}

__global__ void ZeroDroppedWeightsKernel(const int32_t* row_of_pair, int64_t num_pairs, float* d_weights) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p < num_pairs && row_of_pair[p] < 0) d_weights[p] = 0.0f;
}

template <typename T>
__global__ void ZeroEmptyExpertsKernel(const int32_t* offsets, int64_t per_expert, T* w) {
  const int e = blockIdx.y;
  if (offsets[e + 1] > offsets[e]) return;
  T* we = w + e * per_expert;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < per_expert;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    we[i] = FromFloat<T>(0.0f);
  }
}

template <typename Fn>
Status WithType(Dtype dtype, Fn&& fn) {
  if (dtype == Dtype::kBFloat16) return fn(static_cast<__nv_bfloat16*>(nullptr));
  return fn(static_cast<float*>(nullptr));
}

}  // namespace

Status GatherRows(Dtype dtype, const void* src, int64_t width, const int32_t* pair_of_row,
                  const int32_t* expert_offsets, int64_t num_experts, int64_t rows, int64_t top_k, void* dst,
                  cudaStream_t stream) {
  if (rows == 0) return {};
  return WithType(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return WithVectorWidth<T>(width, [&](auto v) {
      constexpr int V = decltype(v)::value;
      GatherRowsKernel<T, V><<<rows, 128, 0, stream>>>(static_cast<const T*>(src), width, pair_of_row,
                                                       expert_offsets + num_experts, top_k, static_cast<T*>(dst));
      return LaunchStatus("gather rows");
    });
  });
}

Status SwigluForward(Dtype dtype, void* gate_up, void* h, const int32_t* expert_offsets, int64_t num_experts,
                     int64_t rows, int64_t intermediate, cudaStream_t stream) {
  if (rows == 0) return {};
  return WithType(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return WithVectorWidth<T>(intermediate, [&](auto v) {
      constexpr int V = decltype(v)::value;
      SwigluForwardKernel<T, V><<<rows, 128, 0, stream>>>(static_cast<T*>(gate_up), static_cast<T*>(h),
                                                          expert_offsets + num_experts, intermediate);
      return LaunchStatus("swiglu forward");
    });
  });
}

Status CombineRows(Dtype dtype, const void* row_values, const int32_t* row_of_pair, const float* weights,
                   int64_t tokens, int64_t top_k, int64_t width, void* out, cudaStream_t stream) {
  if (tokens == 0) return {};
  return WithType(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return WithVectorWidth<T>(width, [&](auto v) {
      constexpr int V = decltype(v)::value;
      CombineRowsKernel<T, V><<<tokens, 128, 0, stream>>>(static_cast<const T*>(row_values), row_of_pair, weights,
                                                          static_cast<int>(top_k), width, static_cast<T*>(out));
      return LaunchStatus("combine rows");
    });
  });
}

Status SwigluBackward(Dtype dtype, const void* gate_up, const void* g, const float* weights, const int32_t* pair_of_row,
                      const int32_t* row_of_pair, const int32_t* expert_offsets, int64_t num_experts, int64_t rows,
                      int64_t intermediate, void* weighted_h, void* dz, float* d_weights, cudaStream_t stream) {
  if (rows == 0) return {};
  ZeroDroppedWeightsKernel<<<(rows + 255) / 256, 256, 0, stream>>>(row_of_pair, rows, d_weights);
  if (Status s = LaunchStatus("zero dropped weights"); !s.empty()) return s;
  return WithType(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return WithVectorWidth<T>(intermediate, [&](auto v) {
      constexpr int V = decltype(v)::value;
      const auto kernel = SwigluBackwardKernel<T, V>;
      int64_t resident = 0;
      if (Status s = ResidentBlocks(kernel, kBackwardThreads, &resident); !s.empty()) {
        return "swiglu backward " + s;
      }
      const auto blocks = static_cast<unsigned>(std::min(resident, (rows + kBackwardWarps - 1) / kBackwardWarps));
      kernel<<<blocks, kBackwardThreads, 0, stream>>>(static_cast<const T*>(gate_up), static_cast<const T*>(g), weights,
                                                      pair_of_row, expert_offsets + num_experts, intermediate,
                                                      static_cast<T*>(weighted_h), static_cast<T*>(dz), d_weights);
      return LaunchStatus("swiglu backward");
    });
  });
}

Status ZeroEmptyExperts(Dtype dtype, const int32_t* expert_offsets, int64_t num_experts, int64_t per_expert, void* w,
                        cudaStream_t stream) {
  if (num_experts == 0 || per_expert == 0) return {};
  return WithType(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t blocks = std::min<int64_t>((per_expert + 255) / 256, 64);
    ZeroEmptyExpertsKernel<T>
        <<<dim3(blocks, num_experts), 256, 0, stream>>>(expert_offsets, per_expert, static_cast<T*>(w));
    return LaunchStatus("zero empty experts");
  });
}

}  // namespace jmm::cuda
