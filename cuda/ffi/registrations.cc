// The Python extension `_ext`: one registration table mapping each FFI target name to the handler symbol of the same
// name (declared in targets.h; jax_megamoe/_targets.py declares the same literals), the workspace-size query of each
// CUDA target that takes a workspace (named `<target>_workspace_bytes`), the nvlink workspaces' lifecycle, and a
// query of which kernels are loaded.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ffi/targets.h"
#ifdef JMM_WITH_CUDA
#include "ffi/extension.h"
#include "kernels/kernel_modules.h"
#endif

namespace nb = nanobind;

namespace {

// jax.ffi.register_ffi_target takes a capsule of an XLA FFI handler: a function of any other type (a kernel, a
// handler's implementation) would be called as one, so it does not compile.
template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_same_v<Fn, XLA_FFI_Handler>,
                "an FFI target must be an XLA FFI handler symbol, XLA_FFI_Error* (XLA_FFI_CallFrame*), as "
                "XLA_FFI_DEFINE_HANDLER_SYMBOL defines it");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Registrations() {
  nb::dict table;
  table["jmm_cpu_moe_layout"] = Capsule(jmm_cpu_moe_layout);
  table["jmm_cpu_moe_gate_up"] = Capsule(jmm_cpu_moe_gate_up);
  table["jmm_cpu_moe_down"] = Capsule(jmm_cpu_moe_down);
  table["jmm_cpu_moe_backward"] = Capsule(jmm_cpu_moe_backward);
  table["jmm_cpu_cross_entropy_rows"] = Capsule(jmm_cpu_cross_entropy_rows);
#ifdef JMM_WITH_CUDA
  table["jmm_cuda_moe_layout"] = Capsule(jmm_cuda_moe_layout);
  table["jmm_cuda_moe_gate_up"] = Capsule(jmm_cuda_moe_gate_up);
  table["jmm_cuda_moe_down"] = Capsule(jmm_cuda_moe_down);
  table["jmm_cuda_moe_backward"] = Capsule(jmm_cuda_moe_backward);
  table["jmm_cuda_cross_entropy_rows"] = Capsule(jmm_cuda_cross_entropy_rows);
  table["jmm_cuda_nvlink_exchange"] = Capsule(jmm_cuda_nvlink_exchange);
  table["jmm_cuda_nvlink_moe_gate_up"] = Capsule(jmm_cuda_nvlink_moe_gate_up);
  table["jmm_cuda_nvlink_moe_down"] = Capsule(jmm_cuda_nvlink_moe_down);
  table["jmm_cuda_nvlink_moe_backward"] = Capsule(jmm_cuda_nvlink_moe_backward);
  table["jmm_cuda_fp8_rows_gemm"] = Capsule(jmm_cuda_fp8_rows_gemm);
  table["jmm_cuda_fp8_weight_gemm"] = Capsule(jmm_cuda_fp8_weight_gemm);
  table["jmm_cuda_fp8_quantize_blocks"] = Capsule(jmm_cuda_fp8_quantize_blocks);
  table["jmm_cuda_fp8_quantize_rows"] = Capsule(jmm_cuda_fp8_quantize_rows);
  table["jmm_cuda_fp8_swiglu_rows"] = Capsule(jmm_cuda_fp8_swiglu_rows);
  table["jmm_cuda_fp8_token_tiles"] = Capsule(jmm_cuda_fp8_token_tiles);
  table["jmm_cuda_fp8_swiglu_grad_rows"] = Capsule(jmm_cuda_fp8_swiglu_grad_rows);
#endif
  return table;
}

}  // namespace

