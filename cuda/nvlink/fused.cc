// The fused calls of the nvlink transport (contract, streams and block layouts in nvlink/fused.h).
#include "nvlink/fused.h"

#include <string>
#include <vector>

#include "ffi/extension.h"
#include "kernels/moe_backward.h"
#include "nvlink/kernels.h"
#include "nvlink/push.h"

namespace jmm::nvlink {
namespace {

using cuda::ScratchCursor;  // one per shard, over its slice of the workspace
using cuda::ScratchFootprint;

// The sum of the results takes one part per source.
static_assert(SummedBlocks::kMaxParts >= kMaxRanks);

// Prefixes a failed step's message with what the step was.
Status Step(const char* what, Status status) { return status.empty() ? status : std::string(what) + ": " + status; }

}  // namespace

size_t GateUpWorkspaceBytes(const FusedDims& d) {
  // The group counters, the gathered rows, the gated GEMM's arguments.
  return ScratchFootprint(d.groups() * sizeof(uint64_t)) + ScratchFootprint(d.rows() * d.hidden * 2) +
         SourceGroupsGemmScratchBytes(d.groups());
}

size_t DownWorkspaceBytes(const FusedDims& d) {
  // h, the rows' results, each received token's result summed over its pairs (the blocks that go back), and the
  // peers' and the own down GEMM's arguments.
  return ScratchFootprint(d.rows() * d.intermediate * 2) + ScratchFootprint(d.rows() * d.hidden * 2) +
         ScratchFootprint(d.tokens() * d.hidden * 2) + 2 * SourceGroupsGemmScratchBytes(d.groups());
}

size_t BackwardWorkspaceBytes(const FusedDims& d) {
  // dx [tokens, H] first, then the moe_ffn backward's own temporaries.
  return ScratchFootprint(d.tokens() * d.hidden * 2) +
         cuda::MoeBackward::ScratchBytes(Dtype::kBFloat16, d.tokens(), d.top_k, d.hidden, d.intermediate, d.experts);
}

Status FusedGateUp(const ShardSet& shards, const FusedDims& d, const std::vector<GateUpShard>& calls,
                   cudaStream_t stream) {
  const int ep = d.ep;
  const int64_t H = d.hidden, K = d.top_k, E = d.experts, block = d.block_bytes();
  const int64_t stride = d.one_block ? 0 : block;
  const int side_sms = SideSMs(ep);
  std::vector<ScratchCursor> cursors;
  cursors.reserve(shards.count);
  std::vector<uint64_t*> group_counters(shards.count);
  std::vector<void*> x_perms(shards.count);
  // Each shard's temporaries, and its per-group counters zeroed before the side stream forks off.
  if (Status status = shards.ForEach([&](int i) -> Status {
        cursors.emplace_back(calls[i].workspace, GateUpWorkspaceBytes(d));
        cuda::Scratch alloc = cursors[i].scratch();
        group_counters[i] = static_cast<uint64_t*>(alloc(d.groups() * sizeof(uint64_t)));
        x_perms[i] = alloc(d.rows() * H * 2);
        if (group_counters[i] == nullptr || x_perms[i] == nullptr) return "out of workspace memory";
        if (cudaMemsetAsync(group_counters[i], 0, d.groups() * sizeof(uint64_t), stream) != cudaSuccess) {
          return "cannot zero the group counters";
        }
        return {};
      });
      !status.empty()) {
    return status;
  }
  // Side stream: every shard's push, then each shard's wait for its peers' rows, their gather for the GEMM, their
  // copy into recv_x (the backward's operand) and their release.
  PushCall push(shards, block, "the rows' push");
  if (Status status = push.Start(stream, [&](int i) { return calls[i].blocks; }, stride); !status.empty()) {
    return status;
  }
  if (Status status = push.Receive(
          [&](int i) -> Status {
            const int me = push.rank(i);
            SourceBlocks slots{};
            for (int s = 0; s < ep; ++s) slots.rows[s] = s == me ? nullptr : push.Received(i, s);
            if (Status gather = GatherSourceRows(slots, ((1u << ep) - 1) & ~(1u << me), ep, me, d.capacity, H, K,
                                                 calls[i].pair_of_row, calls[i].source_offsets, E, x_perms[i], side_sms,
                                                 group_counters[i], push.side());
                !gather.empty()) {
              return "gathering the peers' rows: " + gather;
            }
            return push.CopyOut(i, calls[i].blocks + me * stride, calls[i].recv_x);
          },
          /*release=*/true);
      !status.empty()) {
    return status;
  }
  // XLA's stream: each shard's gate_up GEMM, its own rows first, on the SMs the side gather leaves.
  if (Status status = shards.ForEach([&](int i) -> Status {
        const GateUpShard& c = calls[i];
        const int me = shards.rank(i);
        cuda::Scratch alloc = cursors[i].scratch();
        SourceBlocks own{};
        own.rows[me] = c.blocks + me * stride;
        if (Status s = Step("own rows' gather",
                            GatherSourceRows(own, 1u << me, ep, me, d.capacity, H, K, c.pair_of_row, c.source_offsets,
                                             E, x_perms[i], d.sms - kPushSMs, nullptr, stream));
            !s.empty()) {
          return s;
        }
        return Step("gate_up GEMM",
                    GatedGateUpGemm(x_perms[i], c.w_gate_up, c.gate_up, c.source_offsets, ep, me, E, 2 * d.intermediate,
                                    H, group_counters[i], GatherArrivalsPerGroup(side_sms),
                                    shards.workspace->timeout_ns, d.sms - side_sms, alloc, stream));
      });
      !status.empty()) {
    return status;
  }
  return push.Join(stream);
}

Status FusedDown(const ShardSet& shards, const FusedDims& d, const std::vector<DownShard>& calls, cudaStream_t stream) {
  const int ep = d.ep;
  const int64_t C = d.capacity, H = d.hidden, K = d.top_k, E = d.experts, I = d.intermediate, block = d.block_bytes();
  std::vector<ScratchCursor> cursors;
  cursors.reserve(shards.count);
  std::vector<void*> hs(shards.count), row_outs(shards.count);
  std::vector<char*> ys(shards.count);  // each received token's result, summed over its pairs: the blocks that go back
  const auto own_pairs = [&](int i) { return calls[i].row_of_pair + shards.rank(i) * C * K; };
  const auto own_weights = [&](int i) { return calls[i].weights + shards.rank(i) * C * K; };
  // XLA's stream: each shard's SwiGLU, its peers' rows' down GEMM and their tokens' combine.
  if (Status status = shards.ForEach([&](int i) -> Status {
        const DownShard& c = calls[i];
        const int me = shards.rank(i);
        cursors.emplace_back(c.workspace, DownWorkspaceBytes(d));
        cuda::Scratch alloc = cursors[i].scratch();
        hs[i] = alloc(d.rows() * I * 2);
        row_outs[i] = alloc(d.rows() * H * 2);
        ys[i] = static_cast<char*>(alloc(d.tokens() * H * 2));
        if (hs[i] == nullptr || row_outs[i] == nullptr || ys[i] == nullptr) return "out of workspace memory";
        if (Status s = Step("swiglu", cuda::SwigluForward(Dtype::kBFloat16, c.gate_up, hs[i], c.expert_offsets, E,
                                                          d.rows(), I, stream));
            !s.empty()) {
          return s;
        }
        if (Status s = Step("peers' down GEMM", SourceRowsGemm(hs[i], c.w_down, row_outs[i], c.source_offsets, ep, me,
                                                               E, /*own=*/false, H, I, d.sms, alloc, stream));
            !s.empty()) {
          return s;
        }
        for (int s = 0; s < ep; ++s) {
          if (s == me) continue;
          if (Status st =
                  Step("peers' combine", cuda::CombineRows(Dtype::kBFloat16, row_outs[i], c.row_of_pair + s * C * K,
                                                           c.weights + s * C * K, C, K, H, ys[i] + s * block, stream));
              !st.empty()) {
            return st;
          }
        }
        return {};
      });
      !status.empty()) {
    return status;
  }
  // The peers' results travel back while the own rows' down GEMM runs, on all SMs but the one that the side stream's
  // waits need (kPushSMs).
  PushCall push(shards, block, "the results' push");
  const auto own_down_gemm = [&](int i) -> Status {
    cuda::Scratch alloc = cursors[i].scratch();
    return Step("own down GEMM",
                SourceRowsGemm(hs[i], calls[i].w_down, row_outs[i], calls[i].source_offsets, ep, shards.rank(i), E,
                               /*own=*/true, H, I, d.sms - kPushSMs, alloc, stream));
  };
  if (Status status = push.Start(stream, [&](int i) { return ys[i]; }, block); !status.empty()) return status;
  if (!d.one_block) {
    // `returned` gets every source's block: the peers' by the side stream, the own combined here.
    if (Status status = push.Receive([&](int i) { return push.CopyOut(i, nullptr, calls[i].returned); },
                                     /*release=*/true);
        !status.empty()) {
      return status;
    }
    if (Status status = shards.ForEach([&](int i) -> Status {
          if (Status s = own_down_gemm(i); !s.empty()) return s;
          return Step("own combine", cuda::CombineRows(Dtype::kBFloat16, row_outs[i], own_pairs(i), own_weights(i), C,
                                                       K, H, calls[i].returned + shards.rank(i) * block, stream));
        });
        !status.empty()) {
      return status;
    }
    return push.Join(stream);
  }
  // x was every destination's block: `returned` is the results summed per token, which the own combine adds up
  // straight from the push slots once they are in; then the side stream releases them.
  if (Status status = push.Receive(nullptr, /*release=*/false); !status.empty()) return status;
  if (Status status = shards.ForEach(own_down_gemm); !status.empty()) return status;
  if (Status status = push.Join(stream); !status.empty()) return status;
  if (Status status = shards.ForEach([&](int i) {
        SummedBlocks parts;
        parts.count = ep;
        parts.own = shards.rank(i);
        for (int s = 0; s < ep; ++s) parts.rows[s] = s == parts.own ? nullptr : push.Received(i, s);
        return Step("own combine and sum",
                    CombineRowsIntoSum(Dtype::kBFloat16, row_outs[i], own_pairs(i), own_weights(i), C, K, H, parts,
                                       calls[i].returned, stream));
      });
      !status.empty()) {
    return status;
  }
  if (Status status = push.Resume(stream); !status.empty()) return status;
  if (Status status = push.ReleaseAll(); !status.empty()) return status;
  return push.Join(stream);
}

Status FusedBackward(const ShardSet& shards, const FusedDims& d, cuda::GemmTiles bwd_down_tiles,
                     cuda::GemmTiles bwd_gate_up_tiles, const std::vector<BackwardShard>& calls, cudaStream_t stream) {
  const int ep = d.ep;
  const int64_t C = d.capacity, H = d.hidden, K = d.top_k, E = d.experts, block = d.block_bytes();
  const int64_t dy_stride = d.one_block ? 0 : block;
  std::vector<ScratchCursor> cursors;
  std::vector<cuda::MoeBackward> backwards;
  cursors.reserve(shards.count);
  backwards.reserve(shards.count);
  std::vector<char*> dxs(shards.count);
  std::vector<void*> dy_rows(shards.count);
  if (Status status = shards.ForEach([&](int i) -> Status {
        const BackwardShard& c = calls[i];
        cursors.emplace_back(c.workspace, BackwardWorkspaceBytes(d));
        cuda::Scratch alloc = cursors[i].scratch();
        dxs[i] = static_cast<char*>(alloc(d.tokens() * H * 2));
        if (dxs[i] == nullptr) return "out of workspace memory";
        const cuda::MoeBackwardCall call{Dtype::kBFloat16,
                                         d.tokens(),
                                         K,
                                         H,
                                         d.intermediate,
                                         E,
                                         bwd_down_tiles,
                                         bwd_gate_up_tiles,
                                         /*dy=*/nullptr,
                                         c.recv_x,
                                         c.weights,
                                         c.w_gate_up,
                                         c.w_down,
                                         c.gate_up,
                                         c.row_of_pair,
                                         c.pair_of_row,
                                         c.expert_offsets,
                                         dxs[i],
                                         c.d_w_gate_up,
                                         c.d_w_down,
                                         c.dz,
                                         c.d_weights};
        backwards.emplace_back(call, alloc);
        dy_rows[i] = backwards[i].GatheredDy();
        return dy_rows[i] == nullptr ? "out of workspace memory" : "";
      });
      !status.empty()) {
    return status;
  }

  // The results' cotangent to the experts. Side stream: the pushes, then each shard's wait for its peers' blocks,
  // the gather of their dy rows on every SM, and the release. XLA's stream meanwhile gathers the own rows' dy.
  PushCall there(shards, block, "the results' cotangent push");
  if (Status status = there.Start(stream, [&](int i) { return calls[i].d_returned; }, dy_stride); !status.empty()) {
    return status;
  }
  if (Status status = there.Receive(
          [&](int i) -> Status {
            const int me = there.rank(i);
            SourceBlocks slots{};
            for (int s = 0; s < ep; ++s) slots.rows[s] = s == me ? nullptr : there.Received(i, s);
            return Step("gathering the peers' dy rows",
                        GatherSourceRows(slots, ((1u << ep) - 1) & ~(1u << me), ep, me, C, H, K, calls[i].pair_of_row,
                                         calls[i].source_offsets, E, dy_rows[i], d.sms, nullptr, there.side()));
          },
          /*release=*/true);
      !status.empty()) {
    return status;
  }
  if (Status status = shards.ForEach([&](int i) {
        const int me = shards.rank(i);
        SourceBlocks own{};
        own.rows[me] = calls[i].d_returned + me * dy_stride;
        return Step("own dy gather",
                    GatherSourceRows(own, 1u << me, ep, me, C, H, K, calls[i].pair_of_row, calls[i].source_offsets, E,
                                     dy_rows[i], d.sms - kPushSMs, nullptr, stream));
      });
      !status.empty()) {
    return status;
  }
  if (Status status = there.Join(stream); !status.empty()) return status;
  // XLA's stream: each shard's backward up to its dx. Then the side stream sends the dx blocks back.
  if (Status status = shards.ForEach([&](int i) { return Step("backward", backwards[i].FromGatheredDy(stream)); });
      !status.empty()) {
    return status;
  }
  PushCall back(shards, block, "the rows' cotangent push");
  const auto last_gemms = [&]() {  // XLA's stream, beside the dx push: each shard's d_w_gate_up GEMM
    return shards.ForEach([&](int i) { return Step("backward", backwards[i].GateUpWeightGradient(stream)); });
  };
  if (Status status = back.Start(stream, [&](int i) { return dxs[i]; }, block); !status.empty()) return status;
  if (!d.one_block) {
    if (Status status =
            back.Receive([&](int i) { return back.CopyOut(i, dxs[i] + back.rank(i) * block, calls[i].d_send); },
                         /*release=*/true);
        !status.empty()) {
      return status;
    }
    if (Status status = last_gemms(); !status.empty()) return status;
    return back.Join(stream);
  }
  // One block of x went to every destination: d_send is its cotangent, dx summed over the sources, which XLA's
  // stream adds up straight from the push slots once the last GEMM is done and the peers' blocks are in; then the
  // side stream releases the slots. The side stream waits for the peers' blocks only after the last GEMM: that GEMM
  // takes every SM, and a wait kernel spinning beside it (while a late peer's block is on its way) would hold one
  // of them and delay the GEMM's last tiles by as long.
  if (Status status = last_gemms(); !status.empty()) return status;
  if (Status status = back.Resume(stream); !status.empty()) return status;
  if (Status status = back.Receive(nullptr, /*release=*/false); !status.empty()) return status;
  if (Status status = back.Join(stream); !status.empty()) return status;
  if (Status status = shards.ForEach([&](int i) {
        SummedBlocks parts;
        parts.count = ep;
        for (int s = 0; s < ep; ++s) parts.rows[s] = s == back.rank(i) ? dxs[i] + s * block : back.Received(i, s);
        return Step("dx sum", SumBlocks(Dtype::kBFloat16, parts, C, H, calls[i].d_send, stream));
      });
      !status.empty()) {
    return status;
  }
  if (Status status = back.Resume(stream); !status.empty()) return status;
  if (Status status = back.ReleaseAll(); !status.empty()) return status;
  return back.Join(stream);
}

}  // namespace jmm::nvlink

namespace jmm {

// Per shard; an emulated call's workspace result holds one of these per shard (jax.vmap batches it).
size_t NvlinkMoeGateUpWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                     int64_t groups) {
  return nvlink::GateUpWorkspaceBytes(nvlink::FusedDims{1, tokens, hidden, top_k, groups, intermediate});
}

size_t NvlinkMoeDownWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                   int64_t groups) {
  return nvlink::DownWorkspaceBytes(nvlink::FusedDims{1, tokens, hidden, top_k, groups, intermediate});
}

size_t NvlinkMoeBackwardWorkspaceBytes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                                       int64_t experts) {
  return nvlink::BackwardWorkspaceBytes(nvlink::FusedDims{1, tokens, hidden, top_k, experts, intermediate});
}

}  // namespace jmm
