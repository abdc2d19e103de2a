// Sparse softmax over SR-BCRS values with the quantization of the
// probabilities fused into the store.
//
// One warp owns one vector row (V rows sharing the kept columns). A lane
// loads 8 consecutive slots of one row of one V x 32 block with a 16-byte
// load; the 32 lanes cover 32 / (4 V) ... 1 block(s) per step (lane bits 0-1:
// the 8-slot group, next log2 V bits: the row, the rest: the block). A row of
// up to kCached steps stays in shared memory, so the values are read once;
// longer rows are streamed once per pass, the re-reads mostly from L2. The
// quantized outputs need two passes (max; then exp, sum and store, since
// q = round(e * qmax) does not depend on the sum), fp16 three (max, sum, store).
//
// The kept mask comes from the row's count; only the 8-slot group holding the
// end of the row can mix kept and padding slots (the int4 column shuffle
// permutes inside groups of 8), and only there is col_idx read.
//
// A row keeping more than 8 mean rows' worth of slots (a global token's row,
// csrc/long_rows.cuh) would be the kernel's tail on one warp: such a row gets a
// CTA of its own, whose 4 warps take a quarter of its steps each and combine
// their max and sum through shared memory (in warp order, so the sum is added
// in another order than on one warp: the row scale may move by an ulp).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdint>
#include <cuda_fp16.h>
#include <tuple>

#include "check.cuh"
#include "launch.cuh"
#include "long_rows.cuh"
#include "mma.cuh"

