// sm90 FP8 grouped GEMMs with blockwise float32 scales, the GEMMs of the "fp8_blockwise" recipe
// (jax_megamoe/ops/fp8.py), one group per expert, e4m3 operands both K-major (sm90 FP8 wgmma takes no other
// layout), float32 accumulation with the scales applied per 128-deep K block (CUTLASS's
// KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise, as in its example 68), bf16 or float32 out:
//   rows GEMM:   d[rows of e] = (a * sfa)[rows of e] @ (b_e * sfb_e)^T     (forward and input gradients)
//   weight GEMM: d_e = (a_e * sfa_e) @ (b_e * sfb_e)^T over expert e's tokens (weight gradients)
// Group shapes, pointers, strides and scale layouts are written on the device from the offsets, as for the bf16
// grouped GEMM (grouped_gemm_cutlass.cuh). Contracts: kernels/fp8_kernels.h.
#include <cutlass/detail/blockwise_scale_layout.hpp>

#include <algorithm>
#include <type_traits>

#include "kernels/fp8_kernels.h"
#include "kernels/grouped_gemm_cutlass.cuh"
#include "kernels/kernel_module.cuh"

namespace jmm::cuda::cutlass_gemm {
namespace {

using Fp8 = cutlass::float_e4m3_t;
constexpr int kFp8Alignment = 16;  // 16 bytes of e4m3, what TMA needs

using Fp8TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
using Fp8ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;  // no cluster: no padding row tiles

// The output epilogue (no source operand, beta = 0) for d in ElementD_, with its shared memory size as a constant of
// this class: a sizeof inside the mainloop builder's arguments would make nvcc's host pass emit the expanded type,
// which g++ rejects (as for TilesOf in grouped_gemm_cutlass.cuh).
template <class ElementD_>
struct Fp8Output {
  using ElementD = ElementD_;
  static constexpr int kAlignment = 16 / sizeof(ElementD);  // 16 bytes, what TMA needs
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8TileShape, Fp8ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignment, ElementD, LayoutD*,
      kAlignment, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  static constexpr int kEpilogueSmemBytes = static_cast<int>(sizeof(typename Epilogue::SharedStorage));
};

// One FP8 grouped GEMM whose b scales cover kScaleN columns by 128 along K (a's: one row by 128), both scale arrays
// kMajor-major: K-major for the row GEMMs (the recipe's row-major [rows, K/128] scales as they are), MN-major for the
// weight GEMMs (a global [tokens/128, M] array is then every expert's own compact block).
template <int kScaleN, cute::GMMA::Major kMajor, class Out>
struct Fp8GroupedGemm {
  using ElementD = typename Out::ElementD;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleN, 128, kMajor, kMajor>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8, cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>,
      kFp8Alignment, Fp8, cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, kFp8Alignment, float, Fp8TileShape,
      Fp8ClusterShape, cutlass::gemm::collective::StageCountAutoCarveout<Out::kEpilogueSmemBytes>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, typename Out::Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};
// b: 128x128 blocks of the weights
template <class ElementD>
using RowsG = Fp8GroupedGemm<128, cute::GMMA::Major::K, Fp8Output<ElementD>>;
// b: a row operand too, 1x128 tiles along the tokens
template <class ElementD>
using WeightG = Fp8GroupedGemm<1, cute::GMMA::Major::MN, Fp8Output<ElementD>>;

template <class G>
struct Fp8GroupArrays {
  GroupShape* shapes;
  const Fp8** a;
  const Fp8** b;
  typename G::ElementD** d;
  const float** sfa;
  const float** sfb;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
  typename G::LayoutSFA* layout_sfa;
  typename G::LayoutSFB* layout_sfb;
};

constexpr int kArrays = 11;

template <class G>
constexpr size_t LargestGroupArrayElement() {
  return std::max({sizeof(GroupShape), sizeof(void*), sizeof(typename G::StrideA), sizeof(typename G::StrideB),
                   sizeof(typename G::StrideD), sizeof(typename G::LayoutSFA), sizeof(typename G::LayoutSFB)});
}

template <class G>
bool CarveFp8GroupArrays(int groups, const Scratch& scratch, Fp8GroupArrays<G>* arrays) {
  const size_t sizes[kArrays] = {sizeof(GroupShape),
                                 sizeof(void*),
                                 sizeof(void*),
                                 sizeof(void*),
                                 sizeof(void*),
                                 sizeof(void*),
                                 sizeof(typename G::StrideA),
                                 sizeof(typename G::StrideB),
                                 sizeof(typename G::StrideD),
                                 sizeof(typename G::LayoutSFA),
                                 sizeof(typename G::LayoutSFB)};
  size_t offset[kArrays], total = 0;
  for (int i = 0; i < kArrays; ++i) {
    offset[i] = total;
    total += RoundUp(sizes[i] * groups, 128);
  }
  char* base = static_cast<char*>(scratch(total));
  if (base == nullptr) return false;
  *arrays = Fp8GroupArrays<G>{reinterpret_cast<GroupShape*>(base + offset[0]),
                              reinterpret_cast<const Fp8**>(base + offset[1]),
                              reinterpret_cast<const Fp8**>(base + offset[2]),
                              reinterpret_cast<typename G::ElementD**>(base + offset[3]),
                              reinterpret_cast<const float**>(base + offset[4]),
                              reinterpret_cast<const float**>(base + offset[5]),
                              reinterpret_cast<typename G::StrideA*>(base + offset[6]),
                              reinterpret_cast<typename G::StrideB*>(base + offset[7]),
                              reinterpret_cast<typename G::StrideD*>(base + offset[8]),
                              reinterpret_cast<typename G::LayoutSFA*>(base + offset[9]),
                              reinterpret_cast<typename G::LayoutSFB*>(base + offset[10])};
  return true;
}

// One thread per expert writes its row-grouped group (rows [offsets[e], offsets[e + 1]) of a and d).
template <class G>
__global__ void FillFp8RowGroups(const int32_t* offsets, int num_experts, const Fp8* a, const float* sfa, const Fp8* b,
                                 const float* sfb, typename G::ElementD* d, int n, int k, Fp8GroupArrays<G> out) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= num_experts) return;
  const int64_t first = offsets[e];
  const int rows = offsets[e + 1] - offsets[e];
  const int64_t k_blocks = k / 128;
  out.shapes[e] = GroupShape{rows, n, k};
  out.a[e] = a + first * k;
  out.b[e] = b + static_cast<int64_t>(e) * n * k;
  out.d[e] = d + first * n;
  out.sfa[e] = sfa + first * k_blocks;
  out.sfb[e] = sfb + static_cast<int64_t>(e) * (n / 128) * k_blocks;
  out.stride_a[e] = LeadingStride<G::StrideA>(k);
  out.stride_b[e] = LeadingStride<G::StrideB>(k);
  out.stride_d[e] = LeadingStride<G::StrideD>(n);
  out.layout_sfa[e] = G::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(rows, n, k, 1));
  out.layout_sfb[e] = G::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(rows, n, k, 1));
}

