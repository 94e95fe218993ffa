// sm90 FP8 row-grouped GEMM with blockwise float32 scales, the GEMM of the "fp8_blockwise" recipe
// (jax_megamoe/ops/fp8.py): one group per expert,
//   d[rows of e] = (a[rows of e] * sfa) @ (b_e * sfb_e)^T        (bf16 out, float32 accumulation)
// with e4m3 operands, both K-major (sm90 FP8 wgmma takes no other layout): a [rows, K] row-major, b_e [N, K]
// row-major. The scales apply per 128-deep K block to the float32 partial sums (CUTLASS's
// KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise, as in its example 68): sfa [rows, K/128] row-major (1x128
// tiles of a along K), sfb_e [N/128, K/128] row-major (128x128 blocks of b_e). K and N are multiples of 128 (the
// recipe pads H and I); rows per expert are arbitrary. Group shapes, pointers and scale layouts are written on the
// device from expert_offsets, as for the bf16 grouped GEMM (grouped_gemm_cutlass.cuh).
#include <cutlass/detail/blockwise_scale_layout.hpp>

#include "kernels/fp8_kernels.h"
#include "kernels/grouped_gemm_cutlass.cuh"
#include "kernels/kernel_module.cuh"

namespace jmm::cuda::cutlass_gemm {
namespace {

using Fp8 = cutlass::float_e4m3_t;
constexpr int kFp8Alignment = 16;  // 16 bytes of e4m3, what TMA needs

using Fp8TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
using Fp8ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;  // no cluster: no padding row tiles
// 1x128 tiles of a and 128x128 blocks of b, both scale arrays K-major (the recipe's [rows, K/128] and
// [N/128, K/128] row-major arrays as they are).
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using Fp8Epilogue =
    EpilogueFor<Fp8TileShape, Fp8ClusterShape, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

struct Fp8RowsGemmKernel {
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8, cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>,
      kFp8Alignment, Fp8, cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, kFp8Alignment, float, Fp8TileShape,
      Fp8ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Fp8Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, Fp8Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};
using G = Fp8RowsGemmKernel;

struct Fp8GroupArrays {
  GroupShape* shapes;
  const Fp8** a;
  const Fp8** b;
  Bf16** d;
  const float** sfa;
  const float** sfb;
  G::StrideA* stride_a;
  G::StrideB* stride_b;
  G::StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
};

// One thread per expert writes its group.
__global__ void FillFp8Groups(const int32_t* offsets, int num_experts, const Fp8* a, const float* sfa, const Fp8* b,
                              const float* sfb, Bf16* d, int n, int k, Fp8GroupArrays out) {
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
  out.layout_sfa[e] = ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(rows, n, k, 1));
  out.layout_sfb[e] = ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(rows, n, k, 1));
}

bool CarveFp8GroupArrays(int groups, const Scratch& scratch, Fp8GroupArrays* arrays) {
  constexpr size_t sizes[11] = {sizeof(GroupShape), sizeof(void*),     sizeof(void*),      sizeof(void*),
                                sizeof(void*),      sizeof(void*),     sizeof(G::StrideA), sizeof(G::StrideB),
                                sizeof(G::StrideD), sizeof(LayoutSFA), sizeof(LayoutSFB)};
  size_t offset[11], total = 0;
  for (int i = 0; i < 11; ++i) {
    offset[i] = total;
    total += RoundUp(sizes[i] * groups, 128);
  }
  char* base = static_cast<char*>(scratch(total));
  if (base == nullptr) return false;
  *arrays = Fp8GroupArrays{
      reinterpret_cast<GroupShape*>(base + offset[0]),   reinterpret_cast<const Fp8**>(base + offset[1]),
      reinterpret_cast<const Fp8**>(base + offset[2]),   reinterpret_cast<Bf16**>(base + offset[3]),
      reinterpret_cast<const float**>(base + offset[4]), reinterpret_cast<const float**>(base + offset[5]),
      reinterpret_cast<G::StrideA*>(base + offset[6]),   reinterpret_cast<G::StrideB*>(base + offset[7]),
      reinterpret_cast<G::StrideD*>(base + offset[8]),   reinterpret_cast<LayoutSFA*>(base + offset[9]),
      reinterpret_cast<LayoutSFB*>(base + offset[10])};
  return true;
}

}  // namespace

size_t Fp8RowsGemmScratchBytes(int64_t num_experts) {
  constexpr size_t largest = std::max({sizeof(GroupShape), sizeof(void*), sizeof(G::StrideA), sizeof(G::StrideB),
                                       sizeof(G::StrideD), sizeof(LayoutSFA), sizeof(LayoutSFB)});
  return 11 * RoundUp(largest * num_experts, 128) + CutlassWorkspaceBound(MultiprocessorCount()) + 4 * 256;
}

Status Fp8RowsGemm(const void* a, const float* sfa, const void* b, const float* sfb, void* d, const int32_t* offsets,
                   int64_t num_experts, int64_t n, int64_t k, const Scratch& scratch, cudaStream_t stream) {
  if (n % 128 != 0 || k % 128 != 0) return "Fp8RowsGemm: N and K must be multiples of 128";
  const int experts = static_cast<int>(num_experts);
  Fp8GroupArrays arrays;
  if (!CarveFp8GroupArrays(experts, scratch, &arrays)) return "out of scratch memory for the FP8 GEMM arguments";
  const int threads = 128;
  FillFp8Groups<<<(experts + threads - 1) / threads, threads, 0, stream>>>(
      offsets, experts, static_cast<const Fp8*>(a), sfa, static_cast<const Fp8*>(b), sfb, static_cast<Bf16*>(d),
      static_cast<int>(n), static_cast<int>(k), arrays);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return std::string("FP8 grouped GEMM setup launch failed: ") + cudaGetErrorString(err);
  }
  static const int sm_count = MultiprocessorCount();
  G::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                          {experts, arrays.shapes, nullptr},
                          {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b, arrays.sfa, arrays.layout_sfa,
                           arrays.sfb, arrays.layout_sfb},
                          {{}, nullptr, nullptr, arrays.d, arrays.stride_d},
                          HardwareInfo(sm_count)};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return LaunchGroupedGemm<G>(args, scratch, stream);
}

}  // namespace jmm::cuda::cutlass_gemm
