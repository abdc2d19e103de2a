// Warp-level building blocks of the SDDMM kernels: mma.sync wrappers, operand
// loads with a K tail, int4 / int16 unpacking into 8-bit MMA operands.
//
// The SDDMM computes each output tile transposed: the 32 gathered rows of B
// (one stride block of kept columns) fill the MMA's M = 16 dimension (two
// tiles) and the V rows of A fill N = 8, so V = 8 uses the whole instruction.
// Both operands are K-contiguous, which is the layout mma.sync wants for A
// (row) and B (col). The order of k inside one instruction does not change a
// sum, so a thread may feed any k it likes as long as the other operand's
// matching register holds the same k: every thread therefore loads one
// contiguous 16-element run per row and splits it across consecutive MMAs.
#pragma once

#include <cstdint>
#include <cuda_fp16.h>

namespace magicube_sddmm {

// D += A (16x32, s8/u8) * B (32x8, s8/u8), int32 accumulate.
#define MAGICUBE_SDDMM_MMA_I8(NAME, AT, BT)                                              \
  __device__ __forceinline__ void NAME(int (&d)[4], uint32_t a0, uint32_t a1,            \
                                       uint32_t a2, uint32_t a3, uint32_t b0,            \
                                       uint32_t b1) {                                    \
    asm volatile(                                                                        \
        "mma.sync.aligned.m16n8k32.row.col.s32." AT "." BT ".s32 "                       \
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                        \
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])                                 \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                         \
  }
MAGICUBE_SDDMM_MMA_I8(mma_s8s8, "s8", "s8")
MAGICUBE_SDDMM_MMA_I8(mma_s8u8, "s8", "u8")
MAGICUBE_SDDMM_MMA_I8(mma_u8s8, "u8", "s8")
MAGICUBE_SDDMM_MMA_I8(mma_u8u8, "u8", "u8")
#undef MAGICUBE_SDDMM_MMA_I8

// D += A (16x16 f16) * B (16x8 f16), fp32 accumulate.
__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Loads LB bytes at byte offset `off` (a multiple of LB) of a row of
// `row_bytes` bytes, in units of min(AL, LB) bytes (AL divides row_bytes and
// the row's address), zero past the end.
template <int LB, int AL>
__device__ __forceinline__ void load_row_bytes(uint32_t (&dst)[LB / 4], const uint8_t* row,
                                               int off, int row_bytes) {
  static_assert(LB % 4 == 0 && (AL != 16 || LB == 8 || LB % 16 == 0) && (AL == 1 || AL == 2 || AL == 4 || AL == 16),
                "bad load shape");
  if constexpr (AL == 16 && LB == 8) {
    uint2 v = make_uint2(0, 0);
    if (off + 8 <= row_bytes) v = *reinterpret_cast<const uint2*>(row + off);
    dst[0] = v.x;
    dst[1] = v.y;
  } else if constexpr (AL == 16) {
#pragma unroll
    for (int u = 0; u < LB / 16; ++u) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (off + 16 * u + 16 <= row_bytes) v = *reinterpret_cast<const uint4*>(row + off + 16 * u);
      dst[4 * u + 0] = v.x;
      dst[4 * u + 1] = v.y;
      dst[4 * u + 2] = v.z;
      dst[4 * u + 3] = v.w;
    }
  } else if constexpr (AL == 4) {
#pragma unroll
    for (int u = 0; u < LB / 4; ++u) {
      dst[u] = (off + 4 * u + 4 <= row_bytes)
                   ? *reinterpret_cast<const uint32_t*>(row + off + 4 * u)
                   : 0u;
    }
  } else if constexpr (AL == 2) {
#pragma unroll
    for (int u = 0; u < LB / 4; ++u) {
      uint32_t w = 0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int o = off + 4 * u + 2 * h;
        if (o + 2 <= row_bytes)
          w |= uint32_t(*reinterpret_cast<const uint16_t*>(row + o)) << (16 * h);
      }
      dst[u] = w;
    }
  } else {
#pragma unroll
    for (int u = 0; u < LB / 4; ++u) {
      uint32_t w = 0;
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const int o = off + 4 * u + h;
        if (o < row_bytes) w |= uint32_t(row[o]) << (8 * h);
      }
      dst[u] = w;
    }
  }
}

// Loads LB bytes at `p` (aligned to min(LB, 16)) with no bound: for rows
// whose every k step lies inside the row.
template <int LB>
__device__ __forceinline__ void load_full(uint32_t (&dst)[LB / 4], const uint8_t* p) {
  static_assert(LB == 8 || LB % 16 == 0, "bad load shape");
  if constexpr (LB == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    dst[0] = v.x;
    dst[1] = v.y;
  } else {
#pragma unroll
    for (int u = 0; u < LB / 16; ++u) {
      const uint4 v = *reinterpret_cast<const uint4*>(p + 16 * u);
      dst[4 * u + 0] = v.x;
      dst[4 * u + 1] = v.y;
      dst[4 * u + 2] = v.z;
      dst[4 * u + 3] = v.w;
    }
  }
}

// Four 8x8 b16 matrices, each held as an mma fragment (lane: row lane / 4, the
// b16 pair of columns 2 (lane % 4), + 1), stored transposed: lane L names the
// address of row L % 8 of matrix L / 8 of the transpose.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#endif
}

// Two words of int16 pairs -> the high bytes (signed plane, x >> 8) and the
// low bytes (unsigned plane, x & 0xFF) of the four elements.
__device__ __forceinline__ void split_planes(uint32_t x0, uint32_t x1, uint32_t& hi,
                                             uint32_t& lo) {
  hi = __byte_perm(x0, x1, 0x7531);
  lo = __byte_perm(x0, x1, 0x6420);
}

}  // namespace magicube_sddmm
