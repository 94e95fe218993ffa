// CUDA FFI handlers of the "fp8_blockwise" recipe's GEMMs (contract in targets.h): they check the buffers and run
// cutlass_gemm::Fp8RowsGemm / Fp8WeightGemm (kernels/fp8_kernels.h) on XLA's stream, their temporaries in the
// workspace result.
#include <cuda_runtime.h>

#include <optional>

#include "ffi/cuda_handler.h"
#include "ffi/extension.h"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"
#include "kernels/fp8_kernels.h"

namespace jmm {

size_t Fp8GemmWorkspaceBytes(int64_t experts) { return cuda::cutlass_gemm::Fp8GroupedGemmScratchBytes(experts); }

namespace {

std::optional<cuda::cutlass_gemm::Fp8Out> Fp8OutType(ffi::DataType type) {
  if (type == ffi::BF16) return cuda::cutlass_gemm::Fp8Out::kBf16;
  if (type == ffi::F32) return cuda::cutlass_gemm::Fp8Out::kFloat32;
  return std::nullopt;
}

ffi::Error Fp8RowsGemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::F32> sfa, ffi::AnyBuffer b,
                           ffi::Buffer<ffi::F32> sfb, ffi::Buffer<ffi::S32> expert_offsets,
                           ffi::Result<ffi::AnyBuffer> d, Workspace workspace) {
  const std::string shapes =
      "a [R, K] and b [E, N, K] float8_e4m3fn, sfa [R, K/128] and sfb [E, N/128, K/128] float32, expert_offsets "
      "[E + 1], d [R, N] bfloat16 or float32, with N and K multiples of 128";
  const auto ad = a.dimensions(), bd = b.dimensions(), sad = sfa.dimensions(), sbd = sfb.dimensions(),
             dd = d->dimensions();
  if (a.element_type() != ffi::F8E4M3FN || b.element_type() != ffi::F8E4M3FN || !Fp8OutType(d->element_type())) {
    return InvalidArgument("fp8 rows GEMM: dtypes disagree with " + shapes);
  }
  if (ad.size() != 2 || bd.size() != 3 || sad.size() != 2 || sbd.size() != 3 || dd.size() != 2) {
    return InvalidArgument("fp8 rows GEMM: ranks disagree with " + shapes);
  }
  const int64_t R = ad[0], K = ad[1], E = bd[0], N = bd[1];
  if (N % 128 != 0 || K % 128 != 0 || bd[2] != K || sad[0] != R || sad[1] != K / 128 || sbd[0] != E ||
      sbd[1] != N / 128 || sbd[2] != K / 128 || dd[0] != R || dd[1] != N ||
      expert_offsets.element_count() != static_cast<size_t>(E + 1)) {
    return InvalidArgument("fp8 rows GEMM: shapes disagree with " + shapes);
  }
  if (auto err = CheckWorkspace("fp8 rows GEMM", workspace, Fp8GemmWorkspaceBytes(E)); err.failure()) return err;
  if (R == 0 || N == 0) return ffi::Error::Success();
  WorkspaceCursor cursor(workspace);
  JMM_CUDA_TRY("fp8 rows GEMM",
               cuda::cutlass_gemm::Fp8RowsGemm(a.untyped_data(), sfa.typed_data(), b.untyped_data(), sfb.typed_data(),
                                               d->untyped_data(), *Fp8OutType(d->element_type()),
                                               expert_offsets.typed_data(), E, N, K, cursor.scratch(), stream));
  return ffi::Error::Success();
}

ffi::Error Fp8WeightGemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::F32> sfa, ffi::AnyBuffer b,
                             ffi::Buffer<ffi::F32> sfb, ffi::Buffer<ffi::S32> token_offsets,
                             ffi::Result<ffi::AnyBuffer> d, Workspace workspace) {
  const std::string shapes =
      "a [M, P] and b [N, P] float8_e4m3fn, sfa [P/128, M] and sfb [P/128, N] float32, token_offsets [E + 1] "
      "(multiples of 128, the last at most P), d [E, M, N] bfloat16 or float32, with M, N and P multiples of 128";
  const auto ad = a.dimensions(), bd = b.dimensions(), sad = sfa.dimensions(), sbd = sfb.dimensions(),
             dd = d->dimensions();
  if (a.element_type() != ffi::F8E4M3FN || b.element_type() != ffi::F8E4M3FN || !Fp8OutType(d->element_type())) {
    return InvalidArgument("fp8 weight GEMM: dtypes disagree with " + shapes);
  }
  if (ad.size() != 2 || bd.size() != 2 || sad.size() != 2 || sbd.size() != 2 || dd.size() != 3) {
    return InvalidArgument("fp8 weight GEMM: ranks disagree with " + shapes);
  }
  const int64_t M = ad[0], P = ad[1], N = bd[0], E = dd[0];
  if (M % 128 != 0 || N % 128 != 0 || P % 128 != 0 || bd[1] != P || dd[1] != M || dd[2] != N || sad[0] != P / 128 ||
      sad[1] != M || sbd[0] != P / 128 || sbd[1] != N || token_offsets.element_count() != static_cast<size_t>(E + 1)) {
    return InvalidArgument("fp8 weight GEMM: shapes disagree with " + shapes);
  }
  if (auto err = CheckWorkspace("fp8 weight GEMM", workspace, Fp8GemmWorkspaceBytes(E)); err.failure()) return err;
  if (E == 0 || M == 0 || N == 0) return ffi::Error::Success();
  WorkspaceCursor cursor(workspace);
  JMM_CUDA_TRY("fp8 weight GEMM",
               cuda::cutlass_gemm::Fp8WeightGemm(a.untyped_data(), sfa.typed_data(), b.untyped_data(), sfb.typed_data(),
                                                 d->untyped_data(), *Fp8OutType(d->element_type()),
                                                 token_offsets.typed_data(), E, M, N, P, cursor.scratch(), stream));
  return ffi::Error::Success();
}

