// Host-side queries of the CUDA MoE handlers (handlers.h), exposed by the extension (module.cc).
//
// *WorkspaceBytes: the size of the trailing `workspace` result (uint8) each handler takes. XLA allocates it
// like any output, so the handlers allocate nothing themselves and can be captured into CUDA graphs. The
// Python side sizes the result with these (jax_megamoe/ops/moe.py); a handler given a smaller workspace
// fails with an error naming both sizes. They query the current CUDA device.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jmm {

size_t MoeLayoutWorkspaceBytes(int64_t num_pairs, int64_t num_experts);
size_t MoeGateUpWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                               int64_t experts);
size_t MoeDownWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                             int64_t experts);
size_t MoeBackwardWorkspaceBytes(bool bfloat16, int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                 int64_t experts);

// The nvlink transport's overlapped forward (cuda/ffi/nvlink_forward_cuda.cc), per shard: `tokens` received rows
// (ep * C) of `top_k` pairs, `groups` = ep * E_local (source, expert) groups. An emulated call takes ep times this.
size_t NvlinkForwardWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                   int64_t groups);
// Its overlapped backward (cuda/ffi/nvlink_backward_cuda.cc), per shard, with `experts` = E_local.
size_t NvlinkBackwardWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                    int64_t experts);

// How many calls of each handler (layout, gate_up, down, backward) this process has recorded into a CUDA graph
// rather than run directly: how a test sees that XLA captured them.
struct MoeRecordedCalls {
  int64_t layout, gate_up, down, backward;
};
MoeRecordedCalls MoeCallsRecordedIntoGraphs();

}  // namespace jmm
