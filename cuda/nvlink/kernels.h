// Kernels of the nvlink transport's fused calls (nvlink/fused.h), no XLA header: the gather of one or more sources'
// rows into the expert GEMM's row order, the GEMMs over (source, expert) groups whose peer groups may wait for their
// rows (nvlink/source_gemm.cu), and the sums over the sources of the results and of dx (nvlink/sums.cu).
//
// Row order: the layout of the received pairs sorted by the fine key (local expert e, source shard s), whose
// offsets are source_offsets[e * ep + s] (ep * E_local + 1 entries). Rows of (e, s) are contiguous, and expert e's
// rows are those of (e, 0), (e, 1), ...: the plain expert-major order, which SwiGLU, the combine and the whole
// backward keep using (expert_offsets = source_offsets[::ep]).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/moe_kernels.h"
#include "nvlink/workspace.h"

namespace jmm::nvlink {

using cuda::Dtype;
using cuda::Scratch;

// Where source s's token rows are: a block of `capacity` rows of `hidden` bf16 each (row c is token s * C + c of
// the received problem).
struct SourceBlocks {
  const void* rows[kMaxRanks];
};

// x_perm[r] = source block s's row (pair_of_row[r] / top_k - s * capacity) for every row r of every group (s, e)
// with bit s set in `sources`, on `sms` SMs (one block that fills an SM per SM), in the gated GEMM's group order
// (g = j * E_local + e for source s = (me + j) % ep). With `group_counters` ([ep * E_local], by g), each warp adds 1
// to group g's counter once its share of g's rows is stored, so after the launch every gathered group's counter has
// grown by GatherArrivalsPerGroup(sms). hidden % 8 == 0.
Status GatherSourceRows(const SourceBlocks& sources_rows, uint32_t sources, int ep, int me, int64_t capacity,
                        int64_t hidden, int64_t top_k, const int32_t* pair_of_row, const int32_t* source_offsets,
                        int64_t local_experts, void* x_perm, int sms, uint64_t* group_counters, cudaStream_t stream);

// What one launch of GatherSourceRows on `sms` SMs adds to each gathered group's counter.
int GatherArrivalsPerGroup(int sms);

// gate_up[rows of (s, e)] = x_perm[rows of (s, e)] @ W_gate_up[e] for every group, bf16 tensor cores (the row
// GEMMs' tiles, 128 x 256 cooperative without a cluster, so the result is bit for bit cuda::RowsGemm's). The
// persistent kernel walks the groups g = j * E_local + e (source (me + j) % ep): the own groups, ungated, then the
// peers', each of whose tiles first waits (bounded by timeout_ns, then traps) until group_counters[g] >= target. It
// runs `sm_count` CTAs: leave the SMs the rows' producers need.
Status GatedGateUpGemm(const void* x_perm, const void* w_gate_up, void* gate_up, const int32_t* source_offsets, int ep,
                       int me, int64_t local_experts, int64_t two_inter, int64_t hidden, const uint64_t* group_counters,
                       uint64_t target, uint64_t timeout_ns, int sm_count, const Scratch& scratch, cudaStream_t stream);

// d[rows of (s, e)] = a[rows of (s, e)] @ b[e] ([k, n] row-major) for the own source's groups (`own`, s = me) or
// every peer's (s != me, in the order (me + 1) % ep, ...), without waits; the same kernel as GatedGateUpGemm, so
// each row's result is bit for bit cuda::RowsGemm's. The fused down GEMM runs as these two launches, peers first, so
// that the peers' results can be pushed back while the own rows' GEMM runs. `sm_count` CTAs.
Status SourceRowsGemm(const void* a, const void* b, void* d, const int32_t* source_offsets, int ep, int me,
                      int64_t local_experts, bool own, int64_t n, int64_t k, int sm_count, const Scratch& scratch,
                      cudaStream_t stream);

// Upper bound of what one GatedGateUpGemm or SourceRowsGemm takes from Scratch for up to `groups` = ep * E_local
// groups. Queries the current device.
size_t SourceGroupsGemmScratchBytes(int64_t groups);

// The parts that CombineRowsIntoSum and SumBlocks add up, in order: rows[d] ([tokens, width] of the dtype) for every
// d but `own`, whose part is the combined rows (CombineRowsIntoSum; SumBlocks has none).
struct SummedBlocks {
  static constexpr int kMaxParts = kMaxRanks;
  static constexpr int kNoCombinedPart = -1;
  const void* rows[kMaxParts] = {};
  int count = 0, own = kNoCombinedPart;
};

// out[t] = round(sum_d part_d[t]) accumulated in float32 from zero in order d, where part_own[t] is cuda::CombineRows'
// row t (rounded to the dtype) and part_d[t] = summed.rows[d][t]: the combine of one source's tokens and the sum of
// every source's results per token (rows.sum_blocks of jax_megamoe/parallel, bit for bit) in one pass.
Status CombineRowsIntoSum(Dtype dtype, const void* row_values, const int32_t* row_of_pair, const float* weights,
                          int64_t tokens, int64_t top_k, int64_t width, const SummedBlocks& summed, void* out,
                          cudaStream_t stream);

// out[t] = round(sum_d summed.rows[d][t]) accumulated in float32 from zero in order d (rows.sum_blocks, bit for bit).
Status SumBlocks(Dtype dtype, const SummedBlocks& summed, int64_t tokens, int64_t width, void* out,
                 cudaStream_t stream);

}  // namespace jmm::nvlink