// One thread per expert writes its weight-grouped group: expert e's padded token range
// [token_offsets[e], token_offsets[e + 1]) of a [m, tokens] and b [n, tokens], its scales rows
// token_offsets[e] / 128 .. of sfa [tokens/128, m] and sfb [tokens/128, n] (MN-major: the group's compact block). An
// expert without tokens gets no tiles (M = 0); WeightGemm zeroes its d.
template <class G>
__global__ void FillFp8WeightGroups(const int32_t* token_offsets, int num_experts, const Fp8* a, const float* sfa,
                                    const Fp8* b, const float* sfb, typename G::ElementD* d, int m, int n,
                                    int64_t tokens, Fp8GroupArrays<G> out) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= num_experts) return;
  const int64_t first = token_offsets[e];
  const int k = token_offsets[e + 1] - token_offsets[e];
  out.shapes[e] = GroupShape{k > 0 ? m : 0, n, k};
  out.a[e] = a + first;
  out.b[e] = b + first;
  out.d[e] = d + static_cast<int64_t>(e) * m * n;
  out.sfa[e] = sfa + (first / 128) * m;
  out.sfb[e] = sfb + (first / 128) * n;
  out.stride_a[e] = LeadingStride<G::StrideA>(tokens);
  out.stride_b[e] = LeadingStride<G::StrideB>(tokens);
  out.stride_d[e] = LeadingStride<G::StrideD>(n);
  out.layout_sfa[e] = G::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
  out.layout_sfb[e] = G::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
}

template <class G>
typename G::Gemm::Arguments GroupedArguments(int experts, const Fp8GroupArrays<G>& arrays) {
  static const int sm_count = MultiprocessorCount();
  typename G::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                   {experts, arrays.shapes, nullptr},
                                   {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b, arrays.sfa, arrays.layout_sfa,
                                    arrays.sfb, arrays.layout_sfb},
                                   {{}, nullptr, nullptr, arrays.d, arrays.stride_d},
                                   HardwareInfo(sm_count)};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

