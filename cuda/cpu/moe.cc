// The CPU kernels (moe.h): loops accumulating in float32 (float64 for float64 inputs) that round to the storage
// type where the CUDA kernels store (moe_elementwise.cu follows these rounding points).
//
// Every result is one sum in a fixed order, starting from zero: a row's products in index order, a weight
// gradient's over its expert's rows in row order, y and dx over k. The register tiles of TileProduct only choose
// which results are computed side by side, never the order within one, and the build keeps multiplies and adds
// unfused (-ffp-contract=off, CMakeLists.txt), so the bits do not depend on the tiling, the vector width, the
// threads or which rows share a tile.
#include "cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu/scalar.h"

namespace jmm::cpu {

void MoeLayout(const int32_t* experts, int64_t num_pairs, int64_t num_experts, int32_t* row_of_pair,
               int32_t* pair_of_row, int32_t* expert_offsets) {
  std::vector<int32_t> cursor(num_experts + 1, 0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    int32_t e = experts[p];
    if (e >= 0 && e < num_experts) ++cursor[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) cursor[e + 1] += cursor[e];
  for (int64_t e = 0; e <= num_experts; ++e) expert_offsets[e] = cursor[e];
  for (int64_t r = 0; r < num_pairs; ++r) pair_of_row[r] = -1;
  for (int64_t p = 0; p < num_pairs; ++p) {
    int32_t e = experts[p];
    if (e >= 0 && e < num_experts) {
      int32_t row = cursor[e]++;
      row_of_pair[p] = row;
      pair_of_row[row] = static_cast<int32_t>(p);
    } else {
      row_of_pair[p] = -1;
    }
  }
}

namespace {

constexpr int64_t kTileRows = 4;         // rows of a register tile
constexpr int64_t kTileVectors = 2;      // vectors of accumulators per row of a register tile
constexpr int64_t kBlockRows = 64;       // rows of one work item of the row-wise steps
constexpr int64_t kBlockTokens = 64;     // tokens of one work item of the combines
constexpr int64_t kGateUpGradRows = 16;  // rows of d_w_gate_up[e] in one work item
constexpr int64_t kDownGradCols = 64;    // columns of d_w_down[e] in one work item

template <typename A>
A Sigmoid(A v) {
  return A(1) / (A(1) + std::exp(-v));
}

// c[r * n + j] = sum over k < depth of a[r * a_row + k * a_step] * b[k * ldb + j], for r < kTileRows and j < n, k
// ascending, on vectors of kVectorBytes. The accumulators of a tile (kTileRows x kTileVectors vectors) stay in
// registers while k runs.
template <int kVectorBytes, typename A>
__attribute__((always_inline)) inline void TileProductOn(const A* a, int64_t a_row, int64_t a_step, int64_t depth,
                                                         const A* b, int64_t ldb, int64_t n, A* c) {
  typedef A Vector __attribute__((vector_size(kVectorBytes)));
  typedef A Unaligned __attribute__((vector_size(kVectorBytes), aligned(sizeof(A)), may_alias));
  constexpr int64_t kCols = kTileVectors * kVectorBytes / sizeof(A);
  int64_t j0 = 0;
  for (; j0 + kCols <= n; j0 += kCols) {
    Vector acc[kTileRows][kTileVectors] = {};
    for (int64_t k = 0; k < depth; ++k) {
      const Unaligned* bk = reinterpret_cast<const Unaligned*>(b + k * ldb + j0);
      for (int64_t r = 0; r < kTileRows; ++r) {
        const A av = a[r * a_row + k * a_step];
        for (int64_t v = 0; v < kTileVectors; ++v) acc[r][v] += av * bk[v];
      }
    }
    for (int64_t r = 0; r < kTileRows; ++r) {
      for (int64_t v = 0; v < kTileVectors; ++v) reinterpret_cast<Unaligned*>(c + r * n + j0)[v] = acc[r][v];
    }
  }
  for (int64_t r = 0; r < kTileRows; ++r) {
    for (int64_t j = j0; j < n; ++j) {
      A s = 0;
      for (int64_t k = 0; k < depth; ++k) s += a[r * a_row + k * a_step] * b[k * ldb + j];
      c[r * n + j] = s;
    }
  }
}

// x86-64 builds with GCC or Clang also compile TileProduct for AVX2 and AVX-512, taken where the CPU has them:
// the same sums on wider vectors, so the same bits.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define JMM_CPU_WIDE_VECTORS 1
template <typename A>
__attribute__((target("avx512f"))) void TileProductAvx512(const A* a, int64_t a_row, int64_t a_step, int64_t depth,
                                                          const A* b, int64_t ldb, int64_t n, A* c) {
  TileProductOn<64>(a, a_row, a_step, depth, b, ldb, n, c);
}
template <typename A>
__attribute__((target("avx2"))) void TileProductAvx2(const A* a, int64_t a_row, int64_t a_step, int64_t depth,
                                                     const A* b, int64_t ldb, int64_t n, A* c) {
  TileProductOn<32>(a, a_row, a_step, depth, b, ldb, n, c);
}
#endif

// The widest vectors of this CPU that a TileProduct was compiled for.
int VectorBytes() {
#ifdef JMM_CPU_WIDE_VECTORS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 64;
  if (__builtin_cpu_supports("avx2")) return 32;
#endif
  return 16;
}

template <typename A>
void TileProduct(const A* a, int64_t a_row, int64_t a_step, int64_t depth, const A* b, int64_t ldb, int64_t n, A* c) {
  static const int vector_bytes = VectorBytes();
#ifdef JMM_CPU_WIDE_VECTORS
  if (vector_bytes == 64) return TileProductAvx512(a, a_row, a_step, depth, b, ldb, n, c);
  if (vector_bytes == 32) return TileProductAvx2(a, a_row, a_step, depth, b, ldb, n, c);
#endif
  TileProductOn<16>(a, a_row, a_step, depth, b, ldb, n, c);
}

// One work item of a row-wise step: rows [begin, end) of one expert.
struct RowBlock {
  int64_t expert, begin, end;
};

std::vector<RowBlock> RowBlocks(const int32_t* expert_offsets, int64_t experts) {
  std::vector<RowBlock> blocks;
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = expert_offsets[e]; r < expert_offsets[e + 1]; r += kBlockRows) {
      blocks.push_back({e, r, std::min<int64_t>(r + kBlockRows, expert_offsets[e + 1])});
    }
  }
  return blocks;
}

// `count` weights in the accumulation type, the right operand of TileProduct: `w` itself where that is its type,
// else converted into `buffer`.
template <typename T, typename A>
const A* InAccumulationType(const T* w, int64_t count, std::vector<A>& buffer) {
  if constexpr (std::is_same_v<T, A>) {
    return w;
  } else {
    buffer.resize(count);
    for (int64_t i = 0; i < count; ++i) buffer[i] = Load<A>(w[i]);
    return buffer.data();
  }
}

// out [cols, rows] = w [rows, cols] transposed, in the accumulation type.
template <typename T, typename A>
void Transpose(const T* w, int64_t rows, int64_t cols, A* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = Load<A>(w[r * cols + c]);
  }
}

