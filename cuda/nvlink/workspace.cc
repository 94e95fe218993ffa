// The nvlink transport's workspace registry (nvlink/workspace.h): creation, peer access, CUDA IPC across processes,
// destruction.
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "ffi/extension.h"
#include "kernels/kernel_modules.h"
#include "nvlink/workspace.h"

namespace jmm::nvlink {
namespace {

std::mutex registry_mutex;
std::map<int64_t, std::unique_ptr<Workspace>> registry;
int64_t next_id = 1;

void Check(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess) {
    throw std::runtime_error("jax_megamoe nvlink workspace: " + what + ": " + cudaGetErrorString(status));
  }
}

void EnablePeerAccess(const std::vector<int>& devices) {
  for (int a : devices) {
    for (int b : devices) {
      if (a == b) continue;
      int can = 0;
      Check(cudaDeviceCanAccessPeer(&can, a, b), "cudaDeviceCanAccessPeer");
      if (!can) {
        throw std::runtime_error("jax_megamoe nvlink workspace: GPU " + std::to_string(a) + " cannot access GPU " +
                                 std::to_string(b) +
                                 " directly (no NVLink/PCIe peer access); use "
                                 "moe_ffn_ep transport 'ragged' or 'xla' for this expert axis");
      }
      Check(cudaSetDevice(a), "cudaSetDevice");
      const cudaError_t status = cudaDeviceEnablePeerAccess(b, 0);
      if (status == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // XLA may have enabled it already; clear the sticky-free error
      } else {
        Check(status, "cudaDeviceEnablePeerAccess(" + std::to_string(a) + " -> " + std::to_string(b) + ")");
      }
    }
  }
}

// The one device of this process in a group (groups spanning processes hold exactly one), or kRemote.
int LocalDevice(const Group& group) {
  for (int device : group.devices) {
    if (device != kRemote) return device;
  }
  return kRemote;
}

void FreeGroup(Group& group, int ranks) {
  for (int r = 0; r < ranks; ++r) {
    if (group.imported[r]) {
      cudaSetDevice(LocalDevice(group));
      cudaIpcCloseMemHandle(group.peers.staging[r]);
      cudaIpcCloseMemHandle(group.peers.signals[r]);
    } else if (group.devices[r] != kRemote) {
      cudaSetDevice(group.devices[r]);
      cudaFree(group.peers.staging[r]);
      cudaFree(group.peers.signals[r]);
    }
    group.peers.staging[r] = nullptr;
    group.peers.signals[r] = nullptr;
    if (group.side_streams[r] != nullptr) cudaStreamDestroy(group.side_streams[r]);
    if (group.forks[r] != nullptr) cudaEventDestroy(group.forks[r]);
    if (group.joins[r] != nullptr) cudaEventDestroy(group.joins[r]);
    group.side_streams[r] = nullptr;
    group.forks[r] = group.joins[r] = nullptr;
  }
}

void Allocate(Group& group, int ranks, int64_t block_bytes) {
  const size_t staging_bytes = StagingBytes(ranks, block_bytes);
  for (int r = 0; r < ranks; ++r) {
    if (group.devices[r] == kRemote) continue;
    Check(cudaSetDevice(group.devices[r]), "cudaSetDevice");
    Check(cudaMalloc(reinterpret_cast<void**>(&group.peers.staging[r]), staging_bytes),
          "allocating " + std::to_string(staging_bytes) + " staging bytes on GPU " + std::to_string(group.devices[r]));
    Check(cudaMalloc(reinterpret_cast<void**>(&group.peers.signals[r]), SignalBytes(ranks)), "allocating signals");
    Check(cudaMemset(group.peers.signals[r], 0, SignalBytes(ranks)), "zeroing signals");
    Check(cudaStreamCreateWithFlags(&group.side_streams[r], cudaStreamNonBlocking), "creating the side stream");
    Check(cudaEventCreateWithFlags(&group.forks[r], cudaEventDisableTiming), "creating an event");
    Check(cudaEventCreateWithFlags(&group.joins[r], cudaEventDisableTiming), "creating an event");
    // Every kernel of the library, not only the transport's: any of them may be launched for the first time while
    // a peer waits (kernels/kernel_modules.h).
    if (const std::string error = cuda::LoadAllKernels(); !error.empty()) {
      throw std::runtime_error("jax_megamoe nvlink workspace: loading the library's kernels on GPU " +
                               std::to_string(group.devices[r]) + ": " + error);
    }
  }
  for (int r = 0; r < ranks; ++r) {
    if (group.devices[r] == kRemote) continue;
    Check(cudaSetDevice(group.devices[r]), "cudaSetDevice");
    Check(cudaDeviceSynchronize(), "initialising the workspace");
  }
}

Workspace& Find(int64_t id) {
  auto it = registry.find(id);
  if (it == registry.end())
    throw std::runtime_error("jax_megamoe nvlink workspace " + std::to_string(id) + " is unknown");
  return *it->second;
}

// Whether every rank's memory is mapped (peers in other processes attached).
bool Ready(const Workspace& workspace) {
  for (const auto& group : workspace.groups) {
    for (int r = 0; r < workspace.ranks; ++r) {
      if (group.peers.staging[r] == nullptr) return false;
    }
  }
  return true;
}

// The group holding `device` and its rank there; null when the device is not part of the workspace.
Group* GroupOf(Workspace& workspace, int device, int* rank) {
  for (auto& group : workspace.groups) {
    for (int r = 0; r < workspace.ranks; ++r) {
      if (group.devices[r] == device) {
        *rank = r;
        return &group;
      }
    }
  }
  return nullptr;
}

}  // namespace