template <class G>
Status RowsGemm(const void* a, const float* sfa, const void* b, const float* sfb, void* d, const int32_t* offsets,
                int experts, int64_t n, int64_t k, const Scratch& scratch, cudaStream_t stream) {
  Fp8GroupArrays<G> arrays;
  if (!CarveFp8GroupArrays(experts, scratch, &arrays)) return "out of scratch memory for the FP8 GEMM arguments";
  const int threads = 128;
  FillFp8RowGroups<G><<<(experts + threads - 1) / threads, threads, 0, stream>>>(
      offsets, experts, static_cast<const Fp8*>(a), sfa, static_cast<const Fp8*>(b), sfb,
      static_cast<typename G::ElementD*>(d), static_cast<int>(n), static_cast<int>(k), arrays);
  if (Status s = LaunchStatus("FP8 rows GEMM setup"); !s.empty()) return s;
  return LaunchGroupedGemm<G>(GroupedArguments(experts, arrays), scratch, stream);
}

template <class G>
Status WeightGemm(const void* a, const float* sfa, const void* b, const float* sfb, void* d,
                  const int32_t* token_offsets, int experts, int64_t m, int64_t n, int64_t tokens,
                  const Scratch& scratch, cudaStream_t stream) {
  // Only the experts without tokens: the GEMM writes every other expert's d whole.
  constexpr Dtype kDtype = std::is_same_v<typename G::ElementD, float> ? Dtype::kFloat32 : Dtype::kBFloat16;
  if (Status s = ZeroEmptyExperts(kDtype, token_offsets, experts, m * n, d, stream); !s.empty()) return s;
  Fp8GroupArrays<G> arrays;
  if (!CarveFp8GroupArrays(experts, scratch, &arrays)) return "out of scratch memory for the FP8 GEMM arguments";
  const int threads = 128;
  FillFp8WeightGroups<G><<<(experts + threads - 1) / threads, threads, 0, stream>>>(
      token_offsets, experts, static_cast<const Fp8*>(a), sfa, static_cast<const Fp8*>(b), sfb,
      static_cast<typename G::ElementD*>(d), static_cast<int>(m), static_cast<int>(n), tokens, arrays);
  if (Status s = LaunchStatus("FP8 weight GEMM setup"); !s.empty()) return s;
  return LaunchGroupedGemm<G>(GroupedArguments(experts, arrays), scratch, stream);
}

}  // namespace

size_t Fp8GroupedGemmScratchBytes(int64_t num_experts) {
  constexpr size_t largest =
      std::max({LargestGroupArrayElement<RowsG<Bf16>>(), LargestGroupArrayElement<RowsG<float>>(),
                LargestGroupArrayElement<WeightG<Bf16>>(), LargestGroupArrayElement<WeightG<float>>()});
  return kArrays * RoundUp(largest * num_experts, 128) + CutlassWorkspaceBound(MultiprocessorCount()) + 4 * 256;
}

Status Fp8RowsGemm(const void* a, const float* sfa, const void* b, const float* sfb, void* d, Fp8Out d_type,
                   const int32_t* offsets, int64_t num_experts, int64_t n, int64_t k, const Scratch& scratch,
                   cudaStream_t stream) {
  if (n % 128 != 0 || k % 128 != 0) return "Fp8RowsGemm: N and K must be multiples of 128";
  const int experts = static_cast<int>(num_experts);
  return d_type == Fp8Out::kFloat32 ? RowsGemm<RowsG<float>>(a, sfa, b, sfb, d, offsets, experts, n, k, scratch, stream)
                                    : RowsGemm<RowsG<Bf16>>(a, sfa, b, sfb, d, offsets, experts, n, k, scratch, stream);
}

Status Fp8WeightGemm(const void* a, const float* sfa, const void* b, const float* sfb, void* d, Fp8Out d_type,
                     const int32_t* token_offsets, int64_t num_experts, int64_t m, int64_t n, int64_t tokens,
                     const Scratch& scratch, cudaStream_t stream) {
  if (m % 128 != 0 || n % 128 != 0 || tokens % 128 != 0) {
    return "Fp8WeightGemm: M, N and the padded token count must be multiples of 128";
  }
  const int experts = static_cast<int>(num_experts);
  return d_type == Fp8Out::kFloat32
             ? WeightGemm<WeightG<float>>(a, sfa, b, sfb, d, token_offsets, experts, m, n, tokens, scratch, stream)
             : WeightGemm<WeightG<Bf16>>(a, sfa, b, sfb, d, token_offsets, experts, m, n, tokens, scratch, stream);
}

}  // namespace jmm::cuda::cutlass_gemm
