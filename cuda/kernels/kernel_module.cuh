// Included by every .cu file of the library: registers the file's kernel module with LoadAllKernels
// (kernel_modules.h). The anchor kernel has internal linkage, so its host stub, unlike a template kernel's,
// names this file's module and no other.
#pragma once

#include "kernels/kernel_modules.h"

namespace {
__global__ void KernelModuleAnchor() {}
const jmm::cuda::KernelModule kThisKernelModule{reinterpret_cast<const void*>(KernelModuleAnchor)};
}  // namespace