ffi::Error Fp8QuantizeBlocksCuda(cudaStream_t stream, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> values,
                                 ffi::Result<ffi::Buffer<ffi::F32>> scales, int64_t transpose) {
  const std::string shapes =
      "w [E, A, B] bfloat16 or float32 with A and B multiples of 128, values [E, A, B] (or [E, B, A] transposed) "
      "float8_e4m3fn, scales [E, A/128, B/128] (or [E, B/128, A/128]) float32";
  const auto wd = w.dimensions(), vd = values->dimensions(), sd = scales->dimensions();
  if ((w.element_type() != ffi::BF16 && w.element_type() != ffi::F32) || values->element_type() != ffi::F8E4M3FN) {
    return InvalidArgument("fp8 weight quantiser: dtypes disagree with " + shapes);
  }
  if (wd.size() != 3 || vd.size() != 3 || sd.size() != 3) {
    return InvalidArgument("fp8 weight quantiser: ranks disagree with " + shapes);
  }
  const int64_t E = wd[0], A = wd[1], B = wd[2];
  const int64_t va = transpose ? B : A, vb = transpose ? A : B;
  if (A % 128 != 0 || B % 128 != 0 || vd[0] != E || vd[1] != va || vd[2] != vb || sd[0] != E || sd[1] != va / 128 ||
      sd[2] != vb / 128) {
    return InvalidArgument("fp8 weight quantiser: shapes disagree with " + shapes);
  }
  JMM_CUDA_TRY("fp8 weight quantiser",
               cuda::QuantizeWeightBlocks(w.untyped_data(), w.element_type() == ffi::F32, E, A, B, transpose != 0,
                                          values->untyped_data(), scales->typed_data(), stream));
  return ffi::Error::Success();
}