// XLA only runs a workspace's calls while Python holds it open, so the pointer outlives the call.
Status OpenShards(int64_t id, int device, ShardSet* shards) {
  Workspace* workspace = nullptr;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(id);
    if (it != registry.end()) workspace = it->second.get();
  }
  if (workspace == nullptr) return "workspace " + std::to_string(id) + " is closed or unknown";
  if (!Ready(*workspace)) return "the workspace's peers in other processes are not attached yet";
  int rank = 0;
  Group* group = GroupOf(*workspace, device, &rank);
  if (group == nullptr) return "GPU " + std::to_string(device) + " is not part of this workspace's mesh axis";
  shards->workspace = workspace;
  shards->group = group;
  shards->first_rank = workspace->emulated ? 0 : rank;
  shards->count = workspace->emulated ? workspace->ranks : 1;
  return {};
}

int64_t CreateWorkspace(const std::vector<std::vector<int>>& groups, bool emulated, int64_t block_bytes,
                        int64_t timeout_ms, int blocks_per_peer) {
  if (groups.empty()) throw std::runtime_error("jax_megamoe nvlink workspace: no device groups given");
  const int ranks = static_cast<int>(groups[0].size());
  if (ranks < 1 || ranks > kMaxRanks) {
    throw std::runtime_error("jax_megamoe nvlink workspace: an expert group must have 1 to " +
                             std::to_string(kMaxRanks) + " GPUs, got " + std::to_string(ranks));
  }
  if (block_bytes <= 0 || timeout_ms <= 0 || blocks_per_peer < 1 || blocks_per_peer > 1024) {
    throw std::runtime_error(
        "jax_megamoe nvlink workspace: block_bytes and timeout_ms must be positive and "
        "blocks_per_peer in [1, 1024]");
  }
  if (emulated && groups.size() != 1) {
    throw std::runtime_error("jax_megamoe nvlink workspace: an emulated workspace has exactly one group");
  }
  auto workspace = std::make_unique<Workspace>();
  workspace->emulated = emulated;
  workspace->ranks = ranks;
  workspace->block_bytes = (block_bytes + 255) / 256 * 256;  // keeps every staging block 16-byte aligned
  workspace->timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000ull;
  workspace->blocks_per_peer = blocks_per_peer;
  DeviceGuard guard;
  try {
    for (const auto& devices : groups) {
      if (static_cast<int>(devices.size()) != ranks) {
        throw std::runtime_error("jax_megamoe nvlink workspace: every group must have the same number of GPUs");
      }
      int local = 0;
      for (int device : devices) local += device != kRemote;
      if (local == 0 || (local < ranks && (local > 1 || emulated))) {
        throw std::runtime_error(
            "jax_megamoe nvlink workspace: an expert group spanning processes must have "
            "exactly one GPU in each process (one process per GPU)");
      }
      if (!emulated && local == ranks) EnablePeerAccess(devices);
      Group group;
      group.devices = devices;
      group.imported.assign(ranks, false);
      group.side_streams.assign(ranks, nullptr);
      group.forks.assign(ranks, nullptr);
      group.joins.assign(ranks, nullptr);
      group.push_calls.assign(ranks, 0);
      workspace->groups.push_back(group);
      Allocate(workspace->groups.back(), ranks, workspace->block_bytes);
    }
  } catch (...) {
    for (auto& group : workspace->groups) FreeGroup(group, ranks);
    throw;
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  const int64_t id = next_id++;
  registry[id] = std::move(workspace);
  return id;
}

std::vector<std::string> ExportHandles(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const Workspace& workspace = Find(id);
  std::vector<std::string> handles(workspace.groups.size());
  DeviceGuard guard;
  for (size_t g = 0; g < workspace.groups.size(); ++g) {
    const Group& group = workspace.groups[g];
    const int device = LocalDevice(group);
    for (int r = 0; r < workspace.ranks; ++r) {
      if (group.devices[r] != device) continue;
      cudaIpcMemHandle_t staging, signals;
      Check(cudaSetDevice(device), "cudaSetDevice");
      Check(cudaIpcGetMemHandle(&staging, group.peers.staging[r]), "cudaIpcGetMemHandle(staging)");
      Check(cudaIpcGetMemHandle(&signals, group.peers.signals[r]), "cudaIpcGetMemHandle(signals)");
      handles[g].append(reinterpret_cast<const char*>(&staging), sizeof(staging));
      handles[g].append(reinterpret_cast<const char*>(&signals), sizeof(signals));
    }
  }
  return handles;
}

void AttachPeer(int64_t id, int group_index, int rank, const std::string& handles) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  Workspace& workspace = Find(id);
  if (group_index < 0 || group_index >= static_cast<int>(workspace.groups.size()) || rank < 0 ||
      rank >= workspace.ranks) {
    throw std::runtime_error("jax_megamoe nvlink workspace: no group " + std::to_string(group_index) + " rank " +
                             std::to_string(rank));
  }
  Group& group = workspace.groups[group_index];
  if (group.devices[rank] != kRemote || group.imported[rank]) {
    throw std::runtime_error("jax_megamoe nvlink workspace: rank " + std::to_string(rank) +
                             " is local or already attached");
  }
  if (handles.size() != 2 * sizeof(cudaIpcMemHandle_t)) {
    throw std::runtime_error("jax_megamoe nvlink workspace: a peer's handles must be " +
                             std::to_string(2 * sizeof(cudaIpcMemHandle_t)) + " bytes");
  }
  cudaIpcMemHandle_t staging, signals;
  std::memcpy(&staging, handles.data(), sizeof(staging));
  std::memcpy(&signals, handles.data() + sizeof(staging), sizeof(signals));
  DeviceGuard guard;
  Check(cudaSetDevice(LocalDevice(group)), "cudaSetDevice");
  void* staging_ptr = nullptr;
  void* signals_ptr = nullptr;
  Check(cudaIpcOpenMemHandle(&staging_ptr, staging, cudaIpcMemLazyEnablePeerAccess),
        "opening rank " + std::to_string(rank) + "'s staging (cudaIpcOpenMemHandle)");
  const cudaError_t status = cudaIpcOpenMemHandle(&signals_ptr, signals, cudaIpcMemLazyEnablePeerAccess);
  if (status != cudaSuccess) {
    cudaIpcCloseMemHandle(staging_ptr);
    Check(status, "opening rank " + std::to_string(rank) + "'s signals (cudaIpcOpenMemHandle)");
  }
  group.peers.staging[rank] = static_cast<char*>(staging_ptr);
  group.peers.signals[rank] = static_cast<uint64_t*>(signals_ptr);
  group.imported[rank] = true;
}

void DestroyWorkspace(int64_t id) {
  std::unique_ptr<Workspace> workspace;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(id);
    if (it == registry.end()) return;
    workspace = std::move(it->second);
    registry.erase(it);
  }
  DeviceGuard guard;
  for (auto& group : workspace->groups) {
    for (int device : group.devices) {
      if (device == kRemote) continue;
      cudaSetDevice(device);
      cudaDeviceSynchronize();
    }
    FreeGroup(group, workspace->ranks);
  }
}

}  // namespace jmm::nvlink
