// The cross-entropy rows of a logits chunk (kernels/cross_entropy.h). Each row is split over a cluster of blocks:
// each block copies its segment of the row into shared memory while it takes the segment's running maximum and sum
// of exponentials, the blocks combine theirs through distributed shared memory, and each writes its segment's
// gradient from shared memory. The logits are read from memory once and the gradient written once. A row too wide
// for the cluster's shared memory runs one block per row instead, reading the row twice.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cmath>
#include <utility>

#include "kernels/cross_entropy.h"
#include "kernels/device_math.cuh"
#include "kernels/kernel_module.cuh"

namespace jmm::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 1024;  // the one-block-per-row kernel
constexpr int kCluster = 8;     // blocks per row (the portable cluster size)
// Threads per block of a cluster: 256 for bf16 rows (38 KB of shared memory per block at 151936 ids), 512 for float32
// ones (76 KB, so fewer blocks fit an SM and each needs more threads in flight); measured at 151936 ids.
template <typename T>
constexpr int kClusterThreads = sizeof(T) == 2 ? 256 : 512;
constexpr int kMaxSegmentBytes = 226 * 1024;  // of a block's 227 KiB, leaving room for the static shared memory

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

// The block's combined running maximum and sum, in every thread; `partial` holds one entry per warp.
template <int kBlockThreads>
__device__ __forceinline__ MaxSum BlockCombine(MaxSum acc, MaxSum* partial) {
  constexpr int kWarps = kBlockThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  acc = WarpCombine(acc);
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  acc = WarpCombine(lane < kWarps ? partial[lane] : MaxSum{-INFINITY, 0.f});
  __syncthreads();  // partial may be reused
  return acc;
}

// Folds a pack of values into the running maximum and sum.
template <typename T, int kVec>
__device__ __forceinline__ MaxSum Accumulate(MaxSum acc, const Vec<T, kVec>& p) {
  float x[kVec];
  float top = -INFINITY;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    x[j] = ToFloat(p.v[j]);
    top = fmaxf(top, x[j]);
  }
  const float m = fmaxf(acc.m, top);
  if (m == -INFINITY) return acc;
  float s = acc.s * __expf(acc.m - m);
#pragma unroll
  for (int j = 0; j < kVec; ++j) s += __expf(x[j] - m);
  return {m, s};
}

// The gradient of a pack whose first element is column `col`.
template <typename T, int kVec>
__device__ __forceinline__ Vec<T, kVec> Gradient(const Vec<T, kVec>& p, int64_t col, int32_t label, float lse,
                                                 float scale) {
  Vec<T, kVec> q;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    float g = __expf(ToFloat(p.v[j]) - lse) * scale;
    if (col + j == label) g -= scale;
    q.v[j] = FromFloat<T>(g);
  }
  return q;
}

template <typename T, int kVec>
__device__ __forceinline__ void ZeroPacks(Vec<T, kVec>* out, int64_t packs, int first, int stride) {
  Vec<T, kVec> zero;
#pragma unroll
  for (int j = 0; j < kVec; ++j) zero.v[j] = FromFloat<T>(0.f);
  for (int64_t i = first; i < packs; i += stride) out[i] = zero;
}

