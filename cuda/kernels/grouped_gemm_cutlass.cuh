// CUTLASS 3 sm90 bf16 grouped GEMM (TMA + wgmma, warp-specialised, persistent), one group per expert.
//
// Device-side problem shapes: a tiny kernel reads expert_offsets and writes each group's shape, pointers and
// strides, so the host never learns the group sizes (no synchronisation; host problem shapes are null and
// the persistent scheduler walks the groups on the device). Groups with no rows get an M of zero and hence
// no tiles. Include from exactly one .cu per instantiation (layout x tile configuration): each costs about a
// minute of nvcc time.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "kernels/moe_kernels.h"

namespace jmm::cuda::cutlass_gemm {

using Bf16 = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using GroupShape = ProblemShape::UnderlyingProblemShape;

// Which operand of the group comes from where (see moe_kernels.h):
//   kRows:   d[rows of e] = a[rows of e] @ B_e          (M = rows of e, contraction over the fixed k)
//   kWeight: d_e = a[rows of e]^T @ b[rows of e]        (M, N fixed, contraction over the rows of e)
enum class Grouping { kRows, kWeight };

using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignment = 8;  // 16 bytes of bf16, what TMA needs

// The bf16 output epilogue (no source operand, beta = 0) of one tile configuration.
template <class TileShape, class ClusterShape, class EpilogueSchedule>
using EpilogueFor = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignment, Bf16, LayoutD*,
    kAlignment, EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Bf16, float, void, float>>::CollectiveOp;

// Tile configurations (GemmTiles in moe_kernels.h): CTA tile, cluster, kernel and epilogue schedule, with the
// epilogue's shared memory size as a constant of this class (computed inside the GEMM template below instead,
// nvcc's host pass emits the expanded builder type, which g++ rejects).
//
// A cluster of 2 CTAs along M shares (multicasts) the expert weight tile, but the grouped tile scheduler
// rounds every expert's row tiles up to a multiple of the cluster size, and those padding tiles run the full
// mainloop: with 128-row tiles an expert with 100 rows costs 2 row tiles of work, and one with 1025 rows 10.
template <int kM, int kN, int kClusterM, class KernelSchedule_, class EpilogueSchedule>
struct TilesOf {
  using TileShape = cute::Shape<cute::Int<kM>, cute::Int<kN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;
  using KernelSchedule = KernelSchedule_;
  using CollectiveEpilogue = EpilogueFor<TileShape, ClusterShape, EpilogueSchedule>;
  static constexpr int kEpilogueSmemBytes = static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage));
};

// Cooperative: both consumer warp groups on one tile.
template <int kM, int kN, int kClusterM>
using CooperativeTiles = TilesOf<kM, kN, kClusterM, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

// 128 x 256 x 64 with a 2 x 1 cluster: the weight GEMMs' tiles (their groups are whole experts, so the cluster
// pads nothing there).
using TilesCooperative128x256Cluster2 = CooperativeTiles<128, 256, 2>;
// The same without the cluster: the row GEMMs' tiles (GemmTiles::kCooperative128x256). Without the cluster no row
// tile is padding; on an H200 that saves more than the weight multicast gains, at every MoE size measured.
using TilesCooperative128x256Cluster1 = CooperativeTiles<128, 256, 1>;

template <class Tiles, class LayoutA, class LayoutB>
struct Bf16GroupedGemm {
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, kAlignment, Bf16, LayoutB*, kAlignment,
      float, typename Tiles::TileShape, typename Tiles::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<Tiles::kEpilogueSmemBytes>,
      typename Tiles::KernelSchedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, typename Tiles::CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// A stride tuple whose one dynamic mode (the leading dimension) is `ld`.
template <class Stride>
__host__ __device__ Stride LeadingStride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(s))>>) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

template <class G>
struct GroupArrays {
  GroupShape* shapes;
  const Bf16** a;
  const Bf16** b;
  Bf16** d;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
};

// One thread per expert writes its group. For kRows, (m) is unused; for kWeight, (k) is unused.
template <class G, Grouping kGrouping>
__global__ void FillGroups(const int32_t* offsets, int num_experts, const Bf16* a, const Bf16* b, Bf16* d, int m, int n,
                           int k, GroupArrays<G> out, typename G::StrideA stride_a, typename G::StrideB stride_b,
                           typename G::StrideD stride_d) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= num_experts) return;
  const int64_t first = offsets[e];
  const int rows = offsets[e + 1] - offsets[e];
  if constexpr (kGrouping == Grouping::kRows) {
    out.shapes[e] = GroupShape{rows, n, k};
    out.a[e] = a + first * k;
    out.b[e] = b + static_cast<int64_t>(e) * k * n;
    out.d[e] = d + first * n;
  } else {
    out.shapes[e] = GroupShape{rows > 0 ? m : 0, n, rows};  // no tiles at all for an empty expert
    out.a[e] = a + first * m;
    out.b[e] = b + first * n;
    out.d[e] = d + static_cast<int64_t>(e) * m * n;
  }
  out.stride_a[e] = stride_a;
  out.stride_b[e] = stride_b;
  out.stride_d[e] = stride_d;
}

inline size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

inline int MultiprocessorCount() {
  int device = 0;
  cudaGetDevice(&device);
  int count = 0;
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count;
}

