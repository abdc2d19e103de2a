// Quantization of fp16/fp32 activations into the ops' integer containers, in one pass.
//
// q = clamp(round_half_even(x / scale), qmin, qmax) with an IEEE fp32 division, exactly as the
// reference (and torch's own x / scale, round, clamp) computes it; but where PyTorch needs a
// pass per step over fp32 intermediates, this reads x once and writes the container once:
// for Q, K and V of an attention layer that was most of the quantized layer's time.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <cuda_fp16.h>
#include <type_traits>

#include "check.cuh"

namespace {

constexpr int kGroup = 8;  // elements per thread: one 16-byte fp16 load

template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[kGroup]) {
  if constexpr (std::is_same_v<T, __half>) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  } else {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
}

// x: [rows, cols] with cols % 8 == 0, scale: [rows]. Output container of BITS (int4 packed,
// element 2t in the low nibble).
template <typename T, int BITS, bool SIGNED>
__global__ void quantize_kernel(const T* __restrict__ x, const float* __restrict__ scale,
                                uint8_t* __restrict__ out, int64_t cols, int64_t groups) {
  constexpr float kMin = SIGNED ? -static_cast<float>(1 << (BITS - 1)) : 0.f;
  constexpr float kMax = SIGNED ? static_cast<float>((1 << (BITS - 1)) - 1) : static_cast<float>((1 << BITS) - 1);
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e0 = g * kGroup;
    const float s = scale[e0 / cols];
    float v[kGroup];
    load8(x + e0, v);
    int q[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      q[i] = static_cast<int>(fminf(fmaxf(rintf(__fdiv_rn(v[i], s)), kMin), kMax));
    }
    if constexpr (BITS == 4) {
      uint32_t w = 0;
#pragma unroll
      for (int i = 0; i < kGroup; ++i) w |= static_cast<uint32_t>(q[i] & 0xF) << (4 * i);
      reinterpret_cast<uint32_t*>(out)[g] = w;
    } else if constexpr (BITS == 8) {
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int i = 0; i < kGroup; ++i) w[i / 4] |= static_cast<uint32_t>(q[i] & 0xFF) << (8 * (i % 4));
      reinterpret_cast<uint2*>(out)[g] = make_uint2(w[0], w[1]);
    } else {  // 12 and 16 bits: int16 containers (u16 as its bit pattern)
      uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < kGroup; ++i) w[i / 2] |= static_cast<uint32_t>(q[i] & 0xFFFF) << (16 * (i % 2));
      reinterpret_cast<uint4*>(out)[g] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

template <typename T, int BITS, bool SIGNED>
void launch(const at::Tensor& x, const at::Tensor& scale, at::Tensor& out) {
  const int64_t groups = x.numel() / kGroup;
  if (groups == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((groups + threads - 1) / threads,
                                           static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32);
  quantize_kernel<T, BITS, SIGNED><<<static_cast<unsigned>(blocks), threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(x.data_ptr()), scale.data_ptr<float>(), reinterpret_cast<uint8_t*>(out.data_ptr()),
      x.size(1), groups);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_bits(const at::Tensor& x, const at::Tensor& scale, int64_t bits, bool is_signed, at::Tensor& out) {
  if (is_signed) {
    switch (bits) {
      case 4: return launch<T, 4, true>(x, scale, out);
      case 8: return launch<T, 8, true>(x, scale, out);
      case 12: return launch<T, 12, true>(x, scale, out);
      default: return launch<T, 16, true>(x, scale, out);
    }
  }
  switch (bits) {
    case 4: return launch<T, 4, false>(x, scale, out);
    case 8: return launch<T, 8, false>(x, scale, out);
    default: return launch<T, 16, false>(x, scale, out);
  }
}

at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& scale, int64_t bits, bool is_signed) {
  MAGICUBE_CHECK(x.is_cuda() && scale.is_cuda() && scale.device() == x.device(),
                 "quantize: x and scale must be on one CUDA device");
  MAGICUBE_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize: x must be a contiguous [rows, cols] tensor");
  MAGICUBE_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat, "quantize: x must be float16 or float32, got ",
                 x.scalar_type());
  MAGICUBE_CHECK(x.size(1) % kGroup == 0, "quantize: cols must be a multiple of 8, got ", x.size(1));
  MAGICUBE_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "quantize: x must be 16-byte aligned");
  MAGICUBE_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == x.size(0) &&
                     scale.is_contiguous(),
                 "quantize: scale must be a contiguous float32 [rows] tensor");
  const bool ok = is_signed ? (bits == 4 || bits == 8 || bits == 12 || bits == 16) : (bits == 4 || bits == 8 || bits == 16);
  MAGICUBE_CHECK(ok, "quantize: unsupported bits ", bits, " for ", is_signed ? "signed" : "unsigned", " data");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto dtype = bits == 4 ? at::kByte : bits == 8 ? (is_signed ? at::kChar : at::kByte) : at::kShort;
  at::Tensor out = at::empty({x.size(0), bits == 4 ? x.size(1) / 2 : x.size(1)}, x.options().dtype(dtype));
  if (x.scalar_type() == at::kHalf) {
    dispatch_bits<__half>(x, scale, bits, is_signed, out);
  } else {
    dispatch_bits<float>(x, scale, bits, is_signed, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(magicube_cuda, m) { m.def("quantize(Tensor x, Tensor scale, int bits, bool is_signed) -> Tensor"); }
TORCH_LIBRARY_IMPL(magicube_cuda, CUDA, m) { m.impl("quantize", &quantize_cuda); }
