// The CPU kernels (moe.h): plain loops accumulating in float32 (float64 for float64 inputs) that round to the
// storage type where the CUDA kernels store (moe_elementwise.cu follows these rounding points).
#include "cpu/moe.h"

#include <algorithm>
#include <cmath>
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

template <typename A>
A Sigmoid(A v) {
  return A(1) / (A(1) + std::exp(-v));
}

// out[t] = sum_k scale(t*K + k) * rows[row_of_pair[t*K + k]], in k order (deterministic); dropped
// pairs are skipped. The forward's combine and the backward's dx reduction.
template <typename T, typename A, typename Scale>
void CombineRows(const MoeDims& d, const A* rows, const int32_t* row_of_pair, Scale scale, T* out) {
  const int64_t H = d.hidden, K = d.top_k;
  std::vector<A> sum(H);
  for (int64_t t = 0; t < d.tokens; ++t) {
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
}

}  // namespace

template <typename T>
void MoeGateUp(const MoeDims& d, const T* x, const T* w_gate_up, const int32_t* pair_of_row,
               const int32_t* expert_offsets, T* gate_up) {
  using A = typename Acc<T>::type;
  const int64_t H = d.hidden, I = d.intermediate, K = d.top_k;
  std::vector<A> acc(2 * I);
  for (int64_t e = 0; e < d.experts; ++e) {
    const T* wgu = w_gate_up + e * H * 2 * I;
    for (int64_t r = expert_offsets[e]; r < expert_offsets[e + 1]; ++r) {
      const T* xt = x + (pair_of_row[r] / K) * H;
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t h = 0; h < H; ++h) {
        const A xv = Load<A>(xt[h]);
        const T* wrow = wgu + h * 2 * I;
        for (int64_t j = 0; j < 2 * I; ++j) acc[j] += xv * Load<A>(wrow[j]);
      }
      T* zr = gate_up + r * 2 * I;
      for (int64_t j = 0; j < 2 * I; ++j) zr[j] = Store<T>(acc[j]);
    }
  }
}

template <typename T>
void MoeDown(const MoeDims& d, const T* gate_up, const typename Acc<T>::type* weights, const T* w_down,
             const int32_t* row_of_pair, const int32_t* expert_offsets, T* y) {
  using A = typename Acc<T>::type;
  const int64_t H = d.hidden, I = d.intermediate, K = d.top_k;
  const int64_t rows = d.tokens * K;
  std::vector<A> out(rows * H, A(0));  // per-row expert output, combined in pair order below
  std::vector<A> act(I);
  for (int64_t e = 0; e < d.experts; ++e) {
    const T* wdn = w_down + e * I * H;
    for (int64_t r = expert_offsets[e]; r < expert_offsets[e + 1]; ++r) {
      const T* zr = gate_up + r * 2 * I;
      for (int64_t i = 0; i < I; ++i) {
        const A g = Load<A>(zr[i]), u = Load<A>(zr[I + i]);
        act[i] = Round<T>(g * Sigmoid(g) * u);
      }
      A* o = out.data() + r * H;
      for (int64_t i = 0; i < I; ++i) {
        const A hv = act[i];
        const T* wrow = wdn + i * H;
        for (int64_t h = 0; h < H; ++h) o[h] += hv * Load<A>(wrow[h]);
      }
    }
  }
  CombineRows<T>(d, out.data(), row_of_pair, [&](int64_t pair) { return weights[pair]; }, y);
}

