// The dense path of magicube_cuda::spmm: the sparse operand expanded to dense int8 and multiplied
// by cuBLAS's int8 GEMM (csrc/spmm.cu: run_dense).
//
// The SR-BCRS kernels gather, for every kept vector, its own row of B from L2: at low V and low
// sparsity each row of B is read many times over (V 2, sparsity 0.7, M = K = 4096, N 256: 644 MB
// of gathers for a 1 MB B), while a dense GEMM reads B once per tile of output rows. There the
// exact integer product is cheaper as a dense one: A and B are split into int8 planes, the planes
// multiplied in one GEMM (A's planes stacked along M, B's along N, each product < 2^31 in int32),
// and the plane products recombined in int64 and dequantized with the gather kernel's rounding.
//
// Planes are balanced base-256 digits, x = sum_q d_q * 256^q with every d_q in [-128, 127], since
// the int8 GEMM multiplies signed bytes only: one plane for signed 4- and 8-bit values and
// unsigned 4-bit ones, two for unsigned 8-bit and signed 12-bit, three for 16-bit (the second
// digit of 32767 is 128, which takes a third).
#pragma once

#include <cstdint>
#include <cuda_fp16.h>
#include <type_traits>

namespace magicube {
namespace spmm_dense {

constexpr int kAlign = 16;               // rows and columns of the GEMM's operands are padded to this
constexpr int kExpandThreads = 256;
constexpr int kStripBytes = 48 << 10;    // one CTA's dense strip of A (planes x V rows x columns)

// Digit q of x (see the file comment).
__device__ __forceinline__ int8_t digit(int x, int q) {
  for (int i = 0; i < q; ++i) x = (x - (((x + 128) & 255) - 128)) >> 8;
  return static_cast<int8_t>(((x + 128) & 255) - 128);
}

// Element e of a container of `bits`-wide values (4-bit ones two to a byte, low nibble first;
// unsigned 16-bit ones stored as their int16 bit pattern).
template <int BITS, bool SIGNED>
__device__ __forceinline__ int element(const uint8_t* base, int64_t e) {
  if constexpr (BITS == 4) {
    const int nibble = (base[e >> 1] >> (4 * (e & 1))) & 0xF;
    return SIGNED ? nibble - ((nibble & 8) << 1) : nibble;
  } else if constexpr (BITS == 8) {
    return SIGNED ? static_cast<int>(reinterpret_cast<const int8_t*>(base)[e]) : static_cast<int>(base[e]);
  } else {
    const int16_t x = reinterpret_cast<const int16_t*>(base)[e];
    return SIGNED ? static_cast<int>(x) : static_cast<int>(static_cast<uint16_t>(x));
  }
}

// Four consecutive values of a container from element e (a multiple of 4) on, as one load, and
// value j of them.
template <int BITS>
struct Quad {
  using Word = std::conditional_t<BITS == 16, uint2, uint32_t>;
  __device__ static __forceinline__ Word load(const uint8_t* base, int64_t e) {
    if constexpr (BITS == 4) return *reinterpret_cast<const uint16_t*>(base + (e >> 1));
    else if constexpr (BITS == 8) return *reinterpret_cast<const uint32_t*>(base + e);
    else return *reinterpret_cast<const uint2*>(base + 2 * e);
  }
  template <bool SIGNED>
  __device__ static __forceinline__ int value(Word w, int j) {
    if constexpr (BITS == 16) {
      const int x = ((j < 2 ? w.x : w.y) >> (16 * (j & 1))) & 0xFFFF;
      return SIGNED ? x - ((x & 0x8000) << 1) : x;
    } else {
      const int x = (w >> (BITS * j)) & ((1 << BITS) - 1);
      return SIGNED ? x - ((x & (1 << (BITS - 1))) << 1) : x;
    }
  }
};

struct ExpandParams {
  // A: vector rows x strips of strip_cols columns (a multiple of kAlign) per batch x head.
  const int* row_ptr;
  const int* col_idx;
  const uint8_t* a;      // [BH, nnz_pad * V] containers
  int64_t a_bh_bytes;
  int8_t* a_out;         // [BH, a_planes * m_pad, k_pad]
  int vrows, m_pad, k_pad, v, a_planes, strip_cols;
  // B: 64 x 64 tiles.
  const uint8_t* b;      // [BH, K, row_bytes]
  int64_t b_bh_bytes;
  int row_bytes;
  int8_t* b_out;         // [BH, b_planes * n_pad, k_pad]: B transposed, K contiguous, zeros past N and K
  int k, n, n_pad, b_planes, n_tiles, b_tiles;
};

constexpr int kBTile = 64;
constexpr int kBTileBytes = kBTile * (kBTile + 1) * 4;

// The V rows of every plane of one vector row x strip of A, for one batch x head: built in shared
// memory (zeros, then the kept values scattered by column) and written out with 16-byte stores, so
// the global writes are whole lines however sparse the row. Slots are read in storage order (no
// ascending columns assumed); a row wider than the strip is read once per strip. A thread takes
// four consecutive slots of one row of a 32-slot block (their values are adjacent, as are their
// columns), kUnroll such quads with all their loads issued before any store: the loads' latency,
// not the scatter, bounds this part.
template <int AB, bool AS>
__device__ __forceinline__ void densify_strip(const ExpandParams& p, int8_t* strip, int vrow, int bh) {
  constexpr int kUnroll = 4;
  using Q = Quad<AB>;
  const int c0 = blockIdx.y * p.strip_cols;
  const int cols = min(p.strip_cols, p.k_pad - c0);
  const int rows = p.a_planes * p.v;
  int4* strip16 = reinterpret_cast<int4*>(strip);
  for (int i = threadIdx.x; i < rows * p.strip_cols / 16; i += kExpandThreads) strip16[i] = make_int4(0, 0, 0, 0);

  // Block b of the row holds V x 32 values row-major, so quad item = (b * V + i) * 8 + j covers
  // slots 32 b + 4 j .. + 3 of row i, values (b * V + i) * 32 + 4 j on.
  const uint8_t* a = p.a + bh * p.a_bh_bytes;
  const int start = p.row_ptr[2 * vrow];
  const int items = (p.row_ptr[2 * vrow + 1] - start + 31) / 32 * p.v * 8;
  const int v_shift = __ffs(p.v) - 1;
  __syncthreads();
  for (int base = 0; base < items; base += kUnroll * kExpandThreads) {
    int4 col[kUnroll];
    typename Q::Word x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int item = base + u * kExpandThreads + threadIdx.x;
      col[u] = make_int4(-1, -1, -1, -1);
      if (item < items) {
        col[u] = *reinterpret_cast<const int4*>(p.col_idx + start + 32 * ((item >> 3) >> v_shift) + 4 * (item & 7));
        x[u] = Q::load(a, static_cast<int64_t>(start) * p.v + 4 * item);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int item = base + u * kExpandThreads + threadIdx.x;
      if (item >= items) break;
      const int row = (item >> 3) & (p.v - 1);
      const int c[4] = {col[u].x - c0, col[u].y - c0, col[u].z - c0, col[u].w - c0};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (c[j] >= 0 && c[j] < cols) {
          const int value = Q::template value<AS>(x[u], j);
          for (int q = 0; q < p.a_planes; ++q) strip[(q * p.v + row) * p.strip_cols + c[j]] = digit(value, q);
        }
    }
  }
  __syncthreads();

  // Short as it is, this kernel is bound by instruction issue (at M = K = 4096 and 2 or 3 CTAs of
  // work per SM): the loops here keep their index arithmetic out of the per-chunk path.
  for (int q = 0; q < p.a_planes; ++q)
    for (int i = 0; i < p.v; ++i) {
      const int8_t* src = strip + (q * p.v + i) * p.strip_cols;
      int8_t* dst = p.a_out + ((static_cast<int64_t>(bh) * p.a_planes + q) * p.m_pad +
                               static_cast<int64_t>(vrow) * p.v + i) * p.k_pad + c0;
      for (int c = 16 * threadIdx.x; c < cols; c += 16 * kExpandThreads)
        *reinterpret_cast<int4*>(dst + c) = *reinterpret_cast<const int4*>(src + c);
    }
}

// B's planes for one 64 x 64 tile, transposed through shared memory (the int8 GEMM takes its
// second operand with K contiguous): each thread issues its 16 loads at once, then writes 16 bytes
// of K per plane.
template <int BB>
__device__ __forceinline__ void b_planes_tile(const ExpandParams& p, int (*tile)[kBTile + 1], int t, int bh) {
  const int n0 = (t % p.n_tiles) * kBTile, k0 = (t / p.n_tiles) * kBTile;
  const uint8_t* b = p.b + bh * p.b_bh_bytes;
  const int tn = threadIdx.x & 63, tk = threadIdx.x >> 6;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int k = k0 + tk + 4 * j, n = n0 + tn;
    tile[tk + 4 * j][tn] = k < p.k && n < p.n ? element<BB, true>(b + static_cast<int64_t>(k) * p.row_bytes, n) : 0;
  }
  __syncthreads();
  const int n = n0 + (threadIdx.x >> 2), kq = 16 * (threadIdx.x & 3);
  if (n >= p.n_pad || k0 + kq >= p.k_pad) return;
  for (int q = 0; q < p.b_planes; ++q) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[j] |= static_cast<uint32_t>(static_cast<uint8_t>(digit(tile[kq + 4 * j + i][n - n0], q))) << (8 * i);
    }
    *reinterpret_cast<int4*>(p.b_out + ((static_cast<int64_t>(bh) * p.b_planes + q) * p.n_pad + n) * p.k_pad + k0 +
                             kq) = make_int4(w[0], w[1], w[2], w[3]);
  }
}