NB_MODULE(_ext, m) {
  m.def("registrations", &Registrations, "FFI target name -> handler capsule.");
#ifdef JMM_WITH_CUDA
  m.attr("with_cuda") = true;

  m.def("jmm_cuda_moe_layout_workspace_bytes", &jmm::MoeLayoutWorkspaceBytes, nb::arg("num_pairs"),
        nb::arg("num_experts"), "Bytes of jmm_cuda_moe_layout's workspace result.");
  m.def("jmm_cuda_moe_gate_up_workspace_bytes", &jmm::MoeGateUpWorkspaceBytes, nb::arg("bfloat16"), nb::arg("tokens"),
        nb::arg("top_k"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("experts"),
        "Bytes of jmm_cuda_moe_gate_up's workspace result.");
  m.def("jmm_cuda_moe_down_workspace_bytes", &jmm::MoeDownWorkspaceBytes, nb::arg("bfloat16"), nb::arg("tokens"),
        nb::arg("top_k"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("experts"),
        "Bytes of jmm_cuda_moe_down's workspace result.");
  m.def("jmm_cuda_moe_backward_workspace_bytes", &jmm::MoeBackwardWorkspaceBytes, nb::arg("bfloat16"),
        nb::arg("tokens"), nb::arg("top_k"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("experts"),
        "Bytes of jmm_cuda_moe_backward's workspace result.");
  m.def("jmm_cuda_nvlink_moe_gate_up_workspace_bytes", &jmm::NvlinkMoeGateUpWorkspaceBytes, nb::arg("tokens"),
        nb::arg("top_k"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("groups"),
        "Bytes of jmm_cuda_nvlink_moe_gate_up's workspace result, per shard (bfloat16).");
  m.def("jmm_cuda_nvlink_moe_down_workspace_bytes", &jmm::NvlinkMoeDownWorkspaceBytes, nb::arg("tokens"),
        nb::arg("top_k"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("groups"),
        "Bytes of jmm_cuda_nvlink_moe_down's workspace result, per shard (bfloat16).");
  m.def("jmm_cuda_nvlink_moe_backward_workspace_bytes", &jmm::NvlinkMoeBackwardWorkspaceBytes, nb::arg("tokens"),
        nb::arg("top_k"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("experts"),
        "Bytes of jmm_cuda_nvlink_moe_backward's workspace result, per shard (bfloat16).");
  m.def("jmm_cuda_fp8_rows_gemm_workspace_bytes", &jmm::Fp8GemmWorkspaceBytes, nb::arg("experts"),
        "Bytes of jmm_cuda_fp8_rows_gemm's workspace result.");
  m.def("jmm_cuda_fp8_weight_gemm_workspace_bytes", &jmm::Fp8GemmWorkspaceBytes, nb::arg("experts"),
        "Bytes of jmm_cuda_fp8_weight_gemm's workspace result.");

  m.def("nvlink_create", &jmm::nvlink::CreateWorkspace, nb::arg("groups"), nb::arg("emulated"), nb::arg("block_bytes"),
        nb::arg("timeout_ms"), nb::arg("blocks_per_peer"),
        "Allocates an NVLink exchange workspace over groups of CUDA devices; returns its id.");
  m.def("nvlink_destroy", &jmm::nvlink::DestroyWorkspace, nb::arg("workspace"),
        "Waits for the workspace's devices, then frees its memory.");
  m.def(
      "nvlink_export",
      [](int64_t id) {
        nb::list out;
        for (const std::string& handles : jmm::nvlink::ExportHandles(id)) {
          out.append(nb::bytes(handles.data(), handles.size()));
        }
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
      "loaded_kernel_counts",
      [](int device) {
        jmm::cuda::KernelLoadCounts counts;
        if (const std::string error = jmm::cuda::CountLoadedKernels(device, counts); !error.empty()) {
          throw std::runtime_error("loaded_kernel_counts: " + error);
        }
        return nb::make_tuple(counts.total, counts.not_loaded);
      },
      nb::arg("device"),
      "(total, not_loaded): how many of the library's kernels a CUDA device has, and how many of them are not "
      "loaded yet. For tests and diagnostics; not on any call's path.");
#else
  m.attr("with_cuda") = false;
#endif
}