ffi::Error Fp8QuantizeRowsCuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::S32> index,
                               ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::Buffer<ffi::F32>> scales) {
  const std::string shapes =
      "a [T, C] bfloat16 with C a multiple of 128, index [R] int32, values [R, C] float8_e4m3fn, scales [R, C/128] "
      "float32";
  const auto ad = a.dimensions(), vd = values->dimensions(), sd = scales->dimensions();
  if (values->element_type() != ffi::F8E4M3FN)
    return InvalidArgument("fp8 row quantiser: dtypes disagree with " + shapes);
  if (ad.size() != 2 || vd.size() != 2 || sd.size() != 2 || index.dimensions().size() != 1) {
    return InvalidArgument("fp8 row quantiser: ranks disagree with " + shapes);
  }
  const int64_t T = ad[0], C = ad[1], R = index.dimensions()[0];
  if (C % 128 != 0 || vd[0] != R || vd[1] != C || sd[0] != R || sd[1] != C / 128) {
    return InvalidArgument("fp8 row quantiser: shapes disagree with " + shapes);
  }
  JMM_CUDA_TRY("fp8 row quantiser", cuda::QuantizeRows(a.untyped_data(), T, index.typed_data(), R, C,
                                                       values->untyped_data(), scales->typed_data(), stream));
  return ffi::Error::Success();
}

ffi::Error Fp8SwigluRowsCuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> gate_up, ffi::Buffer<ffi::S32> offsets,
                             ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::Buffer<ffi::F32>> scales) {
  const std::string shapes =
      "gate_up [R, 2I] bfloat16 with I a multiple of 128, offsets [E + 1] int32, values [R, I] float8_e4m3fn, "
      "scales [R, I/128] float32";
  const auto gd = gate_up.dimensions(), vd = values->dimensions(), sd = scales->dimensions();
  if (values->element_type() != ffi::F8E4M3FN)
    return InvalidArgument("fp8 SwiGLU rows: dtypes disagree with " + shapes);
  if (gd.size() != 2 || vd.size() != 2 || sd.size() != 2 || offsets.dimensions().size() != 1 ||
      offsets.element_count() == 0) {
    return InvalidArgument("fp8 SwiGLU rows: ranks disagree with " + shapes);
  }
  const int64_t R = gd[0], I = gd[1] / 2;
  if (gd[1] % 2 != 0 || I % 128 != 0 || vd[0] != R || vd[1] != I || sd[0] != R || sd[1] != I / 128) {
    return InvalidArgument("fp8 SwiGLU rows: shapes disagree with " + shapes);
  }
  const int32_t* rows_used = offsets.typed_data() + offsets.element_count() - 1;  // offsets[E], on the device
  JMM_CUDA_TRY("fp8 SwiGLU rows", cuda::SwigluQuantizeRows(gate_up.untyped_data(), rows_used, R, I,
                                                           values->untyped_data(), scales->typed_data(), stream));
  return ffi::Error::Success();
}

ffi::Error Fp8SwigluGradRowsCuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> gate_up, ffi::Buffer<ffi::F32> g,
                                 ffi::Buffer<ffi::F32> row_weight, ffi::Buffer<ffi::S32> offsets,
                                 ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::Buffer<ffi::F32>> scales) {
  const std::string shapes =
      "gate_up [R, 2I] bfloat16 with I a multiple of 128, g [R, I] float32, row_weight [R] float32, offsets [E + 1] "
      "int32, values [R, 2I] float8_e4m3fn, scales [R, 2I/128] float32";
  const auto gd = gate_up.dimensions(), ggd = g.dimensions(), vd = values->dimensions(), sd = scales->dimensions();
  if (values->element_type() != ffi::F8E4M3FN) {
    return InvalidArgument("fp8 SwiGLU gradient rows: dtypes disagree with " + shapes);
  }
  if (gd.size() != 2 || ggd.size() != 2 || vd.size() != 2 || sd.size() != 2 || row_weight.dimensions().size() != 1 ||
      offsets.dimensions().size() != 1 || offsets.element_count() == 0) {
    return InvalidArgument("fp8 SwiGLU gradient rows: ranks disagree with " + shapes);
  }
  const int64_t R = gd[0], I = gd[1] / 2;
  if (gd[1] % 2 != 0 || I % 128 != 0 || ggd[0] != R || ggd[1] != I || row_weight.dimensions()[0] != R || vd[0] != R ||
      vd[1] != 2 * I || sd[0] != R || sd[1] != 2 * I / 128) {
    return InvalidArgument("fp8 SwiGLU gradient rows: shapes disagree with " + shapes);
  }
  const int32_t* rows_used = offsets.typed_data() + offsets.element_count() - 1;  // offsets[E], on the device
  JMM_CUDA_TRY("fp8 SwiGLU gradient rows",
               cuda::SwigluGradQuantizeRows(gate_up.untyped_data(), g.typed_data(), row_weight.typed_data(), rows_used,
                                            R, I, values->untyped_data(), scales->typed_data(), stream));
  return ffi::Error::Success();
}

