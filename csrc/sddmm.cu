// SDDMM on tensor cores: C = (A B^T) sampled at an SR-BCRS vector mask, with
// the dequantization fused into the epilogue.
//
// One warp streams every stride block of one vector row, the rows taken
// through row_order so that a CTA's eight rows have similar lengths; a row
// past 8 mean rows (a global token's) is split over a CTA's 8 warps instead,
// as it would be the tail on one (sddmm_cuda says which rows). The
// row's A fragment and scales are loaded once; while a block is multiplied,
// the next block's B gathers and the column indices of the block after it
// are already in flight, so the per-block cost is its loads, MMAs and
// epilogue, with no index chain in front of them.
//
// A block is the V x S output tile of vector row i at slots [p0, p0 + S).
// Per k chunk a lane loads one contiguous run of its gathered B rows (slots
// g, g + 8, g + 16, g + 24) and of A row g, and the warp issues the MMAs of
// the transposed tile (see sddmm_mma.cuh). Accumulation is int32 per
// instruction family; the 16-bit path multiplies bit planes (hi signed, lo
// unsigned) and recombines them in int64. A float16 tile is transposed into
// shared memory (stmatrix on sm_90) so that the output block, contiguous in
// the SR-BCRS value layout, leaves in 16-byte stores; an int64 tile is stored
// straight from the fragments, eight lanes filling 64 contiguous bytes.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <cuda_fp16.h>

#include "check.cuh"
#include "launch.cuh"
#include "long_rows.cuh"
#include "mma.cuh"
#include "sddmm_mma.cuh"