// Both operands' planes in one launch (a launch on its own costs about as much as this work at
// M = K = 1024): the first b_tiles CTAs of strip 0 take B's tiles, the others A's strips.
template <int AB, bool AS, int BB>
__global__ void __launch_bounds__(kExpandThreads) expand_kernel(const ExpandParams p) {
  extern __shared__ int4 smem16[];
  const int bh = blockIdx.z, b_tiles = blockIdx.y == 0 ? p.b_tiles : 0;
  if (static_cast<int>(blockIdx.x) < b_tiles) {
    b_planes_tile<BB>(p, reinterpret_cast<int (*)[kBTile + 1]>(smem16), blockIdx.x, bh);
  } else if (static_cast<int>(blockIdx.x) - b_tiles < p.vrows) {
    densify_strip<AB, AS>(p, reinterpret_cast<int8_t*>(smem16), blockIdx.x - b_tiles, bh);
  }
}

struct CombineParams {
  const int* c;          // [BH, a_planes * m_pad, b_planes * n_pad]: the GEMM of the planes
  void* out;             // [BH, M, N]: int64, or fp16
  const float* scale_a;  // [BH, M] or null
  const float* scale_b;  // [BH, N] or null
  int m, n, m_pad, n_pad, a_planes, b_planes;
  bool out_int64;
};

