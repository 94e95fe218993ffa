// LoadAllKernels (kernel_modules.h): each registered module is a CUDA library (the runtime registers every
// .cu file's fatbinary as one); the functions of its module in the current device's context are enumerated, which
// does not load them, and loaded through driver entry points, which the runtime API lacks.
#include "kernels/kernel_modules.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

namespace jmm::cuda {
namespace {

struct Driver {
  CUresult (*kernel_get_library)(CUlibrary*, CUkernel) = nullptr;
  CUresult (*library_get_module)(CUmodule*, CUlibrary) = nullptr;
  CUresult (*module_get_function_count)(unsigned int*, CUmodule) = nullptr;
  CUresult (*module_enumerate_functions)(CUfunction*, unsigned int, CUmodule) = nullptr;
  CUresult (*func_load)(CUfunction) = nullptr;
  CUresult (*func_is_loaded)(CUfunctionLoadingState*, CUfunction) = nullptr;
  std::string missing;  // the first entry point the driver lacks
};

template <typename Fn>
void Find(const char* name, Fn& function, std::string& missing) {
  void* found_function = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &found_function, 12050, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    if (missing.empty()) missing = std::string("the CUDA driver lacks ") + name + " (needs CUDA 12.5 or newer)";
    return;
  }
  function = reinterpret_cast<Fn>(found_function);
}

const Driver& GetDriver() {
  static const Driver driver = [] {
    Driver d;
    Find("cuKernelGetLibrary", d.kernel_get_library, d.missing);
    Find("cuLibraryGetModule", d.library_get_module, d.missing);
    Find("cuModuleGetFunctionCount", d.module_get_function_count, d.missing);
    Find("cuModuleEnumerateFunctions", d.module_enumerate_functions, d.missing);
    Find("cuFuncLoad", d.func_load, d.missing);
    Find("cuFuncIsLoaded", d.func_is_loaded, d.missing);
    return d;
  }();
  return driver;
}

std::mutex anchors_mutex;

std::vector<const void*>& Anchors() {
  static std::vector<const void*> anchors;
  return anchors;
}

std::string DriverError(const char* what, CUresult result) {
  return std::string(what) + " failed with CUresult " + std::to_string(static_cast<int>(result));
}

// Calls visit(function) for every kernel of every registered module, as a function of the current context.
template <typename Visit>
std::string ForEachKernel(Visit visit) {
  const Driver& driver = GetDriver();
  if (!driver.missing.empty()) return driver.missing;
  std::lock_guard<std::mutex> lock(anchors_mutex);
  for (const void* anchor : Anchors()) {
    cudaKernel_t anchor_kernel;
    if (const cudaError_t status = cudaGetKernel(&anchor_kernel, anchor); status != cudaSuccess) {
      return std::string("cudaGetKernel: ") + cudaGetErrorString(status);
    }
    CUlibrary library;
    if (CUresult r = driver.kernel_get_library(&library, reinterpret_cast<CUkernel>(anchor_kernel));
        r != CUDA_SUCCESS) {
      return DriverError("cuKernelGetLibrary", r);
    }
    CUmodule module;  // the library's module in the current context; its functions load one by one
    if (CUresult r = driver.library_get_module(&module, library); r != CUDA_SUCCESS) {
      return DriverError("cuLibraryGetModule", r);
    }
    unsigned int count = 0;
    if (CUresult r = driver.module_get_function_count(&count, module); r != CUDA_SUCCESS) {
      return DriverError("cuModuleGetFunctionCount", r);
    }
    std::vector<CUfunction> functions(count);
    if (CUresult r = driver.module_enumerate_functions(functions.data(), count, module); r != CUDA_SUCCESS) {
      return DriverError("cuModuleEnumerateFunctions", r);
    }
    for (CUfunction function : functions) {
      if (std::string error = visit(function); !error.empty()) return error;
    }
  }
  return {};
}

}  // namespace

KernelModule::KernelModule(const void* anchor) {
  std::lock_guard<std::mutex> lock(anchors_mutex);
  Anchors().push_back(anchor);
}

std::string LoadAllKernels() {
  const Driver& driver = GetDriver();
  return ForEachKernel([&](CUfunction function) {
    const CUresult r = driver.func_load(function);
    return r == CUDA_SUCCESS ? std::string() : DriverError("cuFuncLoad", r);
  });
}

std::string CountLoadedKernels(int device, KernelLoadCounts& counts) {
  const Driver& driver = GetDriver();
  counts = {};
  if (const cudaError_t status = cudaSetDevice(device); status != cudaSuccess) {
    return std::string("cudaSetDevice: ") + cudaGetErrorString(status);
  }
  if (const cudaError_t status = cudaFree(nullptr); status != cudaSuccess) {  // makes its primary context current
    return std::string("initialising the device: ") + cudaGetErrorString(status);
  }
  return ForEachKernel([&](CUfunction function) {
    CUfunctionLoadingState state;
    if (const CUresult r = driver.func_is_loaded(&state, function); r != CUDA_SUCCESS) {
      return DriverError("cuFuncIsLoaded", r);
    }
    ++counts.total;
    if (state != CU_FUNCTION_LOADING_STATE_LOADED) ++counts.not_loaded;
    return std::string();
  });
}

}  // namespace jmm::cuda
