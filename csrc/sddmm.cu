// SDDMM on tensor cores: C = (A B^T) sampled at an SR-BCRS vector mask, with
// the dequantization fused into the epilogue.
//
// One warp owns one or two consecutive stride blocks, each the V x S output
// tile of a vector row i at slots [p0, p0 + S). A block -> row table built by
// a small kernel per call splits the work evenly however unequal the rows are
// (one huge row, empty rows), so row_order is not needed for balance.
//
// Per k chunk a lane loads one contiguous run of its gathered B rows (slots
// g, g + 8, g + 16, g + 24) and of A row g, and the warp issues the MMAs of
// the transposed tile (see sddmm_mma.cuh). Accumulation is int32 per
// instruction family; the 16-bit path multiplies bit planes (hi signed, lo
// unsigned) and recombines them in int64. The tile goes through shared memory
// so the output block, contiguous in the SR-BCRS value layout, is written with
// 16-byte stores.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <cuda_fp16.h>

#include "check.cuh"
#include "sddmm_mma.cuh"

namespace magicube_sddmm {

enum Mode : int { kInt8 = 0, kInt4 = 1, kInt16 = 2, kHalf = 3 };

// LB: bytes a lane loads per row per chunk; CK: k elements per chunk.
template <int MODE>
struct Traits;
template <>
struct Traits<kInt8> {
  static constexpr int LB = 16, CK = 64;
};
template <>
struct Traits<kInt4> {
  static constexpr int LB = 8, CK = 64;
};
template <>
struct Traits<kInt16> {
  static constexpr int LB = 32, CK = 64;
};
template <>
struct Traits<kHalf> {
  static constexpr int LB = 16, CK = 32;
};

constexpr int kWarps = 8;

// Operand words of one row for one chunk: 4 words feed two consecutive MMAs
// (words 0, 1 the first, 2, 3 the second). The 16-bit mode has two planes.
template <int MODE>
struct Operand {
  uint32_t w[4];
  uint32_t lo[MODE == kInt16 ? 4 : 1];
};

template <int MODE, int AL>
__device__ __forceinline__ void load_operand(Operand<MODE>& op, const uint8_t* row, int off,
                                             int row_bytes) {
  constexpr int LB = Traits<MODE>::LB;
  uint32_t raw[LB / 4];
  load_row_bytes<LB, AL>(raw, row, off, row_bytes);
  if constexpr (MODE == kInt4) {
    unpack_s4(raw[0], op.w[0], op.w[1]);
    unpack_s4(raw[1], op.w[2], op.w[3]);
  } else if constexpr (MODE == kInt16) {
#pragma unroll
    for (int j = 0; j < 4; ++j) split_planes(raw[2 * j], raw[2 * j + 1], op.w[j], op.lo[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) op.w[j] = raw[j];
  }
}

template <int MODE>
struct Acc {
  using T = typename std::conditional<MODE == kHalf, float, int>::type;
  T d[4];
  int x[MODE == kInt16 ? 4 : 1];   // hi x lo + lo x hi, weight 2^8
  int ll[MODE == kInt16 ? 4 : 1];  // lo x lo, weight 1
};

template <typename OutT>
__device__ __forceinline__ OutT zero_out() {
  if constexpr (std::is_same<OutT, int64_t>::value) {
    return 0;
  } else {
    return __float2half_rn(0.f);
  }
}

// block_row[j] = the vector row that stride block j belongs to. One thread
// per vector row; a launch of M/V threads, so that the SDDMM warps find their
// row with one load issued beside their col_idx loads instead of a search.
template <int S>
__global__ void block_rows_kernel(const int* __restrict__ row_ptr, int num_vrows, int num_blocks,
                                  int* __restrict__ block_row) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= num_vrows) return;
  const int start = row_ptr[2 * i];
  const int padded = (row_ptr[2 * i + 1] - start + S - 1) / S;
  for (int j = 0; j < padded; ++j) {
    const int blk = start / S + j;
    if (blk >= 0 && blk < num_blocks) block_row[blk] = i;
  }
}

