// The buffer checks of the cross-entropy rows target, shared by its CPU and CUDA handlers (contract in targets.h).
#pragma once

#include <cstdint>

#include "ffi/ffi_common.h"

namespace jmm {

inline ffi::Error CheckCrossEntropyRows(const ffi::AnyBuffer& logits, const ffi::Buffer<ffi::S32>& labels,
                                        const ffi::Buffer<ffi::F32>& scale, const ffi::Buffer<ffi::F32>& loss,
                                        const ffi::AnyBuffer& grad, int64_t* rows, int64_t* vocab) {
  const char* shapes =
      "cross-entropy rows: logits [R, V] bfloat16 or float32, labels [R] int32, scale [] float32, loss [R] float32, "
      "grad [R, V] in the logits' dtype";
  const auto ld = logits.dimensions(), gd = grad.dimensions();
  if (logits.element_type() != ffi::BF16 && logits.element_type() != ffi::F32) {
    return InvalidArgument(std::string(shapes) + "; got logits of another dtype");
  }
  if (ld.size() != 2 || gd.size() != 2 || labels.dimensions().size() != 1 || loss.dimensions().size() != 1 ||
      scale.element_count() != 1 || grad.element_type() != logits.element_type()) {
    return InvalidArgument(std::string(shapes) + "; got other ranks or dtypes");
  }
  *rows = ld[0];
  *vocab = ld[1];
  if (labels.dimensions()[0] != *rows || loss.dimensions()[0] != *rows || gd[0] != *rows || gd[1] != *vocab) {
    return InvalidArgument(std::string(shapes) + "; got other shapes");
  }
  return ffi::Error::Success();
}

}  // namespace jmm
