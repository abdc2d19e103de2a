// The dense path of magicube_cuda::spmm: the sparse operand expanded to dense byte planes and
// multiplied by an int8 GEMM: ours, on wgmma on Hopper (where its tiles do not fill the GPU, with
// K split between the CTAs of a cluster), else on mma.sync, or, for one signed plane each on small
// problems off Hopper, cuBLAS's (csrc/spmm.cu: run_dense, pick_gemm).
//
// The SR-BCRS kernels gather, for every kept vector, its own row of B from L2: at low V and low
// sparsity each row of B is read many times over (V 2, sparsity 0.7, M = K = 4096, N 256: 644 MB
// of gathers for a 1 MB B), while a dense GEMM reads B once per tile of output rows. There the
// exact integer product is cheaper as a dense one: A and B are split into byte planes, every pair
// of planes multiplied into an int32 accumulator of its own (each product < 2^31), and the plane
// products recombined in int64 and dequantized, with the gather kernel's rounding, in our GEMMs'
// epilogue (a pass of its own after cuBLAS's).
//
// Planes are bytes, x = sum_q d_q * 256^q: the low planes unsigned (x's low bytes), the top plane
// the rest, signed for signed x. mma.sync multiplies any mix of s8 and u8, so 4- and 8-bit values
// take one plane and 12- and 16-bit ones two (with signed bytes only, 16-bit values took three).
#pragma once

#include <cuda.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "mma.cuh"

