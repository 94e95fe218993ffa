// Parser of JMM_GEMM_TILES (grammar in jmm/gemm_tiles.h).
#include "jmm/gemm_tiles.h"

#include <algorithm>
#include <optional>
#include <string_view>

namespace jmm {
namespace {

struct NamedTiles {
  std::string_view name;
  cuda::GemmTiles tiles;
};

constexpr NamedTiles kTiles[] = {
    {"coop128x256_c2", cuda::GemmTiles::kCooperative128x256Cluster2},
    {"coop128x256_c1", cuda::GemmTiles::kCooperative128x256Cluster1},
    {"pp64x256_c1", cuda::GemmTiles::kPingpong64x256Cluster1},
};

struct NamedGemm {
  std::string_view name;
  cuda::GemmTiles RowsGemmTiles::*field;
};

constexpr NamedGemm kGemms[] = {
    {"fwd_gate_up", &RowsGemmTiles::fwd_gate_up},
    {"fwd_down", &RowsGemmTiles::fwd_down},
    {"bwd_down", &RowsGemmTiles::bwd_down},
    {"bwd_gate_up", &RowsGemmTiles::bwd_gate_up},
};

// The tiles called `name` for `gemm` ("default": that GEMM's default), or nothing for an unknown name.
std::optional<cuda::GemmTiles> FindTiles(std::string_view name, const NamedGemm& gemm) {
  if (name == "default") return RowsGemmTiles{}.*gemm.field;
  for (const NamedTiles& t : kTiles) {
    if (t.name == name) return t.tiles;
  }
  return std::nullopt;
}

const NamedGemm* FindGemm(std::string_view name) {
  for (const NamedGemm& g : kGemms) {
    if (g.name == name) return &g;
  }
  return nullptr;
}

std::string Accepted() {
  std::string tiles = "default", gemms;
  for (const NamedTiles& t : kTiles) tiles += ", " + std::string(t.name);
  for (const NamedGemm& g : kGemms) gemms += (gemms.empty() ? "" : ", ") + std::string(g.name);
  return "expected <tiles> or a comma list of <gemm>=<tiles>, with <tiles> one of " + tiles +
         " and <gemm> one of " + gemms;
}

}  // namespace

std::string ParseGemmTiles(const char* spec, RowsGemmTiles* tiles) {
  *tiles = RowsGemmTiles{};
  if (spec == nullptr || *spec == '\0') return {};
  const std::string_view all(spec);
  auto error = [&](const std::string& what) {
    return std::string(kGemmTilesEnv) + "=\"" + spec + "\": " + what + "; " + Accepted();
  };

  if (all.find('=') == std::string_view::npos) {
    for (const NamedGemm& g : kGemms) {
      const std::optional<cuda::GemmTiles> t = FindTiles(all, g);
      if (!t) return error("unknown tiles");
      tiles->*g.field = *t;
    }
    return {};
  }

  for (size_t start = 0; start <= all.size();) {
    const size_t end = std::min(all.find(',', start), all.size());
    const std::string_view entry = all.substr(start, end - start);
    start = end + 1;
    const size_t eq = entry.find('=');
    if (eq == std::string_view::npos) return error("entry \"" + std::string(entry) + "\" is not <gemm>=<tiles>");
    const NamedGemm* g = FindGemm(entry.substr(0, eq));
    if (g == nullptr) return error("unknown GEMM \"" + std::string(entry.substr(0, eq)) + "\"");
    const std::optional<cuda::GemmTiles> t = FindTiles(entry.substr(eq + 1), *g);
    if (!t) return error("unknown tiles \"" + std::string(entry.substr(eq + 1)) + "\"");
    tiles->*(g->field) = *t;
  }
  return {};
}

}  // namespace jmm