namespace magicube_sddmm {

enum Mode : int { kInt8 = 0, kInt4 = 1, kInt16 = 2, kHalf = 3 };

// LB: bytes a lane loads per row per chunk; CK: k elements per chunk; KC:
// chunks per k step, the unit that is prefetched a block ahead (float16 takes
// two so that K = 64 is one step, like the 8-bit modes).
template <int MODE>
struct Traits;
template <>
struct Traits<kInt8> {
  static constexpr int LB = 16, CK = 64, KC = 1;
};
template <>
struct Traits<kInt4> {
  static constexpr int LB = 8, CK = 64, KC = 1;
};
template <>
struct Traits<kInt16> {
  static constexpr int LB = 32, CK = 64, KC = 1;
};
template <>
struct Traits<kHalf> {
  static constexpr int LB = 16, CK = 32, KC = 2;
};

// Bytes of a row that one k step covers.
constexpr int step_bytes(int mode) {
  return mode == kInt8    ? Traits<kInt8>::KC * 4 * Traits<kInt8>::LB
         : mode == kInt4  ? Traits<kInt4>::KC * 4 * Traits<kInt4>::LB
         : mode == kInt16 ? Traits<kInt16>::KC * 4 * Traits<kInt16>::LB
                          : Traits<kHalf>::KC * 4 * Traits<kHalf>::LB;
}

constexpr int kWarps = 8;
constexpr int kStride = 32;
// Load unit of 16-byte aligned rows of exactly one k step (K = 64 in every
// mode): no bound checks, no zero fill, and the operand row is held for the
// whole vector row.
constexpr int kWholeSteps = 32;

// Operand words of one row for one chunk: 4 words feed two consecutive MMAs
// (words 0, 1 the first, 2, 3 the second). The 16-bit mode has two planes.
template <int MODE>
struct Operand {
  uint32_t w[4];
  uint32_t lo[MODE == kInt16 ? 4 : 1];
};

template <int MODE>
__device__ __forceinline__ void to_operand(Operand<MODE>& op,
                                           const uint32_t (&raw)[Traits<MODE>::LB / 4]) {
  if constexpr (MODE == kInt4) {
    // 16 x nibble in each byte: three instructions a word against sign extension's nine (SASS).
    // Both operands alike, so the k order it makes cancels in the dot product; the products come
    // out 256 times too large, undone by an exact shift (kProductShift).
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      op.w[2 * j] = magicube::low_nibbles_x16(raw[j]);
      op.w[2 * j + 1] = magicube::high_nibbles_x16(raw[j]);
    }
  } else if constexpr (MODE == kInt16) {
#pragma unroll
    for (int j = 0; j < 4; ++j) split_planes(raw[2 * j], raw[2 * j + 1], op.w[j], op.lo[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) op.w[j] = raw[j];
  }
}

// 4-bit operands are widened to 16 x value (to_operand), so their int32 products carry 2^8.
template <int MODE>
constexpr int kProductShift = MODE == kInt4 ? 8 : 0;

template <int MODE>
struct Acc {
  using T = typename std::conditional<MODE == kHalf, float, int>::type;
  T d[4];
  int x[MODE == kInt16 ? 4 : 1];   // hi x lo + lo x hi, weight 2^8
  int ll[MODE == kInt16 ? 4 : 1];  // lo x lo, weight 1
};

// One block's B rows of one k step as they arrive, raw: chunk u, row q (slot
// 8q + g), plus what the block's epilogue needs. Held in registers, two of
// them per warp, so the next block's loads never wait on this block's MMAs.
// Columns stay with the lane that owns the slot (lane = slot) and reach the
// lanes that gather them by shuffles, which costs fewer registers.
template <int MODE>
struct Gather {
  uint32_t raw[Traits<MODE>::KC][4][Traits<MODE>::LB / 4];
  int own;         // the lane's own slot's column; 0 for padding, whose rows are
                   // read (row 0 exists) and multiplied but never stored
  uint32_t kept;   // bit s: slot s is not padding
  int ahead;       // the lane's own slot's column (raw) two blocks further on
  float sb;        // scale_b of the lane's own slot
};

// 16-byte chunk (row r, slots 8q..8q+7) of a float16 tile: the XOR spreads the
// eight rows of each stmatrix matrix over all 32 banks.
__device__ __forceinline__ int tile_chunk(int r, int q) { return 4 * r + (q ^ ((r >> 1) & 3)); }

// CTAs an SM, as registers allow: more warps keep more gathers in flight. 4-bit
// operands of one k step a row fit 64 registers (four CTAs, 32 warps an SM: 4 %
// faster than three on the target, H200); other 4- and 8-bit rows fit 80 (three;
// at 64 they spill, and 8-bit runs 15 % slower); the 16-bit planes and the
// float16 two-chunk step need up to 128 (two).
constexpr int ctas_per_sm(int mode, int al) {
  return mode == kInt4 && al == kWholeSteps ? 4 : mode == kInt8 || mode == kInt4 ? 3 : 2;
}

// Grid (long_rows + ceil(M/V / 8), BH). CTA x < long_rows takes the vector row
// at position x of row_order if it keeps more than long_count vectors, its
// blocks in 8 runs, one a warp; past those, warp w of CTA x owns the row at
// position 8 (x - long_rows) + w, unless it is one of the former.
template <int MODE, int AL, typename OutT>
__global__ void __launch_bounds__(kWarps * 32, ctas_per_sm(MODE, AL))
    sddmm_kernel(const int* __restrict__ row_ptr, const int* __restrict__ col_idx,
                 const int* __restrict__ row_order, int long_rows, int long_count, int num_vrows, int num_blocks,
                 int64_t nnz_pad, const uint8_t* __restrict__ a, const uint8_t* __restrict__ b,
                 const float* __restrict__ scale_a, const float* __restrict__ scale_b,
                 OutT* __restrict__ out, int m, int n, int k, int row_bytes_arg, int v) {
  constexpr int S = kStride;
  constexpr int LB = Traits<MODE>::LB;
  constexpr int CK = Traits<MODE>::CK;
  constexpr int KC = Traits<MODE>::KC;
  constexpr bool kHalfOut = std::is_same<OutT, __half>::value;
  constexpr bool kScaled = MODE != kHalf && kHalfOut;
  const int row_bytes = AL == kWholeSteps ? step_bytes(MODE) : row_bytes_arg;
  magicube::await_inputs();
  // Two tiles a warp, alternating by block: one __syncwarp a block then
  // orders each tile's reads before its next writes.
  __shared__ __align__(16) uint8_t smem[kHalfOut ? kWarps : 1][2][8 * S * 2];

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const bool split = static_cast<int>(blockIdx.x) < long_rows;
  const int order_pos = split ? blockIdx.x : (blockIdx.x - long_rows) * kWarps + warp;
  if (order_pos >= num_vrows) return;
  const int vrow = min(max(__ldg(row_order + order_pos), 0), num_vrows - 1);
  const int start = __ldg(row_ptr + 2 * vrow);
  const int end = __ldg(row_ptr + 2 * vrow + 1);
  if (order_pos < long_rows && (end - start > long_count) != split) return;  // the other layout's row
  // The row's blocks [start / S, + ceil(count / S)), clipped to the values.
  const int64_t first = start / S;
  const int64_t last = first + (static_cast<int64_t>(end) - start + S - 1) / S;
  int lo = static_cast<int>(first < 0 ? 0 : first > num_blocks ? num_blocks : first);
  int hi = static_cast<int>(last < lo ? lo : last > num_blocks ? num_blocks : last);
  if (split) {  // this warp's run of the row's blocks
    const int len = (hi - lo + kWarps - 1) / kWarps;
    lo = min(hi, lo + warp * len);
    hi = min(hi, lo + len);
  }
  if (lo >= hi) return;

  const int64_t bh = blockIdx.y;
  const int g = lane >> 2;
  const int t = lane & 3;
  const uint8_t* b_lane = b + bh * n * row_bytes + t * LB;
  const float* sb_bh = kScaled ? scale_b + bh * n : scale_b;
  const int* col_lane = col_idx + lane;

  const bool a_valid = g < v;
  const int64_t arow0 = bh * m + static_cast<int64_t>(vrow) * v;
  const uint8_t* arow = a + (arow0 + (a_valid ? g : 0)) * row_bytes;
  const int arow_bytes = a_valid ? row_bytes : 0;
  float sa[2] = {0.f, 0.f};
  if constexpr (kScaled) {
#pragma unroll
    for (int jj = 0; jj < 2; ++jj)
      if (2 * t + jj < v) sa[jj] = __ldg(scale_a + arow0 + 2 * t + jj);
  }

  const int num_chunks = max((k + CK - 1) / CK, 1);
  const int num_steps = AL == kWholeSteps ? 1 : (num_chunks + KC - 1) / KC;
  auto chunk_off = [&](int step, int u) { return (step * KC + u) * 4 * LB + t * LB; };

  Operand<MODE> ao[KC];
  auto load_a = [&](int step) {
#pragma unroll
    for (int u = 0; u < KC; ++u) {
      uint32_t raw[LB / 4];
      load_row_bytes<LB, AL == kWholeSteps ? 16 : AL>(raw, arow, chunk_off(step, u), arow_bytes);
      to_operand<MODE>(ao[u], raw);
    }
  };

  auto load_b = [&](Gather<MODE>& gb, int step) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t c = __shfl_sync(0xffffffffu, gb.own, 8 * q + g);
      const uint8_t* row = b_lane + static_cast<uint64_t>(c) * static_cast<uint32_t>(row_bytes);
#pragma unroll
      for (int u = 0; u < KC; ++u) {
        if constexpr (AL == kWholeSteps) {
          load_full<LB>(gb.raw[u][q], row + chunk_off(step, u) - t * LB);
        } else {
          load_row_bytes<LB, AL>(gb.raw[u][q], row - t * LB, chunk_off(step, u), row_bytes);
        }
      }
    }
  };

  // The block's columns were fetched two blocks ago: its scales and first B
  // step go out at once, and the columns two blocks on are fetched.
  auto start_block = [&](Gather<MODE>& gb, int blk) {
    const int own = gb.ahead;
    if (blk + 2 < hi) gb.ahead = __ldg(col_lane + static_cast<int64_t>(blk + 2) * S);
    const bool ok = own >= 0 && own < n;
    gb.own = ok ? own : 0;
    gb.kept = __ballot_sync(0xffffffffu, ok);
    gb.sb = 0.f;
    if constexpr (kScaled) {
      if (ok) gb.sb = __ldg(sb_bh + static_cast<uint32_t>(own));
    }
    load_b(gb, 0);
  };

  auto multiply = [&](const Gather<MODE>& gb, Acc<MODE> (&acc)[2], int step) {
#pragma unroll
    for (int u = 0; u < KC; ++u) {
      // A chunk past K would only add zero products (and turn a -0 sum into +0).
      if (AL != kWholeSteps && u > 0 && step * KC + u >= num_chunks) break;
      Operand<MODE> go[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) to_operand<MODE>(go[q], gb.raw[u][q]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const Operand<MODE>& g0 = go[2 * h];
        const Operand<MODE>& g1 = go[2 * h + 1];
        const Operand<MODE>& ar = ao[u];
        Acc<MODE>& ac = acc[h];
#pragma unroll
        for (int s2 = 0; s2 < 2; ++s2) {
          const int w0 = 2 * s2, w1 = 2 * s2 + 1;
          if constexpr (MODE == kHalf) {
            mma_f16(ac.d, g0.w[w0], g1.w[w0], g0.w[w1], g1.w[w1], ar.w[w0], ar.w[w1]);
          } else if constexpr (MODE == kInt16) {
            mma_s8s8(ac.d, g0.w[w0], g1.w[w0], g0.w[w1], g1.w[w1], ar.w[w0], ar.w[w1]);
            mma_s8u8(ac.x, g0.w[w0], g1.w[w0], g0.w[w1], g1.w[w1], ar.lo[w0], ar.lo[w1]);
            mma_u8s8(ac.x, g0.lo[w0], g1.lo[w0], g0.lo[w1], g1.lo[w1], ar.w[w0], ar.w[w1]);
            mma_u8u8(ac.ll, g0.lo[w0], g1.lo[w0], g0.lo[w1], g1.lo[w1], ar.lo[w0], ar.lo[w1]);
          } else {
            mma_s8s8(ac.d, g0.w[w0], g1.w[w0], g0.w[w1], g1.w[w1], ar.w[w0], ar.w[w1]);
          }
        }
      }
    }
  };

  // The exact integer result of fragment element j of tile h.
  auto exact = [&](const Acc<MODE>& ac, int j) -> int64_t {
    int64_t qv = ac.d[j];
    if constexpr (MODE == kInt16) {
      qv = qv * 65536 + static_cast<int64_t>(ac.x[j]) * 256 + ac.ll[j];
    }
    return qv >> kProductShift<MODE>;
  };

  // Fragment element j of tile h: slot 16h + g + 8(j / 2) (row q = 2h + j / 2
  // of the gather), output row 2t + j % 2.
  OutT* const out_bh = out + bh * nnz_pad * v;
  const uint32_t tile_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem[kHalfOut ? warp : 0]));
  auto finish_block = [&](const Gather<MODE>& gb, const Acc<MODE> (&acc)[2], int blk, int tile) {
    OutT* dst = out_bh + static_cast<int64_t>(blk) * (S * v);
    const uint32_t kept = gb.kept >> g;
    if constexpr (kHalfOut) {
      float sb[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) sb[q] = kScaled ? __shfl_sync(0xffffffffu, gb.sb, 8 * q + g) : 0.f;
      uint32_t packed[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int h = q >> 1, e = q & 1;
        float f[2];
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int j = 2 * e + jj;
          if constexpr (MODE == kHalf) {
            f[jj] = acc[h].d[j];
          } else if constexpr (MODE == kInt16) {
            f[jj] = __ll2float_rn(exact(acc[h], j)) * (sa[jj] * sb[q]);
          } else {
            // An int32 accumulator rounds to fp32 the same through the cheaper
            // 32-bit conversion.
            f[jj] = __int2float_rn(acc[h].d[j] >> kProductShift<MODE>) * (sa[jj] * sb[q]);
          }
        }
        const __half2 hv = __floats2half2_rn(f[0], f[1]);
        packed[q] = (kept >> (8 * q)) & 1u ? *reinterpret_cast<const uint32_t*>(&hv) : 0u;
      }
      const uint32_t buf = tile_base + tile * (8 * S * 2);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      stmatrix_x4_trans(buf + 16 * tile_chunk(lane & 7, lane >> 3), packed[0], packed[1], packed[2], packed[3]);
#else
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const uint16_t hv = static_cast<uint16_t>(packed[q] >> (16 * jj));
          asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(buf + 16 * tile_chunk(2 * t + jj, q) + 2 * g), "h"(hv)
                       : "memory");
        }
      }
