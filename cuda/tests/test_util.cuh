// Helpers of the standalone CUDA test programs in cuda/tests (checks and benchmarks built by nvcc outside the
// library): error checking, uploads and downloads, eager module loading, CUTLASS GEMM set-up and launch, fill
// patterns, timing, the stream-write signal.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cutlass/bfloat16.h>
#include <cutlass/cutlass.h>
#include <cutlass/kernel_hardware_info.h>

#include "nvlink/stream_write.h"

namespace test_util {

using Bf16 = cutlass::bfloat16_t;

#define CHECK_CUDA(expr)                                                                                \
  do {                                                                                                  \
    cudaError_t err_ = (expr);                                                                          \
    if (err_ != cudaSuccess) {                                                                          \
      std::printf("CUDA error %s at %s:%d: %s\n", #expr, __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(2);                                                                                     \
    }                                                                                                   \
  } while (0)

// Call first in main. With CUDA's default lazy module loading, the first launch of a kernel loads it, and that load
// waits for the kernels already running (the gated GEMM's launch would wait out the sender, so the GEMM would never
// have to wait itself). Kernels meant to run side by side must be loaded before either starts.
inline void LoadModulesEagerly() { setenv("CUDA_MODULE_LOADING", "EAGER", 1); }

template <class T>
T* Upload(const std::vector<T>& host) {
  T* dev = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, std::max<size_t>(host.size(), 1) * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return dev;
}

// This device with all its SMs, for a CUTLASS GEMM's arguments.
inline cutlass::KernelHardwareInfo HardwareInfo() {
  cutlass::KernelHardwareInfo hw;
  CHECK_CUDA(cudaGetDevice(&hw.device_id));
  CHECK_CUDA(cudaDeviceGetAttribute(&hw.sm_count, cudaDevAttrMultiProcessorCount, hw.device_id));
  return hw;
}

// Enqueues an initialised CUTLASS GEMM; exits with code 2 on failure.
template <class Gemm>
void Run(Gemm& gemm, cudaStream_t stream) {
  if (gemm.run(stream) != cutlass::Status::kSuccess) std::printf("launch failed\n"), std::exit(2);
}

template <class T>
std::vector<T> Download(const T* dev, size_t n) {
  std::vector<T> host(n);
  CHECK_CUDA(cudaMemcpy(host.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

// n elements on the device, every byte set to `byte` (0xFF: NaN in bf16 and float32, the poison of the checks).
template <class T>
T* AllocateFilled(size_t n, int byte) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  CHECK_CUDA(cudaMemset(p, byte, n * sizeof(T)));
  return p;
}

// Initialises `gemm` for `args` on `stream` (workspace allocated here); exits on failure.
template <class Gemm>
void Initialise(Gemm& gemm, const typename Gemm::Arguments& args, cudaStream_t stream) {
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) std::printf("cannot implement\n"), std::exit(2);
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, std::max<size_t>(Gemm::get_workspace_size(args), 1)));
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) std::printf("init failed\n"), std::exit(2);
}

// Deterministic values in [-scale, scale) (for the benchmarks, where only the timing matters).
__global__ void FillPattern(Bf16* out, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    out[i] = Bf16(scale * (float(h & 0xFFFF) / 32768.0f - 1.0f));
  }
}

// n elements of FillPattern on the current device.
inline Bf16* DevicePattern(int64_t n, uint32_t seed, float scale) {
  Bf16* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, n * sizeof(Bf16)));
  FillPattern<<<1024, 256>>>(p, n, seed, scale);
  CHECK_CUDA(cudaGetLastError());
  return p;
}

// Median milliseconds of `body()` enqueued on `stream` between two events, over 20 runs after 3 warm-ups; each
// run is preceded (untimed) by `prepare()`.
template <class Prepare, class Body>
float MedianMs(cudaStream_t stream, Prepare prepare, Body body) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int it = 0; it < 23; ++it) {
    prepare();
    CHECK_CUDA(cudaEventRecord(start, stream));
    body();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    if (it >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// The library's lookup (nvlink/stream_write.h); a test program cannot run without it.
using jmm::nvlink::StreamWriteValue64;
inline StreamWriteValue64 LoadStreamWriteValue64() {
  const StreamWriteValue64 function = jmm::nvlink::LoadStreamWriteValue64();
  if (function == nullptr) std::printf("no cuStreamWriteValue64\n"), std::exit(2);
  return function;
}

}  // namespace test_util
