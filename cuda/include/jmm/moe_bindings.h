// The FFI signatures of the MoE op family, shared by every platform's handlers (contract: handlers.h).
// A platform passes its binding with its context already bound (e.g. the CUDA stream), then the
// buffers and attributes are appended here, in the order the Python side passes them. Bindings are
// built from rvalues (the FFI API's methods are &&-qualified).
#pragma once

#include <utility>

#include "jmm/ffi_common.h"

namespace jmm {

template <typename Binding>
auto BindMoeLayout(Binding binding) {
  return std::move(binding).template Arg<ffi::Buffer<ffi::S32>>()  // experts
      .template Ret<ffi::Buffer<ffi::S32>>()            // row_of_pair
      .template Ret<ffi::Buffer<ffi::S32>>()            // pair_of_row
      .template Ret<ffi::Buffer<ffi::S32>>()            // expert_offsets
      .template Attr<int64_t>("num_experts");
}

template <typename Binding>
auto BindMoeGateUp(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()            // w_gate_up
      .template Arg<ffi::Buffer<ffi::S32>>()     // pair_of_row
      .template Arg<ffi::Buffer<ffi::S32>>()     // expert_offsets
      .template Ret<ffi::AnyBuffer>();           // gate_up
}

template <typename Binding>
auto BindMoeDown(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // gate_up
      .template Arg<ffi::AnyBuffer>()            // weights
      .template Arg<ffi::AnyBuffer>()            // w_down
      .template Arg<ffi::Buffer<ffi::S32>>()     // row_of_pair
      .template Arg<ffi::Buffer<ffi::S32>>()     // expert_offsets
      .template Ret<ffi::AnyBuffer>();           // y
}

template <typename Binding>
auto BindMoeBackward(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // dy
      .template Arg<ffi::AnyBuffer>()            // x
      .template Arg<ffi::AnyBuffer>()            // weights
      .template Arg<ffi::AnyBuffer>()            // w_gate_up
      .template Arg<ffi::AnyBuffer>()            // w_down
      .template Arg<ffi::AnyBuffer>()            // gate_up
      .template Arg<ffi::Buffer<ffi::S32>>()     // row_of_pair
      .template Arg<ffi::Buffer<ffi::S32>>()     // pair_of_row
      .template Arg<ffi::Buffer<ffi::S32>>()     // expert_offsets
      .template Ret<ffi::AnyBuffer>()            // dx
      .template Ret<ffi::AnyBuffer>()            // d_weights
      .template Ret<ffi::AnyBuffer>()            // d_w_gate_up
      .template Ret<ffi::AnyBuffer>();           // d_w_down
}

}  // namespace jmm