#endif
      __syncwarp();
      // Chunk o of the block is row o / 4, slots 8 (o % 4)..: V rows of 64 bytes.
      if (lane < 4 * v) {
        uint4 val;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                     : "r"(buf + 16 * tile_chunk(lane >> 2, lane & 3))
                     : "memory");
        reinterpret_cast<uint4*>(dst)[lane] = val;
      }
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int r = 2 * t + jj;
          if (r < v) dst[r * S + 8 * q + g] = (kept >> (8 * q)) & 1u ? exact(acc[q >> 1], 2 * (q & 1) + jj) : 0;
        }
      }
    }
  };

  auto process = [&](Gather<MODE>& cur, Gather<MODE>& next, int blk, int tile) {
    if (blk + 1 < hi) start_block(next, blk + 1);
    Acc<MODE> acc[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[h].d[j] = 0;
        if constexpr (MODE == kInt16) {
          acc[h].x[j] = 0;
          acc[h].ll[j] = 0;
        }
      }
    }
    for (int step = 0; step < num_steps; ++step) {
      if (step > 0) load_b(cur, step);
      if (num_steps > 1) load_a(step);
      multiply(cur, acc, step);
    }
    finish_block(cur, acc, blk, tile);
  };

  if (num_steps == 1) load_a(0);
  Gather<MODE> gather[2];
  gather[0].ahead = __ldg(col_lane + static_cast<int64_t>(lo) * S);
  gather[1].ahead = lo + 1 < hi ? __ldg(col_lane + static_cast<int64_t>(lo + 1) * S) : -1;
  start_block(gather[0], lo);
  for (int blk = lo; blk < hi; blk += 2) {
    process(gather[0], gather[1], blk, 0);
    if (blk + 1 >= hi) break;
    process(gather[1], gather[0], blk + 1, 1);
  }
}