namespace magicube_softmax {

constexpr int kWarps = 4;
constexpr int kStride = 32;
constexpr int kCached = 16;

template <int V>
struct LaneMap {
  static constexpr int kLogV = V == 2 ? 1 : V == 4 ? 2 : 3;
  static constexpr int kBlocksPerStep = 8 / V;
};

// Reduces over the lanes that hold the same row: lane bits 0-1 and the block bits.
template <int V, typename F>
__device__ __forceinline__ float row_reduce(float x, F op) {
  x = op(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = op(x, __shfl_xor_sync(0xffffffffu, x, 2));
#pragma unroll
  for (int bit = 2 + LaneMap<V>::kLogV; bit < 5; ++bit) x = op(x, __shfl_xor_sync(0xffffffffu, x, 1 << bit));
  return x;
}

// 2^x, flushing results below 2^-126 to 0 (they round to probability 0 anyway).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Grid (long_rows + ceil(M/V / 4), BH). CTA x < long_rows takes the vector row at
// position x of row_order if it keeps more than long_count slots, with all of its
// warps; the other CTAs give each warp the row at position 4 (x - long_rows) +
// warp, unless it is one of the former.
template <int V, int OUT_BITS>
__global__ void __launch_bounds__(kWarps * 32)
    softmax_kernel(const int* __restrict__ row_ptr, const int* __restrict__ col_idx,
                   const int* __restrict__ row_order, int long_rows, int long_count, int num_vrows,
                   int64_t nnz_pad, const __half* __restrict__ values, uint8_t* __restrict__ probs,
                   float* __restrict__ row_scale, float scale) {
  constexpr int kBps = LaneMap<V>::kBlocksPerStep;
  magicube::await_inputs();
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  // split is uniform over the CTA, so are its returns: its warps all reach the barriers.
  const bool split = static_cast<int>(blockIdx.x) < long_rows;
  const int pos = split ? static_cast<int>(blockIdx.x) : (static_cast<int>(blockIdx.x) - long_rows) * kWarps + warp;
  if (pos >= num_vrows) return;
  const int64_t bh = blockIdx.y;
  const int vrow = __ldg(row_order + pos);
  const int64_t start = __ldg(row_ptr + 2 * vrow);
  const int count = __ldg(row_ptr + 2 * vrow + 1) - static_cast<int>(start);
  if (pos < long_rows && (count > long_count) != split) return;  // the other layout's row
  const int num_blocks = (count + kStride - 1) / kStride;
  const int steps = (num_blocks + kBps - 1) / kBps;
  // The warp's steps [first, last): the whole row, or a quarter of a split one.
  int first = 0, last = steps;
  if (split) {
    const int per = (steps + kWarps - 1) / kWarps;
    first = min(steps, warp * per);
    last = min(steps, first + per);
  }

  const int grp = lane & 3;
  const int r = (lane >> 2) & (V - 1);
  const int bo = lane >> (2 + LaneMap<V>::kLogV);

  const __half* vbase = values + bh * nnz_pad * V;
  // Element offset (within this BH) of the lane's 8 slots at step `it`, or -1.
  auto elem_offset = [&](int it) -> int64_t {
    const int j = it * kBps + bo;
    if (j >= num_blocks) return -1;
    return (start + static_cast<int64_t>(j) * kStride) * V + r * kStride + grp * 8;
  };
  // Which slots of the row's last, partly kept 8-slot group are kept; read
  // once, beside the value loads.
  uint32_t tail = 0;
  if (count & 7) {
    const int rel = count & ~7;
#pragma unroll
    for (int u = 0; u < 8; ++u) tail |= (__ldg(col_idx + start + rel + u) != -1 ? 1u : 0u) << u;
  }
  auto kept_mask = [&](int it) -> uint32_t {
    const int j = it * kBps + bo;
    const int rel = j * kStride + grp * 8;
    if (j >= num_blocks || rel >= count) return 0u;
    return rel + 8 <= count ? 0xFFu : tail;
  };

  // The lane's slots of up to kCached steps, staged by cp.async so that all
  // of a chunk's loads are in flight at once; a lane reads back only what it
  // wrote itself, so no warp barrier is needed.
  __shared__ uint4 cache[kWarps][kCached][32];
  uint4(&mine)[kCached][32] = cache[warp];
  const bool cached = last - first <= kCached;
  auto load_chunk = [&](int c0) {
#pragma unroll 4
    for (int u = 0; u < kCached && c0 + u < last; ++u) {
      const int64_t o = elem_offset(c0 + u);
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(&mine[u][lane]));
      const void* src = o >= 0 ? static_cast<const void*>(vbase + o) : static_cast<const void*>(vbase);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                   "r"(o >= 0 ? 16 : 0)
                 : "memory");
    }
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  };
  // x = value * scale and d = x - max, each rounded, as the reference and the fused attention
  // compute them. Folding log2(e) into the scale (y = value * scale * log2 e, then y - y_max) would
  // round two large products instead, up to |x| 2^-23 relative in e at large scores, far from the
  // reference's rounding. exp(d) = 2^(d log2 e) moves e by at most |d| 2^-24 relative (e |d| <= 1/e),
  // ex2.approx by 2 ulp.
  auto slot_x = [&](int u, int e) -> float {
    const uint4 q = mine[u][lane];
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    const uint32_t hw = words[e >> 1] >> (16 * (e & 1));
    return __fmul_rn(__half2float(__ushort_as_half(static_cast<unsigned short>(hw & 0xFFFFu))), scale);
  };

  if (cached) load_chunk(first);
  // body(u, chunk) for every chunk of the warp's part of the row, u its place in the cache (each
  // run of kCached chunks loaded first where the part does not stay cached).
  auto for_each_chunk = [&](auto&& body) {
    for (int c0 = first; c0 < last; c0 += kCached) {
      if (!cached) load_chunk(c0);
#pragma unroll 2
      for (int u = 0; u < kCached && c0 + u < last; ++u) body(u, c0 + u);
    }
  };

  // A row's max or sum: over the warp's lanes of the row, then over the warps of a
  // split row in warp order.
  __shared__ float partial[kWarps][V];
  auto over_row = [&](float x, auto op) -> float {
    x = row_reduce<V>(x, op);
    if (!split) return x;
    if (grp == 0 && bo == 0) partial[warp][r] = x;
    __syncthreads();
    x = partial[0][r];
#pragma unroll
    for (int i = 1; i < kWarps; ++i) x = op(x, partial[i][r]);
    __syncthreads();  // the next call rewrites partial
    return x;
  };
  const auto add = [](float x, float y) { return x + y; };