template <typename T>
void MoeBackward(const MoeDims& d, const T* dy, const T* x, const typename Acc<T>::type* weights, const T* w_gate_up,
                 const T* w_down, const T* gate_up, const int32_t* row_of_pair, const int32_t* pair_of_row,
                 const int32_t* expert_offsets, T* dx, typename Acc<T>::type* d_weights, T* d_w_gate_up, T* d_w_down) {
  using A = typename Acc<T>::type;
  const int64_t H = d.hidden, I = d.intermediate, K = d.top_k;
  const int64_t rows = d.tokens * K;
  std::vector<A> dx_rows(rows * H, A(0));  // per-row input gradients, reduced in pair order below
  std::vector<A> dwgu(2 * I * H), dwdn(I * H);
  std::vector<A> grad_act(I), act(I), dz(2 * I), wdy(H);
  for (int64_t p = 0; p < rows; ++p) d_weights[p] = A(0);
  for (int64_t e = 0; e < d.experts; ++e) {
    const T* wgu = w_gate_up + e * H * 2 * I;
    const T* wdn = w_down + e * I * H;
    std::fill(dwgu.begin(), dwgu.end(), A(0));
    std::fill(dwdn.begin(), dwdn.end(), A(0));
    for (int64_t r = expert_offsets[e]; r < expert_offsets[e + 1]; ++r) {
      const int64_t pair = pair_of_row[r], t = pair / K;
      const A w = weights[pair];
      const T* xt = x + t * H;
      const T* dyt = dy + t * H;
      const T* zr = gate_up + r * 2 * I;
      A dw = 0;
      for (int64_t i = 0; i < I; ++i) {
        const T* wrow = wdn + i * H;
        A g = 0;
        for (int64_t h = 0; h < H; ++h) g += Load<A>(dyt[h]) * Load<A>(wrow[h]);
        const A zg = Load<A>(zr[i]), zu = Load<A>(zr[I + i]);
        const A sig = Sigmoid(zg), silu = zg * sig;
        act[i] = Round<T>(silu * zu);
        dw += g * act[i];
        const A dact = w * g;
        dz[i] = Round<T>(dact * zu * sig * (A(1) + zg * (A(1) - sig)));
        dz[I + i] = Round<T>(dact * silu);
      }
      d_weights[pair] = dw;
      A* dxr = dx_rows.data() + r * H;
      for (int64_t h = 0; h < H; ++h) {
        const T* wrow = wgu + h * 2 * I;
        A s = 0;
        for (int64_t j = 0; j < 2 * I; ++j) s += dz[j] * Load<A>(wrow[j]);
        dxr[h] = s;
        const A xv = Load<A>(xt[h]);
        A* grow = dwgu.data() + h * 2 * I;
        for (int64_t j = 0; j < 2 * I; ++j) grow[j] += xv * dz[j];
      }
      for (int64_t h = 0; h < H; ++h) wdy[h] = Round<T>(w * Load<A>(dyt[h]));
      for (int64_t i = 0; i < I; ++i) {
        A* drow = dwdn.data() + i * H;
        for (int64_t h = 0; h < H; ++h) drow[h] += act[i] * wdy[h];
      }
    }
    for (int64_t j = 0; j < 2 * I * H; ++j) d_w_gate_up[e * 2 * I * H + j] = Store<T>(dwgu[j]);
    for (int64_t j = 0; j < I * H; ++j) d_w_down[e * I * H + j] = Store<T>(dwdn[j]);
  }
  CombineRows<T>(d, dx_rows.data(), row_of_pair, [](int64_t) { return A(1); }, dx);
}

#define JMM_INSTANTIATE(T)                                                                                            \
  template void MoeGateUp<T>(const MoeDims&, const T*, const T*, const int32_t*, const int32_t*, T*);                 \
  template void MoeDown<T>(const MoeDims&, const T*, const Acc<T>::type*, const T*, const int32_t*, const int32_t*,   \
                           T*);                                                                                       \
  template void MoeBackward<T>(const MoeDims&, const T*, const T*, const Acc<T>::type*, const T*, const T*, const T*, \
                               const int32_t*, const int32_t*, const int32_t*, T*, Acc<T>::type*, T*, T*);
JMM_INSTANTIATE(float)
JMM_INSTANTIATE(double)
JMM_INSTANTIATE(BFloat16)
JMM_INSTANTIATE(_Float16)
#undef JMM_INSTANTIATE

}  // namespace jmm::cpu
