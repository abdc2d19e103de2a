// Host-side launch helpers shared by the kernel families.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

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

// The dynamic shared memory `Kernel` may take on the current device, its attribute raised to that
// once per device, so that a launch (inside a graph capture too) makes no other runtime call. The
// opt-in limit covers static and dynamic shared memory together.
template <auto Kernel>
int max_dynamic_smem() {
  static int dynamic_limit[256] = {};
  const int device = c10::cuda::current_device();
  MAGICUBE_CHECK(device < 256, "device index ", device, " out of range");
  if (dynamic_limit[device] == 0) {
    cudaFuncAttributes attributes;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, Kernel));
    const int limit =
        static_cast<int>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin - attributes.sharedSizeBytes);
    C10_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
    dynamic_limit[device] = limit;
  }
  return dynamic_limit[device];
}

// CTAs of `Kernel` an SM holds at `threads` threads and `smem` bytes of dynamic shared memory,
// queried once per (device, threads, smem): the runtime query costs a microsecond or so per
// launch, and a layer launches the same few shapes again and again.
template <auto Kernel>
int max_active_ctas(int threads, int64_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int64_t>, int> known;
  const auto key = std::make_tuple(static_cast<int>(c10::cuda::current_device()), threads, smem);
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, static_cast<size_t>(smem)));
  known.emplace(key, per_sm);
  return per_sm;
}

}  // namespace magicube