// NT: m16 tiles per stride block (S = 16 NT slots); NB: stride blocks per
// warp, whose loads are all issued before any of them is waited on.
// Four resident CTAs (32 warps, 64 registers a thread) keep enough gathers in
// flight; the 16-bit planes need twice the registers.
template <int MODE, int AL, typename OutT, int NT, int NB>
__global__ void __launch_bounds__(kWarps * 32, MODE == kInt16 ? 2 : 4)
    sddmm_kernel(const int* __restrict__ col_idx,
                 const int* __restrict__ block_row, int num_vrows, int num_blocks, int64_t nnz_pad,
                 const uint8_t* __restrict__ a,
                 const uint8_t* __restrict__ b, const float* __restrict__ scale_a,
                 const float* __restrict__ scale_b, OutT* __restrict__ out, int m, int n,
                 int k, int row_bytes, int v) {
  constexpr int S = 16 * NT;
  constexpr int LB = Traits<MODE>::LB;
  constexpr int CK = Traits<MODE>::CK;
  constexpr int kTileBytes = 8 * S * static_cast<int>(sizeof(OutT));
  __shared__ __align__(16) uint8_t smem[kWarps][kTileBytes];

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int blk0 = (blockIdx.x * kWarps + warp) * NB;
  if (blk0 >= num_blocks) return;
  const int64_t bh = blockIdx.y;
  const int g = lane >> 2;
  const int t = lane & 3;
  constexpr bool kScaled = MODE != kHalf && !std::is_same<OutT, int64_t>::value;

  // The gathered rows depend only on col_idx, the A rows only on block_row:
  // both chains start at once.
  int col[NB][NT][2];
  float sb[NB][NT][2];
  const uint8_t* b_bh = b + bh * n * row_bytes;
  auto grow = [&](int c) { return b_bh + static_cast<int64_t>(c < 0 ? 0 : c) * row_bytes; };
  auto grow_bytes = [&](int c) { return c < 0 ? 0 : row_bytes; };
  Operand<MODE> go[NB][NT][2];
#pragma unroll
  for (int q = 0; q < NB; ++q) {
    const bool live = blk0 + q < num_blocks;
    const int64_t p0 = static_cast<int64_t>(blk0 + q) * S;
#pragma unroll
    for (int h = 0; h < NT; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = live ? __ldg(col_idx + p0 + h * 16 + g + 8 * e) : -1;
        const bool valid = c >= 0 && c < n;
        col[q][h][e] = valid ? c : -1;
        sb[q][h][e] = 0.f;
        if constexpr (kScaled) {
          if (valid) sb[q][h][e] = __ldg(scale_b + bh * n + c);
        }
        load_operand<MODE, AL>(go[q][h][e], grow(col[q][h][e]), t * LB, grow_bytes(col[q][h][e]));
      }
    }
  }

  int vrow[NB];
#pragma unroll
  for (int q = 0; q < NB; ++q)
    vrow[q] = blk0 + q < num_blocks ? min(max(__ldg(block_row + blk0 + q), 0), num_vrows - 1) : 0;

  const bool a_valid = g < v;
  const uint8_t* arow[NB];
#pragma unroll
  for (int q = 0; q < NB; ++q)
    arow[q] = a + (bh * m + static_cast<int64_t>(vrow[q]) * v + (a_valid ? g : 0)) * row_bytes;
  const int arow_bytes = a_valid ? row_bytes : 0;
  // The lane's two output rows' scales, fetched beside A rather than after
  // the MMAs, where their latency would stall the epilogue.
  float sa[NB][2];
#pragma unroll
  for (int q = 0; q < NB; ++q) {
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      sa[q][jj] = 0.f;
      if constexpr (kScaled) {
        if (2 * t + jj < v) sa[q][jj] = __ldg(scale_a + bh * m + static_cast<int64_t>(vrow[q]) * v + 2 * t + jj);
      }
    }
  }

  Acc<MODE> acc[NB][NT];