  // max(value * scale) is value_max * scale exactly (rounding is monotone), so the max
  // is taken on the packed halves; a negative scale takes it on -value.
  const uint32_t flip = scale < 0.f ? 0x80008000u : 0u;
  __half2 hmax = __halves2half2(__ushort_as_half(0xFC00u), __ushort_as_half(0xFC00u));
  for_each_chunk([&](int u, int chunk) {
    const uint32_t msk = kept_mask(chunk);
    if (msk == 0u) return;
    const uint4 qd = mine[u][lane];
    const uint32_t words[4] = {qd.x, qd.y, qd.z, qd.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t w = words[q] ^ flip;
      if (msk != 0xFFu) {
        if (!(msk >> (2 * q) & 1u)) w = (w & 0xFFFF0000u) | 0xFC00u;
        if (!(msk >> (2 * q + 1) & 1u)) w = (w & 0xFFFFu) | 0xFC000000u;
      }
      hmax = __hmax2(hmax, *reinterpret_cast<const __half2*>(&w));
    }
  });
  float xmax = fmaxf(__low2float(hmax), __high2float(hmax));
  xmax = over_row(xmax, [](float x, float y) { return fmaxf(x, y); });
  const float row_max = __fmul_rn(flip ? -xmax : xmax, scale);
  constexpr float kLog2e = 1.4426950408889634f;

  constexpr float kQmax = OUT_BITS == 0 ? 0.f : static_cast<float>((1 << OUT_BITS) - 1);  // fp16 output: unused
  const int64_t out_row = bh * static_cast<int64_t>(num_vrows) * V + static_cast<int64_t>(vrow) * V + r;
  auto exps = [&](int u, uint32_t msk, float (&ev)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      ev[e] = (msk >> e & 1u) ? ex2(__fmul_rn(__fsub_rn(slot_x(u, e), row_max), kLog2e)) : 0.f;
    }
  };

  float sum = 0.f;
  if constexpr (OUT_BITS == 0) {
    for_each_chunk([&](int u, int chunk) {
      float ev[8];
      exps(u, kept_mask(chunk), ev);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += ev[e];
    });
    sum = over_row(sum, add);
    const float inv_sum = 1.f / sum;
    for_each_chunk([&](int u, int chunk) {
      const int64_t o = elem_offset(chunk);
      if (o < 0) return;
      float ev[8];
      exps(u, kept_mask(chunk), ev);
      uint32_t pw[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const unsigned short lo = __half_as_ushort(__float2half_rn(ev[2 * q] * inv_sum));
        const unsigned short hi = __half_as_ushort(__float2half_rn(ev[2 * q + 1] * inv_sum));
        pw[q] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
      }
      *reinterpret_cast<uint4*>(probs + (bh * nnz_pad * V + o) * 2) = make_uint4(pw[0], pw[1], pw[2], pw[3]);
    });
  } else {
    // q = round(e * qmax) needs no sum: one pass computes e once for both.
    for_each_chunk([&](int u, int chunk) {
      const int64_t o = elem_offset(chunk);
      if (o < 0) return;
      float ev[8];
      exps(u, kept_mask(chunk), ev);
      uint32_t qv[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        sum += ev[e];
        qv[e] = __float2uint_rn(ev[e] * kQmax);
      }
      const int64_t dst = bh * nnz_pad * V + o;
      if constexpr (OUT_BITS == 16) {
        *reinterpret_cast<uint4*>(probs + dst * 2) =
            make_uint4(qv[0] | qv[1] << 16, qv[2] | qv[3] << 16, qv[4] | qv[5] << 16, qv[6] | qv[7] << 16);
      } else if constexpr (OUT_BITS == 8) {
        *reinterpret_cast<uint2*>(probs + dst) =
            make_uint2(qv[0] | qv[1] << 8 | qv[2] << 16 | qv[3] << 24,
                       qv[4] | qv[5] << 8 | qv[6] << 16 | qv[7] << 24);
      } else {
        uint32_t packed = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) packed |= qv[e] << (4 * e);
        *reinterpret_cast<uint32_t*>(probs + dst / 2) = packed;
      }
    });
    sum = over_row(sum, add);
  }

  if (grp == 0 && bo == 0 && (!split || warp == 0)) {
    // fp16 probabilities carry no scale (ones, empty rows included); a quantized
    // empty row gets 0, never 1 / 0.
    float rs = 1.f;
    if constexpr (OUT_BITS != 0) rs = count == 0 ? 0.f : 1.f / (sum * kQmax);
    row_scale[out_row] = rs;
  }
}

