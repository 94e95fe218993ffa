// The fused calls' row gather and (source, expert) group GEMMs; the contract is in nvlink/kernels.h.
#include "kernels/grouped_gemm_cutlass.cuh"
#include "kernels/kernel_module.cuh"
#include "nvlink/arrival_mainloop_sm90.hpp"
#include "nvlink/kernels.h"

namespace jmm::nvlink {
namespace {

namespace cg = cuda::cutlass_gemm;
using cuda::LaunchStatus;
using cuda::ScratchFootprint;

// One block of 1024 threads fills an SM's registers (at most 64 per thread), so a launch of N blocks takes exactly N
// SMs: the side gather's blocks cannot spread over more SMs than the gated GEMM leaves it. (Blocks of 512 threads
// spread over up to twice the SMs and keep GEMM CTAs off them for the whole gather, which slows the gated GEMM.)
constexpr int kGatherThreads = 1024;
constexpr int kLoadsInFlight = 8;  // per thread: a copy on few SMs is bound by the bytes in flight per SM

// Rows of groups (s, e) for the sources in `sources`, in the gated GEMM's group order (source me + j, then expert),
// as 16-byte chunks: chunk c of row r goes from the source block's row (pair_of_row[r] / top_k - s * capacity) to
// x_perm row r. Each thread walks (row, chunk) by a fixed step, so no 64-bit division runs per chunk, and keeps
// kLoadsInFlight loads in flight before it stores. With `group_counters`, each warp adds 1 to group g's counter
// once its share of g's rows is stored, so g is complete when its counter reaches the grid's warp count (per warp,
// so that no warp waits at a block barrier for the others).
__global__ void __launch_bounds__(kGatherThreads, 1)
    GatherSourceRowsKernel(SourceBlocks blocks, uint32_t sources, int ep, int me, int64_t capacity, int chunks_per_row,
                           int top_k, const int32_t* pair_of_row, const int32_t* source_offsets, int local_experts,
                           uint4* x_perm, uint64_t* group_counters) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t step_rows = threads / chunks_per_row;
  const int step_chunks = static_cast<int>(threads % chunks_per_row);
  for (int j = 0; j < ep; ++j) {
    const int s = (me + j) % ep;
    if (!(sources >> s & 1u)) continue;
    const auto* block = static_cast<const uint4*>(blocks.rows[s]);
    const int64_t base = static_cast<int64_t>(s) * capacity;
    for (int e = 0; e < local_experts; ++e) {
      const int64_t last = source_offsets[e * ep + s + 1];
      int64_t row = source_offsets[e * ep + s] + thread / chunks_per_row;
      int chunk = static_cast<int>(thread % chunks_per_row);
      while (row < last) {
        uint4 value[kLoadsInFlight];
        int64_t to[kLoadsInFlight];
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; ++u) {
          to[u] = -1;
          if (row < last) {
            to[u] = row * chunks_per_row + chunk;
            value[u] = block[(pair_of_row[row] / top_k - base) * chunks_per_row + chunk];
          }
          row += step_rows;
          chunk += step_chunks;
          if (chunk >= chunks_per_row) chunk -= chunks_per_row, ++row;
        }
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; ++u) {
          if (to[u] >= 0) x_perm[to[u]] = value[u];
        }
      }
      if (group_counters != nullptr) {  // per warp, not per block: no warp waits for the others of its block
        __threadfence();
        __syncwarp();
        if (threadIdx.x % 32 == 0) {
          asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(group_counters + j * local_experts + e),
                       "l"(uint64_t{1})
                       : "memory");
        }
      }
    }
  }
}

// The row GEMMs' tiles (GemmTiles::kCooperative128x256) with the arrival-gated mainloop
// (nvlink/arrival_mainloop_sm90.hpp).
using Tiles = cg::TilesCooperative128x256Cluster1;
using Ungated = cg::Bf16GroupedGemm<Tiles, cutlass::layout::RowMajor, cutlass::layout::RowMajor>;
struct GatedGemm {
  using CollectiveMainloop = cg::ArrivalGatedMainloop<typename Ungated::CollectiveMainloop>;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cg::ProblemShape, CollectiveMainloop, typename Tiles::CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// One thread per group g of the launch, g = (j - first_j) * E_local + e for source s = (me + j) % ep, j from first_j:
// with first_j = 0 the own groups come first. Group counters are indexed by j * E_local + e; null: no waits.
__global__ void FillSourceGroups(const int32_t* source_offsets, int ep, int me, int local_experts, int first_j,
                                 int groups, const cg::Bf16* a, const cg::Bf16* b, cg::Bf16* d, int n, int k,
                                 cg::GroupArrays<GatedGemm> out, const uint64_t** counters, uint64_t* targets,
                                 const uint64_t* group_counters, uint64_t target) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const int j = first_j + g / local_experts, e = g % local_experts, s = (me + j) % ep;
  const int64_t first = source_offsets[e * ep + s];
  out.shapes[g] = cg::GroupShape{source_offsets[e * ep + s + 1] - static_cast<int>(first), n, k};
  out.a[g] = a + first * k;
  out.b[g] = b + static_cast<int64_t>(e) * k * n;
  out.d[g] = d + first * n;
  out.stride_a[g] = cg::LeadingStride<GatedGemm::StrideA>(k);
  out.stride_b[g] = cg::LeadingStride<GatedGemm::StrideB>(n);
  out.stride_d[g] = cg::LeadingStride<GatedGemm::StrideD>(n);
  counters[g] = (s == me || group_counters == nullptr) ? nullptr : group_counters + j * local_experts + e;
  targets[g] = target;
}

