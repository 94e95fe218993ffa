#include "cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/scalar.h"

namespace jmm::cpu {

template <typename T>
void CrossEntropyRows(const T* logits, const int32_t* labels, float scale, int64_t rows, int64_t vocab, float* loss,
                      T* grad) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = logits + r * vocab;
    T* out = grad + r * vocab;
    const int32_t label = labels[r];
    if (label < 0 || label >= vocab) {
      std::fill(out, out + vocab, Store<T, float>(0.f));
      loss[r] = 0.f;
      continue;
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < vocab; ++j) m = std::max(m, Load<float>(in[j]));
    double s = 0.0;  // a long row's sum in float32 would lose more than the reference's tree of partial sums
    for (int64_t j = 0; j < vocab; ++j) s += std::exp(Load<float>(in[j]) - m);
    const float lse = m + static_cast<float>(std::log(s));
    loss[r] = lse - Load<float>(in[label]);  // before the writes: grad may be logits
    for (int64_t j = 0; j < vocab; ++j) {
      const float g = std::exp(Load<float>(in[j]) - lse) * scale - (j == label ? scale : 0.f);
      out[j] = Store<T, float>(g);
    }
  }
}

template void CrossEntropyRows<float>(const float*, const int32_t*, float, int64_t, int64_t, float*, float*);
template void CrossEntropyRows<BFloat16>(const BFloat16*, const int32_t*, float, int64_t, int64_t, float*, BFloat16*);

}  // namespace jmm::cpu
