// The NVLink workspaces' host-side records, shared by the nvlink transport's FFI handlers: the registry and the
// block exchange (cuda/ffi/nvlink_cuda.cc) and stage 2's overlapped calls (jmm/nvlink_push.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "jmm/nvlink_cuda.h"

namespace jmm::nvlink {

constexpr int kRemote = -1;  // the device of a rank that another process owns

struct Group {
  std::vector<int> devices;    // device of each rank; kRemote for a rank of another process
  Peers peers{};               // staging and signals of each rank (remote ones mapped through CUDA IPC)
  std::vector<bool> imported;  // per rank: mapped from another process (closed, not freed)
  // Per rank, made for the local ones: the overlapped calls' side stream, its fork and join events, and how many
  // overlapped calls (forward and backward) the rank has enqueued (the value its `pushed` and `released` carry).
  std::vector<cudaStream_t> side_streams;
  std::vector<cudaEvent_t> forks, joins;
  std::vector<uint64_t> push_calls;
};

struct Workspace {
  bool emulated = false;
  bool overlap = false;  // the overlapped calls' push slots are allocated (Peers::staging)
  int ranks = 0;
  int64_t block_bytes = 0;
  int blocks_per_peer = 0;
  uint64_t timeout_ns = 0;
  std::vector<Group> groups;
};

// The open workspace `id`, or null. XLA only runs a workspace's calls while Python holds it open.
Workspace* FindOpen(int64_t id);

// Whether every rank's memory is mapped (peers in other processes attached).
bool Ready(const Workspace& workspace);

// The group holding `device` and its rank there; null when the device is not part of the workspace.
Group* GroupOf(Workspace& workspace, int device, int* rank);

// Restores the calling thread's current device on scope exit (XLA's threads keep their own).
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&saved_); }
  ~DeviceGuard() { cudaSetDevice(saved_); }

 private:
  int saved_ = 0;
};

}  // namespace jmm::nvlink