template <int V, int OUT_BITS>
void launch(const at::Tensor& row_ptr, const at::Tensor& col_idx, const at::Tensor& row_order,
            const magicube::LongRows& lr, int64_t num_vrows, int64_t nnz_pad, int64_t bh,
            const at::Tensor& values, at::Tensor& probs, at::Tensor& row_scale, double scale) {
  const dim3 grid(static_cast<unsigned>(lr.candidates + (num_vrows + kWarps - 1) / kWarps), static_cast<unsigned>(bh));
  magicube::launch_overlapped(
      softmax_kernel<V, OUT_BITS>, grid, dim3(kWarps * 32), 0, at::cuda::getCurrentCUDAStream(),
      row_ptr.data_ptr<int>(), col_idx.data_ptr<int>(), row_order.data_ptr<int>(), static_cast<int>(lr.candidates),
      static_cast<int>(std::min<int64_t>(lr.slots, INT32_MAX)), static_cast<int>(num_vrows), nnz_pad,
      reinterpret_cast<const __half*>(values.data_ptr()), static_cast<uint8_t*>(probs.data_ptr()),
      row_scale.data_ptr<float>(), static_cast<float>(scale));
}

template <int V>
void dispatch_bits(int64_t out_bits, const at::Tensor& row_ptr, const at::Tensor& col_idx,
                   const at::Tensor& row_order, const magicube::LongRows& lr, int64_t num_vrows, int64_t nnz_pad,
                   int64_t bh, const at::Tensor& values, at::Tensor& probs, at::Tensor& row_scale, double scale) {
#define MAGICUBE_SOFTMAX_LAUNCH(BITS) \
  launch<V, BITS>(row_ptr, col_idx, row_order, lr, num_vrows, nnz_pad, bh, values, probs, row_scale, scale)
  switch (out_bits) {
    case 0: MAGICUBE_SOFTMAX_LAUNCH(0); break;
    case 16: MAGICUBE_SOFTMAX_LAUNCH(16); break;
    case 8: MAGICUBE_SOFTMAX_LAUNCH(8); break;
    default: MAGICUBE_SOFTMAX_LAUNCH(4); break;
  }
#undef MAGICUBE_SOFTMAX_LAUNCH
}