// The groups of sources j in [first_j, first_j + sources) (see FillSourceGroups), each waiting for its counter when
// `group_counters` is not null.
Status SourceGroupsGemm(const void* a, const void* b, void* d, const int32_t* source_offsets, int ep, int me,
                        int64_t local_experts, int first_j, int sources, int64_t n, int64_t k,
                        const uint64_t* group_counters, uint64_t target, uint64_t timeout_ns, int sm_count,
                        const Scratch& scratch, cudaStream_t stream) {
  const int groups = static_cast<int>(sources * local_experts);
  cg::GroupArrays<GatedGemm> arrays;
  auto* counters = static_cast<const uint64_t**>(scratch(groups * sizeof(uint64_t)));
  auto* targets = static_cast<uint64_t*>(scratch(groups * sizeof(uint64_t)));
  if (!cg::CarveGroupArrays(groups, scratch, &arrays) || counters == nullptr || targets == nullptr) {
    return "out of scratch memory for the source groups' GEMM arguments";
  }
  const int threads = 128;
  FillSourceGroups<<<(groups + threads - 1) / threads, threads, 0, stream>>>(
      source_offsets, ep, me, static_cast<int>(local_experts), first_j, groups, static_cast<const cg::Bf16*>(a),
      static_cast<const cg::Bf16*>(b), static_cast<cg::Bf16*>(d), static_cast<int>(n), static_cast<int>(k), arrays,
      counters, targets, group_counters, target);
  if (Status status = LaunchStatus("source groups' GEMM setup"); !status.empty()) return status;
  typename GatedGemm::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, arrays.shapes, nullptr},
      {{arrays.a, arrays.stride_a, arrays.b, arrays.stride_b}, cg::GroupArrival{counters, targets, timeout_ns}},
      {{}, nullptr, nullptr, arrays.d, arrays.stride_d},
      cg::HardwareInfo(sm_count)};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return cg::LaunchGroupedGemm<GatedGemm>(args, scratch, stream);
}

}  // namespace

Status GatherSourceRows(const SourceBlocks& sources_rows, uint32_t sources, int ep, int me, int64_t capacity,
                        int64_t hidden, int64_t top_k, const int32_t* pair_of_row, const int32_t* source_offsets,
                        int64_t local_experts, void* x_perm, int sms, uint64_t* group_counters, cudaStream_t stream) {
  if (hidden % 8 != 0) return "GatherSourceRows needs hidden % 8 == 0 (16-byte rows)";
  GatherSourceRowsKernel<<<sms, kGatherThreads, 0, stream>>>(
      sources_rows, sources, ep, me, capacity, static_cast<int>(hidden / 8), static_cast<int>(top_k), pair_of_row,
      source_offsets, static_cast<int>(local_experts), static_cast<uint4*>(x_perm), group_counters);
  return LaunchStatus("source row gather");
}

int GatherArrivalsPerGroup(int sms) { return sms * (kGatherThreads / 32); }

size_t SourceGroupsGemmScratchBytes(int64_t groups) {
  return ScratchFootprint(cg::GroupArraysBound(groups)) + 2 * ScratchFootprint(groups * sizeof(uint64_t)) +
         ScratchFootprint(cg::CutlassWorkspaceBound(cg::MultiprocessorCount()));
}

Status GatedGateUpGemm(const void* x_perm, const void* w_gate_up, void* gate_up, const int32_t* source_offsets, int ep,
                       int me, int64_t local_experts, int64_t two_inter, int64_t hidden, const uint64_t* group_counters,
                       uint64_t target, uint64_t timeout_ns, int sm_count, const Scratch& scratch,
                       cudaStream_t stream) {
  return SourceGroupsGemm(x_perm, w_gate_up, gate_up, source_offsets, ep, me, local_experts, 0, ep, two_inter, hidden,
                          group_counters, target, timeout_ns, sm_count, scratch, stream);
}

Status SourceRowsGemm(const void* a, const void* b, void* d, const int32_t* source_offsets, int ep, int me,
                      int64_t local_experts, bool own, int64_t n, int64_t k, int sm_count, const Scratch& scratch,
                      cudaStream_t stream) {
  return SourceGroupsGemm(a, b, d, source_offsets, ep, me, local_experts, own ? 0 : 1, own ? 1 : ep - 1, n, k, nullptr,
                          0, 0, sm_count, scratch, stream);
}

}  // namespace jmm::nvlink