namespace magicube {
namespace spmm_dense {

constexpr int kAlign = 16;               // rows and columns of the GEMM's operands are padded to this
constexpr int kExpandThreads = 256;
constexpr int kStripBytes = 48 << 10;    // one CTA's dense strip of A (planes x V rows x columns)

// Byte planes of a BITS-wide operand (see the file comment).
template <int BITS>
constexpr int kPlanesOf = BITS > 8 ? 2 : 1;

// Plane q of x, one of `planes` (see the file comment), as the byte the GEMM reads.
__device__ __forceinline__ int8_t plane_byte(int x, int q, int planes) {
  return static_cast<int8_t>(q + 1 < planes ? (x >> (8 * q)) & 255 : x >> (8 * q));
}

// The BITS-wide two's-complement value in x's low bits (the bits above them are ignored).
template <int BITS>
__device__ __forceinline__ int sign_extend(uint32_t x) {
  return static_cast<int>(x << (32 - BITS)) >> (32 - BITS);
}

// The bits of a container of signed BITS-wide values (B's; 4-bit ones two to a byte, low nibble
// first) that hold element e, and element e from them: apart, so that a thread's loads are all in
// flight before it decodes any. With the nibble's shift under the bounds check, ptxas gave each
// 4-bit load a branch of its own and waited for it there: the expansion took 4.5-4.9 us against
// 8-bit B's 2.2-3.1 at M = K = 512-1024, and the dense path forced now takes 0.86-0.88x the time
// it took with 4-bit B (H200, M = K 512-4096; kernel_checks.md, fifty-fifth round).
template <int BITS>
__device__ __forceinline__ uint32_t element_bits(const uint8_t* base, int64_t e) {
  if constexpr (BITS == 4) return base[e >> 1];
  else if constexpr (BITS == 8) return base[e];
  else return reinterpret_cast<const uint16_t*>(base)[e];
}
template <int BITS>
__device__ __forceinline__ int element(uint32_t bits, int64_t e) {
  return sign_extend<BITS>(BITS == 4 ? bits >> (4 * (e & 1)) : bits);
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
  // Value j in a word's low bits (the bits above them are the next values').
  __device__ static __forceinline__ uint32_t low(Word w, int j) {
    if constexpr (BITS == 16) return (j < 2 ? w.x : w.y) >> (16 * (j & 1));
    else return w >> (BITS * j);
  }
  template <bool SIGNED>
  __device__ static __forceinline__ int value(Word w, int j) {
    return SIGNED ? sign_extend<BITS>(low(w, j)) : low(w, j) & ((1u << BITS) - 1);
  }
};

struct ExpandParams {
  // A: groups of G vector rows (expand_kernel's) x strips of strip_cols columns (a multiple of
  // kAlign) per batch x head; groups of more than one row only where a strip is the whole of K.
  const int* row_ptr;
  const int* col_idx;
  const uint8_t* a;      // [BH, nnz_pad * V] containers
  int64_t a_bh_bytes;
  int8_t* a_out;         // [BH, A's planes * m_pad, k_pad]
  int vrows, m_pad, k_pad, v, strip_cols;
  // B: 64 x 64 tiles.
  const uint8_t* b;      // [BH, K, row_bytes]
  int64_t b_bh_bytes;
  int row_bytes;
  int8_t* b_out;         // [BH, B's planes * n_pad, k_pad]: B transposed, K contiguous, zeros past N and K
  int k, n, n_pad, n_tiles, b_tiles;
};

constexpr int kBTile = 64;
constexpr int kBTileBytes = kBTile * (kBTile + 1) * 4;

// The kept values of one vector row of V rows, scattered by column into its rows of the strip
// (row_strip, rows kPlanes * cols bytes apart). A thread takes a quad: four consecutive slots of a
// 32-slot block in every row of the vector (item = 8 b + j: slots 32 b + 4 j .. + 3), whose columns
// it reads and tests against the strip once for all V rows (row i's values, (b V + i) 32 + 4 j on,
// are adjacent too); 32 values' loads are issued before any store. Against a quad a row, the
// scatter's instructions a value fell from about 11 to 7.5 at V 2, 4.3 at V 4 and 5.4 at V 8
// (sm_90a), and the forced dense path took 0.988x the time (H200, M = K 1024-4096, N 256, V 2 / 4
// / 8, sparsity 0.5 / 0.7 / 0.9, the seven pairs): 0.95x at M = K = 4096, V 8 (0.84-0.94x at
// sparsity 0.5), 0.985x at 4096, V 2, and 1.007x at 2048, V 2 (up to 1.04x, where rows are short).
template <int AB, bool AS, int V, int kTeam>
__device__ __forceinline__ void scatter_row(const ExpandParams& p, const uint8_t* a, int start, int items, int lane,
                                            uint32_t row_strip, int c0, int cols) {
  constexpr int kUnroll = 8 / V, kPlanes = kPlanesOf<AB>;
  using Q = Quad<AB>;
  using Bytes = std::conditional_t<kPlanes == 2, uint16_t, uint8_t>;  // a value's plane bytes
  const uint32_t row_step = kPlanes * p.strip_cols;
  for (int base = 0; base < items; base += kUnroll * kTeam) {
    int4 col[kUnroll];
    typename Q::Word x[kUnroll][V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int item = base + u * kTeam + lane;
      col[u] = make_int4(-1, -1, -1, -1);
      if (item < items) {
        col[u] = *reinterpret_cast<const int4*>(p.col_idx + start + 4 * item);
        const int64_t e = static_cast<int64_t>(start) * V + 32 * V * (item >> 3) + 4 * (item & 7);
#pragma unroll
        for (int i = 0; i < V; ++i) x[u][i] = Q::load(a, e + 32 * i);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int item = base + u * kTeam + lane;
      if (item >= items) break;
      // As unsigned, the columns outside the strip (below c0 too) are at least `cols`.
      const unsigned c[4] = {static_cast<unsigned>(col[u].x - c0), static_cast<unsigned>(col[u].y - c0),
                             static_cast<unsigned>(col[u].z - c0), static_cast<unsigned>(col[u].w - c0)};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (c[j] < static_cast<unsigned>(cols)) {
          const uint32_t at = row_strip + kPlanes * c[j];
#pragma unroll
          for (int i = 0; i < V; ++i) {
            // The store keeps the low bytes: 8- and 16-bit values fill them as they are, 4-bit
            // ones are extended.
            const uint32_t bits = AB == 8 * kPlanes ? Q::low(x[u][i], j) : Q::template value<AS>(x[u][i], j);
            st_shared<Bytes>(at + i * row_step, bits);
          }
        }
    }
  }
}

// The V rows of every plane of G vector rows x strip of A, for one batch x head: built in shared
// memory (zeros, then the kept values scattered by column: scatter_row) and written out with
// 16-byte stores, so the global writes are whole lines however sparse the row. The strip holds
// each value's plane bytes side by side, which for two planes are its 16-bit container as stored
// (low byte first, see the file comment): each value is one shared store, and the copy out splits
// the planes apart (H200, M = K 1024-4096, the forced dense path: 0.95-0.98x the time with 12- and
// 16-bit A against a store per plane, with the scatter's shared address and value bits below).
// Each of the G rows has a team of the CTA's threads. Slots are read in storage order (no
// ascending columns assumed); a row wider than the strip is read once per strip. The kernel was
// bound by instruction issue (Nsight Compute, M = K = 4096: some 0.7 warp instructions a scheduler
// a cycle, before the single stores; since, it moves some 3.4-3.5 TB/s there on an H200, V 2,
// sparsity 0.7), hence the planes, V and G as compile-time counts (counted at run time, the planes
// put loops in the scatter and took 60-62 registers, and the kernel 1.1-1.5x the time; G,
// 1.0-1.1x) and the groups where there are CTAs to spare (a row of V 2 at sparsity 0.7 gives each
// of a CTA's threads 1.2 quads of the 4 a pass takes, and the CTA's fixed work is paid once a group).
template <int AB, bool AS, int G>
__device__ __forceinline__ void densify_strip(const ExpandParams& p, int8_t* strip, int group, int bh) {
  constexpr int kPlanes = kPlanesOf<AB>, kTeam = kExpandThreads / G;
  const int c0 = blockIdx.y * p.strip_cols;
  const int cols = min(p.strip_cols, p.k_pad - c0);
  int4* strip16 = reinterpret_cast<int4*>(strip);
  for (int i = threadIdx.x; i < kPlanes * G * p.v * p.strip_cols / 16; i += kExpandThreads)
    strip16[i] = make_int4(0, 0, 0, 0);

  // With G 1 the team is the whole CTA, and its row below p.vrows (expand_kernel's bound).
  const int team = G == 1 ? 0 : threadIdx.x / kTeam, lane = G == 1 ? threadIdx.x : threadIdx.x % kTeam;
  const int vrow = G * group + team;
  const bool in_rows = G == 1 || vrow < p.vrows;
  const uint8_t* a = p.a + bh * p.a_bh_bytes;
  const int start = in_rows ? p.row_ptr[2 * vrow] : 0;
  const int items = in_rows ? (p.row_ptr[2 * vrow + 1] - start + 31) / 32 * 8 : 0;
  // Through a shuffle, the strip's address stays in a register: ptxas otherwise recomputes it (S2R,
  // MOV, LEA) before each of the scatter's stores.
  const uint32_t row_strip = __shfl_sync(~0u, smem_addr(strip), 0) + team * p.v * p.strip_cols * kPlanes;
  __syncthreads();
  if (p.v == 2) scatter_row<AB, AS, 2, kTeam>(p, a, start, items, lane, row_strip, c0, cols);
  else if (p.v == 4) scatter_row<AB, AS, 4, kTeam>(p, a, start, items, lane, row_strip, c0, cols);
  else scatter_row<AB, AS, 8, kTeam>(p, a, start, items, lane, row_strip, c0, cols);
  __syncthreads();

  // Short as it is, this kernel was bound by instruction issue (at M = K = 4096 and 2 or 3 CTAs of
  // work per SM): the loops here keep their index arithmetic out of the per-chunk path.
  const int rows = (G == 1 ? 1 : min(G, p.vrows - G * group)) * p.v;
  const int64_t plane_bytes = static_cast<int64_t>(p.m_pad) * p.k_pad;
  for (int i = 0; i < rows; ++i) {
    const int8_t* src = strip + i * kPlanes * p.strip_cols;
    int8_t* dst = p.a_out + (static_cast<int64_t>(bh) * kPlanes * p.m_pad + static_cast<int64_t>(G) * group * p.v + i) *
                                p.k_pad + c0;
    for (int c = 16 * threadIdx.x; c < cols; c += 16 * kExpandThreads) {
      const int4 w = *reinterpret_cast<const int4*>(src + kPlanes * c);
      if constexpr (kPlanes == 1) {
        *reinterpret_cast<int4*>(dst + c) = w;
      } else {
        // 16 values' containers: their low bytes to plane 0, their high bytes to plane 1.
        const int4 w1 = *reinterpret_cast<const int4*>(src + 2 * c + 16);
        *reinterpret_cast<int4*>(dst + c) =
            make_int4(even_bytes(w.x, w.y), even_bytes(w.z, w.w), even_bytes(w1.x, w1.y), even_bytes(w1.z, w1.w));
        *reinterpret_cast<int4*>(dst + plane_bytes + c) =
            make_int4(odd_bytes(w.x, w.y), odd_bytes(w.z, w.w), odd_bytes(w1.x, w1.y), odd_bytes(w1.z, w1.w));
      }
    }
  }
}

// B's planes for one 64 x 64 tile, transposed through shared memory (the int8 GEMM takes its
// second operand with K contiguous): each thread issues its 16 loads at once, then writes 16 bytes
// of K per plane.
template <int BB>
__device__ __forceinline__ void b_planes_tile(const ExpandParams& p, int (*tile)[kBTile + 1], int t, int bh) {
  const int n0 = (t % p.n_tiles) * kBTile, k0 = (t / p.n_tiles) * kBTile;
  const uint8_t* b = p.b + bh * p.b_bh_bytes;
  constexpr int kPlanes = kPlanesOf<BB>;
  const int tn = threadIdx.x & 63, tk = threadIdx.x >> 6;
  uint32_t bits[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int k = k0 + tk + 4 * j, n = n0 + tn;
    bits[j] = k < p.k && n < p.n ? element_bits<BB>(b + static_cast<int64_t>(k) * p.row_bytes, n) : 0;
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) tile[tk + 4 * j][tn] = element<BB>(bits[j], n0 + tn);
  __syncthreads();
  const int n = n0 + (threadIdx.x >> 2), kq = 16 * (threadIdx.x & 3);
  if (n >= p.n_pad || k0 + kq >= p.k_pad) return;
#pragma unroll
  for (int q = 0; q < kPlanes; ++q) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[j] |= static_cast<uint32_t>(static_cast<uint8_t>(plane_byte(tile[kq + 4 * j + i][n - n0], q, kPlanes)))
                << (8 * i);
    }
    *reinterpret_cast<int4*>(p.b_out + ((static_cast<int64_t>(bh) * kPlanes + q) * p.n_pad + n) * p.k_pad + k0 +
                             kq) = make_int4(w[0], w[1], w[2], w[3]);
  }
}

// Both operands' planes in one launch (a launch on its own costs about as much as this work at
// M = K = 1024): the first b_tiles CTAs of strip 0 take B's tiles, the others A's strips.
template <int AB, bool AS, int BB, int G>
__global__ void __launch_bounds__(kExpandThreads) expand_kernel(const ExpandParams p) {
  extern __shared__ int4 smem16[];
  const int bh = blockIdx.z, b_tiles = blockIdx.y == 0 ? p.b_tiles : 0;
  await_inputs();
  if (static_cast<int>(blockIdx.x) < b_tiles) {
    b_planes_tile<BB>(p, reinterpret_cast<int (*)[kBTile + 1]>(smem16), blockIdx.x, bh);
  } else if (G * (static_cast<int>(blockIdx.x) - b_tiles) < p.vrows) {
    densify_strip<AB, AS, G>(p, reinterpret_cast<int8_t*>(smem16), blockIdx.x - b_tiles, bh);
  }
}

// mma_16832 with the operands' signedness as arguments: in the GEMM's unrolled plane loops they are
// constants (only the top planes carry a sign, and B's values are always signed).
__device__ __forceinline__ void mma_planes(bool a_signed, bool b_signed, int (&c)[4], const uint32_t (&a)[4],
                                           uint32_t b0, uint32_t b1) {
  if (a_signed && b_signed) mma_16832<true, true>(c, a, b0, b1);
  else if (a_signed) mma_16832<true, false>(c, a, b0, b1);
  else if (b_signed) mma_16832<false, true>(c, a, b0, b1);
  else mma_16832<false, false>(c, a, b0, b1);
}

// The dense path's output: the exact product as int64, or fp16(float(x) * (scale_a * scale_b)),
// the gather kernel's rounding.
struct Output {
  void* out;             // [BH, M, N]: int64, or fp16
  const float* scale_a;  // [BH, M] or null
  const float* scale_b;  // [BH, N] or null
  int m, n;
  bool out_int64;

