// A CUTLASS sm90 ptr-array grouped-GEMM mainloop whose groups may wait for their A rows to arrive.
//
// The nvlink transport's fused gate_up call (docs/nvlink_design.md) gathers token rows from other GPUs into the
// expert GEMM's A operand while the GEMM runs, and wants each group's tiles to start as soon as that group's rows
// are there, while rows of other groups are still in flight. This collective derives from CUTLASS 4.2's
// `sm90_mma_array_tma_gmma_ss_warpspecialized` (TMA + wgmma, warp-specialised, persistent; what the MoE GEMMs
// use) and changes one thing: before the producer warp issues the first TMA load of a work tile, it waits until
// the tile's group counter reaches the group's target (`GroupArrival`). Groups without a counter start at once.
// Everything else (shared-memory layouts, stages, wgmma sequence, epilogue) is the base collective's, so the
// results are bit for bit those of the ungated kernel.
//
// Ordering: the sender stores the rows, fences (__threadfence_system) and then bumps the counter with a release;
// here the producer reads the counter with ld.acquire.sys and then issues `fence.proxy.async.global`, because the
// TMA reads that follow belong to the async proxy, which the generic-proxy acquire does not order by itself.
//
// Safety (docs/nvlink_design.md): the wait is bounded. After `timeout_ns` of %globaltimer it records the group,
// counter value and target in `GroupArrival::failure` (host-mapped memory, still readable after the trap ends
// the CUDA context) and traps, which fails the launch instead of hanging. No printf here: a call anywhere in the
// kernel makes ptxas serialise its wgmma instructions (warning C7510). A gated kernel must leave the
// SMs its senders need: launch it with `KernelHardwareInfo::sm_count` below the device's count (or the
// senders first), since its resident CTAs spin while they wait.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "nvlink/bounded_wait.cuh"

namespace jmm::cuda::cutlass_gemm {

// What a timed-out wait leaves behind. Every thread that gives up writes it (plain stores: atomics on host-mapped
// memory need PCIe atomics), so with several it holds one of them, possibly fields of different ones.
struct ArrivalFailure {
  uint32_t failed;  // 0 until a wait times out, then 1 (written after the other fields)
  int32_t group;
  uint64_t seen, target;
};

// Per group g: wait until *counters[g] >= targets[g] (counters[g] null: no wait). Device arrays, one entry per
// group; null `counters` gates nothing. `failure` may be null (the trap alone then reports the timeout).
struct GroupArrival {
  const uint64_t* const* counters = nullptr;
  const uint64_t* targets = nullptr;
  uint64_t timeout_ns = 10'000'000'000ull;
  ArrivalFailure* failure = nullptr;
};

namespace detail {

// Called by one thread: returns once group g's rows are published, traps after the timeout.
__device__ __forceinline__ void WaitForGroup(GroupArrival const& arrival, int group) {
  if (arrival.counters == nullptr) return;
  const uint64_t* counter = arrival.counters[group];
  if (counter == nullptr) return;
  const uint64_t target = arrival.targets[group];
  const uint64_t start = jmm::nvlink::GlobalTimerNs();
  uint64_t seen;
  while ((seen = jmm::nvlink::LoadAcquireSystem(counter)) < target) {
    if (jmm::nvlink::GlobalTimerNs() - start > arrival.timeout_ns) {
      if (volatile ArrivalFailure* failure = arrival.failure; failure != nullptr) {
        failure->group = group;
        failure->seen = seen;
        failure->target = target;
        __threadfence_system();
        failure->failed = 1;
        __threadfence_system();
      }
      __trap();
    }
    __nanosleep(128);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace detail

template <class Base>
struct ArrivalGatedMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;

  struct Arguments : Base::Arguments {
    GroupArrival arrival;
  };

  struct Params : Base::Params {
    GroupArrival arrival;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    return Params{Base::to_underlying_arguments(problem_shapes, args, workspace), args.arrival};
  }

  // The kernel announces each new group to the producer warp through this call (at its first tile and whenever
  // the group changes); the load below cannot read the group from blk_coord, whose L is a constant 0 in the
  // ptr-array kernels.
  template <class TensorMaps, class ProblemShape>
  CUTLASS_DEVICE void tensormaps_perform_update(typename Base::TensorMapStorage& shared_tensormaps,
                                                Params const& params, TensorMaps const& input_tensormaps,
                                                ProblemShape problem_shape, int32_t next_batch) {
    group_ = next_batch;
    Base::tensormaps_perform_update(shared_tensormaps, params, input_tensormaps, problem_shape, next_batch);
  }

  // The producer warp's per-tile entry point (the kernel calls it once per work tile): wait, then the base load.
  template <class LoadInputs, class TensorMaps, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           LoadInputs const& load_inputs, TensorMaps const& input_tensormaps,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    if (k_tile_count > 0 && cute::elect_one_sync()) {
      detail::WaitForGroup(params.arrival, group_);
    }
    __syncwarp();
    Base::load(params, pipeline, smem_pipe_write, load_inputs, input_tensormaps, blk_coord, k_tile_iter, k_tile_count,
               thread_idx, block_rank_in_cluster, shared_tensors);
  }

 private:
  int32_t group_ = 0;  // the group of the producer warp's current work tile
};

}  // namespace jmm::cuda::cutlass_gemm