// out[t] = sum_k scale(t*K + k) * rows[row_of_pair[t*K + k]], in k order (deterministic); dropped
// pairs are skipped. The forward's combine and the backward's dx reduction.
template <typename T, typename A, typename Scale>
void CombineRows(const MoeDims& d, const A* rows, const int32_t* row_of_pair, Scale scale, T* out,
                 const ParallelFor& parallel) {
  const int64_t H = d.hidden, K = d.top_k;
  parallel((d.tokens + kBlockTokens - 1) / kBlockTokens, [&](int64_t item) {
    std::vector<A> sum(H);
    for (int64_t t = item * kBlockTokens; t < std::min(d.tokens, (item + 1) * kBlockTokens); ++t) {
      std::fill(sum.begin(), sum.end(), A(0));
      for (int64_t k = 0; k < K; ++k) {
        const int32_t r = row_of_pair[t * K + k];
        if (r < 0) continue;
        const A w = scale(t * K + k);
        const A* row = rows + r * H;
        for (int64_t h = 0; h < H; ++h) sum[h] += w * row[h];
      }
      for (int64_t h = 0; h < H; ++h) out[t * H + h] = Store<T>(sum[h]);
    }
  });
}

// An uninitialised buffer of n values: every entry the kernels read they write first.
template <typename A>
std::unique_ptr<A[]> Buffer(int64_t n) {
  return std::unique_ptr<A[]>(new A[n]);
}