  __device__ __forceinline__ void store(int bh, int row, int col, int64_t x, float sa) const {
    const int64_t e = (static_cast<int64_t>(bh) * m + row) * n + col;
    if (out_int64) {
      static_cast<int64_t*>(out)[e] = x;
    } else {
      static_cast<__half*>(out)[e] = __float2half_rn(scaled(x, sa, scale_b[static_cast<int64_t>(bh) * n + col]));
    }
  }
  // Columns col and col + 1 (col even, below N): where N is even, one store of both (the output
  // is a fresh allocation, so the pair is 8- or 16-byte aligned).
  __device__ __forceinline__ void store_pair(int bh, int row, int col, const int64_t (&x)[2], float sa) const {
    if (n & 1) {
      store(bh, row, col, x[0], sa);
      if (col + 1 < n) store(bh, row, col + 1, x[1], sa);
      return;
    }
    const int64_t e = (static_cast<int64_t>(bh) * m + row) * n + col;
    if (out_int64) *reinterpret_cast<longlong2*>(static_cast<int64_t*>(out) + e) = make_longlong2(x[0], x[1]);
    else *reinterpret_cast<__half2*>(static_cast<__half*>(out) + e) = half_pair(bh, col, x, sa);
  }
  // Columns col .. col + 3 (col a multiple of 4, below N; those past N are not stored), the fp16
  // ones with the columns' scales sb: where N is a multiple of 4, one store of all four.
  __device__ __forceinline__ void store_quad(int bh, int row, int col, const int64_t (&x)[4], float sa,
                                             const float (&sb)[4]) const {
    const int64_t e = (static_cast<int64_t>(bh) * m + row) * n + col;
    if (n % 4 == 0) {
      if (out_int64) {
        auto* to = reinterpret_cast<longlong2*>(static_cast<int64_t*>(out) + e);
        to[0] = make_longlong2(x[0], x[1]);
        to[1] = make_longlong2(x[2], x[3]);
      } else {
        const __half2 lo = __floats2half2_rn(scaled(x[0], sa, sb[0]), scaled(x[1], sa, sb[1]));
        const __half2 hi = __floats2half2_rn(scaled(x[2], sa, sb[2]), scaled(x[3], sa, sb[3]));
        uint2 both;
        both.x = *reinterpret_cast<const uint32_t*>(&lo);
        both.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(static_cast<__half*>(out) + e) = both;
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (col + i >= n) break;
      if (out_int64) static_cast<int64_t*>(out)[e + i] = x[i];
      else static_cast<__half*>(out)[e + i] = __float2half_rn(scaled(x[i], sa, sb[i]));
    }
  }
  // The fp16 outputs of columns col and col + 1 (both below N).
  __device__ __forceinline__ __half2 half_pair(int bh, int col, const int64_t (&x)[2], float sa) const {
    const float* sb = scale_b + static_cast<int64_t>(bh) * n + col;
    return __floats2half2_rn(scaled(x[0], sa, sb[0]), scaled(x[1], sa, sb[1]));
  }
  // The value an fp16 output rounds.
  __device__ static __forceinline__ float scaled(int64_t x, float sa, float sb) { return __ll2float_rn(x) * (sa * sb); }
  __device__ __forceinline__ float row_scale(int bh, int row) const {
    return out_int64 ? 0.f : scale_a[static_cast<int64_t>(bh) * m + row];
  }
};

// One product of single planes, from cuBLAS's int8 GEMM ([BH, m_pad, n_pad] int32), stored: one
// CTA per output row.
constexpr int kDequantizeThreads = 128;
__global__ void __launch_bounds__(kDequantizeThreads) dequantize_kernel(const int* c, int m_pad, int n_pad,
                                                                       const Output o) {
  const int row = blockIdx.x;  // bh * M + r, below 2^31 (the host checks)
  const int bh = row / o.m, r = row - bh * o.m;
  const int* c_row = c + (static_cast<int64_t>(bh) * m_pad + r) * n_pad;
  const float sa = o.row_scale(bh, r);
  for (int col = threadIdx.x; col < o.n; col += kDequantizeThreads) o.store(bh, r, col, c_row[col], sa);
}

struct GemmParams {
  const int8_t* a;  // [BH, a_planes, m_pad, k_pad]
  const int8_t* b;  // [BH, b_planes, n_pad, k_pad]
  int m_pad, n_pad, k_pad;
  Output o;
};

// Both GEMMs stage K in 128-byte steps: row r of a stage holds 128 bytes of one operand row (A's
// planes' rows, then B's), its 16-byte chunk c at chunk c ^ (r % 8). ldmatrix reads one chunk
// column of 8 consecutive rows, which this puts in 8 different bank groups, and it is the 128-byte
// swizzle that wgmma's descriptors and the TMA name (8-row atoms of 1024 bytes).
constexpr int kStepBytes = 128;
__device__ __forceinline__ uint32_t stage_offset(int r, int c) { return r * kStepBytes + 16 * (c ^ (r & 7)); }

// The mma.sync GEMM's copies into its ring of stages (tile T): thread i copies chunk i % 8 of rows
// i / 8 + j kThreads / 8 of every stage (kThreads / 8 is a multiple of 8, so the chunk's place in
// its row is the same for every j), from sources computed once (null past the operand's padded
// rows).
template <class T>
struct StageCopies {
  static constexpr int kRowsApart = T::kThreads / 8;
  static constexpr int kLoads = (T::AP * T::kM + T::BP * T::kN) / kRowsApart;
  static_assert(kRowsApart % 8 == 0 && (T::AP * T::kM + T::BP * T::kN) % kRowsApart == 0);
  const int8_t* src[kLoads];
  uint32_t dst0;
  int chunk;