template <int MODE, int AL, typename OutT>
void launch(const at::Tensor& row_ptr, const at::Tensor& col_idx, const at::Tensor& row_order,
            int64_t long_rows, int64_t long_count, int64_t num_vrows, int64_t nnz_pad, int64_t bh,
            const at::Tensor& a, const at::Tensor& b, const float* sa, const float* sb, at::Tensor& out,
            int64_t m, int64_t n, int64_t k, int64_t row_bytes, int64_t v) {
  const dim3 grid(static_cast<unsigned>(long_rows + (num_vrows + kWarps - 1) / kWarps), static_cast<unsigned>(bh));
  magicube::launch_overlapped(
      sddmm_kernel<MODE, AL, OutT>, grid, dim3(kWarps * 32), 0, at::cuda::getCurrentCUDAStream(),
      row_ptr.data_ptr<int>(), col_idx.data_ptr<int>(), row_order.data_ptr<int>(), static_cast<int>(long_rows),
      static_cast<int>(std::min<int64_t>(long_count, INT32_MAX)), static_cast<int>(num_vrows),
      static_cast<int>(nnz_pad / kStride), nnz_pad,
      static_cast<const uint8_t*>(a.data_ptr()), static_cast<const uint8_t*>(b.data_ptr()), sa, sb,
      static_cast<OutT*>(out.data_ptr()), static_cast<int>(m), static_cast<int>(n),
      static_cast<int>(k), static_cast<int>(row_bytes), static_cast<int>(v));
}

