// Shared by every FFI handler (CPU and CUDA): the XLA FFI API, error formatting and the shape checks of the MoE ops'
// buffers (contract in targets.h).
#pragma once

#include <cstdint>
#include <string>

#include "moe_dims.h"
#include "xla/ffi/api/ffi.h"

namespace jmm {

namespace ffi = xla::ffi;

inline ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_megamoe: " + message);
}

// Routing weights travel in the accumulation type: float64 with float64 x, float32 otherwise.
inline ffi::Error CheckWeightsType(const ffi::AnyBuffer& weights, ffi::DataType x_type) {
  if (weights.element_type() != (x_type == ffi::F64 ? ffi::F64 : ffi::F32)) {
    return InvalidArgument("routing weights must be float32 (float64 for float64 x) at the FFI boundary");
  }
  return ffi::Error::Success();
}

// Reads and cross-checks the sizes of x [T,H], weights [T,K], w_gate_up [E,H,2I], w_down [E,I,H].
inline ffi::Error ReadMoeDims(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weights, const ffi::AnyBuffer& w_gate_up,
                              const ffi::AnyBuffer& w_down, MoeDims* dims) {
  auto xd = x.dimensions();
  auto wd = weights.dimensions();
  auto gd = w_gate_up.dimensions();
  auto dd = w_down.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || gd.size() != 3 || dd.size() != 3) {
    return InvalidArgument("moe buffers have the wrong rank");
  }
  dims->tokens = xd[0];
  dims->hidden = xd[1];
  dims->top_k = wd[1];
  dims->experts = gd[0];
  dims->intermediate = gd[2] / 2;
  if (wd[0] != dims->tokens || gd[1] != dims->hidden || gd[2] % 2 != 0 || dd[0] != dims->experts ||
      dd[1] != dims->intermediate || dd[2] != dims->hidden) {
    return InvalidArgument("moe buffers have inconsistent shapes");
  }
  if (auto err = CheckWeightsType(weights, x.element_type()); err.failure()) return err;
  if (x.element_type() != w_gate_up.element_type() || x.element_type() != w_down.element_type()) {
    return InvalidArgument("x, w_gate_up and w_down must share one dtype");
  }
  return ffi::Error::Success();
}

// Reads and cross-checks the sizes of moe_gate_up's x [T,H], w_gate_up [E,H,2I] and `pairs` = T*K layout entries.
inline ffi::Error ReadGateUpDims(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w_gate_up, size_t pairs,
                                 MoeDims* dims) {
  auto xd = x.dimensions();
  auto gd = w_gate_up.dimensions();
  if (xd.size() != 2 || gd.size() != 3) return InvalidArgument("moe_gate_up buffers have the wrong rank");
  dims->tokens = xd[0];
  dims->hidden = xd[1];
  dims->experts = gd[0];
  dims->intermediate = gd[2] / 2;
  dims->top_k = dims->tokens > 0 ? static_cast<int64_t>(pairs) / dims->tokens : 0;
  if (gd[1] != dims->hidden || gd[2] % 2 != 0 || static_cast<size_t>(dims->tokens * dims->top_k) != pairs) {
    return InvalidArgument("moe_gate_up buffers have inconsistent shapes");
  }
  if (x.element_type() != w_gate_up.element_type()) return InvalidArgument("x and w_gate_up must share one dtype");
  return ffi::Error::Success();
}

// Reads and cross-checks the sizes of moe_down's gate_up [T*K,2I], weights [T,K] and w_down [E,I,H].
inline ffi::Error ReadDownDims(const ffi::AnyBuffer& gate_up, const ffi::AnyBuffer& weights,
                               const ffi::AnyBuffer& w_down, MoeDims* dims) {
  auto zd = gate_up.dimensions();
  auto wd = weights.dimensions();
  auto dd = w_down.dimensions();
  if (zd.size() != 2 || wd.size() != 2 || dd.size() != 3) {
    return InvalidArgument("moe_down buffers have the wrong rank");
  }
  dims->tokens = wd[0];
  dims->top_k = wd[1];
  dims->experts = dd[0];
  dims->intermediate = dd[1];
  dims->hidden = dd[2];
  if (zd[0] != dims->tokens * dims->top_k || zd[1] != 2 * dims->intermediate) {
    return InvalidArgument("moe_down buffers have inconsistent shapes");
  }
  if (auto err = CheckWeightsType(weights, gate_up.element_type()); err.failure()) return err;
  if (gate_up.element_type() != w_down.element_type()) {
    return InvalidArgument("gate_up and w_down must share one dtype");
  }
  return ffi::Error::Success();
}

}  // namespace jmm