  __device__ __forceinline__ StageCopies(const GemmParams& p, int bh, int m0, int n0) {
    chunk = threadIdx.x & 7;
    const int r0 = threadIdx.x >> 3;
    dst0 = stage_offset(r0, chunk);
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int r = r0 + j * kRowsApart;
      if (r < T::AP * T::kM) {
        const int q = r / T::kM, row = m0 + r % T::kM;
        src[j] = row < p.m_pad ? p.a + ((static_cast<int64_t>(bh) * T::AP + q) * p.m_pad + row) * p.k_pad + 16 * chunk
                               : nullptr;
      } else {
        const int q = (r - T::AP * T::kM) / T::kN, col = n0 + (r - T::AP * T::kM) % T::kN;
        src[j] = col < p.n_pad ? p.b + ((static_cast<int64_t>(bh) * T::BP + q) * p.n_pad + col) * p.k_pad + 16 * chunk
                               : nullptr;
      }
    }
  }

  // K step t into its slot of the ring at `smem` (zeros past K and the padded rows).
  __device__ __forceinline__ void load(const GemmParams& p, uint32_t smem, int t) const {
    const uint32_t base = smem + (t % T::kStages) * T::kStageBytes + dst0;
    const int k0 = t * kStepBytes;
    const bool in_k = k0 + 16 * chunk < p.k_pad;  // k_pad is a multiple of 16
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const bool ok = in_k && src[j] != nullptr;
      cp_async16<false>(base + j * kRowsApart * kStepBytes, ok ? src[j] + k0 : p.a, ok ? 16 : 0);
    }
  }
};

// Two adjacent outputs x[e], e = 0, 1, from their plane products acc(qa, qb, e): the sum over
// plane pairs of 256^(qa + qb) times the product, in int64 (modulo 2^64 on the way, in unsigned
// arithmetic: the result fits).
template <int AP, int BP, class Acc>
__device__ __forceinline__ void recombine_pair(Acc acc, int64_t (&x)[2]) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    uint64_t sum = 0;
#pragma unroll
    for (int qa = 0; qa < AP; ++qa)
#pragma unroll
      for (int qb = 0; qb < BP; ++qb)
        sum += static_cast<uint64_t>(static_cast<int64_t>(acc(qa, qb, e))) << (8 * (qa + qb));
    x[e] = static_cast<int64_t>(sum);
  }
}
// The same pair, stored at (row, col + e) (col even; nothing where col is past N).
template <int AP, int BP, class Acc>
__device__ __forceinline__ void store_recombined(const Output& o, int bh, int row, int col, float sa, Acc acc) {
  if (col >= o.n) return;
  int64_t x[2];
  recombine_pair<AP, BP>(acc, x);
  o.store_pair(bh, row, col, x, sa);
}

