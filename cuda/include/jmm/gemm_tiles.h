// Run-time choice of the CUTLASS tile configuration (cuda::GemmTiles) of each row-grouped bf16 GEMM of the CUDA
// handlers. The handlers read the environment variable JMM_GEMM_TILES on every call, so one process (one build,
// one compiled program) can compare configurations: benchmarks/bench_moe.py's ours_tiles_* implementations,
// tests/test_gemm_tiles_gpu.py.
//
//   unset, "" or "default"   every GEMM uses the default tiles
//   "<tiles>"                every row-grouped GEMM built with <tiles> uses them, the others the default
//   "<gemm>=<tiles>,..."     the GEMMs listed use the tiles given, the others the default
// <gemm>: fwd_gate_up (x @ W_gate_up), fwd_down (h @ W_down), bwd_down (dy @ W_down^T),
//         bwd_gate_up (dz @ W_gate_up^T); the weight-gradient GEMMs always use the default tiles.
// <tiles>: default, coop128x256_c1, pp64x256_c1, pp128x128_c2 (GemmTiles in jmm/moe_cuda.h, in that order;
//          pp128x128_c2 only for the forward GEMMs, whose expert weights are not transposed).
#pragma once

#include <string>

#include "jmm/moe_cuda.h"

namespace jmm {

inline constexpr char kGemmTilesEnv[] = "JMM_GEMM_TILES";

// The tiles of each row-grouped GEMM of one forward and backward.
struct RowsGemmTiles {
  cuda::GemmTiles fwd_gate_up = cuda::GemmTiles::kDefault;
  cuda::GemmTiles fwd_down = cuda::GemmTiles::kDefault;
  cuda::GemmTiles bwd_down = cuda::GemmTiles::kDefault;
  cuda::GemmTiles bwd_gate_up = cuda::GemmTiles::kDefault;
};

// Parses a JMM_GEMM_TILES value (null: unset) into `tiles`. Returns an empty string, or a message naming the
// variable, what is wrong and the accepted values.
std::string ParseGemmTiles(const char* spec, RowsGemmTiles* tiles);

}  // namespace jmm
