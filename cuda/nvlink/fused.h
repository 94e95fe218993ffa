// The nvlink transport's fused exchange + experts + combine (docs/expert_parallelism.md), no XLA header: what the
// handlers jmm_cuda_nvlink_moe_gate_up, jmm_cuda_nvlink_moe_down and jmm_cuda_nvlink_moe_backward
// (nvlink/handlers_cuda.cc) run once they have read their buffers. Together they compute, bit for bit, "the rows'
// exchange, moe_ffn's CUDA kernels on the received rows, the results' reverse exchange" and its gradient, but move the
// rows and the results by the copy engines (nvlink/push.h) beside the expert GEMMs.
//
// The forward is two calls, like moe_ffn's: under jax.checkpoint the backward's recomputation needs only what the
// gate_up call returns (the received rows and the gate_up projections), and XLA drops the down call whose result
// nothing reads there. Each call is SPMD on every rank, and each makes the same push calls on every rank (one each;
// two in the backward), so the push protocol's call counts agree whichever calls XLA keeps.
//
// Block layouts. `blocks` is [ep, C, H], block d the rows for destination d (the live rows first, the rest zero:
// dispatch_rows' fill), or [1, C, H]: x itself as every destination's block (an uncompacted plan, C = T; token t is
// row t of every block, and a token not sent to d has no pairs at d, so its row there is never read and its result
// there is zero). A push moves whole blocks, so the rows past the live ones travel too; their results and
// cotangents are zero (they have no pairs; the source reads only its live rows), as the plain exchanges' fill. With
// one block the down call returns the results summed over the sources (one block, [1, C, H]) and the backward
// returns x's cotangent summed the same way, both in rows.sum_blocks' order.
//
// Streams of one shard (S: XLA's stream, S2: the side stream; f, f+1, ...: push calls):
//   gate_up  S:  gather the own rows ─ gate_up GEMM on all SMs but SideSMs(ep): the own groups at once, each peer group
//                waiting for its rows ─ wait(join)
//            S2: push f: block d to peer d ─ wait for the peers' ─ gather their rows group by group in the GEMM's
//                order on the SideSMs(ep) SMs the GEMM leaves, counting each group's finished warps ─ DMA them into
//                recv_x (the backward's operand) ─ release ─ join
//   down     S:  SwiGLU ─ down GEMM of the peers' rows ─ combine the peers' tokens ─ fork ─ down GEMM of the own rows ─
//                combine the own tokens into returned's own block (one block: wait(join), then combine the own
//                tokens and add the peers' results from the push slots, then resume S2)
//            S2: push f+1: result block d back to peer d ─ wait for the peers' ─ DMA them into returned (one block:
//                release once S has read them) ─ join
//   backward S:  gather the own rows' dy ─ wait(join) ─ moe_ffn's backward through dx ─ fork ─ gather x,
//                d_w_gate_up GEMM ─ (one block: resume S2, wait(join), sum dx over the sources from the push slots,
//                resume S2) ─ wait(join)
//            S2: push f+2: d_returned block d to peer d ─ wait ─ gather the peers' dy rows from the slots (every SM) ─
//                release ─ join ─ push f+3: dx block d to peer d ─ wait (one block: after the last GEMM) ─ DMA them
//                into d_send (one block: release once S has summed them) ─ join
// The per-group counters live in the gate_up call's workspace result, zeroed on S before the fork: nothing outside
// the call reads or writes them, so they need no epochs. The gated GEMM's waits only lag when the side stream's do,
// and trap after the same bound. Deadlock freedom: nvlink/workspace.h (ShardSet).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/moe_kernels.h"
#include "nvlink/workspace.h"

