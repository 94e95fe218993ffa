// Deterministic expert layout: a stable radix sort of the (token, k) pairs by expert id (CUB), then the
// offsets read off the sorted keys. No atomics, no host synchronisation; dropped ids sort last.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/kernel_module.cuh"
#include "kernels/moe_kernels.h"

namespace jmm::cuda {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

// Sort keys: the expert id, or num_experts for ids outside [0, num_experts); values: the pair index.
__global__ void MakeSortKeys(const int32_t* experts, int num_pairs, int num_experts, int32_t* keys, int32_t* pairs) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= num_pairs) return;
  const int32_t e = experts[p];
  keys[p] = (e >= 0 && e < num_experts) ? e : num_experts;
  pairs[p] = p;
}

// Row r starts every expert in (key[r-1], key[r]]; the last row also closes (key[last], num_experts].
__global__ void WriteLayout(const int32_t* sorted_keys, const int32_t* sorted_pairs, int num_pairs, int num_experts,
                            int32_t* row_of_pair, int32_t* pair_of_row, int32_t* expert_offsets) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= num_pairs) return;
  const int32_t key = sorted_keys[r];
  const int32_t prev = r == 0 ? -1 : sorted_keys[r - 1];
  for (int32_t e = prev + 1; e <= key; ++e) expert_offsets[e] = r;
  if (r == num_pairs - 1) {
    for (int32_t e = key + 1; e <= num_experts; ++e) expert_offsets[e] = num_pairs;
  }
  const bool kept = key < num_experts;
  const int32_t pair = sorted_pairs[r];
  pair_of_row[r] = kept ? pair : -1;
  row_of_pair[pair] = kept ? r : -1;
}

int KeyBits(int64_t num_experts) {
  int bits = 1;
  while ((int64_t{1} << bits) <= num_experts) ++bits;
  return bits;
}

size_t SortTempBytes(int n, int64_t num_experts) {
  size_t temp_bytes = 0;
  int32_t* none = nullptr;
  if (cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, none, none, none, none, n, 0, KeyBits(num_experts)) !=
      cudaSuccess) {
    return 0;
  }
  return temp_bytes;
}

}  // namespace

size_t SortPairsScratchBytes(int64_t num_pairs, int64_t num_experts) {
  if (num_pairs == 0) return 0;
  return ScratchFootprint(4 * num_pairs * sizeof(int32_t)) +
         ScratchFootprint(SortTempBytes(static_cast<int>(num_pairs), num_experts));
}

Status SortPairsByExpert(const int32_t* experts, int64_t num_pairs, int64_t num_experts, int32_t* row_of_pair,
                         int32_t* pair_of_row, int32_t* expert_offsets, const Scratch& scratch, cudaStream_t stream) {
  const int n = static_cast<int>(num_pairs);
  if (n == 0) {
    return cudaMemsetAsync(expert_offsets, 0, (num_experts + 1) * sizeof(int32_t), stream) == cudaSuccess
               ? Status{}
               : Status("expert_offsets memset failed");
  }
  int32_t* buffers = static_cast<int32_t*>(scratch(4 * num_pairs * sizeof(int32_t)));
  if (buffers == nullptr) return "out of scratch memory for the expert sort";
  int32_t *keys = buffers, *pairs = buffers + n, *sorted_keys = buffers + 2 * n, *sorted_pairs = buffers + 3 * n;
  const int bits = KeyBits(num_experts);
  size_t temp_bytes = SortTempBytes(n, num_experts);
  if (temp_bytes == 0) return "cub radix sort size query failed";
  void* temp = scratch(temp_bytes);
  if (temp == nullptr) return "out of scratch memory for the expert sort";
  MakeSortKeys<<<Blocks(n), kThreads, 0, stream>>>(experts, n, static_cast<int>(num_experts), keys, pairs);
  if (cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, sorted_keys, pairs, sorted_pairs, n, 0, bits, stream) !=
      cudaSuccess) {
    return std::string("cub radix sort failed: ") + cudaGetErrorString(cudaGetLastError());
  }
  WriteLayout<<<Blocks(n), kThreads, 0, stream>>>(sorted_keys, sorted_pairs, n, static_cast<int>(num_experts),
                                                  row_of_pair, pair_of_row, expert_offsets);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return std::string("layout kernels failed: ") + cudaGetErrorString(err);
  }
  return {};
}

}  // namespace jmm::cuda
