// What the CUDA FFI handlers share (cuda/ffi/moe_cuda.cc, the nvlink transport's handlers): errors, reading the
// dtype and the GEMM tiles attributes, and handing out the trailing workspace result XLA allocates for a call's
// temporaries (so that a handler allocates nothing itself and XLA may capture it into a CUDA graph).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ffi/ffi_common.h"
#include "kernels/moe_kernels.h"

namespace jmm {

inline ffi::Error Internal(const std::string& stage, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInternal, "jax_megamoe CUDA " + stage + ": " + message);
}

// Returns Internal(stage, status) from the calling handler when a kernel entry point reports an error.
#define JMM_CUDA_TRY(stage, expr)                                 \
  do {                                                            \
    if (::jmm::cuda::Status status_ = (expr); !status_.empty()) { \
      return ::jmm::Internal(stage, status_);                     \
    }                                                             \
  } while (0)

using Workspace = ffi::Result<ffi::Buffer<ffi::U8>>;

// The handler's workspace result handed out front to back (cuda::ScratchCursor).
class WorkspaceCursor : public cuda::ScratchCursor {
 public:
  explicit WorkspaceCursor(Workspace& workspace)
      : cuda::ScratchCursor(workspace->typed_data(), workspace->element_count()) {}
};

// A workspace smaller than the handler needs (sized for other shapes) is an error naming both sizes.
inline ffi::Error CheckWorkspace(const std::string& op, Workspace& workspace, size_t needed) {
  if (workspace->element_count() >= needed) return ffi::Error::Success();
  return InvalidArgument("the " + op + " workspace holds " + std::to_string(workspace->element_count()) +
                         " bytes, the call needs " + std::to_string(needed));
}

inline ffi::Error ReadDtype(ffi::DataType type, cuda::Dtype* dtype) {
  switch (type) {
    case ffi::BF16:
      *dtype = cuda::Dtype::kBFloat16;
      return ffi::Error::Success();
    case ffi::F32:
      *dtype = cuda::Dtype::kFloat32;
      return ffi::Error::Success();
    default:
      return InvalidArgument("the CUDA MoE kernels support bfloat16 and float32 only");
  }
}

// Reads the int64 attribute `attribute` (e.g. "fwd_gate_up_tiles") as a built GemmTiles value.
inline ffi::Error ReadGemmTiles(const char* attribute, int64_t value, cuda::GemmTiles* tiles) {
  if (!cuda::GemmTilesBuilt(value)) {
    return InvalidArgument(
        std::string(attribute) + " = " + std::to_string(value) +
        " is not a GEMM tile configuration built into this extension; accepted: " + cuda::AcceptedGemmTiles());
  }
  *tiles = static_cast<cuda::GemmTiles>(value);
  return ffi::Error::Success();
}

}  // namespace jmm
