// A cpu::ParallelFor over XLA's intra-op thread pool, for the CPU handlers.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "cpu/parallel.h"
#include "ffi/ffi_common.h"

namespace jmm {

// The calling thread claims items too, and it waits only for items that another thread has claimed, so the call
// finishes whether the pool runs the helpers at once, later, or not at all (XLA promises none of these). A helper
// that starts after the last item was claimed touches only the state it shares by ownership, not `task`.
inline cpu::ParallelFor OnThreadPool(ffi::ThreadPool& pool) {
  return [&pool](int64_t count, const std::function<void(int64_t)>& task) {
    const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
    if (helpers <= 0) return cpu::RunInOrder(count, task);
    struct Shared {
      std::atomic<int64_t> next{0}, done{0};
      std::mutex mutex;
      std::condition_variable all_done;
    };
    auto shared = std::make_shared<Shared>();
    auto work = [count, &task](Shared& s) {
      for (int64_t i = s.next.fetch_add(1); i < count; i = s.next.fetch_add(1)) {
        task(i);
        if (s.done.fetch_add(1) + 1 == count) {
          std::lock_guard<std::mutex> lock(s.mutex);
          s.all_done.notify_all();
        }
      }
    };
    for (int64_t h = 0; h < helpers; ++h) pool.Schedule([shared, work] { work(*shared); });
    work(*shared);
    std::unique_lock<std::mutex> lock(shared->mutex);
    shared->all_done.wait(lock, [&] { return shared->done.load() == count; });
  };
}

}  // namespace jmm
