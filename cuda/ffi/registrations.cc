// The Python extension: one registration table mapping FFI target names to handler capsules.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

#include "jmm/handlers.h"
#ifdef JMM_WITH_CUDA
#include "jmm/kernel_modules.h"
#include "jmm/moe_host.h"
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
  table["jmm_cpu_moe_gate_up"] = Capsule(jmm_cpu_moe_gate_up);
  table["jmm_cpu_moe_down"] = Capsule(jmm_cpu_moe_down);
  table["jmm_cpu_moe_backward"] = Capsule(jmm_cpu_moe_backward);
#ifdef JMM_WITH_CUDA
  table["jmm_cuda_moe_layout"] = Capsule(jmm_cuda_moe_layout);
  table["jmm_cuda_moe_gate_up"] = Capsule(jmm_cuda_moe_gate_up);
  table["jmm_cuda_moe_down"] = Capsule(jmm_cuda_moe_down);
  table["jmm_cuda_moe_backward"] = Capsule(jmm_cuda_moe_backward);
  table["jmm_cuda_nvlink_exchange"] = Capsule(jmm_cuda_nvlink_exchange);
  table["jmm_cuda_nvlink_moe_forward"] = Capsule(jmm_cuda_nvlink_moe_forward);
  table["jmm_cuda_nvlink_moe_backward"] = Capsule(jmm_cuda_nvlink_moe_backward);
#endif
  return table;
}

}  // namespace

NB_MODULE(_ext, m) {
  m.def("registrations", &Registrations, "FFI target name -> handler capsule.");
#ifdef JMM_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def(
      "cuda_workspace_bytes",
      [](const std::string& op, bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
         int64_t experts) -> size_t {
        if (op == "moe_layout") return jmm::MoeLayoutWorkspaceBytes(tokens * top_k, experts);
        if (op == "moe_gate_up") return jmm::MoeGateUpWorkspaceBytes(bfloat16, tokens, top_k, hidden, intermediate, experts);
        if (op == "moe_down") return jmm::MoeDownWorkspaceBytes(bfloat16, tokens, top_k, hidden, intermediate, experts);
        if (op == "moe_backward") return jmm::MoeBackwardWorkspaceBytes(bfloat16, tokens, top_k, hidden, intermediate, experts);
        if (op == "nvlink_moe_forward") {  // bfloat16 only; `experts` is the (source, expert) group count
          return jmm::NvlinkForwardWorkspaceBytes(tokens, top_k, hidden, intermediate, experts);
        }
        if (op == "nvlink_moe_backward") {  // bfloat16 only
          return jmm::NvlinkBackwardWorkspaceBytes(tokens, top_k, hidden, intermediate, experts);
        }
        throw std::invalid_argument("cuda_workspace_bytes: unknown op " + op);
      },
      nb::arg("op"), nb::arg("bfloat16"), nb::arg("tokens"), nb::arg("top_k"), nb::arg("hidden"),
      nb::arg("intermediate"), nb::arg("experts"),
      "Bytes of the workspace result the CUDA handler of `op` takes (jmm/moe_host.h).");
  m.def(
      "cuda_graph_recorded_calls",
      [] {
        const jmm::MoeRecordedCalls calls = jmm::MoeCallsRecordedIntoGraphs();
        nb::dict counts;
        counts["moe_layout"] = calls.layout;
        counts["moe_gate_up"] = calls.gate_up;
        counts["moe_down"] = calls.down;
        counts["moe_backward"] = calls.backward;
        return counts;
      },
      "Calls of each CUDA MoE handler this process recorded into CUDA graphs (jmm/moe_host.h).");
  m.def("nvlink_create", &jmm::nvlink::CreateWorkspace, nb::arg("groups"), nb::arg("emulated"),
        nb::arg("block_bytes"), nb::arg("timeout_ms"), nb::arg("blocks_per_peer"), nb::arg("overlap"),
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
  m.def(
      "kernel_load_counts",
      [](int device) {
        jmm::cuda::KernelLoadCounts counts;
        if (const std::string error = jmm::cuda::CountLoadedKernels(device, counts); !error.empty()) {
          throw std::runtime_error("kernel_load_counts: " + error);
        }
        return nb::make_tuple(counts.total, counts.not_loaded);
      },
      nb::arg("device"),
      "(kernels, not loaded yet) of the library's kernels on a CUDA device (jmm/kernel_modules.h).");
#else
  m.attr("with_cuda") = false;
#endif
}
