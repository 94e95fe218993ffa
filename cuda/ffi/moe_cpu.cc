// CPU FFI handlers of the MoE op family (contract in targets.h): argument checks and dtype dispatch onto the CPU
// kernels of cuda/cpu/moe.h.
#include <type_traits>

#include "cpu/moe.h"
#include "cpu/scalar.h"
#include "ffi/cpu_thread_pool.h"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"

namespace jmm {
namespace {

// Calls fn with a null pointer of the C++ storage type matching `type`.
template <typename Fn>
ffi::Error DispatchFloat(ffi::DataType type, Fn&& fn) {
  switch (type) {
    case ffi::F32:
      return fn(static_cast<float*>(nullptr));
    case ffi::F64:
      return fn(static_cast<double*>(nullptr));
    case ffi::BF16:
      return fn(static_cast<cpu::BFloat16*>(nullptr));
    case ffi::F16:
      return fn(static_cast<_Float16*>(nullptr));
    default:
      return InvalidArgument("unsupported dtype for the CPU MoE kernels");
  }
}

template <typename T>
T* Data(ffi::AnyBuffer buffer) {
  return static_cast<T*>(buffer.untyped_data());
}

ffi::Error MoeLayoutCpu(ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<ffi::S32> row_of_pair,
                        ffi::ResultBuffer<ffi::S32> pair_of_row, ffi::ResultBuffer<ffi::S32> expert_offsets,
                        int64_t num_experts) {
  if (expert_offsets->element_count() != static_cast<size_t>(num_experts + 1)) {
    return InvalidArgument("expert_offsets must hold num_experts + 1 entries");
  }
  cpu::MoeLayout(experts.typed_data(), experts.element_count(), num_experts, row_of_pair->typed_data(),
                 pair_of_row->typed_data(), expert_offsets->typed_data());
  return ffi::Error::Success();
}

ffi::Error MoeGateUpCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w_gate_up,
                        ffi::Buffer<ffi::S32> pair_of_row, ffi::Buffer<ffi::S32> expert_offsets,
                        ffi::Result<ffi::AnyBuffer> gate_up) {
  MoeDims d;
  if (auto err = ReadGateUpDims(x, w_gate_up, pair_of_row.element_count(), &d); err.failure()) return err;
  return DispatchFloat(x.element_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cpu::MoeGateUp<T>(d, Data<T>(x), Data<T>(w_gate_up), pair_of_row.typed_data(), expert_offsets.typed_data(),
                      Data<T>(*gate_up), OnThreadPool(pool));
    return ffi::Error::Success();
  });
}

ffi::Error MoeDownCpu(ffi::ThreadPool pool, ffi::AnyBuffer gate_up, ffi::AnyBuffer weights, ffi::AnyBuffer w_down,
                      ffi::Buffer<ffi::S32> row_of_pair, ffi::Buffer<ffi::S32> expert_offsets,
                      ffi::Result<ffi::AnyBuffer> y) {
  MoeDims d;
  if (auto err = ReadDownDims(gate_up, weights, w_down, &d); err.failure()) return err;
  return DispatchFloat(gate_up.element_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cpu::MoeDown<T>(d, Data<T>(gate_up), Data<typename cpu::Acc<T>::type>(weights), Data<T>(w_down),
                    row_of_pair.typed_data(), expert_offsets.typed_data(), Data<T>(*y), OnThreadPool(pool));
    return ffi::Error::Success();
  });
}

ffi::Error MoeBackwardCpu(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weights,
                          ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down, ffi::AnyBuffer gate_up,
                          ffi::Buffer<ffi::S32> row_of_pair, ffi::Buffer<ffi::S32> pair_of_row,
                          ffi::Buffer<ffi::S32> expert_offsets, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::Result<ffi::AnyBuffer> d_weights, ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                          ffi::Result<ffi::AnyBuffer> d_w_down) {
  MoeDims d;
  if (auto err = ReadMoeDims(x, weights, w_gate_up, w_down, &d); err.failure()) return err;
  return DispatchFloat(x.element_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename cpu::Acc<T>::type;
    cpu::MoeBackward<T>(d, Data<T>(dy), Data<T>(x), Data<A>(weights), Data<T>(w_gate_up), Data<T>(w_down),
                        Data<T>(gate_up), row_of_pair.typed_data(), pair_of_row.typed_data(),
                        expert_offsets.typed_data(), Data<T>(*dx), Data<A>(*d_weights), Data<T>(*d_w_gate_up),
                        Data<T>(*d_w_down), OnThreadPool(pool));
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cpu_moe_layout, jmm::MoeLayoutCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // experts
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // row_of_pair
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // pair_of_row
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_offsets
                                  .Attr<int64_t>("num_experts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cpu_moe_gate_up, jmm::MoeGateUpCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Arg<xla::ffi::AnyBuffer>()              // w_gate_up
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // pair_of_row
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_offsets
                                  .Ret<xla::ffi::AnyBuffer>());            // gate_up

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cpu_moe_down, jmm::MoeDownCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()              // gate_up
                                  .Arg<xla::ffi::AnyBuffer>()              // weights
                                  .Arg<xla::ffi::AnyBuffer>()              // w_down
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_of_pair
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_offsets
                                  .Ret<xla::ffi::AnyBuffer>());            // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cpu_moe_backward, jmm::MoeBackwardCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()              // dy
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Arg<xla::ffi::AnyBuffer>()              // weights
                                  .Arg<xla::ffi::AnyBuffer>()              // w_gate_up
                                  .Arg<xla::ffi::AnyBuffer>()              // w_down
                                  .Arg<xla::ffi::AnyBuffer>()              // gate_up
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_of_pair
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // pair_of_row
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_offsets
                                  .Ret<xla::ffi::AnyBuffer>()              // dx
                                  .Ret<xla::ffi::AnyBuffer>()              // d_weights
                                  .Ret<xla::ffi::AnyBuffer>()              // d_w_gate_up
                                  .Ret<xla::ffi::AnyBuffer>());            // d_w_down