// The mma.sync GEMM: 4 warps of a CTA in a 2 x 2 grid, each a WM x WN output tile of every plane
// product, over K in 128-byte steps through a ring of STAGES shared-memory stages (cp.async),
// fragments by ldmatrix, products by mma.sync m16n8k32. One CTA holds every plane product of its
// output tile, so the recombination happens in registers.
template <int AP_, int BP_, int WM, int WN, int STAGES>
struct GemmTile {
  static constexpr int AP = AP_, BP = BP_, kWarpM = WM, kWarpN = WN, kStages = STAGES, kSplit = 1;
  static constexpr int kThreads = 128, kM = 2 * WM, kN = 2 * WN;
  static constexpr int kStageBytes = (AP * kM + BP * kN) * kStepBytes;
  static constexpr int kSmemBytes = STAGES * kStageBytes;
  static_assert(WN % 16 == 0 && WM % 16 == 0);
};

// Per number of plane products, the fastest of the tiles timed on an H200 (M = K 1024-4096, N
// 128-512): 64 x 64 CTA tiles for one or two products, 64 x 32 for four (64 accumulators a
// thread), 128-byte steps. Larger CTA tiles (128 x 64, 128 x 128), 64-byte steps, and K split
// between the two CTAs of a cluster with the sums added through distributed shared memory, were
// slower nearly everywhere (eval/results/kernel_checks.md, thirty-second round). This GEMM runs
// off Hopper and where the wgmma GEMM's tiles do not fill the GPU (its smaller tiles make more
// CTAs); one product here only for unsigned 8-bit A, cuBLAS's GEMM being faster for a signed one.
template <int AP, int BP>
struct DefaultGemmTile;
template <>
struct DefaultGemmTile<1, 1> {
  using type = GemmTile<1, 1, 32, 32, 4>;
};
template <>
struct DefaultGemmTile<2, 1> {
  using type = GemmTile<2, 1, 32, 32, 3>;
};
template <>
struct DefaultGemmTile<2, 2> {
  using type = GemmTile<2, 2, 32, 16, 4>;
};

template <int AB, bool AS, int BB, class T = typename DefaultGemmTile<kPlanesOf<AB>, kPlanesOf<BB>>::type>
__global__ void __launch_bounds__(T::kThreads) gemm_kernel(const GemmParams p) {
  constexpr int AP = T::AP, BP = T::BP;
  static_assert(AP == kPlanesOf<AB> && BP == kPlanesOf<BB>);
  constexpr int kMT = T::kWarpM / 16, kNT = T::kWarpN / 8;
  extern __shared__ int4 smem16[];
  const uint32_t smem = smem_addr(smem16);
  const int bh = blockIdx.z, m0 = blockIdx.y * T::kM, n0 = blockIdx.x * T::kN;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = (warp >> 1) * T::kWarpM, wn = (warp & 1) * T::kWarpN;
  const StageCopies<T> copies(p, bh, m0, n0);
  const int k_tiles = (p.k_pad + kStepBytes - 1) / kStepBytes;

  // Fragments: A's matrices (rows 0-7, bytes 0-15), (8-15, 0-15), (0-7, 16-31), (8-15, 16-31) of
  // each m16 tile; B's (cols 0-7, bytes 0-15), (0-7, 16-31), (8-15, 0-15), (8-15, 16-31) of each
  // pair of n8 tiles. Lane l gives the address of row l % 8 of matrix l / 8: its offsets for the
  // first 32 bytes of K; the next 32-byte steps flip bits 5 and 6 (the swizzle is an XOR).
  uint32_t a_off[AP][kMT], b_off[BP][kNT / 2];
#pragma unroll
  for (int q = 0; q < AP; ++q)
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
      a_off[q][mt] = stage_offset(q * T::kM + wm + 16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1), lane >> 4);
#pragma unroll
  for (int q = 0; q < BP; ++q)
#pragma unroll
    for (int nt = 0; nt < kNT; nt += 2)
      b_off[q][nt / 2] =
          stage_offset(AP * T::kM + q * T::kN + wn + 8 * nt + (lane & 7) + 8 * (lane >> 4), (lane >> 3) & 1);
  uint32_t af[2][AP][kMT][4], bf[2][BP][kNT][2];
  auto load_fragments = [&](int buf, uint32_t stage, int kk) {
#pragma unroll
    for (int q = 0; q < AP; ++q)
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        ldsm_x4(stage + (a_off[q][mt] ^ (32 * kk)), af[buf][q][mt][0], af[buf][q][mt][1], af[buf][q][mt][2],
                af[buf][q][mt][3]);
#pragma unroll
    for (int q = 0; q < BP; ++q)
#pragma unroll
      for (int nt = 0; nt < kNT; nt += 2)
        ldsm_x4(stage + (b_off[q][nt / 2] ^ (32 * kk)), bf[buf][q][nt][0], bf[buf][q][nt][1], bf[buf][q][nt + 1][0],
                bf[buf][q][nt + 1][1]);
  };

  // The ring: tiles t + 1 .. t + kStages - 1 in flight while tile t is multiplied, and each 32-byte
  // step's fragments loaded while the step before is multiplied (the next tile's first ones across
  // the barrier that frees the slot of tile t).
  constexpr int kSteps = kStepBytes / 32;
  static_assert(kSteps % 2 == 0, "a tile's steps alternate the fragment buffers, so the next tile starts on 0");
  int acc[AP][BP][kMT][kNT][4] = {};
  await_inputs();
