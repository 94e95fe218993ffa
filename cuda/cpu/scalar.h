// Storage types of the CPU kernels and their conversion to the accumulation type.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jmm::cpu {

// bfloat16 stored as its 16 raw bits; converted with round-to-nearest-even like XLA.
struct BFloat16 {
  uint16_t bits;
};

inline float ToFloat(BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline BFloat16 ToBFloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t quiet_nan = (u >> 16) | 0x40, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return BFloat16{static_cast<uint16_t>(std::isnan(f) ? quiet_nan : rounded)};  // a select: loops of it vectorise
}

// Accumulation type: float64 for float64 inputs, float32 for everything narrower.
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

template <typename A, typename T>
inline A Load(T v) {
  return static_cast<A>(v);
}
template <>
inline float Load<float, BFloat16>(BFloat16 v) {
  return ToFloat(v);
}

template <typename T, typename A>
inline T Store(A v) {
  return static_cast<T>(v);
}
template <>
inline BFloat16 Store<BFloat16, float>(float v) {
  return ToBFloat16(v);
}

// Rounds an accumulator value through the storage type (models where the kernels store it).
template <typename T, typename A>
inline A Round(A v) {
  return Load<A>(Store<T>(v));
}

}  // namespace jmm::cpu