// The widest unit (16, 4, 2 or 1 bytes) that divides every row's address,
// kWholeSteps where 16 does and a row is one k step of `mode`.
int64_t load_unit(int mode, int64_t row_bytes, const at::Tensor& a, const at::Tensor& b) {
  const auto pa = reinterpret_cast<uintptr_t>(a.data_ptr());
  const auto pb = reinterpret_cast<uintptr_t>(b.data_ptr());
  for (int64_t u : {16, 4, 2}) {
    if (row_bytes % u == 0 && pa % u == 0 && pb % u == 0) {
      return u == 16 && row_bytes == step_bytes(mode) ? kWholeSteps : u;
    }
  }
  return 1;
}

template <int MODE, typename OutT>
void dispatch_unit(int64_t unit, const at::Tensor& row_ptr, const at::Tensor& col_idx,
                   const at::Tensor& row_order, int64_t long_rows, int64_t long_count,
                   int64_t num_vrows, int64_t nnz_pad, int64_t bh, const at::Tensor& a,
                   const at::Tensor& b, const float* sa, const float* sb, at::Tensor& out,
                   int64_t m, int64_t n, int64_t k, int64_t row_bytes, int64_t v) {
#define MAGICUBE_SDDMM_LAUNCH(U)                                                                  \
  launch<MODE, U, OutT>(row_ptr, col_idx, row_order, long_rows, long_count, num_vrows, nnz_pad, bh, a, b, sa, \
                        sb, out, m, n, k, row_bytes, v)
  switch (unit) {
    case kWholeSteps: MAGICUBE_SDDMM_LAUNCH(kWholeSteps); break;
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
                      at::ScalarType out_dtype, int64_t longest_row) {
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
  // int32 accumulators: per plane product |term| <= 2^15 (s8 x s8, and 4-bit operands widened to
  // 16 x value), 2^16 (u8 x u8) or 2^16 for the two summed cross planes, so K is bounded for the
  // sum to fit.
  const int64_t k_max = mode == kInt16 ? 32768 : mode == kHalf ? INT32_MAX / 64 : 131071;
  MAGICUBE_CHECK(k <= k_max, "sddmm: K = ", k, " exceeds the exact int32 accumulation limit ", k_max);
  MAGICUBE_CHECK(n < INT32_MAX && m < INT32_MAX && bh <= 65535, "sddmm: a or b is too large");

  constexpr int64_t S = kStride;
  const int64_t nnz_pad = col_idx.numel();
  MAGICUBE_CHECK(nnz_pad % S == 0, "sddmm: col_idx length (", nnz_pad,
              ") must be a multiple of the stride ", S);
  MAGICUBE_CHECK(nnz_pad / S < INT32_MAX, "sddmm: col_idx is too long");
  magicube::check_longest_row("sddmm", longest_row);

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
  // No vector row owns a block, or no column is in range: every slot is padding.
  if (num_vrows == 0 || n == 0) return out.zero_();

  // Long rows (long_rows.cuh) get a CTA each (the kernel's comment).
  const magicube::LongRows lr = magicube::long_rows(nnz_pad, num_vrows, longest_row, S);
  const int64_t unit = load_unit(mode, row_bytes, a, b);
#define MAGICUBE_SDDMM_DISPATCH(MODE, OUT)                                                       \
  dispatch_unit<MODE, OUT>(unit, row_ptr, col_idx, row_order, lr.candidates, lr.slots, num_vrows, nnz_pad, bh, a, b, \
                           sa, sb, out, m, n, k, row_bytes, v)
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
      "Tensor? scale_a, Tensor? scale_b, int v, int bits, ScalarType out_dtype, int longest_row=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(magicube_cuda, CUDA, m) { m.impl("sddmm", &magicube_sddmm::sddmm_cuda); }
