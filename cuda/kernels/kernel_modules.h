// Loading every kernel of the library before anything waits on another GPU.
//
// CUDA loads kernels lazily by default (CUDA_MODULE_LOADING=LAZY): a kernel's first launch loads it, and a load may
// wait until every kernel running in the process has ended. The nvlink transport's kernels spin until a peer GPU's
// rows or signals arrive; if the peer's host thread is inside such a load before it enqueued what they wait for,
// neither moves until the wait's bound (a first call that times out). NCCL avoids this by loading
// its kernels when a communicator is made; the nvlink workspace does the same with LoadAllKernels, on each device.
#pragma once

#include <string>

namespace jmm::cuda {

// Registers the kernel module (the fatbinary of one .cu file) that holds `anchor`, a kernel of that file. Made by
// kernel_module.cuh, which every .cu file of the library includes.
struct KernelModule {
  explicit KernelModule(const void* anchor);
};

// Loads every kernel of every registered module on the current device. An empty message means success.
std::string LoadAllKernels();

// The registered modules' kernels on a device: how many there are and how many are not loaded yet. A query for
// outside the hot path (the extension's loaded_kernel_counts).
struct KernelLoadCounts {
  int total = 0;
  int not_loaded = 0;
};
// Fills `counts` for CUDA device `device` (made current); an empty message means success.
std::string CountLoadedKernels(int device, KernelLoadCounts& counts);

}  // namespace jmm::cuda
