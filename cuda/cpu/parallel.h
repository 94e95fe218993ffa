// How the CPU kernels spread their work over threads, with no XLA here: a kernel splits its work into items whose
// results do not depend on the thread that runs them or on the order the items run in, and hands them to a
// ParallelFor, which the FFI handlers build over XLA's intra-op thread pool (ffi/cpu_thread_pool.h).
#pragma once

#include <cstdint>
#include <functional>

namespace jmm::cpu {

// Runs task(i) for every i in [0, count), possibly on several threads at once; returns when every item has run.
using ParallelFor = std::function<void(int64_t count, const std::function<void(int64_t)>& task)>;

// A ParallelFor that runs the items in order on the calling thread.
inline void RunInOrder(int64_t count, const std::function<void(int64_t)>& task) {
  for (int64_t i = 0; i < count; ++i) task(i);
}

}  // namespace jmm::cpu