ffi::Error Fp8TokenTilesCuda(cudaStream_t stream, ffi::AnyBuffer values, ffi::Buffer<ffi::F32> scales,
                             ffi::Buffer<ffi::F32> row_factor, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::F32>> out_scales) {
  const std::string shapes =
      "values [R, C] float8_e4m3fn and scales [R, C/128] float32 with R and C multiples of 128, row_factor [R] "
      "float32, out [C, R] float8_e4m3fn, out_scales [R/128, C] float32";
  const auto vd = values.dimensions(), sd = scales.dimensions(), od = out->dimensions(), osd = out_scales->dimensions();
  if (values.element_type() != ffi::F8E4M3FN || out->element_type() != ffi::F8E4M3FN) {
    return InvalidArgument("fp8 token tiles: dtypes disagree with " + shapes);
  }
  if (vd.size() != 2 || sd.size() != 2 || od.size() != 2 || osd.size() != 2 || row_factor.dimensions().size() != 1) {
    return InvalidArgument("fp8 token tiles: ranks disagree with " + shapes);
  }
  const int64_t R = vd[0], C = vd[1];
  if (R % 128 != 0 || C % 128 != 0 || sd[0] != R || sd[1] != C / 128 || row_factor.dimensions()[0] != R || od[0] != C ||
      od[1] != R || osd[0] != R / 128 || osd[1] != C) {
    return InvalidArgument("fp8 token tiles: shapes disagree with " + shapes);
  }
  JMM_CUDA_TRY("fp8 token tiles",
               cuda::RequantizeTokenTiles(values.untyped_data(), scales.typed_data(), row_factor.typed_data(), R, C,
                                          out->untyped_data(), out_scales->typed_data(), stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_fp8_rows_gemm, jmm::Fp8RowsGemmCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // a
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // sfa
                                  .Arg<xla::ffi::AnyBuffer>()              // b
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // sfb
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_offsets
                                  .Ret<xla::ffi::AnyBuffer>()              // d
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>(),  // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_fp8_weight_gemm, jmm::Fp8WeightGemmCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // a
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // sfa
                                  .Arg<xla::ffi::AnyBuffer>()              // b
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // sfb
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token_offsets
                                  .Ret<xla::ffi::AnyBuffer>()              // d
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>(),  // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_fp8_quantize_blocks, jmm::Fp8QuantizeBlocksCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // w
                                  .Ret<xla::ffi::AnyBuffer>()              // values
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // scales
                                  .Attr<int64_t>("transpose"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_fp8_quantize_rows, jmm::Fp8QuantizeRowsCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // a
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // index
                                  .Ret<xla::ffi::AnyBuffer>()               // values
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // scales
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_fp8_swiglu_rows, jmm::Fp8SwigluRowsCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // gate_up
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // offsets
                                  .Ret<xla::ffi::AnyBuffer>()               // values
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // scales
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_fp8_token_tiles, jmm::Fp8TokenTilesCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // values
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // scales
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // row_factor
                                  .Ret<xla::ffi::AnyBuffer>()               // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // out_scales
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmm_cuda_fp8_swiglu_grad_rows, jmm::Fp8SwigluGradRowsCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // gate_up
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // g
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // row_weight
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // offsets
                                  .Ret<xla::ffi::AnyBuffer>()               // values
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // scales
                              {xla::ffi::Traits::kCmdBufferCompatible});