// A tile of kTileRows rows of width `width` for rows r0 .. r0 + rows - 1: row r is the token row of its pair
// (`tokens + (pair_of_row[r0 + r] / top_k) * width`), converted to A; the rows past `rows` are zeros.
template <typename T, typename A>
void GatherTokenTile(const T* tokens, const int32_t* pair_of_row, int64_t r0, int64_t rows, int64_t top_k,
                     int64_t width, A* tile) {
  for (int64_t r = 0; r < kTileRows; ++r) {
    A* row = tile + r * width;
    if (r >= rows) {
      std::fill(row, row + width, A(0));
      continue;
    }
    const T* token = tokens + (pair_of_row[r0 + r] / top_k) * width;
    for (int64_t h = 0; h < width; ++h) row[h] = Load<A>(token[h]);
  }
}

}  // namespace

template <typename T>
void MoeGateUp(const MoeDims& d, const T* x, const T* w_gate_up, const int32_t* pair_of_row,
               const int32_t* expert_offsets, T* gate_up, const ParallelFor& parallel) {
  using A = typename Acc<T>::type;
  const int64_t H = d.hidden, N = 2 * d.intermediate, K = d.top_k;
  const std::vector<RowBlock> blocks = RowBlocks(expert_offsets, d.experts);
  parallel(blocks.size(), [&](int64_t item) {
    const RowBlock& block = blocks[item];
    std::vector<A> w_buffer, a(kTileRows * H), c(kTileRows * N);
    const A* w = InAccumulationType(w_gate_up + block.expert * H * N, H * N, w_buffer);
    for (int64_t r0 = block.begin; r0 < block.end; r0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, block.end - r0);
      GatherTokenTile(x, pair_of_row, r0, rows, K, H, a.data());
      TileProduct(a.data(), H, 1, H, w, N, N, c.data());
      for (int64_t j = 0; j < rows * N; ++j) gate_up[r0 * N + j] = Store<T>(c[j]);
    }
  });
}

template <typename T>
void MoeDown(const MoeDims& d, const T* gate_up, const typename Acc<T>::type* weights, const T* w_down,
             const int32_t* row_of_pair, const int32_t* expert_offsets, T* y, const ParallelFor& parallel) {
  using A = typename Acc<T>::type;
  const int64_t H = d.hidden, I = d.intermediate;
  const std::vector<RowBlock> blocks = RowBlocks(expert_offsets, d.experts);
  auto out = Buffer<A>(expert_offsets[d.experts] * H);  // per-row expert output, combined in pair order below
  parallel(blocks.size(), [&](int64_t item) {
    const RowBlock& block = blocks[item];
    std::vector<A> w_buffer, act(kTileRows * I), sig(I), c(kTileRows * H);
    const A* w = InAccumulationType(w_down + block.expert * I * H, I * H, w_buffer);
    for (int64_t r0 = block.begin; r0 < block.end; r0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, block.end - r0);
      for (int64_t r = 0; r < kTileRows; ++r) {
        A* ar = act.data() + r * I;
        if (r >= rows) {
          std::fill(ar, ar + I, A(0));
          continue;
        }
        const T* zr = gate_up + (r0 + r) * 2 * I;
        for (int64_t i = 0; i < I; ++i) sig[i] = Sigmoid(Load<A>(zr[i]));
        for (int64_t i = 0; i < I; ++i) ar[i] = Round<T>(Load<A>(zr[i]) * sig[i] * Load<A>(zr[I + i]));
      }
      TileProduct(act.data(), I, 1, I, w, H, H, c.data());
      std::copy(c.begin(), c.begin() + rows * H, out.get() + r0 * H);
    }
  });
  CombineRows<T>(d, out.get(), row_of_pair, [&](int64_t pair) { return weights[pair]; }, y, parallel);
}

