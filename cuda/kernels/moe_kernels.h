// Host entry points of the CUDA MoE kernels (cuda/kernels/*.cu), called by the FFI handlers (cuda/ffi/moe_cuda.cc)
// and by plain CUDA programs alike: nothing here depends on XLA.
//
// Every function only enqueues work on `stream`: no host synchronisation, no device allocation (temporary
// memory comes from the caller's `Scratch`; the FFI handlers carve it out of the workspace XLA allocates for the
// call, so that a CUDA graph capturing the call keeps valid addresses).
// Rows are (token, k) pairs in expert-sorted order: expert e owns rows [offsets[e], offsets[e+1]); rows at
// or past offsets[E] are dropped pairs and are never read.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>

namespace jmm::cuda {

enum class Dtype { kFloat32, kBFloat16 };

// Returns device memory of at least `bytes` (kScratchAlignment-aligned) that lives until the handler's work
// has run, or nullptr when the workspace is exhausted.
using Scratch = std::function<void*(size_t bytes)>;
constexpr size_t kScratchAlignment = 256;

// What one Scratch request of `bytes` takes from the workspace (a request of 0 bytes still gets a pointer).
inline size_t ScratchFootprint(size_t bytes) {
  return (std::max<size_t>(bytes, 1) + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

// Hands out `bytes` of workspace at `begin` front to back as a Scratch (XLA's buffers are kScratchAlignment-aligned,
// and so is every piece). The Scratch refers to the cursor, which must outlive it and not move.
class ScratchCursor {
 public:
  ScratchCursor(uint8_t* begin, size_t bytes) : next_(begin), end_(begin + bytes) {}
  size_t bytes_left() const { return static_cast<size_t>(end_ - next_); }
  Scratch scratch() {
    return [this](size_t bytes) -> void* {
      const size_t take = ScratchFootprint(bytes);
      if (take > bytes_left()) return nullptr;
      void* piece = next_;
      next_ += take;
      return piece;
    };
  }

 private:
  uint8_t* next_;
  uint8_t* end_;
};

// Upper bounds of what the steps below take from Scratch, for sizing the workspace: SortPairsByExpert (CUB's
// own size query; needs the current device), and one tensor-core RowsGemm or WeightGemm of any tile
// configuration (the SIMT path takes nothing).
size_t SortPairsScratchBytes(int64_t num_pairs, int64_t num_experts);
size_t GroupedGemmScratchBytes(int64_t num_experts);

// An empty message means success.
using Status = std::string;

// The status of the kernel launch just made: `what` and CUDA's message when it failed.
inline Status LaunchStatus(const char* what) {
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return std::string(what) + " launch failed: " + cudaGetErrorString(err);
  }
  return {};
}

// Bytes of one element of `dtype`.
inline size_t ElementBytes(Dtype dtype) { return dtype == Dtype::kBFloat16 ? 2 : 4; }

// Stable sort of the pairs by expert id (dropped ids last), written as three arrays:
//   row_of_pair [num_pairs]       sorted row of pair p, or -1 when its id is outside [0, num_experts)
//   pair_of_row [num_pairs]       pair held by sorted row r, or -1 for r >= expert_offsets[num_experts]
//   expert_offsets [num_experts+1] rows of expert e are [offsets[e], offsets[e+1]); stable in pair order
Status SortPairsByExpert(const int32_t* experts, int64_t num_pairs, int64_t num_experts, int32_t* row_of_pair,
                         int32_t* pair_of_row, int32_t* expert_offsets, const Scratch& scratch, cudaStream_t stream);

// dst[r] = src[pair_of_row[r] / top_k] for every kept row r.
Status GatherRows(Dtype dtype, const void* src, int64_t width, const int32_t* pair_of_row,
                  const int32_t* expert_offsets, int64_t num_experts, int64_t rows, int64_t top_k, void* dst,
                  cudaStream_t stream);

// h[r] = round(silu(gate) * up) for kept rows; gate_up rows past the kept ones are set to zero.
Status SwigluForward(Dtype dtype, void* gate_up, void* h, const int32_t* expert_offsets, int64_t num_experts,
                     int64_t rows, int64_t intermediate, cudaStream_t stream);

// out[t] = sum_k (weights[t,k] or 1) * row_values[row_of_pair[t*K+k]], float32, k in order.
Status CombineRows(Dtype dtype, const void* row_values, const int32_t* row_of_pair, const float* weights,
                   int64_t tokens, int64_t top_k, int64_t width, void* out, cudaStream_t stream);

// The SwiGLU backward of kept rows, given g = dy @ W_down^T (row r in row order), with h = round(silu(zg) * zu):
//   weighted_h = round(w * h); d_weights[pair] = <g, h>; dz = round(w * g * d(silu(zg) * zu)).
// weighted_h feeds d_W_down = weighted_h^T dy, so no copy of w * dy is needed; it may be written over g (the
// same pointer), and dz over gate_up; no other buffers may overlap. d_weights of dropped pairs is set to zero.
Status SwigluBackward(Dtype dtype, const void* gate_up, const void* g, const float* weights, const int32_t* pair_of_row,
                      const int32_t* row_of_pair, const int32_t* expert_offsets, int64_t num_experts, int64_t rows,
                      int64_t intermediate, void* weighted_h, void* dz, float* d_weights, cudaStream_t stream);

// Zeroes the `per_expert` elements of expert e in `w` for every expert without rows.
Status ZeroEmptyExperts(Dtype dtype, const int32_t* expert_offsets, int64_t num_experts, int64_t per_expert, void* w,
                        cudaStream_t stream);

// Tensor-core (CUTLASS sm90) grouped GEMMs need bf16 and 16-byte aligned rows; otherwise the SIMT path.
bool UseTensorCores(Dtype dtype, int64_t hidden, int64_t intermediate);

// Tile configurations of the tensor-core row-grouped GEMMs, each built for both B layouts. The values travel as
// int64 FFI attributes (jax_megamoe/ops/gemm_config.py's GemmTiles mirrors them), so they are explicit and never
// renumbered. The SIMT path ignores the choice. The weight-gradient GEMMs always use cooperative 128 x 256 tiles
// with a 2 x 1 cluster.
enum class GemmTiles : int64_t {
  kCooperative128x256 = 0,  // CUTLASS sm90 (grouped_gemm_cutlass.cuh): cooperative 128 x 256 x 64, no cluster
  kSmallRows = 1,           // grouped_gemm_small_rows.cu: one expert's 128-column slice per block, mma.sync
};

// Whether `value` names a GemmTiles configuration built into this library.
inline bool GemmTilesBuilt(int64_t value) {
  return value == static_cast<int64_t>(GemmTiles::kCooperative128x256) ||
         value == static_cast<int64_t>(GemmTiles::kSmallRows);
}

// The built values and what they are, for error messages.
inline std::string AcceptedGemmTiles() {
  return "0 (cooperative 128x256, no cluster), 1 (small rows: a 128-column slice of one expert per block)";
}

// Row-grouped GEMM: d[rows of e] = a[rows of e] @ B_e, a [rows, k], d [rows, n].
// B_e = b + e*k*n holds [k, n] row-major, or [n, k] row-major when `b_transposed`. `tiles` picks the CUTLASS
// instantiation (an error if it is not built).
Status RowsGemm(Dtype dtype, bool tensor_cores, const void* a, const void* b, void* d, const int32_t* expert_offsets,
                int64_t num_experts, int64_t rows, int64_t n, int64_t k, bool b_transposed, GemmTiles tiles,
                const Scratch& scratch, cudaStream_t stream);

// RowsGemm's GemmTiles::kSmallRows kernel (bf16, k and n multiples of 8): the decode-size path, for a few rows per
// expert. It takes no scratch.
Status SmallRowsGemm(const void* a, const void* b, void* d, const int32_t* expert_offsets, int64_t num_experts,
                     int64_t n, int64_t k, bool b_transposed, cudaStream_t stream);

// Expert-grouped weight GEMM: d_e = a[rows of e]^T @ b[rows of e], a [rows, m], b [rows, n], d [E, m, n].
// Experts without rows get zeros.
Status WeightGemm(Dtype dtype, bool tensor_cores, const void* a, const void* b, void* d, const int32_t* expert_offsets,
                  int64_t num_experts, int64_t rows, int64_t m, int64_t n, const Scratch& scratch, cudaStream_t stream);

// The CUTLASS instantiations behind RowsGemm / WeightGemm for bf16, one per .cu (grouped_gemm_{nn,nt,tn}.cu): NN
// has row-major B_e, NT transposed B_e, both with GemmTiles::kCooperative128x256; TN is the weight GEMM.
namespace cutlass_gemm {
// Bounds of the two Scratch requests of one instantiation, checked by it at run time: its group arrays (7
// arrays of one element per expert, an element at most kMaxGroupArrayElement bytes, each array rounded up
// to 128 bytes) and CUTLASS's workspace (TMA descriptors per SM, and the tile scheduler's).
constexpr size_t kMaxGroupArrayElement = 32;
inline size_t GroupArraysBound(int64_t experts) { return 7 * ((kMaxGroupArrayElement * experts + 127) / 128 * 128); }
inline size_t CutlassWorkspaceBound(int sm_count) { return 1024 * static_cast<size_t>(sm_count) + 4096; }

Status RowsGemmNN(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts, int64_t n,
                  int64_t k, const Scratch& scratch, cudaStream_t stream);
Status RowsGemmNT(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts, int64_t n,
                  int64_t k, const Scratch& scratch, cudaStream_t stream);
Status WeightGemmTN(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts, int64_t m,
                    int64_t n, const Scratch& scratch, cudaStream_t stream);
}  // namespace cutlass_gemm

}  // namespace jmm::cuda