#pragma unroll
  for (int q = 0; q < NB; ++q) {
#pragma unroll
    for (int h = 0; h < NT; ++h) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[q][h].d[j] = 0;
        if constexpr (MODE == kInt16) {
          acc[q][h].x[j] = 0;
          acc[q][h].ll[j] = 0;
        }
      }
    }
  }

  const int num_chunks = (k + CK - 1) / CK;
  for (int ch = 0; ch < num_chunks; ++ch) {
    const int off = ch * 4 * LB + t * LB;
    Operand<MODE> ao[NB];
#pragma unroll
    for (int q = 0; q < NB; ++q) load_operand<MODE, AL>(ao[q], arow[q], off, arow_bytes);
    if (ch > 0) {
#pragma unroll
      for (int q = 0; q < NB; ++q) {
#pragma unroll
        for (int h = 0; h < NT; ++h) {
#pragma unroll
          for (int e = 0; e < 2; ++e) load_operand<MODE, AL>(go[q][h][e], grow(col[q][h][e]), off, grow_bytes(col[q][h][e]));
        }
      }
    }
#pragma unroll
    for (int q = 0; q < NB; ++q) {
#pragma unroll
      for (int h = 0; h < NT; ++h) {
        const Operand<MODE>& g0 = go[q][h][0];
        const Operand<MODE>& g1 = go[q][h][1];
        Acc<MODE>& ac = acc[q][h];
#pragma unroll
        for (int s2 = 0; s2 < 2; ++s2) {
          const int w0 = 2 * s2, w1 = 2 * s2 + 1;
          if constexpr (MODE == kHalf) {
            mma_f16(ac.d, g0.w[w0], g1.w[w0], g0.w[w1], g1.w[w1], ao[q].w[w0], ao[q].w[w1]);
          } else if constexpr (MODE == kInt16) {
            mma_s8s8(ac.d, g0.w[w0], g1.w[w0], g0.w[w1], g1.w[w1], ao[q].w[w0], ao[q].w[w1]);
            mma_s8u8(ac.x, g0.w[w0], g1.w[w0], g0.w[w1], g1.w[w1], ao[q].lo[w0], ao[q].lo[w1]);
            mma_u8s8(ac.x, g0.lo[w0], g1.lo[w0], g0.lo[w1], g1.lo[w1], ao[q].w[w0], ao[q].w[w1]);
            mma_u8u8(ac.ll, g0.lo[w0], g1.lo[w0], g0.lo[w1], g1.lo[w1], ao[q].lo[w0], ao[q].lo[w1]);
          } else {
            mma_s8s8(ac.d, g0.w[w0], g1.w[w0], g0.w[w1], g1.w[w1], ao[q].w[w0], ao[q].w[w1]);
          }
        }
      }
    }
  }

  // Fragment element j of tile h: slot h*16 + g + 8*(j/2), A row 2t + j%2.
  OutT* tile = reinterpret_cast<OutT*>(smem[warp]);
  const int vec_count = v * S * static_cast<int>(sizeof(OutT)) / 16;
#pragma unroll
  for (int q = 0; q < NB; ++q) {
    if (blk0 + q >= num_blocks) break;
    const int64_t p0 = static_cast<int64_t>(blk0 + q) * S;
    if (q > 0) __syncwarp();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = 2 * t + (j & 1);
      if (r >= v) continue;
#pragma unroll
      for (int h = 0; h < NT; ++h) {
        const int e = j >> 1;
        const int slot = h * 16 + g + 8 * e;
        OutT val = zero_out<OutT>();
        if (col[q][h][e] >= 0) {
          if constexpr (MODE == kHalf) {
            val = __float2half_rn(acc[q][h].d[j]);
          } else {
            int64_t qv = acc[q][h].d[j];
            if constexpr (MODE == kInt16) {
              qv = qv * 65536 + static_cast<int64_t>(acc[q][h].x[j]) * 256 + acc[q][h].ll[j];
            }
            if constexpr (std::is_same<OutT, int64_t>::value) {
              val = qv;
            } else {
              // An int32 accumulator rounds to fp32 the same through the cheaper
              // 32-bit conversion.
              const float acc_f = MODE == kInt16 ? __ll2float_rn(qv) : __int2float_rn(acc[q][h].d[j]);
              val = __float2half_rn(acc_f * (sa[q][j & 1] * sb[q][h][e]));
            }
          }
        }
        tile[r * S + slot] = val;
      }
    }
    __syncwarp();
    const uint4* src = reinterpret_cast<const uint4*>(smem[warp]);
    uint4* dst = reinterpret_cast<uint4*>(out + bh * nnz_pad * v + p0 * v);
    for (int o = lane; o < vec_count; o += 32) dst[o] = src[o];
  }
}

