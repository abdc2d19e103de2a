// Host-side launch helpers shared by the kernel families.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "check.cuh"

namespace magicube {

// A fresh allocation is 256-byte aligned; a view with an odd storage offset is copied once so the
// 16-byte loads and asynchronous copies stay legal.
inline at::Tensor aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
}

// `query()` once per key, remembered in `known`: the runtime calls behind the values below cost a
// microsecond or so each, a layer launches the same few shapes again and again, and a launch inside
// a graph capture may make no other runtime call.
template <class Key, class Query>
int remembered(std::mutex& mutex, std::map<Key, int>& known, const Key& key, Query&& query) {
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  const int value = query();
  known.emplace(key, value);
  return value;
}

// The dynamic shared memory `Kernel` may take on the current device, its attribute raised to that
// once per device. The opt-in limit covers static and dynamic shared memory together.
template <auto Kernel>
int max_dynamic_smem() {
  static std::mutex mutex;
  static std::map<int, int> known;
  return remembered(mutex, known, static_cast<int>(c10::cuda::current_device()), [] {
    cudaFuncAttributes attributes;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, Kernel));
    const int limit =
        static_cast<int>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin - attributes.sharedSizeBytes);
    C10_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
    return limit;
  });
}

// CTAs of `Kernel` an SM holds at `threads` threads and `smem` bytes of dynamic shared memory, once
// per (device, threads, smem).
template <auto Kernel>
int max_active_ctas(int threads, int64_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int64_t>, int> known;
  const auto key = std::make_tuple(static_cast<int>(c10::cuda::current_device()), threads, smem);
  return remembered(mutex, known, key, [&] {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, static_cast<size_t>(smem)));
    return per_sm;
  });
}

// CTAs of `Kernel` that one wave holds on the current device (at least one an SM).
template <auto Kernel>
int64_t wave_ctas(int threads, int64_t smem) {
  return int64_t{at::cuda::getCurrentDeviceProperties()->multiProcessorCount} *
         std::max(max_active_ctas<Kernel>(threads, smem), 1);
}

// Launches `kernel` so that it may start while the kernel before it on the stream finishes
// (programmatic dependent launch, sm_90+): the kernel must call `await_inputs()` before it reads
// or writes any global memory. Elsewhere a plain launch. `cluster` CTAs along x form a thread
// block cluster (sm_90+; 1 for none).
template <class... KernelArgs, class... Args>
void launch_overlapped_clusters(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                unsigned cluster, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = cluster;
  attrs[1].val.clusterDim.y = 1;
  attrs[1].val.clusterDim.z = 1;
  const bool hopper = at::cuda::getCurrentDeviceProperties()->major >= 9;
  MAGICUBE_CHECK(hopper || cluster == 1, "thread block clusters need sm_90 or newer");
  if (hopper) {
    config.attrs = attrs;
    config.numAttrs = cluster > 1 ? 2 : 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}
template <class... KernelArgs, class... Args>
void launch_overlapped(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  launch_overlapped_clusters(kernel, grid, block, smem, stream, 1, std::forward<Args>(args)...);
}

}  // namespace magicube