namespace jmm::nvlink {

// SMs left free of the gated gate_up GEMM for the side gather (its blocks each fill an SM, so it takes exactly
// these). The gather moves the peers' (ep - 1) / ep of the rows while the GEMM starts on the own 1 / ep, so it needs
// more SMs as ep grows: 16 at ep = 2 (the fastest of 4-32 on two GPUs, q30, cuda/tests/fused_forward_bench.cu), 32 at
// 3-4 and 48 at 5-8 (the fastest of 16-48 at ep = 4 and of 16-64 at ep = 8, q30s, emulated shards on one GPU); with 16
// at ep = 8 the GEMM waited for its rows.
inline int SideSMs(int ep) { return ep <= 2 ? 16 : ep <= 4 ? 32 : 48; }

// The sizes of one fused call, per shard.
struct FusedDims {
  int ep = 0;
  int64_t capacity = 0;      // C: rows per block
  int64_t hidden = 0;        // H
  int64_t top_k = 0;         // K: pairs per received row
  int64_t experts = 0;       // E_local
  int64_t intermediate = 0;  // I
  bool one_block = false;    // the blocks' operand (or result) is one block for every destination
  int sms = 0;               // the device's multiprocessors

  int64_t tokens() const { return ep * capacity; }   // received rows
  int64_t rows() const { return tokens() * top_k; }  // received pairs
  int64_t groups() const { return ep * experts; }    // (source, expert) groups
  int64_t block_bytes() const { return capacity * hidden * 2; }
};

// One shard's buffers of the gate_up call (shapes without the emulated shard axis).
struct GateUpShard {
  const char* blocks;             // [ep or 1, C, H] bf16
  const void* w_gate_up;          // [E, H, 2I] bf16
  const int32_t* pair_of_row;     // [ep*C*K]
  const int32_t* source_offsets;  // [ep*E + 1]
  char* recv_x;                   // result [ep, C, H]: the received rows
  void* gate_up;                  // result [ep*C*K, 2I]
  uint8_t* workspace;             // NvlinkMoeGateUpWorkspaceBytes
};

// One shard's buffers of the down call.
struct DownShard {
  void* gate_up;                  // [ep*C*K, 2I] bf16 (rows past the kept ones are zeroed, as cuda::SwigluForward does)
  const float* weights;           // [ep*C, K]
  const void* w_down;             // [E, I, H] bf16
  const int32_t* row_of_pair;     // [ep*C*K]
  const int32_t* source_offsets;  // [ep*E + 1]
  const int32_t* expert_offsets;  // [E + 1]
  char* returned;                 // result [ep, C, H], or [1, C, H] summed over the sources
  uint8_t* workspace;             // NvlinkMoeDownWorkspaceBytes
};

// One shard's buffers of the backward call.
struct BackwardShard {
  const char* d_returned;  // [ep or 1, C, H] bf16: the cotangent of the down call's result
  const void* recv_x;      // [ep, C, H]
  const float* weights;    // [ep*C, K]
  const void *w_gate_up, *w_down;
  const void* gate_up;  // [ep*C*K, 2I]
  const int32_t *row_of_pair, *pair_of_row, *source_offsets, *expert_offsets;
  char* d_send;      // result [ep or 1, C, H]: the blocks' cotangent
  float* d_weights;  // result [ep*C, K]
  void *d_w_gate_up, *d_w_down;
  void* dz;            // result [ep*C*K, 2I], gate_up's gradient: may be gate_up (aliased), its last reader
  uint8_t* workspace;  // NvlinkMoeBackwardWorkspaceBytes
};

// What one shard of each call takes of its workspace result (the handlers check it; the Python side sizes the result
// with the same functions, bound on _ext and declared in ffi/extension.h).
size_t GateUpWorkspaceBytes(const FusedDims& dims);
size_t DownWorkspaceBytes(const FusedDims& dims);
size_t BackwardWorkspaceBytes(const FusedDims& dims);

// The calls, for every shard of `shards` (`calls[i]` is shard i's buffers), enqueued on `stream` and the workspace's
// side stream. The device must be current.
Status FusedGateUp(const ShardSet& shards, const FusedDims& dims, const std::vector<GateUpShard>& calls,
                   cudaStream_t stream);
Status FusedDown(const ShardSet& shards, const FusedDims& dims, const std::vector<DownShard>& calls,
                 cudaStream_t stream);
Status FusedBackward(const ShardSet& shards, const FusedDims& dims, cuda::GemmTiles bwd_down_tiles,
                     cuda::GemmTiles bwd_gate_up_tiles, const std::vector<BackwardShard>& calls, cudaStream_t stream);

}  // namespace jmm::nvlink