#pragma unroll
  for (int t = 0; t < T::kStages - 1; ++t) {
    if (t < k_tiles) copies.load(p, smem, t);
    cp_async_commit();
  }
  cp_async_wait<T::kStages - 2>();
  __syncthreads();
  load_fragments(0, smem, 0);
  for (int t = 0; t < k_tiles; ++t) {
    // Tile t + kStages - 1 goes to the slot of tile t - 1, which every warp has finished reading.
    if (t + T::kStages - 1 < k_tiles) copies.load(p, smem, t + T::kStages - 1);
    cp_async_commit();
    const uint32_t stage = smem + (t % T::kStages) * T::kStageBytes;
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      const int cur = kk & 1;
      if (kk + 1 < kSteps) {
        load_fragments(cur ^ 1, stage, kk + 1);
      } else {
        cp_async_wait<T::kStages - 2>();
        __syncthreads();  // tile t + 1 has landed; no warp reads tile t's slot after this
        if (t + 1 < k_tiles) load_fragments(cur ^ 1, smem + ((t + 1) % T::kStages) * T::kStageBytes, 0);
      }
#pragma unroll
      for (int qa = 0; qa < AP; ++qa)
#pragma unroll
        for (int qb = 0; qb < BP; ++qb)
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
              mma_planes(qa == AP - 1 && AS, qb == BP - 1, acc[qa][qb][mt][nt], af[cur][qa][mt], bf[cur][qb][nt][0],
                         bf[cur][qb][nt][1]);
    }
  }

  // Thread (lane / 4, lane % 4) holds rows lane / 4 and lane / 4 + 8 of each m16 tile, columns
  // 2 (lane % 4) and the next of each n8 tile.
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + wm + 16 * mt + (lane >> 2) + 8 * h;
      if (row >= p.o.m) continue;
      const float sa = p.o.row_scale(bh, row);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
        store_recombined<AP, BP>(p.o, bh, row, n0 + wn + 8 * nt + 2 * (lane & 3), sa,
                                 [&](int qa, int qb, int e) { return acc[qa][qb][mt][nt][2 * h + e]; });
    }
}

// wgmma_k32 with the operands' signedness as arguments (constants in the unrolled plane loops).
template <int N>
__device__ __forceinline__ void wgmma_planes(bool a_signed, bool b_signed, int (&d)[N / 2], uint64_t a, uint64_t b) {
  if (a_signed && b_signed) wgmma_k32<N, true, true>(d, a, b);
  else if (a_signed) wgmma_k32<N, true, false>(d, a, b);
  else if (b_signed) wgmma_k32<N, false, true>(d, a, b);
  else wgmma_k32<N, false, false>(d, a, b);
}

// The accumulators of wgmmas in flight must stay in their registers: an empty asm that reads and
// writes each one keeps the compiler from moving them (or sharing one zero among several) across
// the asynchronous section, which would make ptxas serialize the wgmmas.
template <int A, int B, int N>
__device__ __forceinline__ void keep_in_place(int (&acc)[A][B][N]) {
#pragma unroll
  for (int a = 0; a < A; ++a)
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
      for (int i = 0; i < N; ++i) asm volatile("" : "+r"(acc[a][b][i])::"memory");
}

// The GEMM on Hopper: WGS warpgroups, each 64 rows x N columns of every plane product by wgmma
// from shared memory, over K in 128-byte steps (one swizzle row) through a ring of STAGES stages
// that a producer warp fills by the tensor memory accelerator (TMA), as far ahead as the ring
// allows; with SPLIT > 1, the K of each tile split between the SPLIT CTAs of a cluster
// (store_split).
template <int AP_, int BP_, int WGS, int BN, int STAGES, int SPLIT = 1>
struct WgmmaTile {
  static constexpr int AP = AP_, BP = BP_, kN = BN, kStages = STAGES, kSplit = SPLIT;
  static constexpr int kMathThreads = 128 * WGS, kThreads = kMathThreads + 32, kM = 64 * WGS;
  static constexpr int kStageBytes = (AP * kM + BP * kN) * kStepBytes;
  // The stages, two barriers each, and the atoms' 1024-byte alignment.
  static constexpr int kSmemBytes = STAGES * kStageBytes + 16 * STAGES + 1024;
  static_assert(STAGES >= 2 && (BN == 64 || BN == 128));
};

// A two-warpgroup tile's fp16 output where N is a multiple of 8, through shared memory: each warp
// writes its 16 rows into the freed stages (rows padded by 16 bytes, so that the 8 rows one store
// instruction spans fall in different banks) and stores them a 16-byte chunk a lane, whole rows
// an instruction, where its accumulators' layout scatters 4-byte pairs over 8 rows. The GEMM took
// 0.66-0.88x its time with one product, 0.92-0.98x with two and 0.97-1.01x with four (H100 and
// H200, M = K 512-4096, N 128-512, 1-32 batch x heads); the one-warpgroup tiles took 1.01-1.04x
// and store directly (kernel_checks.md, thirty-ninth round).
template <int AP, int BP, class T>
__device__ __forceinline__ void store_staged(const Output& o, uint32_t smem, int bh, int m0, int n0,
                                             const int (&acc)[AP][BP][T::kN / 2]) {
  constexpr int kN = T::kN, kRowBytes = 2 * kN + 16, kChunks = kN / 8;
  static_assert(T::kMathThreads == 256 && T::kM * kRowBytes <= T::kStages * T::kStageBytes);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = m0 + 16 * warp;
  const uint32_t rows = smem + 16 * warp * kRowBytes;
  named_barrier_sync(1, T::kMathThreads);  // both warpgroups' wgmmas are done with the stages
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = (lane >> 2) + 8 * h;
    if (row0 + r >= o.m) continue;
    const float sa = o.row_scale(bh, row0 + r);
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int c = 8 * j + 2 * (lane & 3);
      if (n0 + c >= o.n) continue;
      int64_t x[2];
      recombine_pair<AP, BP>([&](int qa, int qb, int e) { return acc[qa][qb][4 * j + 2 * h + e]; }, x);
      const __half2 v = o.half_pair(bh, n0 + c, x, sa);
      st_shared<uint32_t>(rows + r * kRowBytes + 2 * c, *reinterpret_cast<const uint32_t*>(&v));
    }
  }
  __syncwarp();
  __half* out = static_cast<__half*>(o.out);
#pragma unroll
  for (int i = lane; i < 16 * kChunks; i += 32) {
    const int r = i / kChunks, c = 8 * (i % kChunks);
    if (row0 + r < o.m && n0 + c < o.n)
      *reinterpret_cast<int4*>(out + (static_cast<int64_t>(bh) * o.m + row0 + r) * o.n + n0 + c) =
          ld_shared_v4(rows + r * kRowBytes + 2 * c);
  }
}