template <int MODE, int AL, typename OutT, int NT>
void launch(const at::Tensor& row_ptr, const at::Tensor& col_idx, int64_t num_vrows,
            int64_t nnz_pad, int64_t bh, const at::Tensor& a, const at::Tensor& b,
            const float* sa, const float* sb, at::Tensor& out, int64_t m, int64_t n, int64_t k,
            int64_t row_bytes, int64_t v) {
  constexpr int S = 16 * NT;
  // One block per warp: at 64 registers 32 resident warps keep more gathers
  // in flight than 16 warps of two blocks each would.
  constexpr int NB = 1;
  const int64_t num_blocks = nnz_pad / S;
  at::Tensor block_row = at::empty({num_blocks}, row_ptr.options());
  const auto stream = at::cuda::getCurrentCUDAStream();
  block_rows_kernel<S><<<static_cast<unsigned>((num_vrows + 127) / 128), 128, 0, stream>>>(
      row_ptr.data_ptr<int>(), static_cast<int>(num_vrows), static_cast<int>(num_blocks),
      block_row.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t num_warps = (num_blocks + NB - 1) / NB;
  const dim3 grid(static_cast<unsigned>((num_warps + kWarps - 1) / kWarps), static_cast<unsigned>(bh));
  sddmm_kernel<MODE, AL, OutT, NT, NB><<<grid, kWarps * 32, 0, stream>>>(
      col_idx.data_ptr<int>(), block_row.data_ptr<int>(), static_cast<int>(num_vrows),
      static_cast<int>(num_blocks), nnz_pad, static_cast<const uint8_t*>(a.data_ptr()),
      static_cast<const uint8_t*>(b.data_ptr()), sa, sb, static_cast<OutT*>(out.data_ptr()),
      static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), static_cast<int>(row_bytes),
      static_cast<int>(v));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The widest unit (16, 4, 2 or 1 bytes) that divides every row's address.
int64_t load_unit(int64_t row_bytes, const at::Tensor& a, const at::Tensor& b) {
  const auto pa = reinterpret_cast<uintptr_t>(a.data_ptr());
  const auto pb = reinterpret_cast<uintptr_t>(b.data_ptr());
  for (int64_t u : {16, 4, 2}) {
    if (row_bytes % u == 0 && pa % u == 0 && pb % u == 0) return u;
  }
  return 1;
}

template <int MODE, typename OutT, int NT>
void dispatch_unit(int64_t unit, const at::Tensor& row_ptr, const at::Tensor& col_idx,
                   int64_t num_vrows, int64_t nnz_pad, int64_t bh, const at::Tensor& a,
                   const at::Tensor& b, const float* sa, const float* sb, at::Tensor& out,
                   int64_t m, int64_t n, int64_t k, int64_t row_bytes, int64_t v) {
#define MAGICUBE_SDDMM_LAUNCH(U)                                                                  \
  launch<MODE, U, OutT, NT>(row_ptr, col_idx, num_vrows, nnz_pad, bh, a, b, sa, sb, out, m, n, k, \
                            row_bytes, v)
  switch (unit) {
    case 16: MAGICUBE_SDDMM_LAUNCH(16); break;
    case 4: MAGICUBE_SDDMM_LAUNCH(4); break;
    case 2: MAGICUBE_SDDMM_LAUNCH(2); break;
    default: MAGICUBE_SDDMM_LAUNCH(1); break;
  }
#undef MAGICUBE_SDDMM_LAUNCH
}

at::Tensor sddmm_cuda(const at::Tensor& row_ptr, const at::Tensor& col_idx,
                      const at::Tensor& row_order, const at::Tensor& a, const at::Tensor& b,
                      const std::optional<at::Tensor>& scale_a,
                      const std::optional<at::Tensor>& scale_b, int64_t v, int64_t bits,
                      at::ScalarType out_dtype) {
  MAGICUBE_CHECK(v == 2 || v == 4 || v == 8, "sddmm: v must be 2, 4 or 8, got ", v);
  MAGICUBE_CHECK(a.is_cuda() && b.is_cuda(), "sddmm: a and b must be CUDA tensors");
  const c10::cuda::CUDAGuard guard(a.device());
  for (const auto* p : {&row_ptr, &col_idx, &row_order}) {
    MAGICUBE_CHECK(p->device() == a.device(), "sddmm: row_ptr, col_idx and row_order must be on a's device");
    MAGICUBE_CHECK(p->scalar_type() == at::kInt && p->dim() == 1 && p->is_contiguous(),
                "sddmm: row_ptr, col_idx and row_order must be contiguous 1-D int32 tensors");
  }
  MAGICUBE_CHECK(b.device() == a.device(), "sddmm: b must be on a's device");
  MAGICUBE_CHECK(a.dim() == 3 && b.dim() == 3, "sddmm: a must be [BH, M, K] and b [BH, N, K]");
  MAGICUBE_CHECK(a.is_contiguous() && b.is_contiguous(), "sddmm: a and b must be contiguous");
  MAGICUBE_CHECK(a.size(0) == b.size(0), "sddmm: a and b must have the same batch size BH, got ",
              a.size(0), " and ", b.size(0));
  MAGICUBE_CHECK(a.size(2) == b.size(2), "sddmm: a and b must have the same last dim, got ",
              a.size(2), " and ", b.size(2));

  const bool half = a.scalar_type() == at::kHalf;
  int mode;
  if (half) {
    MAGICUBE_CHECK(bits == 16, "sddmm: float16 operands need bits=16, got ", bits);
    MAGICUBE_CHECK(b.scalar_type() == at::kHalf, "sddmm: b must be float16 like a");
    MAGICUBE_CHECK(!scale_a.has_value() && !scale_b.has_value(), "sddmm: float16 operands take no scales");
    MAGICUBE_CHECK(out_dtype == at::kHalf, "sddmm: float16 operands give out_dtype float16");
    mode = kHalf;
  } else {
    const at::ScalarType want = bits == 16 ? at::kShort : bits == 8 ? at::kChar : at::kByte;
    MAGICUBE_CHECK(bits == 16 || bits == 8 || bits == 4, "sddmm: bits must be 16, 8 or 4, got ", bits);
    MAGICUBE_CHECK(a.scalar_type() == want, "sddmm: a must be ", c10::toString(want), " for bits=", bits,
                ", got ", c10::toString(a.scalar_type()));
    MAGICUBE_CHECK(b.scalar_type() == want, "sddmm: b must be ", c10::toString(want), " for bits=", bits,
                ", got ", c10::toString(b.scalar_type()));
    MAGICUBE_CHECK(out_dtype == at::kHalf || out_dtype == at::kLong,
                "sddmm: out_dtype must be float16 or int64, got ", c10::toString(out_dtype));
    mode = bits == 16 ? kInt16 : bits == 8 ? kInt8 : kInt4;
  }

  const int64_t bh = a.size(0), m = a.size(1), n = b.size(1);
  const int64_t k = mode == kInt4 ? 2 * a.size(2) : a.size(2);
  const int64_t row_bytes = a.size(2) * a.element_size();
  MAGICUBE_CHECK(m % v == 0, "sddmm: M (", m, ") must be a multiple of v (", v, ")");
  const int64_t num_vrows = m / v;
  MAGICUBE_CHECK(row_ptr.numel() == 2 * num_vrows, "sddmm: row_ptr must have 2 * M / v = ",
              2 * num_vrows, " entries, got ", row_ptr.numel());
  MAGICUBE_CHECK(row_order.numel() == num_vrows, "sddmm: row_order must have M / v = ", num_vrows,
              " entries, got ", row_order.numel());
  // int32 accumulators: per plane product |term| <= 2^15 (s8 x s8), 2^16 (u8 x u8) or
  // 2^16 for the two summed cross planes, so K is bounded for the sum to fit.
  const int64_t k_max = mode == kInt16 ? 32768 : mode == kHalf ? INT32_MAX / 64 : 131071;
  MAGICUBE_CHECK(k <= k_max, "sddmm: K = ", k, " exceeds the exact int32 accumulation limit ", k_max);
  MAGICUBE_CHECK(n < INT32_MAX && m < INT32_MAX && bh <= 65535, "sddmm: a or b is too large");

  constexpr int64_t S = 32;
  const int64_t nnz_pad = col_idx.numel();
  MAGICUBE_CHECK(nnz_pad % S == 0, "sddmm: col_idx length (", nnz_pad,
              ") must be a multiple of the stride ", S);
  MAGICUBE_CHECK(nnz_pad / S < INT32_MAX, "sddmm: col_idx is too long");

  const float* sa = nullptr;
  const float* sb = nullptr;
  if (!half && out_dtype == at::kHalf) {
    MAGICUBE_CHECK(scale_a.has_value() && scale_b.has_value(),
                "sddmm: scale_a and scale_b are required for a float16 output");
    const auto& ta = *scale_a;
    const auto& tb = *scale_b;
    MAGICUBE_CHECK(ta.device() == a.device() && tb.device() == a.device(),
                "sddmm: scale_a and scale_b must be on a's device");
    MAGICUBE_CHECK(ta.scalar_type() == at::kFloat && ta.is_contiguous() && ta.dim() == 2 &&
                    ta.size(0) == bh && ta.size(1) == m,
                "sddmm: scale_a must be a contiguous float32 [BH, M] = [", bh, ", ", m, "] tensor");
    MAGICUBE_CHECK(tb.scalar_type() == at::kFloat && tb.is_contiguous() && tb.dim() == 2 &&
                    tb.size(0) == bh && tb.size(1) == n,
                "sddmm: scale_b must be a contiguous float32 [BH, N] = [", bh, ", ", n, "] tensor");
    sa = ta.data_ptr<float>();
    sb = tb.data_ptr<float>();
  }

  at::Tensor out = at::empty({bh, nnz_pad * v}, a.options().dtype(out_dtype));
  if (bh == 0 || nnz_pad == 0) return out;

  const int64_t unit = load_unit(row_bytes, a, b);
#define MAGICUBE_SDDMM_DISPATCH(MODE, OUT)                                                       \
  dispatch_unit<MODE, OUT, S / 16>(unit, row_ptr, col_idx, num_vrows, nnz_pad, bh, a, b, sa, sb, \
                                   out, m, n, k, row_bytes, v)
  const bool i64 = out_dtype == at::kLong;
  switch (mode) {
    case kInt8:
      if (i64) MAGICUBE_SDDMM_DISPATCH(kInt8, int64_t); else MAGICUBE_SDDMM_DISPATCH(kInt8, __half);
      break;
    case kInt4:
      if (i64) MAGICUBE_SDDMM_DISPATCH(kInt4, int64_t); else MAGICUBE_SDDMM_DISPATCH(kInt4, __half);
      break;
    case kInt16:
      if (i64) MAGICUBE_SDDMM_DISPATCH(kInt16, int64_t); else MAGICUBE_SDDMM_DISPATCH(kInt16, __half);
      break;
    default:
      MAGICUBE_SDDMM_DISPATCH(kHalf, __half);
      break;
  }
#undef MAGICUBE_SDDMM_DISPATCH
  return out;
}

}  // namespace magicube_sddmm

TORCH_LIBRARY_FRAGMENT(magicube_cuda, m) {
  m.def(
      "sddmm(Tensor row_ptr, Tensor col_idx, Tensor row_order, Tensor a, Tensor b, "
      "Tensor? scale_a, Tensor? scale_b, int v, int bits, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(magicube_cuda, CUDA, m) { m.impl("sddmm", &magicube_sddmm::sddmm_cuda); }