std::tuple<at::Tensor, at::Tensor> sparse_softmax_cuda(const at::Tensor& row_ptr,
                                                       const at::Tensor& col_idx,
                                                       const at::Tensor& row_order,
                                                       const at::Tensor& values, int64_t v,
                                                       double scale, int64_t out_bits, int64_t longest_row) {
  MAGICUBE_CHECK(v == 2 || v == 4 || v == 8, "sparse_softmax: v must be 2, 4 or 8, got ", v);
  MAGICUBE_CHECK(out_bits == 0 || out_bits == 16 || out_bits == 8 || out_bits == 4,
              "sparse_softmax: out_bits must be 0, 16, 8 or 4, got ", out_bits);
  magicube::check_longest_row("sparse_softmax", longest_row);
  MAGICUBE_CHECK(values.is_cuda(), "sparse_softmax: values must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(values.device());
  for (const auto* p : {&row_ptr, &col_idx, &row_order}) {
    MAGICUBE_CHECK(p->device() == values.device(),
                "sparse_softmax: row_ptr, col_idx and row_order must be on values' device");
    MAGICUBE_CHECK(p->scalar_type() == at::kInt && p->dim() == 1 && p->is_contiguous(),
                "sparse_softmax: row_ptr, col_idx and row_order must be contiguous 1-D int32 tensors");
  }
  MAGICUBE_CHECK(values.scalar_type() == at::kHalf && values.dim() == 2 && values.is_contiguous(),
              "sparse_softmax: values must be a contiguous float16 [BH, nnz_pad * v] tensor");
  MAGICUBE_CHECK(row_ptr.numel() % 2 == 0, "sparse_softmax: row_ptr must have an even length");
  const int64_t num_vrows = row_ptr.numel() / 2;
  MAGICUBE_CHECK(row_order.numel() == num_vrows, "sparse_softmax: row_order must have ", num_vrows,
              " entries (row_ptr length / 2), got ", row_order.numel());
  const int64_t nnz_pad = col_idx.numel();
  MAGICUBE_CHECK(nnz_pad % kStride == 0, "sparse_softmax: col_idx length (", nnz_pad,
              ") must be a multiple of the stride ", kStride);
  MAGICUBE_CHECK(values.size(1) == nnz_pad * v, "sparse_softmax: values must have nnz_pad * v = ",
              nnz_pad * v, " columns, got ", values.size(1));
  const int64_t bh = values.size(0);
  MAGICUBE_CHECK(bh <= 65535 && num_vrows < INT32_MAX, "sparse_softmax: values is too large");
  const int64_t m = num_vrows * v;

  at::Tensor probs;
  const auto opts = values.options();
  switch (out_bits) {
    case 0: probs = at::empty({bh, nnz_pad * v}, opts.dtype(at::kHalf)); break;
    case 16: probs = at::empty({bh, nnz_pad * v}, opts.dtype(at::kShort)); break;
    case 8: probs = at::empty({bh, nnz_pad * v}, opts.dtype(at::kByte)); break;
    default: probs = at::empty({bh, nnz_pad * v / 2}, opts.dtype(at::kByte)); break;
  }
  at::Tensor row_scale = at::empty({bh, m}, opts.dtype(at::kFloat));
  if (bh == 0 || num_vrows == 0) return {probs, row_scale};

  // Long rows (long_rows.cuh) get a CTA each (the kernel's comment).
  const magicube::LongRows lr = magicube::long_rows(nnz_pad, num_vrows, longest_row, kStride);
  const at::Tensor values16 = magicube::aligned16(values);  // the kernel's 16-byte loads
#define MAGICUBE_SOFTMAX_DISPATCH(V) \
  dispatch_bits<V>(out_bits, row_ptr, col_idx, row_order, lr, num_vrows, nnz_pad, bh, values16, probs, row_scale, scale)
  switch (v) {
    case 2: MAGICUBE_SOFTMAX_DISPATCH(2); break;
    case 4: MAGICUBE_SOFTMAX_DISPATCH(4); break;
    default: MAGICUBE_SOFTMAX_DISPATCH(8); break;
  }
#undef MAGICUBE_SOFTMAX_DISPATCH
  return {probs, row_scale};
}

}  // namespace magicube_softmax

TORCH_LIBRARY_FRAGMENT(magicube_cuda, m) {
  m.def(
      "sparse_softmax(Tensor row_ptr, Tensor col_idx, Tensor row_order, Tensor values, int v, "
      "float scale, int out_bits, int longest_row=-1) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(magicube_cuda, CUDA, m) {
  m.impl("sparse_softmax", &magicube_softmax::sparse_softmax_cuda);
}
