// The host functions the extension module (registrations.cc) exposes besides the handlers: the workspace-size query
// of each CUDA target that takes a workspace, and the nvlink workspaces' lifecycle. No XLA FFI here.
//
// <target>_workspace_bytes: the size of the trailing `workspace` result (uint8) the handler of <target> takes. XLA
// allocates it like any output, so the handlers allocate nothing themselves and can be captured into CUDA graphs.
// The Python side sizes the result with these (jax_megamoe/_targets.py names the query of each target); a handler
// given a smaller workspace fails with an error naming both sizes. They query the current CUDA device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jmm {

// jmm_cuda_moe_* (cuda/ffi/moe_cuda.cc).
size_t MoeLayoutWorkspaceBytes(int64_t num_pairs, int64_t num_experts);
size_t MoeGateUpWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                               int64_t experts);
size_t MoeDownWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                             int64_t experts);
size_t MoeBackwardWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                 int64_t experts);

// jmm_cuda_nvlink_moe_* (cuda/nvlink/), bfloat16 only, per shard: `tokens` received rows of `top_k` pairs; the
// forward's `groups` counts (source, expert) groups, the backward's `experts` the local experts.
size_t NvlinkMoeGateUpWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                     int64_t groups);
size_t NvlinkMoeDownWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate, int64_t groups);
size_t NvlinkMoeBackwardWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                       int64_t experts);

// jmm_cuda_fp8_rows_gemm and jmm_cuda_fp8_weight_gemm (cuda/ffi/fp8_cuda.cc): the group arrays for `experts`
// experts and CUTLASS's workspace.
size_t Fp8GemmWorkspaceBytes(int64_t experts);

namespace nvlink {

// The nvlink workspaces (cuda/nvlink/): `groups[g][r]` is the CUDA device of rank r of group g (-1: another
// process's rank); `emulated` puts every rank of one group on one device. Creating allocates the staging, the push
// slots and the signals of every local rank and returns the workspace's id; errors throw std::runtime_error with
// a message for the user.
int64_t CreateWorkspace(const std::vector<std::vector<int>>& groups, bool emulated, int64_t block_bytes,
                        int64_t timeout_ms, int blocks_per_peer);
// Waits for the workspace's devices to finish their work, then frees its memory. Unknown ids are ignored.
void DestroyWorkspace(int64_t id);
// Per group, this process's rank's CUDA IPC handles.
std::vector<std::string> ExportHandles(int64_t id);
// Maps another process's rank of a group into this process.
void AttachPeer(int64_t id, int group, int rank, const std::string& handles);

}  // namespace nvlink
}  // namespace jmm
