// The driver's cuStreamWriteValue64, which the runtime API lacks: a stream-ordered 8-byte write that, with
// CU_STREAM_WRITE_VALUE_DEFAULT, is fenced after the stream's earlier work (DMAs included), so a peer that sees the
// value also sees the bytes copied before it (checked between two H200s by cuda/tests/peer_push_check.cu).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

namespace jmm::nvlink {

using StreamWriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

// Looked up once per process; null when the driver does not have it.
inline StreamWriteValue64 LoadStreamWriteValue64() {
  static const StreamWriteValue64 function = [] {
    void* found_function = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &found_function, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return StreamWriteValue64{nullptr};
    }
    return reinterpret_cast<StreamWriteValue64>(found_function);
  }();
  return function;
}

}  // namespace jmm::nvlink
