// CPU FFI handler of linear_cross_entropy's cross-entropy rows (contract in targets.h) over cpu/cross_entropy.h.
#include "cpu/cross_entropy.h"
#include "cpu/scalar.h"
#include "ffi/cross_entropy_checks.h"
#include "ffi/targets.h"

namespace jmm {
namespace {

ffi::Error CrossEntropyRowsCpu(ffi::AnyBuffer logits, ffi::Buffer<ffi::S32> labels, ffi::Buffer<ffi::F32> scale,
                               ffi::Result<ffi::Buffer<ffi::F32>> loss, ffi::Result<ffi::AnyBuffer> grad) {
  int64_t rows = 0, vocab = 0;
  if (auto err = CheckCrossEntropyRows(logits, labels, scale, *loss, *grad, &rows, &vocab); err.failure()) return err;
  if (logits.element_type() == ffi::BF16) {
    cpu::CrossEntropyRows(static_cast<const cpu::BFloat16*>(logits.untyped_data()), labels.typed_data(),
                          scale.typed_data()[0], rows, vocab, loss->typed_data(),
                          static_cast<cpu::BFloat16*>(grad->untyped_data()));
  } else {
    cpu::CrossEntropyRows(static_cast<const float*>(logits.untyped_data()), labels.typed_data(), scale.typed_data()[0],
                          rows, vocab, loss->typed_data(), static_cast<float*>(grad->untyped_data()));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cpu_cross_entropy_rows, jmm::CrossEntropyRowsCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()              // logits
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // labels
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scale
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // loss
                                  .Ret<xla::ffi::AnyBuffer>());            // grad