template <typename T>
void MoeBackward(const MoeDims& d, const T* dy, const T* x, const typename Acc<T>::type* weights, const T* w_gate_up,
                 const T* w_down, const T* gate_up, const int32_t* row_of_pair, const int32_t* pair_of_row,
                 const int32_t* expert_offsets, T* dx, typename Acc<T>::type* d_weights, T* d_w_gate_up, T* d_w_down,
                 const ParallelFor& parallel) {
  using A = typename Acc<T>::type;
  const int64_t H = d.hidden, I = d.intermediate, N = 2 * I, K = d.top_k;
  const int64_t R = expert_offsets[d.experts];  // rows with a pair
  const std::vector<RowBlock> blocks = RowBlocks(expert_offsets, d.experts);
  // Per row: dz (the gradient of gate_up) and h = silu(gate) * up, which the weight gradients read (h padded to
  // whole tiles with zeros), and dx's share, reduced in pair order.
  const int64_t I_padded = (I + kTileRows - 1) / kTileRows * kTileRows;
  auto dz_rows = Buffer<A>(R * N), act_rows = Buffer<A>(R * I_padded), dx_rows = Buffer<A>(R * H);
  std::fill(d_weights, d_weights + d.tokens * K, A(0));  // dropped pairs keep it
  // The transposed weights, the right operands of g = dy[t] . w_down^T and of dx's rows = dz . w_gate_up^T.
  auto w_t = Buffer<A>(d.experts * 3 * H * I);
  parallel(d.experts, [&](int64_t e) {
    if (expert_offsets[e + 1] == expert_offsets[e]) return;
    Transpose(w_down + e * I * H, I, H, w_t.get() + e * 3 * H * I);
    Transpose(w_gate_up + e * H * N, H, N, w_t.get() + e * 3 * H * I + H * I);
  });
  parallel(blocks.size(), [&](int64_t item) {
    const RowBlock& block = blocks[item];
    const A* wd_t = w_t.get() + block.expert * 3 * H * I;  // [H, I]
    const A* wgu_t = wd_t + H * I;                         // [2I, H]
    std::vector<A> dy_tile(kTileRows * H), g(kTileRows * I), sig(kTileRows * I), dz(kTileRows * N),
        dx_tile(kTileRows * H);
    for (int64_t r0 = block.begin; r0 < block.end; r0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, block.end - r0);
      GatherTokenTile(dy, pair_of_row, r0, rows, K, H, dy_tile.data());
      TileProduct(dy_tile.data(), H, 1, H, wd_t, I, I, g.data());  // g = dy[t] . w_down^T
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < I; ++i) sig[r * I + i] = Sigmoid(Load<A>(gate_up[(r0 + r) * N + i]));
      }
      for (int64_t r = 0; r < kTileRows; ++r) {
        A* __restrict__ dzr = dz.data() + r * N;
        if (r >= rows) {
          std::fill(dzr, dzr + N, A(0));
          continue;
        }
        const int64_t row = r0 + r;
        const A w = weights[pair_of_row[row]];
        const A* __restrict__ gr = g.data() + r * I;
        const A* __restrict__ sr = sig.data() + r * I;
        const T* __restrict__ zr = gate_up + row * N;
        A* __restrict__ act = act_rows.get() + row * I_padded;
        for (int64_t i = 0; i < I; ++i) {
          const A zg = Load<A>(zr[i]), zu = Load<A>(zr[I + i]), silu = zg * sr[i], dact = w * gr[i];
          act[i] = Round<T>(silu * zu);
          dzr[i] = Round<T>(dact * zu * sr[i] * (A(1) + zg * (A(1) - sr[i])));
          dzr[I + i] = Round<T>(dact * silu);
        }
        std::fill(act + I, act + I_padded, A(0));
        std::copy(dzr, dzr + N, dz_rows.get() + row * N);
      }
      A dw[kTileRows] = {};  // d_weights = <g, h>, the tile's rows side by side
      for (int64_t i = 0; i < I; ++i) {
        for (int64_t r = 0; r < rows; ++r) dw[r] += g[r * I + i] * act_rows[(r0 + r) * I_padded + i];
      }
      for (int64_t r = 0; r < rows; ++r) d_weights[pair_of_row[r0 + r]] = dw[r];
      TileProduct(dz.data(), N, 1, N, wgu_t, H, H, dx_tile.data());  // dx's rows: dz . w_gate_up^T
      std::copy(dx_tile.begin(), dx_tile.begin() + rows * H, dx_rows.get() + r0 * H);
    }
  });
  CombineRows<T>(d, dx_rows.get(), row_of_pair, [](int64_t) { return A(1); }, dx, parallel);

  // The weight gradients, K-grouped over each expert's rows: d_w_gate_up[e] = x_e^T . dz_e, kGateUpGradRows of its
  // H rows per work item, and d_w_down[e] = h_e^T . (w dy)_e, kDownGradCols of its H columns per work item, each
  // item gathering its share of x_e or w dy.
  const int64_t gate_up_items = (H + kGateUpGradRows - 1) / kGateUpGradRows;
  const int64_t items_per_expert = gate_up_items + (H + kDownGradCols - 1) / kDownGradCols;
  parallel(d.experts * items_per_expert, [&](int64_t item) {
    const int64_t e = item / items_per_expert, part = item % items_per_expert;
    const int64_t begin = expert_offsets[e], count = expert_offsets[e + 1] - begin;
    if (count == 0) {  // no rows: zero gradients
      if (part < gate_up_items) {
        const int64_t first = part * kGateUpGradRows, height = std::min(kGateUpGradRows, H - first);
        std::fill(d_w_gate_up + (e * H + first) * N, d_w_gate_up + (e * H + first + height) * N, Store<T>(A(0)));
      } else {
        const int64_t first = (part - gate_up_items) * kDownGradCols, width = std::min(kDownGradCols, H - first);
        for (int64_t i = 0; i < I; ++i) {
          std::fill(d_w_down + (e * I + i) * H + first, d_w_down + (e * I + i) * H + first + width, Store<T>(A(0)));
        }
      }
      return;
    }
    if (part < gate_up_items) {
      const int64_t first = part * kGateUpGradRows, height = std::min(kGateUpGradRows, H - first);
      std::vector<A> xs(count * kGateUpGradRows), c(kTileRows * N);  // x_e's columns [first, first + height)
      for (int64_t s = 0; s < count; ++s) {
        const T* xt = x + (pair_of_row[begin + s] / K) * H + first;
        for (int64_t q = 0; q < kGateUpGradRows; ++q) xs[s * kGateUpGradRows + q] = q < height ? Load<A>(xt[q]) : A(0);
      }
      for (int64_t q0 = 0; q0 < height; q0 += kTileRows) {
        TileProduct(xs.data() + q0, 1, kGateUpGradRows, count, dz_rows.get() + begin * N, N, N, c.data());
        T* grad = d_w_gate_up + (e * H + first + q0) * N;
        for (int64_t j = 0; j < std::min(kTileRows, height - q0) * N; ++j) grad[j] = Store<T>(c[j]);
      }
    } else {
      const int64_t first = (part - gate_up_items) * kDownGradCols, width = std::min(kDownGradCols, H - first);
      std::vector<A> wdy(count * width), c(kTileRows * width);  // (w dy)_e's columns [first, first + width)
      for (int64_t s = 0; s < count; ++s) {
        const int64_t pair = pair_of_row[begin + s];
        const T* dyt = dy + (pair / K) * H + first;
        for (int64_t h = 0; h < width; ++h) wdy[s * width + h] = Round<T>(weights[pair] * Load<A>(dyt[h]));
      }
      for (int64_t q0 = 0; q0 < I; q0 += kTileRows) {
        TileProduct(act_rows.get() + begin * I_padded + q0, 1, I_padded, count, wdy.data(), width, width, c.data());
        T* grad = d_w_down + (e * I + q0) * H + first;
        for (int64_t q = 0; q < std::min(kTileRows, I - q0); ++q) {
          for (int64_t h = 0; h < width; ++h) grad[q * H + h] = Store<T>(c[q * width + h]);
        }
      }
    }
  });
}

#define JMM_INSTANTIATE(T)                                                                                            \
  template void MoeGateUp<T>(const MoeDims&, const T*, const T*, const int32_t*, const int32_t*, T*,                  \
                             const ParallelFor&);                                                                     \
  template void MoeDown<T>(const MoeDims&, const T*, const Acc<T>::type*, const T*, const int32_t*, const int32_t*,   \
                           T*, const ParallelFor&);                                                                   \
  template void MoeBackward<T>(const MoeDims&, const T*, const T*, const Acc<T>::type*, const T*, const T*, const T*, \
                               const int32_t*, const int32_t*, const int32_t*, T*, Acc<T>::type*, T*, T*,             \
                               const ParallelFor&);
JMM_INSTANTIATE(float)
JMM_INSTANTIATE(double)
JMM_INSTANTIATE(BFloat16)
JMM_INSTANTIATE(_Float16)
#undef JMM_INSTANTIATE

}  // namespace jmm::cpu