// Row blockIdx.x / kCluster, its segment cluster rank r: packs [r * segment, (r + 1) * segment) of the row.
template <typename T, int kVec>
__global__ void __launch_bounds__(kClusterThreads<T>)
    CrossEntropyRowsClusterKernel(const T* logits, const int32_t* labels, const float* scale_ptr, int64_t vocab,
                                  int64_t segment, float* loss, T* grad) {
  using P = Vec<T, kVec>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  P* held = reinterpret_cast<P*>(shared_bytes);
  constexpr int kBlock = kClusterThreads<T>;
  __shared__ MaxSum partial[kBlock / 32];
  __shared__ MaxSum block_total;
  __shared__ float row_lse;

  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / kCluster;
  const int32_t label = labels[row];
  const int64_t packs = vocab / kVec;
  const int64_t begin = rank * segment;
  const int64_t count = begin < packs ? min(segment, packs - begin) : 0;
  const P* in = reinterpret_cast<const P*>(logits + row * vocab) + begin;
  P* out = reinterpret_cast<P*>(grad + row * vocab) + begin;

  if (label < 0 || label >= vocab) {  // the whole cluster returns here: no block touches another's memory
    ZeroPacks(out, count, threadIdx.x, kBlock);
    if (rank == 0 && threadIdx.x == 0) loss[row] = 0.f;
    return;
  }

  MaxSum acc{-INFINITY, 0.f};
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < count; i += kBlock) {
    const P p = in[i];
    held[i] = p;
    acc = Accumulate(acc, p);
  }
  acc = BlockCombine<kBlock>(acc, partial);
  if (threadIdx.x == 0) block_total = acc;
  cluster.sync();  // every block's total is visible to the cluster

  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    acc = WarpCombine(lane < kCluster ? *cluster.map_shared_rank(&block_total, lane) : MaxSum{-INFINITY, 0.f});
    if (lane == 0) row_lse = acc.m + __logf(acc.s);
  }
  __syncthreads();
  // No block may leave while another still reads its total: arrive now, wait before returning.
  auto token = cluster.barrier_arrive();

  const float lse = row_lse;
  const int64_t first_col = begin * kVec;
  if (threadIdx.x == 0 && label >= first_col && label < first_col + count * kVec) {
    loss[row] = lse - ToFloat(held[(label - first_col) / kVec].v[(label - first_col) % kVec]);
  }
  const float scale = *scale_ptr;
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < count; i += kBlock) {
    out[i] = Gradient(held[i], first_col + i * kVec, label, lse, scale);
  }
  cluster.barrier_wait(std::move(token));
}

// One block per row, for rows wider than the cluster's shared memory: a pass for the running maximum and sum, a
// second pass over the row (read again) for the gradient.
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
    ZeroPacks(out, packs, threadIdx.x, kThreads);
    if (threadIdx.x == 0) loss[row] = 0.f;
    return;
  }

  MaxSum acc{-INFINITY, 0.f};
  for (int64_t i = threadIdx.x; i < packs; i += kThreads) acc = Accumulate(acc, in[i]);
  __shared__ MaxSum partial[kThreads / 32];
  acc = BlockCombine<kThreads>(acc, partial);
  const float lse = acc.m + __logf(acc.s);
  const float label_logit = ToFloat(logits[row * vocab + label]);
  __syncthreads();  // every thread has read the label's logit before any writes: grad may be logits
  if (threadIdx.x == 0) loss[row] = lse - label_logit;

  const float scale = *scale_ptr;
  for (int64_t i = threadIdx.x; i < packs; i += kThreads) out[i] = Gradient(in[i], i * kVec, label, lse, scale);
}

template <typename T, int kVec>
void LaunchRows(const T* logits, const int32_t* labels, const float* scale, int64_t rows, int64_t vocab, float* loss,
                T* grad, cudaStream_t stream) {
  const int64_t packs = vocab / kVec;
  const int64_t segment = (packs + kCluster - 1) / kCluster;
  const int64_t bytes = segment * static_cast<int64_t>(sizeof(Vec<T, kVec>));
  if (bytes > kMaxSegmentBytes || rows > 0x7fffffff / kCluster) {
    CrossEntropyRowsKernel<T, kVec><<<rows, kThreads, 0, stream>>>(logits, labels, scale, vocab, loss, grad);
    return;
  }
  const auto kernel = CrossEntropyRowsClusterKernel<T, kVec>;
  // Set at every launch: the attribute belongs to the current device, and one process may drive several.
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = kCluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(rows * kCluster));
  config.blockDim = dim3(kClusterThreads<T>);
  config.dynamicSmemBytes = static_cast<size_t>(bytes);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, logits, labels, scale, vocab, segment, loss, grad);
}

template <typename T>
void Launch(const void* logits, const int32_t* labels, const float* scale, int64_t rows, int64_t vocab, float* loss,
            void* grad, cudaStream_t stream) {
  constexpr int kVec = kWideVec<T>;
  const auto* in = static_cast<const T*>(logits);
  auto* out = static_cast<T*>(grad);
  if (vocab % kVec == 0) {
    LaunchRows<T, kVec>(in, labels, scale, rows, vocab, loss, out, stream);
  } else {
    LaunchRows<T, 1>(in, labels, scale, rows, vocab, loss, out, stream);
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
