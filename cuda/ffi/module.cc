// The Python extension: one registration table mapping FFI target names to handler capsules.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "jmm/handlers.h"
#ifdef JMM_WITH_CUDA
#include "jmm/nvlink_cuda.h"
#endif

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Registrations() {
  nb::dict table;
  table["jmm_cpu_moe_layout"] = Capsule(jmm_cpu_moe_layout);
  table["jmm_cpu_moe_forward"] = Capsule(jmm_cpu_moe_forward);
  table["jmm_cpu_moe_backward"] = Capsule(jmm_cpu_moe_backward);
#ifdef JMM_WITH_CUDA
  table["jmm_cuda_moe_layout"] = Capsule(jmm_cuda_moe_layout);
  table["jmm_cuda_moe_forward"] = Capsule(jmm_cuda_moe_forward);
  table["jmm_cuda_moe_backward"] = Capsule(jmm_cuda_moe_backward);
  table["jmm_cuda_nvlink_exchange"] = Capsule(jmm_cuda_nvlink_exchange);
#endif
  return table;
}

}  // namespace

NB_MODULE(_ext, m) {
  m.def("registrations", &Registrations, "FFI target name -> handler capsule.");
#ifdef JMM_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("nvlink_create", &jmm::nvlink::CreateWorkspace, nb::arg("groups"), nb::arg("emulated"),
        nb::arg("block_bytes"), nb::arg("timeout_ms"), nb::arg("blocks_per_peer"),
        "Allocates an NVLink exchange workspace over groups of CUDA devices; returns its id.");
  m.def("nvlink_destroy", &jmm::nvlink::DestroyWorkspace, nb::arg("workspace"),
        "Waits for the workspace's devices, then frees its memory.");
  m.def(
      "nvlink_export",
      [](int64_t id) {
        nb::list out;
        for (const std::string& handles : jmm::nvlink::ExportHandles(id)) out.append(nb::bytes(handles.data(), handles.size()));
        return out;
      },
      nb::arg("workspace"), "Per group, this process's rank's CUDA IPC handles (bytes).");
  m.def(
      "nvlink_attach",
      [](int64_t id, int group, int rank, nb::bytes handles) {
        jmm::nvlink::AttachPeer(id, group, rank, std::string(handles.c_str(), handles.size()));
      },
      nb::arg("workspace"), nb::arg("group"), nb::arg("rank"), nb::arg("handles"),
      "Maps another process's rank of a group into this process.");
#else
  m.attr("with_cuda") = false;
#endif
}