// K split between the T::kSplit CTAs of a cluster (part: this CTA's rank): each has multiplied its
// share of K for the whole tile. Each writes its plane products to its freed stages (rows padded by
// 16 bytes: a warp's 8-byte stores, 8 rows x 4 columns, then take 2-3 wavefronts, not 8), and CTA r
// adds every part's sums of rows r kM / kSplit onwards (from its own part on, so the CTAs do not
// all read one CTA at once) through distributed shared memory, recombines and stores them. A thread
// takes 4 columns of every kRowStep-th row of that share: its scales are loaded before the
// cluster's parts are awaited, and all its loads of one part are issued before their first sum (a
// row at a time, each waiting on the last, the reduction took 6.5 us beside the main loop's 8 at M
// = K = 4096, N 256, 128 x 128 tiles split in two). The sums of a part stay below 2^31, as those of
// the whole of K do (DenseShape::applies).
template <int AP, int BP, class T>
__device__ __forceinline__ void store_split(const Output& o, uint32_t smem, int bh, int m0, int n0,
                                            const int (&acc)[AP][BP][T::kN / 2], int part) {
  constexpr int kN = T::kN, kPitch = 4 * kN + 16, kPlaneBytes = T::kM * kPitch, kChunks = kN / 4;
  constexpr int kParts = T::kSplit, kQ = AP * BP, kRowStep = T::kMathThreads / kChunks;
  constexpr int kShare = T::kM / kParts, kRows = kShare / kRowStep;  // rows a CTA adds, and a thread
  static_assert(kQ * kPlaneBytes <= T::kStages * T::kStageBytes && kShare % kRowStep == 0);
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  named_barrier_sync(1, T::kMathThreads);  // every warpgroup's wgmmas are done with the stages
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 64 * wg + 16 * warp + (lane >> 2) + 8 * h;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j)
#pragma unroll
      for (int q = 0; q < kQ; ++q)
        st_shared_v2(smem + q * kPlaneBytes + r * kPitch + 4 * (8 * j + 2 * (lane & 3)),
                     acc[q / BP][q % BP][4 * j + 2 * h], acc[q / BP][q % BP][4 * j + 2 * h + 1]);
  }

  const int c = 4 * (threadIdx.x % kChunks), col = n0 + c;
  const int r0 = part * kShare + threadIdx.x / kChunks;  // this thread's first row in the tile
  auto mine = [&](int s) { return m0 + r0 + s * kRowStep < o.m; };
  float sa[kRows], sb[4];
#pragma unroll
  for (int s = 0; s < kRows; ++s) sa[s] = mine(s) ? o.row_scale(bh, m0 + r0 + s * kRowStep) : 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    sb[e] = !o.out_int64 && col + e < o.n ? o.scale_b[static_cast<int64_t>(bh) * o.n + col + e] : 0.f;
  cluster_sync();  // every part's sums are in place

  int sum[kRows][kQ][4] = {};
#pragma unroll
  for (int k = 0; k < kParts; ++k) {
    const int from = (part + k) % kParts;
    int4 v[kRows][kQ];
#pragma unroll
    for (int s = 0; s < kRows; ++s)
#pragma unroll
      for (int q = 0; q < kQ; ++q)
        if (mine(s)) v[s][q] = ld_cluster_v4(smem + q * kPlaneBytes + (r0 + s * kRowStep) * kPitch + 4 * c, from);
#pragma unroll
    for (int s = 0; s < kRows; ++s)
#pragma unroll
      for (int q = 0; q < kQ; ++q)
        if (mine(s)) sum[s][q][0] += v[s][q].x, sum[s][q][1] += v[s][q].y, sum[s][q][2] += v[s][q].z,
                     sum[s][q][3] += v[s][q].w;
  }
  if (col < o.n) {
#pragma unroll
    for (int s = 0; s < kRows; ++s) {
      if (!mine(s)) continue;
      int64_t x[4];
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        int64_t pair[2];
        recombine_pair<AP, BP>([&](int qa, int qb, int e) { return sum[s][qa * BP + qb][2 * e2 + e]; }, pair);
        x[2 * e2] = pair[0], x[2 * e2 + 1] = pair[1];
      }
      o.store_quad(bh, m0 + r0 + s * kRowStep, col, x, sa[s], sb);
    }
  }
  cluster_sync();  // no CTA exits while another reads its shared memory
}

