// What the CUDA FFI handlers share (cuda/ffi/moe_cuda.cc, cuda/ffi/nvlink_forward_cuda.cc): errors, reading the
// dtype and the GEMM tiles, and handing out the trailing workspace result XLA allocates for a call's temporaries
// (so that a handler allocates nothing itself; jmm/moe_host.h sizes it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "jmm/ffi_common.h"
#include "jmm/gemm_tiles.h"
#include "jmm/moe_cuda.h"

namespace jmm {

inline ffi::Error Internal(const std::string& stage, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInternal, "jax_megamoe CUDA " + stage + ": " + message);
}

// Returns Internal(stage, status) from the calling handler when a kernel entry point reports an error.
#define JMM_CUDA_TRY(stage, expr)                          \
  do {                                                     \
    if (::jmm::cuda::Status status_ = (expr); !status_.empty()) { \
      return ::jmm::Internal(stage, status_);              \
    }                                                      \
  } while (0)

using Workspace = ffi::Result<ffi::Buffer<ffi::U8>>;

// Hands out workspace bytes front to back (XLA's buffers are 256-byte aligned, and so is every piece).
class WorkspaceCursor {
 public:
  WorkspaceCursor(uint8_t* begin, size_t bytes) : next_(begin), end_(begin + bytes) {}
  explicit WorkspaceCursor(Workspace& workspace)
      : WorkspaceCursor(workspace->typed_data(), workspace->element_count()) {}
  size_t bytes_left() const { return static_cast<size_t>(end_ - next_); }
  cuda::Scratch scratch() {
    return [this](size_t bytes) -> void* {
      const size_t take = cuda::ScratchFootprint(bytes);
      if (take > bytes_left()) return nullptr;
      void* piece = next_;
      next_ += take;
      return piece;
    };
  }

 private:
  uint8_t* next_;
  uint8_t* end_;
};

// A workspace smaller than the handler needs (sized for other shapes) is an error naming both sizes.
inline ffi::Error CheckWorkspace(const std::string& op, Workspace& workspace, size_t needed) {
  if (workspace->element_count() >= needed) return ffi::Error::Success();
  return InvalidArgument("the " + op + " workspace holds " + std::to_string(workspace->element_count()) +
                         " bytes, the call needs " + std::to_string(needed));
}

inline ffi::Error ReadDtype(ffi::DataType type, cuda::Dtype* dtype) {
  switch (type) {
    case ffi::BF16: *dtype = cuda::Dtype::kBFloat16; return ffi::Error::Success();
    case ffi::F32: *dtype = cuda::Dtype::kFloat32; return ffi::Error::Success();
    default: return InvalidArgument("the CUDA MoE kernels support bfloat16 and float32 only");
  }
}

inline ffi::Error ReadGemmTiles(std::string_view spec, RowsGemmTiles* tiles) {
  const std::string value(spec);  // empty: JMM_GEMM_TILES was unset, the defaults
  if (std::string err = ParseGemmTiles(value.empty() ? nullptr : value.c_str(), tiles); !err.empty()) {
    return InvalidArgument(err);
  }
  return ffi::Error::Success();
}

inline size_t ElementBytes(cuda::Dtype dtype) { return dtype == cuda::Dtype::kBFloat16 ? 2 : 4; }

}  // namespace jmm