// Carves the 7 group arrays of `groups` groups out of `scratch`; false when it is exhausted.
template <class G>
bool CarveGroupArrays(int groups, const Scratch& scratch, GroupArrays<G>* arrays) {
  const size_t align = 128;
  constexpr size_t sizes[7] = {sizeof(GroupShape),
                               sizeof(void*),
                               sizeof(void*),
                               sizeof(void*),
                               sizeof(typename G::StrideA),
                               sizeof(typename G::StrideB),
                               sizeof(typename G::StrideD)};
  static_assert(sizeof(GroupShape) <= kMaxGroupArrayElement && sizeof(typename G::StrideA) <= kMaxGroupArrayElement &&
                    sizeof(typename G::StrideB) <= kMaxGroupArrayElement &&
                    sizeof(typename G::StrideD) <= kMaxGroupArrayElement,
                "GroupArraysBound no longer bounds the group arrays");
  size_t total = 0;
  size_t offset[7];
  for (int i = 0; i < 7; ++i) {
    offset[i] = total;
    total += RoundUp(sizes[i] * groups, align);
  }
  char* base = static_cast<char*>(scratch(total));
  if (base == nullptr) return false;
  *arrays = GroupArrays<G>{reinterpret_cast<GroupShape*>(base + offset[0]),
                           reinterpret_cast<const Bf16**>(base + offset[1]),
                           reinterpret_cast<const Bf16**>(base + offset[2]),
                           reinterpret_cast<Bf16**>(base + offset[3]),
                           reinterpret_cast<typename G::StrideA*>(base + offset[4]),
                           reinterpret_cast<typename G::StrideB*>(base + offset[5]),
                           reinterpret_cast<typename G::StrideD*>(base + offset[6])};
  return true;
}

// The hardware description CUTLASS's persistent scheduler sizes its grid by: the current device, `sm_count` SMs.
inline cutlass::KernelHardwareInfo HardwareInfo(int sm_count) {
  cutlass::KernelHardwareInfo hw_info;
  cudaGetDevice(&hw_info.device_id);
  hw_info.sm_count = sm_count;
  return hw_info;
}

// Checks, initialises (CUTLASS's workspace from `scratch`) and launches one grouped GEMM on `stream`.
template <class G>
Status LaunchGroupedGemm(const typename G::Gemm::Arguments& args, const Scratch& scratch, cudaStream_t stream) {
  typename G::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "CUTLASS cannot implement this grouped GEMM";
  void* workspace = nullptr;
  if (size_t bytes = G::Gemm::get_workspace_size(args); bytes > 0) {
    if (bytes > CutlassWorkspaceBound(args.hw_info.sm_count)) {
      return "CUTLASS needs " + std::to_string(bytes) +
             " workspace bytes, more than the bound the workspace was "
             "sized with (CutlassWorkspaceBound)";
    }
    workspace = scratch(bytes);
    if (workspace == nullptr) return "out of scratch memory for the grouped GEMM workspace";
  }
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) {
    return "CUTLASS grouped GEMM initialisation failed";
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    return std::string("CUTLASS grouped GEMM launch failed: ") + cudaGetErrorString(cudaGetLastError());
  }
  return {};
}

// Launches one grouped GEMM, one group per expert, on every SM. ld_* are the leading dimensions of the
// (row-major or column-major) operands.
template <class G, Grouping kGrouping>
Status RunGroupedGemm(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts, int64_t m,
                      int64_t n, int64_t k, int64_t ld_a, int64_t ld_b, const Scratch& scratch, cudaStream_t stream) {
  const int experts = static_cast<int>(num_experts);
  GroupArrays<G> arrays;
  if (!CarveGroupArrays(experts, scratch, &arrays)) return "out of scratch memory for the grouped GEMM arguments";
  const int threads = 128;
  FillGroups<G, kGrouping><<<(experts + threads - 1) / threads, threads, 0, stream>>>(
      offsets, experts, static_cast<const Bf16*>(a), static_cast<const Bf16*>(b), static_cast<Bf16*>(d),
      static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), arrays, LeadingStride<typename G::StrideA>(ld_a),
      LeadingStride<typename G::StrideB>(ld_b), LeadingStride<typename G::StrideD>(n));
  if (Status s = LaunchStatus("grouped GEMM setup"); !s.empty()) return s;

  static const int sm_count = MultiprocessorCount();
  typename G::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                   {experts, arrays.shapes, nullptr},
                                   {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b},
                                   {{}, nullptr, nullptr, arrays.d, arrays.stride_d},
                                   HardwareInfo(sm_count)};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return LaunchGroupedGemm<G>(args, scratch, stream);
}

// The row-grouped GEMM of RowsGemm with a given tile configuration: B_e is [k, n] row-major (LayoutB RowMajor,
// "NN"), or [n, k] row-major, i.e. the k x n operand in column-major order (LayoutB ColumnMajor, "NT").
template <class Tiles, class LayoutB>
Status RowsGemmWith(const void* a, const void* b, void* d, const int32_t* offsets, int64_t num_experts, int64_t n,
                    int64_t k, const Scratch& scratch, cudaStream_t stream) {
  using G = Bf16GroupedGemm<Tiles, cutlass::layout::RowMajor, LayoutB>;
  constexpr bool kRowMajorB = std::is_same_v<LayoutB, cutlass::layout::RowMajor>;
  return RunGroupedGemm<G, Grouping::kRows>(a, b, d, offsets, num_experts, 0, n, k, /*ld_a=*/k,
                                            /*ld_b=*/kRowMajorB ? n : k, scratch, stream);
}

}  // namespace jmm::cuda::cutlass_gemm