// `a_map`, `b_map`: the TMA's views of A's and B's planes, [BH x planes][rows][k_pad] bytes in
// boxes of 128 bytes of K x kM (A) or kN (B) rows, zeros past the padded rows and K, stored with
// the 128-byte swizzle (csrc/spmm.cu: plane_map).
template <int AB, bool AS, int BB, class T>
__global__ void __launch_bounds__(T::kThreads)
    wgmma_gemm_kernel(const GemmParams p, const __grid_constant__ CUtensorMap a_map,
                      const __grid_constant__ CUtensorMap b_map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int AP = T::AP, BP = T::BP, kN = T::kN, kS = T::kStages;
  static_assert(AP == kPlanesOf<AB> && BP == kPlanesOf<BB>);
  extern __shared__ int4 smem16[];
  const uint32_t smem = (smem_addr(smem16) + 1023) & ~1023u;
  // Slot s is full once its tile has landed, and empty once every warpgroup has multiplied it.
  const uint32_t full = smem + kS * T::kStageBytes, empty = full + 8 * kS;
  // Split, the CTAs of a cluster (along x) share the K steps of one tile (store_split).
  const int part = T::kSplit > 1 ? cluster_rank() : 0;
  const int bh = blockIdx.z, m0 = blockIdx.y * T::kM, n0 = blockIdx.x / T::kSplit * kN;
  const int k_steps = (p.k_pad + kStepBytes - 1) / kStepBytes;
  const int k_first = part * k_steps / T::kSplit, k_tiles = (part + 1) * k_steps / T::kSplit - k_first;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kS; ++s) {
      mbarrier_init(full + 8 * s, 1);
      mbarrier_init(empty + 8 * s, T::kMathThreads / 128);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  await_inputs();

  if (threadIdx.x >= T::kMathThreads) {
    // The producer warp, one lane: tile u into slot u % kS once every warpgroup is done with the
    // slot's tile u - kS.
    if (threadIdx.x == T::kMathThreads) {
      for (int u = 0; u < k_tiles; ++u) {
        const int s = u % kS;
        if (u >= kS) mbarrier_wait(empty + 8 * s, (u / kS - 1) & 1);
        const uint32_t stage = smem + s * T::kStageBytes, bar = full + 8 * s;
        const int k0 = (k_first + u) * kStepBytes;
        mbarrier_expect_tx(bar, T::kStageBytes);
#pragma unroll
        for (int qa = 0; qa < AP; ++qa)
          tma_load_3d(stage + qa * T::kM * kStepBytes, &a_map, k0, m0, bh * AP + qa, bar);
#pragma unroll
        for (int qb = 0; qb < BP; ++qb)
          tma_load_3d(stage + (AP * T::kM + qb * kN) * kStepBytes, &b_map, k0, n0, bh * BP + qb, bar);
      }
    }
    return;
  }

  // The math warpgroups: tile t while tile t - 1's wgmmas may still run; once they have, its slot
  // is released (one arrival a warpgroup).
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  int acc[AP][BP][kN / 2] = {};
  for (int t = 0; t < k_tiles; ++t) {
    mbarrier_wait(full + 8 * (t % kS), (t / kS) & 1);
    const uint32_t stage = smem + (t % kS) * T::kStageBytes;
    keep_in_place(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kStepBytes / 32; ++kk)
#pragma unroll
      for (int qa = 0; qa < AP; ++qa)
#pragma unroll
        for (int qb = 0; qb < BP; ++qb)
          wgmma_planes<kN>(qa == AP - 1 && AS, qb == BP - 1, acc[qa][qb],
                           wgmma_desc(stage + (qa * T::kM + 64 * wg) * kStepBytes + 32 * kk),
                           wgmma_desc(stage + (AP * T::kM + qb * kN) * kStepBytes + 32 * kk));
    wgmma_commit();
    keep_in_place(acc);
    wgmma_wait<1>();
    if (t > 0 && (threadIdx.x & 127) == 0) mbarrier_arrive(empty + 8 * ((t - 1) % kS));
  }
  wgmma_wait<0>();
  keep_in_place(acc);

  // Each warpgroup's accumulators in wgmma_k32's layout: warp w of it holds rows 16 w + lane / 4
  // and 8 below, columns 2 (lane % 4) and the next of each 8-column block.
  if constexpr (T::kSplit > 1) {
    store_split<AP, BP, T>(p.o, smem, bh, m0, n0, acc, part);
  } else {
    if constexpr (T::kMathThreads == 256) {
      if (!p.o.out_int64 && p.o.n % 8 == 0) return store_staged<AP, BP, T>(p.o, smem, bh, m0, n0, acc);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + 64 * wg + 16 * warp + (lane >> 2) + 8 * h;
      if (row >= p.o.m) continue;
      const float sa = p.o.row_scale(bh, row);
#pragma unroll
      for (int j = 0; j < kN / 8; ++j)
        store_recombined<AP, BP>(p.o, bh, row, n0 + 8 * j + 2 * (lane & 3), sa,
                                 [&](int qa, int qb, int e) { return acc[qa][qb][4 * j + 2 * h + e]; });
    }
  }
#else
  __trap();  // built without sm_90a: the host launches this kernel only where the build has it
#endif
}

// Per number of plane products, the wgmma GEMM's two tiles (rows x columns of output), the fastest
// of those timed on an H200 (M = K 1024-4096, N 128-512) where their tiles fill the SMs: one or two
// products 128 x 128 (64 or 128 accumulators a thread) and 128 x 64 or 64 x 128, four products
// 128 x 64 and 64 x 64 (128 accumulators); 4 stages, 6 for the one-warpgroup tiles of 32 KB
// stages (4 and 6 timed within 1 us of each other, and 6 no faster for the larger tiles; timed
// when every thread copied its stages, before the TMA). Where neither fills the SMs, one or two
// products take a third, least tile, one warpgroup's 64 x 64, which makes twice the smaller tile's
// CTAs: there it took 0.60-0.77x the GEMM time of what ran before it (cuBLAS's GEMM and its pass,
// or our mma.sync GEMM; H200, M = K 1024-4096, N 128-512, 1-3 batch x heads), with 8 stages where
// its CTAs fit one wave (4 or 6 stages took up to 1.21x the time; past one wave, equal). Where
// that does not fill them either, the least tile with K split between two CTAs (csrc/spmm.cu:
// pick_gemm).
template <int AP, int BP>
struct WgmmaTiles;
template <>
struct WgmmaTiles<1, 1> {
  using Large = WgmmaTile<1, 1, 2, 128, 4>;
  using Small = WgmmaTile<1, 1, 2, 64, 4>;
  // Where the smaller tile's CTAs fit one wave, 8 stages (192 KB, one CTA an SM) took 0.90-1.01x
  // the time of 4 (H200, M = K 1000-4096, N 128-512); past one wave 1.16-1.21x, two CTAs an SM
  // at 4 stages doing better (kernel_checks.md, thirty-seventh and thirty-eighth rounds).
  using SmallOneWave = WgmmaTile<1, 1, 2, 64, 8>;
  using Least = WgmmaTile<1, 1, 1, 64, 4>;
  using LeastOneWave = WgmmaTile<1, 1, 1, 64, 8>;
  using LeastSplit = WgmmaTile<1, 1, 1, 64, 4, 2>;
};
template <>
struct WgmmaTiles<2, 1> {
  using Large = WgmmaTile<2, 1, 2, 128, 4>;
  using Small = WgmmaTile<2, 1, 1, 128, 6>;
  using SmallOneWave = Small;
  using Least = WgmmaTile<2, 1, 1, 64, 4>;
  using LeastOneWave = WgmmaTile<2, 1, 1, 64, 8>;
  using LeastSplit = WgmmaTile<2, 1, 1, 64, 4, 2>;
};
template <>
struct WgmmaTiles<2, 2> {
  using Large = WgmmaTile<2, 2, 2, 64, 4>;
  using Small = WgmmaTile<2, 2, 1, 64, 6>;
  using SmallOneWave = Small;
  using Least = Small;
  using LeastOneWave = Small;
};

}  // namespace spmm_dense
}  // namespace magicube
