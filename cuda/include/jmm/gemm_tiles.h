// Run-time choice of the CUTLASS tile configuration (cuda::GemmTiles) of each row-grouped bf16 GEMM of the CUDA
// handlers: the value of the environment variable JMM_GEMM_TILES when the calling function is traced, passed to
// the handlers as an attribute (jax_megamoe/ops/moe.py), so one build compares configurations by tracing again:
// benchmarks/bench_moe.py's ours_tiles_* implementations, tests/test_gemm_tiles_gpu.py.
//
//   unset, "" or "default"   every GEMM uses its default tiles (RowsGemmTiles below)
//   "<tiles>"                every row-grouped GEMM uses <tiles>
//   "<gemm>=<tiles>,..."     the GEMMs listed use the tiles given, the others their default
// <gemm>: fwd_gate_up (x @ W_gate_up), fwd_down (h @ W_down), bwd_down (dy @ W_down^T),
//         bwd_gate_up (dz @ W_gate_up^T); the weight-gradient GEMMs always use coop128x256_c2.
// <tiles>: default, coop128x256_c2, coop128x256_c1, pp64x256_c1 (GemmTiles in jmm/moe_cuda.h, in that order;
//          coop128x256_c2 was every GEMM's default until 2026-11-29).
#pragma once

#include <string>

#include "jmm/moe_cuda.h"

namespace jmm {

inline constexpr char kGemmTilesEnv[] = "JMM_GEMM_TILES";

// The tiles of each row-grouped GEMM of one forward and backward; the initialisers are the defaults (no
// cluster: its row-tile padding cost more than its weight multicast saved, benchmarks/RESULTS.md).
struct RowsGemmTiles {
  cuda::GemmTiles fwd_gate_up = cuda::GemmTiles::kCooperative128x256Cluster1;
  cuda::GemmTiles fwd_down = cuda::GemmTiles::kCooperative128x256Cluster1;
  cuda::GemmTiles bwd_down = cuda::GemmTiles::kCooperative128x256Cluster1;
  cuda::GemmTiles bwd_gate_up = cuda::GemmTiles::kCooperative128x256Cluster1;
};

// Parses a JMM_GEMM_TILES value (null: unset) into `tiles`. Returns an empty string, or a message naming the
// variable, what is wrong and the accepted values.
std::string ParseGemmTiles(const char* spec, RowsGemmTiles* tiles);

}  // namespace jmm
