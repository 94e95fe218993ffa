// CUDA FFI handler of linear_cross_entropy's cross-entropy rows (contract in targets.h) over kernels/cross_entropy.h.
#include <cuda_runtime.h>

#include "ffi/cross_entropy_checks.h"
#include "ffi/cuda_handler.h"
#include "ffi/targets.h"
#include "kernels/cross_entropy.h"

namespace jmm {
namespace {

ffi::Error CrossEntropyRowsCuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::Buffer<ffi::S32> labels,
                                ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::Buffer<ffi::F32>> loss,
                                ffi::Result<ffi::AnyBuffer> grad) {
  int64_t rows = 0, vocab = 0;
  if (auto err = CheckCrossEntropyRows(logits, labels, scale, *loss, *grad, &rows, &vocab); err.failure()) return err;
  cuda::Dtype dtype;
  if (auto err = ReadDtype(logits.element_type(), &dtype); err.failure()) return err;
  JMM_CUDA_TRY("cross-entropy rows",
               cuda::CrossEntropyRows(dtype, logits.untyped_data(), labels.typed_data(), scale.typed_data(), rows,
                                      vocab, loss->typed_data(), grad->untyped_data(), stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_cross_entropy_rows, jmm::CrossEntropyRowsCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // logits
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // labels
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scale
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // loss
                                  .Ret<xla::ffi::AnyBuffer>(),             // grad
                              {xla::ffi::Traits::kCmdBufferCompatible});