// One CTA per output row: out = sum over plane pairs of 256^(qa + qb) * C[qa, qb], in int64 (the
// sum may pass 2^63 on the way, but the result fits: it is taken modulo 2^64 in unsigned
// arithmetic), then stored as int64 or as fp16(float(acc) * (scale_a * scale_b)), the gather
// kernel's rounding. kCols columns a thread, their loads issued together.
constexpr int kCombineThreads = 64;
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const CombineParams p) {
  constexpr int kCols = 4;
  const int row = blockIdx.x;  // bh * M + r, below 2^31 (the host checks)
  const int bh = row / p.m, r = row - bh * p.m;
  const int64_t ld = static_cast<int64_t>(p.b_planes) * p.n_pad;
  const int* c = p.c + (static_cast<int64_t>(bh) * p.a_planes * p.m_pad + r) * ld;
  const float sa = p.out_int64 ? 0.f : p.scale_a[row];
  for (int base = 0; base < p.n; base += kCols * kCombineThreads) {
    uint64_t acc[kCols] = {};
    float sb[kCols] = {};
    for (int qa = 0; qa < p.a_planes; ++qa)
      for (int qb = 0; qb < p.b_planes; ++qb) {
        const int* plane = c + qa * p.m_pad * ld + qb * p.n_pad;
#pragma unroll
        for (int u = 0; u < kCols; ++u) {
          const int col = base + u * kCombineThreads + threadIdx.x;
          if (col < p.n) acc[u] += static_cast<uint64_t>(static_cast<int64_t>(plane[col])) << (8 * (qa + qb));
        }
      }
#pragma unroll
    for (int u = 0; u < kCols; ++u) {
      const int col = base + u * kCombineThreads + threadIdx.x;
      if (!p.out_int64 && col < p.n) sb[u] = p.scale_b[static_cast<int64_t>(bh) * p.n + col];
    }
#pragma unroll
    for (int u = 0; u < kCols; ++u) {
      const int col = base + u * kCombineThreads + threadIdx.x;
      if (col >= p.n) continue;
      const int64_t result = static_cast<int64_t>(acc[u]);
      const int64_t e = static_cast<int64_t>(row) * p.n + col;
      if (p.out_int64) static_cast<int64_t*>(p.out)[e] = result;
      else static_cast<__half*>(p.out)[e] = __float2half_rn(__ll2float_rn(result) * (sa * sb[u]));
    }
  }
}

}  // namespace spmm_dense
}  // namespace magicube
