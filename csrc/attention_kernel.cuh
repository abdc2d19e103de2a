// Fused sparse attention on SR-BCRS: out = spmm(softmax_quantized(sddmm(Q, K)), V) in one kernel,
// with the roundings of the three-op pipeline (fp16 scores as the SDDMM writes them, probabilities
// quantized to p_bits unsigned or fp16, exact integer accumulation, one fp16 rounding at the end).
//
// Two layouts. Whole rows (the default): one warp = one vector row (V query rows sharing their kept
// keys) of one batch x head, one CTA = 4 vector rows of the same batch x head, neighbours in
// row_order (so of about equal length). Their kept keys overlap (at density 0.1, 4 random rows
// keep 34 % of the keys between them, not 40 %), and the key loads go through L1, so a key row
// that two warps of the CTA both need is often fetched from L2 once. A warp owns its
// row: there is no block barrier and no cross-warp reduction. Split rows (SPLIT, for rows too
// long for one warp's exact int32 accumulators): one CTA = one vector row of one batch x head,
// its 4 warps take the row's 32-slot blocks round-robin and reduce through shared memory. Scores
// and probabilities never leave the SM.
//
// Why this shape (Hopper, L = 4096, d = 64, sparsity 0.9: ~13 blocks per row):
// - The kernel is bound by the gather of key and value rows (K and V stay in L2), not by tensor
//   cores: by the L1 wavefronts of the gathers and by latency more than by L2 bandwidth (Nsight
//   Compute, H100, 8b-8b: L1 data pipe at 78 % of peak, L2 at 53 %, issue slots 64 % busy with 19
//   warps per SM). So every key and value row of a block is fetched once, with as few rows per
//   instruction as the row size allows, through as few shared-memory passes as possible, and the
//   CTA's shared memory is kept small enough for 5 CTAs (20 warps) per SM: 3 (12 warps) took
//   208 us against 160 (H100, 8b-8b, L = 4096). Scores are
//   kept on chip, not recomputed: a warp keeps the fp16 scores of its first `cached` blocks in
//   shared memory and recomputes only the blocks past that, so a row longer than the cache stays
//   correct at the price of a second key gather. The host sizes the cache from the pattern's
//   mean row length (nnz_pad / rows, known without reading the pattern), so no host read of the
//   pattern is needed (CUDA-graph capturable) and the cache does not cost occupancy on short
//   rows. Shared memory rather than registers keeps the block loops rolled: registers and code
//   size do not grow with the cache.
// - Softmax needs the row max before any probability can be quantized, so a warp makes two
//   passes over its blocks: scores and the max (pass 1), then exp, quantization and the product
//   with V (pass 2); the sum is not needed to quantize (q = rint(e * qmax) with e = exp(x - max))
//   and is reduced at the end. fp16 probabilities (e / s) need the sum first: one extra pass over
//   the cached scores.
// - QK^T is computed untransposed, S (query rows x slots) = Q K^T with m16n8k32 (Q fills M, rows
//   past V are zero), because the accumulator layout of that product is, register for register,
//   the B operand of the transposed value product O^T = V^T P^T (dv fills M, the V query rows are
//   n): the probabilities go from the softmax straight into the next MMA. The MMA's k order inside
//   a block is free as long as both operands agree; the gathered value tile (slots x dv, row-major
//   in shared memory) is transposed by ldmatrix.trans plus one byte permute, which yields exactly
//   the slot order the probabilities already sit in.
// - Key rows go straight from global memory into the MMA registers, one block ahead: a copy
//   through shared memory would cross the L1 data pipe twice more (its fill and its reads).
//   Value rows, which the product needs transposed, are copied by cp.async into a per-warp ring
//   of two tiles (ldmatrix.trans reads them), so a warp never waits on another; the ring starts
//   filling at the kernel's start and its first tile lands during pass 1.
// Wide operands use 8-bit bit planes (16-bit: signed high byte, unsigned low byte; probabilities:
// two unsigned bytes) recombined in int64; int4 is widened in registers to 16 * value, shifted out
// exactly (the scores by 8 bits, the output by 4).
#pragma once

#include <cmath>
#include <cstdint>
#include <cuda_fp16.h>
#include <type_traits>

#include "mma.cuh"
#include "sddmm_mma.cuh"

namespace magicube {
namespace attention_detail {

enum Operand : int { kInt8 = 0, kInt4 = 1, kInt16 = 2, kHalf = 3 };

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kSlots = 32;

// Q, K or V: row t of batch b, head h starts `b * batch + h * head + t * row` bytes after `data`:
// [BH, rows, d] contiguous, or per-head views of one Q/K/V projection output read in place. Rows are
// whole 16-byte chunks at 16-byte boundaries.
struct Rows {
  const uint8_t* data;
  int64_t batch, head;
  uint32_t row;  // the host keeps (rows - 1) * row below 2^32

  __device__ __forceinline__ const uint8_t* of(uint32_t b, uint32_t h) const { return data + b * batch + h * head; }
};

// A scale of the integer modes, fp32 over the rows (Q, K) or columns (V) of every batch x head at any
// strides, so that a scale per head or per batch x head, expanded (stride 0), is read in place: element
// i of batch b, head h lies `b * batch + h * head` elements plus `i * step` bytes after `data`.
struct Scale {
  const float* data;
  int64_t batch, head;
  uint32_t step;  // the host keeps (count - 1) * step below 2^32

  __device__ __forceinline__ const float* of(uint32_t b, uint32_t h) const { return data + b * batch + h * head; }
};

struct Params {
  const int* row_ptr;
  const int* col_idx;
  const int* row_order;
  Rows q, k, val;          // M query rows, N key and value rows of every batch x head
  Scale scale_q, scale_k, scale_v;  // over M, N and DV; the integer modes only
  // [BH / heads, M, heads, DV]: batch x head bh = b * heads + h writes rows of b, head slot h, the
  // layout of [B, M, heads * DV] that the output projection reads.
  __half* out;
  int heads;
  int bh, m, n, v;
  int cached;              // blocks per warp whose scores stay in shared memory
  int group0;              // the launch's first row group (the kernel's comment)
  // Long rows (csrc/long_rows.cuh): a row at a position below long_rows of row_order that keeps
  // more than long_count slots belongs to the split launch (one CTA a position), and the whole-row
  // launch skips it. long_rows = 0: each launch takes every row it is given.
  int long_rows = 0;
  int long_count = 0;
  float softmax_scale;
};

// OP: the container of Q, K and V; PB: probability bits (0 = fp16); D, DV: head dims.
template <int OP, int PB, int D, int DV>
struct Cfg {
  static constexpr bool kFp16 = OP == kHalf;
  static constexpr int bytes(int dim) { return OP == kInt4 ? dim / 2 : OP == kInt8 ? dim : 2 * dim; }
  static constexpr int kKeyBytes = bytes(D);
  static constexpr int kValBytes = bytes(DV);
  static constexpr int kLaneBytes = kKeyBytes / 4;  // a lane's run of one key row
  static constexpr int kLaneWords = kLaneBytes / 4;
  static constexpr int kRowStride = kKeyBytes > kValBytes ? kKeyBytes : kValBytes;
  // Two value tiles: one in use, the next in flight.
  static constexpr int kStages = 2;
  // Shared tile rows are unpadded, their 16-byte chunks XOR-swizzled so that 8 consecutive rows
  // of one chunk (an ldmatrix read) hit 8 distinct bank groups: rows of 64 bytes pair up in a
  // 128-byte line, so the 4 rows of each parity need distinct chunk masks (0, 2, 1, 3, which
  // also keeps the copies of 4 consecutive rows conflict-free); rows of 32 bytes fill a line by
  // 4. The swizzle depends on bits 0-2 of the row only, so rows 8n + g share the mask of row g.
  static constexpr int kChunksPerRow = kRowStride / 16;
  static __device__ __forceinline__ uint32_t swizzle(int row) {
    if constexpr (kChunksPerRow == 1) return 0u;
    else if constexpr (kChunksPerRow == 2) return (row >> 2) & 1;
    else if constexpr (kChunksPerRow == 4) return (row & 2) | ((row >> 2) & 1);
    else return row & 7;
  }
  // Byte offset of byte `byte` of row `row` in a tile. XOR with 16 u stays inside the tile when
  // byte / 16 and u share no bits (the chunk of a row plus whole chunks above it).
  static __device__ __forceinline__ uint32_t tile_offset(int row, int byte) {
    return row * kRowStride + ((((byte >> 4) ^ swizzle(row)) << 4) | (byte & 15));
  }
  // A value tile: the 32 gathered rows of a block.
  static constexpr int kTileBytes = kSlots * kRowStride;
  static constexpr int kPPlanes = PB == 16 ? 2 : 1;
  static constexpr int kVPlanes = OP == kInt16 ? 2 : 1;
  static constexpr int kAccSets = kPPlanes == 2 && kVPlanes == 2 ? 3 : kPPlanes * kVPlanes;
  static constexpr int kMT = DV / 16;
  static constexpr int kCacheWords = 4;  // per lane and block: 4 half2 scores
  static constexpr int kCacheBlockBytes = kWarps * kCacheWords * 32 * 4;  // one block per warp
  static constexpr int kShift = OP == kInt4 ? 4 : 0;
  static constexpr int kStageSmem = kWarps * kStages * kTileBytes;
  static constexpr int kReduceSmem = kWarps * 8 * DV * (kFp16 ? 4 : 8);
  // Shared memory per cached block of a warp, for the 4 warps: their scores and masks of live slots.
  static constexpr int kCachedBlockBytes = kCacheBlockBytes + kWarps * 4;
  // Dynamic shared memory for a score cache of `cached` blocks per warp.
  static constexpr int smem_bytes(int cached) {
    return kStageSmem + cached * kCachedBlockBytes > kReduceSmem ? kStageSmem + cached * kCachedBlockBytes
                                                                  : kReduceSmem;
  }
  static_assert(kKeyBytes % 16 == 0 && kValBytes % 16 == 0, "rows must be whole 16-byte chunks");
  static_assert(kLaneWords >= 1, "head dim too small");
};

template <int NB>
__device__ __forceinline__ void ldg_words(uint32_t (&w)[NB / 4], const uint8_t* src) {
  if constexpr (NB >= 16) {
#pragma unroll
    for (int u = 0; u < NB / 16; ++u) {
      const uint4 x = *reinterpret_cast<const uint4*>(src + 16 * u);
      w[4 * u] = x.x; w[4 * u + 1] = x.y; w[4 * u + 2] = x.z; w[4 * u + 3] = x.w;
    }
  } else if constexpr (NB == 8) {
    const uint2 x = *reinterpret_cast<const uint2*>(src);
    w[0] = x.x; w[1] = x.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  }
}

// A lane's run of one Q or K row as MMA words. The same map is applied to both operands, so any
// k permutation it makes cancels in the dot product.
template <int OP, int NW>
struct QkWords {
  static constexpr int kWords = OP == kInt4 ? 2 * NW : OP == kInt16 ? NW / 2 : NW;
  uint32_t hi[kWords];                          // the only plane, or the signed high bytes
  uint32_t lo[OP == kInt16 ? kWords : 1];       // unsigned low bytes (16-bit)

  __device__ __forceinline__ void set(const uint32_t (&raw)[NW]) {
    if constexpr (OP == kInt4) {
      // 16 x nibble in each byte, as for the value operand: three instructions a word against sign
      // extension's nine (SASS); the scores come out 256 times too large, undone by an exact shift.
#pragma unroll
      for (int i = 0; i < NW; ++i) {
        hi[2 * i] = low_nibbles_x16(raw[i]);
        hi[2 * i + 1] = high_nibbles_x16(raw[i]);
      }
    } else if constexpr (OP == kInt16) {
#pragma unroll
      for (int i = 0; i < kWords; ++i) magicube_sddmm::split_planes(raw[2 * i], raw[2 * i + 1], hi[i], lo[i]);
    } else {
#pragma unroll
      for (int i = 0; i < NW; ++i) hi[i] = raw[i];
    }
  }
};

template <int OP>
struct QkAcc {
  using T = typename std::conditional<OP == kHalf, float, int>::type;
  T d[4];
  int x[OP == kInt16 ? 4 : 1];   // hi x lo + lo x hi, weight 2^8
  int ll[OP == kInt16 ? 4 : 1];  // lo x lo
};

__device__ __forceinline__ uint32_t pack_half2(__half a, __half b) {
  return static_cast<uint32_t>(__half_as_ushort(a)) | (static_cast<uint32_t>(__half_as_ushort(b)) << 16);
}
__device__ __forceinline__ float half_lo(uint32_t h) { return __half2float(__ushort_as_half(h & 0xFFFFu)); }
__device__ __forceinline__ float half_hi(uint32_t h) { return __half2float(__ushort_as_half(h >> 16)); }

// 2^x in one MUFU op; results below 2^-126 flush to 0, which every probability rounds to anyway
// (quantized: e * qmax < 0.5; fp16: below its subnormals).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The low bits of rint(v) for 0 <= v < 2^22 (a NaN v gives 0, as cvt.rni.u32 does), by the FMA pipe
// instead of the conversion unit that ex2 also needs (16 results a clock an SM): adding 1.5 * 2^23
// rounds v to an integer, to nearest even, in the float's low mantissa bits.
__device__ __forceinline__ uint32_t small_rint_bits(float v) {
  return __float_as_uint(__fadd_rn(fmaxf(v, 0.f), 12582912.f));
}

// Element i of an fp32 vector whose elements lie `step` bytes apart. The host keeps every i * step
// below 2^32: a 32-bit product (a 64-bit one costs the split-row kernels up to 5 registers).
__device__ __forceinline__ const float* strided(const float* base, uint32_t i, uint32_t step) {
  return reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(base) + i * step);
}

// Vector row `order_pos` of row_order in batch x head bh: the warp's own row (whole rows), or the
// CTA's, its blocks shared by the 4 warps (SPLIT). UNIFORM_SK: attention_kernel's comment.
template <int OP, int PB, int D, int DV, bool SPLIT, bool UNIFORM_SK>
__device__ __forceinline__ void attention_row(const Params& p, int64_t bh, int order_pos) {
  using C = Cfg<OP, PB, D, DV>;
  constexpr int NW = C::kLaneWords;
  using Words = QkWords<OP, NW>;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float red_max[kWarps][8];
  __shared__ float red_sum[kWarps][8];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int vrow = p.row_order[order_pos];
  const int v = p.v;
  const int start = p.row_ptr[2 * vrow];
  const int count = p.row_ptr[2 * vrow + 1] - start;
  // Uniform in the CTA when SPLIT: its warps read the same row.
  if (order_pos < p.long_rows && (count > p.long_count) != SPLIT) return;  // the other launch's row
  const int nb = (count + kSlots - 1) / kSlots;
  // This warp's blocks: block (SPLIT ? warp : 0) + j * kBlockStride for j < nbw.
  constexpr int kBlockStride = SPLIT ? kWarps : 1;
  const int nbw = !SPLIT ? nb : nb > warp ? (nb - warp + kWarps - 1) / kWarps : 0;
  const bool row_live = g < v;
  const uint32_t b = static_cast<uint32_t>(bh) / static_cast<uint32_t>(p.heads);
  const uint32_t h = static_cast<uint32_t>(bh) - b * static_cast<uint32_t>(p.heads);
  // Scores are kept as fl(x) * sign(softmax_scale) (negation is exact), so that
  // fl(x * softmax_scale) = fl(stored * |softmax_scale|) and the row max is a plain max.
  const float scale_abs = fabsf(p.softmax_scale);
  const bool negate = p.softmax_scale < 0.f;

  // Query fragment (A of S = Q K^T): row g, the lane's run t; rows g >= V and g + 8 are zero.
  Words qw;
  float sq = 0.f;
  {
    uint32_t raw[NW];
#pragma unroll
    for (int i = 0; i < NW; ++i) raw[i] = 0;
    if (row_live) {
      ldg_words<C::kLaneBytes>(raw, p.q.of(b, h) + static_cast<uint32_t>(vrow * v + g) * p.q.row + t * C::kLaneBytes);
      if constexpr (!C::kFp16) sq = *strided(p.scale_q.of(b, h), vrow * v + g, p.scale_q.step);
    }
    qw.set(raw);
  }

  // ---- The warp's value tiles, blocks 0..nbw-1 in the order pass 2 consumes them, streamed
  // through a per-warp ring from the start of the kernel: the first kStages - 1 land while pass 1
  // runs.
  //
  // Copy map: LPR lanes share a row (up to 4, 64 bytes), so one 16-byte cp.async of the warp
  // covers 32 / LPR rows: lane copies rows lane / LPR + (32 / LPR) k of a tile, 16-byte chunks
  // LPR u + lane % LPR. The gathers are bound by L1 wavefronts, which grow with the rows an
  // instruction touches: 8 rows of 64 bytes an instruction instead of 16 rows of 32 took 8b-8b
  // from 240 to 217-220 us, fp16 from 410-418 to 324-335 (H200, same run; 32-byte rows, as
  // 4-bit d = 64, stay at 16 rows). In the tile, chunk LPR u + lane % LPR of a row lies at the
  // row's offset for chunk lane % LPR, XOR 16 LPR u. The copies read through L2 only (.cg), which
  // spares the L1 its fills: H100, L = 4096, sparsity 0.9, random and structured patterns, 8b-8b
  // 148 -> 134 us and 145 -> 135 us, the other precisions up to 4 % less (.ca before).
  static_assert(C::kKeyBytes == C::kValBytes, "key and value rows have one size");
  constexpr int RB = C::kKeyBytes;
  constexpr int CPR = RB / 16;
  constexpr int LPR = CPR < 4 ? CPR : 4;
  constexpr int kRowStep = 32 / LPR;  // rows an instruction covers
  constexpr int kRows = LPR;          // rows a lane copies
  constexpr int kChunks = CPR / LPR;  // chunks a lane copies of each
  const int lane_chunk = lane % LPR;
  uint32_t row_dst[kRows];
#pragma unroll
  for (int k = 0; k < kRows; ++k) row_dst[k] = pinned(C::tile_offset(lane / LPR + kRowStep * k, lane_chunk * 16));
  const uint8_t* const key_base = pinned(p.k.of(b, h) + t * C::kLaneBytes);
  const uint8_t* const val_base = pinned(p.val.of(b, h) + lane_chunk * 16);
  const float* const sk_base = pinned(p.scale_k.of(b, h));
  const int* const warp_cols = p.col_idx + start + (SPLIT ? warp : 0) * kSlots + lane;  // + j * kBlockStride * kSlots
  const uint32_t n_cols = static_cast<uint32_t>(p.n);
  const uint32_t ring = smem_addr(smem) + warp * C::kStages * C::kTileBytes;
  const uint32_t ring_end = ring + C::kStages * C::kTileBytes;
  // Score cache, per lane and block: 4 half2 scores; per block the mask of its live slots.
  uint32_t* const cache = reinterpret_cast<uint32_t*>(smem + C::kStageSmem) + warp * p.cached * C::kCacheWords * 32;
  uint32_t* const masks =
      reinterpret_cast<uint32_t*>(smem + C::kStageSmem + p.cached * C::kCacheBlockBytes) + warp * p.cached;
  // The column of slot `lane` of block j (a cached line of L1 after its first read).
  auto col_of = [&](int j) { return warp_cols[j * kBlockStride * kSlots]; };

  // The column of slot `lane` of the next value tile to issue, loaded one tile ahead so the
  // gather addresses never wait on a dependent global load.
  int pf_col = nbw > 0 ? col_of(0) : -1;
  int iss_j = 0;
  uint32_t iss_dst = ring;
  // 4-bit containers copy past the last block too (pf_col -1: value row 0, into a tile nobody
  // reads), without a branch: H200, B 8, H 4, L 4096, sparsity 0.9, 4b-4b and 8b-4b 111 -> 108 us
  // (0.95: 69 -> 67). 8- and 16-bit ones ran slower that way (8b-8b 117 -> 124, 16b-16b 256 ->
  // 263), and fp16 ones, 2-3 us faster at 0.9, took 158 against 136 us at 0.95.
  constexpr bool kCopyPastEnd = OP == kInt4;
  auto issue = [&]() {
    if (kCopyPastEnd || iss_j < nbw) {
      // Each lane turns its own slot's column into a row offset once, and the copies take theirs
      // by shuffle. A dead slot (padding) copies value row 0, whose probability is 0: integer
      // products then add 0; fp16 ones would turn an inf or NaN there into NaN, so fp16 copies
      // zeros instead.
      const bool live_l = static_cast<uint32_t>(pf_col) < n_cols;
      const uint32_t off_l = (live_l ? static_cast<uint32_t>(pf_col) : 0u) * p.val.row;
      const uint32_t live_mask = C::kFp16 ? __ballot_sync(0xffffffffu, live_l) : ~0u;
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const int src_lane = lane / LPR + kRowStep * k;
        const uint8_t* src = val_base + __shfl_sync(0xffffffffu, off_l, src_lane);
        const int bytes = live_mask >> src_lane & 1u ? 16 : 0;
#pragma unroll
        for (int u = 0; u < kChunks; ++u)
          cp_async16<false>(iss_dst + (row_dst[k] ^ (16 * LPR * u)), src + 16 * LPR * u, bytes);
      }
      ++iss_j;
      if (iss_j < nbw) pf_col = col_of(iss_j);
      else if (kCopyPastEnd) pf_col = -1;
    }
    cp_async_commit();
    iss_dst = iss_dst + C::kTileBytes == ring_end ? ring : iss_dst + C::kTileBytes;
  };
  uint32_t rd_tile = ring;
  auto next_tile = [&]() -> uint32_t {
    cp_async_wait<C::kStages - 2>();
    __syncwarp();
    issue();
    const uint32_t tile = rd_tile;
    rd_tile = rd_tile + C::kTileBytes == ring_end ? ring : rd_tile + C::kTileBytes;
    return tile;
  };
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) issue();

  // ---- Key rows straight into registers: no shared-memory copy, which would cross the L1 data
  // pipe twice more (its fill and its reads) and take shared memory from the CTAs per SM. Blocks
  // past the score cache load theirs in pass 2 when used, unprefetched (a second Keys in flight
  // there would cost the registers of a 5th CTA per SM). Lane (g, t) holds run t of the key rows
  // of slots g, 8 + g, 16 + g, 24 + g (the B fragments of S = Q K^T), the key scale of slot `lane`
  // and the mask of live slots.
  struct Keys {
    uint32_t raw[4][NW];
    float sk;
    uint32_t live;
  };
  // A uniform key scale is read once: sq * sk is then one product per query row.
  const float sq_signed = negate ? -sq : sq;
  const float sqk = UNIFORM_SK && p.n > 0 ? sq_signed * *sk_base : 0.f;
  constexpr bool kKeyScales = !C::kFp16 && !UNIFORM_SK;
  auto load_keys = [&](int col_l, Keys& kr) {
    const bool live = static_cast<uint32_t>(col_l) < n_cols;
    kr.live = __ballot_sync(0xffffffffu, live);
    kr.sk = 0.f;
    if constexpr (kKeyScales) {
      if (live) kr.sk = *strided(sk_base, col_l, p.scale_k.step);
    }
    // A dead slot (padding) loads key row 0 instead: its score is never kept, and an
    // unconditional load spares the zeroing and the predicated copies around it.
    const uint32_t off_l = (live ? static_cast<uint32_t>(col_l) : 0u) * p.k.row;  // as the value copies
#pragma unroll
    for (int n = 0; n < 4; ++n)
      ldg_words<C::kLaneBytes>(kr.raw[n], key_base + __shfl_sync(0xffffffffu, off_l, 8 * n + g));
  };

  // ---- Scores of one block: h[n] holds the fp16 scores of row g at slots 8n + 2t, 8n + 2t + 1
  // (low, high half); bit 8n + e of `bits` says whether slot 8n + 2t + e is kept (the mask of
  // live slots shifted by 2t: one shift and one AND instead of gathering 8 bits).
  auto kept_bits = [&](uint32_t live_mask) { return row_live ? (live_mask >> (2 * t)) & 0x03030303u : 0u; };
  auto block_scores = [&](const Keys& kr, uint32_t (&h)[4], uint32_t& bits) {
    QkAcc<OP> acc[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[n].d[e] = 0;
        if constexpr (OP == kInt16) { acc[n].x[e] = 0; acc[n].ll[e] = 0; }
      }
      Words kw;
      kw.set(kr.raw[n]);
#pragma unroll
      for (int s = 0; s < Words::kWords / 2; ++s) {
        const uint32_t a[4] = {qw.hi[2 * s], 0u, qw.hi[2 * s + 1], 0u};
        if constexpr (C::kFp16) {
          float (&c)[4] = acc[n].d;
          mma_16816_f16(c, a, kw.hi[2 * s], kw.hi[2 * s + 1]);
        } else {
          mma_16832<true, true>(acc[n].d, a, kw.hi[2 * s], kw.hi[2 * s + 1]);
          if constexpr (OP == kInt16) {
            const uint32_t al[4] = {qw.lo[2 * s], 0u, qw.lo[2 * s + 1], 0u};
            mma_16832<true, false>(acc[n].x, a, kw.lo[2 * s], kw.lo[2 * s + 1]);
            mma_16832<false, true>(acc[n].x, al, kw.hi[2 * s], kw.hi[2 * s + 1]);
            mma_16832<false, false>(acc[n].ll, al, kw.lo[2 * s], kw.lo[2 * s + 1]);
          }
        }
      }
    }
    bits = kept_bits(kr.live);
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      // sq times the key scales of the lane's two slots 8n + 2t, 8n + 2t + 1.
      float f[2] = {sqk, sqk};
      if constexpr (kKeyScales) {
        f[0] = sq_signed * __shfl_sync(0xffffffffu, kr.sk, 8 * n + 2 * t);
        f[1] = sq_signed * __shfl_sync(0xffffffffu, kr.sk, 8 * n + 2 * t + 1);
      }
      __half hv[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if constexpr (C::kFp16) {
          hv[e] = __float2half_rn(acc[n].d[e]);
        } else if constexpr (OP == kInt16) {
          const int64_t q = static_cast<int64_t>(acc[n].d[e]) * 65536 + static_cast<int64_t>(acc[n].x[e]) * 256 +
                            acc[n].ll[e];
          hv[e] = __float2half_rn(__ll2float_rn(q) * f[e]);
        } else {
          hv[e] = __float2half_rn(__int2float_rn(acc[n].d[e] >> (2 * C::kShift)) * f[e]);
        }
      }
      h[n] = pack_half2(hv[0], hv[1]) ^ (C::kFp16 && negate ? 0x80008000u : 0u);  // integers: f has the sign
    }
  };

  // The row max of fl(x * softmax_scale) over the kept slots. Rounding is monotonic, so that is
  // fl(max stored * |s|): the blocks keep a running fp16 max of the stored scores, one max.f16x2
  // per slot pair with the dropped slots set to -inf; max.f16x2 drops NaN as fmaxf does.
  uint32_t hmax = 0xFC00FC00u;  // -inf, -inf
  // A full block (every slot kept: all but a row's last) takes no mask in the quantized kernels
  // (fp16 ran 1 % slower without them). Its rows past V get a max too, which nothing reads (their
  // outputs are not stored).
  constexpr bool kUnmaskedFull = !C::kFp16;
  auto block_max = [&](const uint32_t (&h)[4], uint32_t bits, bool full) {
    if (full) {
#pragma unroll
      for (int n = 0; n < 4; ++n) asm("max.f16x2 %0, %0, %1;\n" : "+r"(hmax) : "r"(h[n]));
      return;
    }
    // Kept bit 8n + e moved to the sign bit of byte n (e = 0: k0, e = 1: k1); a sign-replicating
    // byte permute spreads it over half e of the mask.
    const uint32_t k0 = bits << 7, k1 = bits << 6;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const uint32_t keep = prmt(k0, k1, (8 + n) * 0x11 + (12 + n) * 0x1100);
      const uint32_t x = (h[n] & keep) | (~keep & 0xFC00FC00u);
      asm("max.f16x2 %0, %0, %1;\n" : "+r"(hmax) : "r"(x));
    }
  };

  // ---- Pass 1: scores (cached in shared memory for the first `cached` blocks) and the row max.
  auto cache_store = [&](int j, const uint32_t (&h)[4], uint32_t live) {
    reinterpret_cast<uint4*>(cache + j * C::kCacheWords * 32)[lane] = make_uint4(h[0], h[1], h[2], h[3]);
    if (lane == 0) masks[j] = live;
  };
  // A block's scores: from the cache, or recomputed from its key rows (blocks past the cache:
  // rows longer than the mean).
  auto scores_of = [&](int j, uint32_t (&h)[4], uint32_t& bits, bool& full) {
    if (j < p.cached) {
      const uint4 c = reinterpret_cast<const uint4*>(cache + j * C::kCacheWords * 32)[lane];
      h[0] = c.x, h[1] = c.y, h[2] = c.z, h[3] = c.w;
      const uint32_t live = masks[j];
      bits = kept_bits(live);
      full = live == ~0u;
    } else {
      Keys kr;
      load_keys(col_of(j), kr);
      block_scores(kr, h, bits);
      full = kr.live == ~0u;
    }
  };
  // The key rows of block j + 1 are in flight while block j is multiplied, and the columns of
  // block j + 2 while those are. Wider runs load when used: two blocks of them in registers would
  // spill or cost occupancy (16-bit keys of d 64 and any of d 128); fp16 at d 64, whose shared
  // memory allows 3 CTAs per SM anyway, has the registers.
  constexpr bool kKeysAhead = C::kLaneBytes <= 16 || (C::kFp16 && C::kLaneBytes <= 32);
  // Two key buffers take turns (the loop unrolled by two): a copy of the next block's keys
  // into the current one cost some 20 moves a block. The next block's load is unconditional
  // (past the last block it reads key row 0): with a branch around it ptxas loaded into spare
  // registers and moved them over. H200, B 8, H 4, L 4096, sparsity 0.9: 8b-8b 122.5 -> 116.8 us,
  // 16b-8b 144.5 -> 125.6, fp16 274 -> 265.5.
  Keys keys_a, keys_b;
  int col_next = nbw > 1 ? col_of(1) : -1;
  if (kKeysAhead && nbw > 0) load_keys(col_of(0), keys_a);
  auto pass1_block = [&](int j, Keys& cur, Keys& next) {
    uint32_t h[4], bits;
    if constexpr (kKeysAhead) {
      load_keys(col_next, next);  // past the last block: key row 0 (col_next -1), never used
      col_next = j + 2 < nbw ? col_of(j + 2) : -1;
    } else {
      load_keys(col_of(j), cur);
    }
    block_scores(cur, h, bits);
    if (j < p.cached) cache_store(j, h, cur.live);
    block_max(h, bits, kUnmaskedFull && cur.live == ~0u);
  };
#pragma unroll 1
  for (int j = 0; j < nbw; j += 2) {
    pass1_block(j, keys_a, keys_b);
    if (j + 1 < nbw) pass1_block(j + 1, keys_b, keys_a);
  }
  __syncwarp();  // lane 0's block masks, for every lane of pass 2
  const float hm = fmaxf(half_lo(hmax), half_hi(hmax));
  float mx = hm > -INFINITY ? hm * scale_abs : -INFINITY;  // no kept slot: -inf, also for s = 0
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  float row_max = mx;
  if constexpr (SPLIT) {
    if (t == 0) red_max[warp][g] = mx;
    __syncthreads();
    row_max = red_max[0][g];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) row_max = fmaxf(row_max, red_max[w][g]);
  }

  // e = exp(x - max) of the kept slots (0 elsewhere). x and x - max are rounded separately, as
  // the reference does: an FMA contraction would move quantized probabilities across a rounding
  // boundary. exp(d) = 2^(d log2 e): the product's rounding moves e by at most |d| 2^-24 relative
  // (e |d| <= 1/e), ex2.approx by 2 ulp, about what expf itself allows. Computed for every slot
  // and selected, not branched on: padding and dead rows may give inf or NaN, which the select drops.
  constexpr float kLog2e = 1.4426950408889634f;
  // `full` (std::true_type) drops the select for a block whose slots are all kept: its rows past V
  // then get probabilities too, which multiply into their own output columns only (not stored).
  auto block_exp = [&](const uint32_t (&h)[4], uint32_t bits, float (&e)[4][2], auto full) {
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const float x0 = __fsub_rn(__fmul_rn(half_lo(h[n]), scale_abs), row_max);
      const float x1 = __fsub_rn(__fmul_rn(half_hi(h[n]), scale_abs), row_max);
      const float y0 = ex2(__fmul_rn(x0, kLog2e)), y1 = ex2(__fmul_rn(x1, kLog2e));
      e[n][0] = decltype(full)::value || (bits >> (8 * n) & 1u) ? y0 : 0.f;
      e[n][1] = decltype(full)::value || (bits >> (8 * n + 1) & 1u) ? y1 : 0.f;
    }
  };

  float sum = 0.f;
  float row_sum = 0.f;
  if constexpr (C::kFp16) {
    // fp16 probabilities are e / s: the sum is needed before the product.
    auto add = [&](const uint32_t (&h)[4], uint32_t bits) {
      float e[4][2];
      block_exp(h, bits, e, std::false_type{});
#pragma unroll
      for (int n = 0; n < 4; ++n) sum += e[n][0] + e[n][1];
    };
#pragma unroll 1
    for (int j = 0; j < nbw; ++j) {
      uint32_t h[4], bits;
      bool full;
      scores_of(j, h, bits, full);
      add(h, bits);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if constexpr (SPLIT) {
      if (t == 0) red_sum[warp][g] = sum;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < kWarps; ++w) row_sum += red_sum[w][g];
    } else {
      row_sum = sum;
    }
  }

  // ---- Pass 2: probabilities and O^T += V^T P^T.
  using AccT = typename std::conditional<C::kFp16, float, int>::type;
  AccT acc[C::kAccSets][C::kMT][4];
#pragma unroll
  for (int s = 0; s < C::kAccSets; ++s)
#pragma unroll
    for (int mt = 0; mt < C::kMT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[s][mt][e] = 0;

  const int li = lane & 7, lm = lane >> 3;
  const uint32_t lane_row = pinned(C::tile_offset(lane, 0));  // XOR 16 c: chunk c of slot `lane`
  auto block_pv = [&](uint32_t tile, const uint32_t (&h)[4], uint32_t bits, auto full) {
    float e[4][2];
    block_exp(h, bits, e, full);
    if constexpr (C::kFp16) {
      uint32_t pb[4];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        // e is 0 off the kept slots and on dead rows (sum 0: never 0 / 0). A NaN e (a NaN or infinite
        // score, or a row of -inf alone) stays NaN and makes the row's output NaN, as in the reference.
        const __half p0 = e[n][0] != 0.f ? __float2half_rn(e[n][0] / row_sum) : __float2half_rn(0.f);
        const __half p1 = e[n][1] != 0.f ? __float2half_rn(e[n][1] / row_sum) : __float2half_rn(0.f);
        pb[n] = pack_half2(p0, p1);
      }
#pragma unroll
      for (int mt = 0; mt < C::kMT; ++mt)
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
          const int row = 16 * ks + 8 * (lm >> 1) + li;
          const int chunk = 2 * mt + (lm & 1);
          uint32_t a[4];
          ldsm_x4_trans(tile + C::tile_offset(row, chunk * 16), a[0], a[1], a[2], a[3]);
          mma_16816_f16(acc[0][mt], a, pb[2 * ks], pb[2 * ks + 1]);
        }
    } else {
      constexpr float kQmax = static_cast<float>((1 << PB) - 1);
      uint32_t q[4][2];
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          sum += e[n][x];
          // x <= 0, so e <= 1 + 2^-22 (ex2.approx: 2 ulp) and e * qmax rounds to at most qmax: no
          // clamp, as in the reference.
          q[n][x] = small_rint_bits(__fmul_rn(e[n][x], kQmax));  // the planes below take its low bytes
        }
      // B fragment: k = 4t + i <-> slots 2t, 2t+1, 8+2t, 9+2t (b0) and 16 + the same (b1).
      uint32_t pb[C::kPPlanes][2];
#pragma unroll
      for (int pl = 0; pl < C::kPPlanes; ++pl) {
        // Byte 1 (the high plane of 16-bit probabilities) or byte 0 of each, 4 to a word.
        const uint32_t pick = (C::kPPlanes == 2 && pl == 0) ? 0x0051u : 0x0040u;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int n0 = 2 * half, n1 = 2 * half + 1;
          pb[pl][half] = __byte_perm(__byte_perm(q[n0][0], q[n0][1], pick), __byte_perm(q[n1][0], q[n1][1], pick),
                                     0x5410u);
        }
      }
      // Lane l addresses slot l's 16-byte chunk c of the tile.
      auto lchunk = [&](int c) { return tile + (lane_row ^ (16 * c)); };
      if constexpr (OP == kInt8) {
#pragma unroll
        for (int mt = 0; mt < C::kMT; ++mt) {
          uint32_t r[4];
          ldsm_x4_trans(lchunk(mt), r[0], r[1], r[2], r[3]);
          const uint32_t a[4] = {even_bytes(r[0], r[1]), odd_bytes(r[0], r[1]), even_bytes(r[2], r[3]),
                                 odd_bytes(r[2], r[3])};
#pragma unroll
          for (int pl = 0; pl < C::kPPlanes; ++pl) mma_16832<true, false>(acc[pl][mt], a, pb[pl][0], pb[pl][1]);
        }
      } else if constexpr (OP == kInt4) {
#pragma unroll
        for (int c = 0; c < C::kMT / 2; ++c) {
          uint32_t r[4];
          ldsm_x4_trans(lchunk(c), r[0], r[1], r[2], r[3]);
          const uint32_t x01 = even_bytes(r[0], r[1]), y01 = odd_bytes(r[0], r[1]);
          const uint32_t x23 = even_bytes(r[2], r[3]), y23 = odd_bytes(r[2], r[3]);
          const uint32_t lo[4] = {low_nibbles_x16(x01), low_nibbles_x16(y01), low_nibbles_x16(x23),
                                  low_nibbles_x16(y23)};
          const uint32_t hi[4] = {high_nibbles_x16(x01), high_nibbles_x16(y01), high_nibbles_x16(x23),
                                  high_nibbles_x16(y23)};
#pragma unroll
          for (int pl = 0; pl < C::kPPlanes; ++pl) {
            mma_16832<true, false>(acc[pl][2 * c], lo, pb[pl][0], pb[pl][1]);
            mma_16832<true, false>(acc[pl][2 * c + 1], hi, pb[pl][0], pb[pl][1]);
          }
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < C::kMT; ++mt) {
          uint32_t r[4], s[4];
          ldsm_x4_trans(lchunk(2 * mt), r[0], r[1], r[2], r[3]);
          ldsm_x4_trans(lchunk(2 * mt + 1), s[0], s[1], s[2], s[3]);
          const uint32_t vh[4] = {odd_bytes(r[0], r[1]), odd_bytes(s[0], s[1]), odd_bytes(r[2], r[3]),
                                  odd_bytes(s[2], s[3])};
          const uint32_t vl[4] = {even_bytes(r[0], r[1]), even_bytes(s[0], s[1]), even_bytes(r[2], r[3]),
                                  even_bytes(s[2], s[3])};
          // planes: P = ph * 2^8 + pl, V = vh * 2^8 + vl -> sets 2^16, 2^8, 2^0
          mma_16832<true, false>(acc[0][mt], vh, pb[0][0], pb[0][1]);
          mma_16832<true, false>(acc[1][mt], vh, pb[1][0], pb[1][1]);
          mma_16832<false, false>(acc[1][mt], vl, pb[0][0], pb[0][1]);
          mma_16832<false, false>(acc[2][mt], vl, pb[1][0], pb[1][1]);
        }
      }
    }
  };

#pragma unroll 1
  for (int j = 0; j < nbw; ++j) {
    uint32_t h[4], bits;
    bool full;
    scores_of(j, h, bits, full);
    // Full blocks without the kept-slot masks: H200, B 8, H 4, L 4096, sparsity 0.9, 8b-8b 126.8 ->
    // 125.0 us, 4-bit 130.4 -> 125.6.
    const uint32_t tile = next_tile();
    if (kUnmaskedFull && full) block_pv(tile, h, bits, std::true_type{});
    else block_pv(tile, h, bits, std::false_type{});
  }

  if constexpr (!C::kFp16) {
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (SPLIT && t == 0) red_sum[warp][g] = sum;
  }

  // The output element of accumulator (mt, e): query row 2t + (e & 1), column dv_of(mt, g + 8 (e >> 1)).
  auto dv_of = [](int mt, int rr) {
    if constexpr (OP == kInt8) return 16 * mt + 2 * (rr & 7) + (rr >> 3);
    else if constexpr (OP == kInt4) return 32 * (mt >> 1) + 4 * (rr & 7) + 2 * (rr >> 3) + (mt & 1);
    else return 16 * mt + rr;
  };
  // The exact integer output of accumulator (mt, e), its planes recombined.
  auto total = [&](int mt, int e) {
    int64_t w = 0;
#pragma unroll
    for (int s = 0; s < C::kAccSets; ++s) {
      const int sh = C::kAccSets == 1 ? 0 : 8 * (C::kAccSets - 1 - s);
      w += static_cast<int64_t>(acc[s][mt][e]) << sh;
    }
    return w >> C::kShift;
  };
  // Output rows of this vector row: [BH / heads, M, heads, DV] at (bh / heads, vrow * V, bh % heads),
  // rows `ld` elements apart.
  const int ld = p.heads * DV;
  auto out_rows = [&]() {
    return p.out + (static_cast<int64_t>(b) * p.m + static_cast<int64_t>(vrow) * v) * ld + h * DV;
  };
  const float* const sv_base = p.scale_v.of(b, h);
  // body(mt, e, r, dv) for each accumulator of a live output row: row r of the vector row, column dv.
  auto for_each_output = [&](auto&& body) {
#pragma unroll
    for (int mt = 0; mt < C::kMT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 2 * t + (e & 1);
        if (r < v) body(mt, e, r, dv_of(mt, g + 8 * (e >> 1)));
      }
  };

  if constexpr (!SPLIT) {
    // The warp owns the whole row: round its accumulators straight to the output. The row sums
    // sit with the lanes of g = row.
    constexpr float kQmax = static_cast<float>((1 << PB) - 1);
    float rs[2] = {0.f, 0.f};
    if constexpr (!C::kFp16) {
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const float s = __shfl_sync(0xffffffffu, sum, 4 * (2 * t + x));
        rs[x] = count == 0 ? 0.f : 1.f / (s * kQmax);
      }
    }
    auto value = [&](int mt, int e) {
      if constexpr (C::kFp16) {
        return __float2half_rn(acc[0][mt][e]);
      } else {
        const float sv = *strided(sv_base, dv_of(mt, g + 8 * (e >> 1)), p.scale_v.step);
        return __float2half_rn(__ll2float_rn(total(mt, e)) * (rs[e & 1] * sv));
      }
    };
    // 8- and 4-bit values leave output columns dv, dv + 1 (dv even) in one lane: accumulators
    // (mt, e) and (mt, e + 2) for 8 bits, (mt, e) and (mt + 1, e) for 4; one half2 store takes both.
    constexpr bool kPairs = OP == kInt8 || OP == kInt4;
    __half* out = out_rows();
    for_each_output([&](int mt, int e, int r, int dv) {
      if constexpr (kPairs) {
        if (OP == kInt8 ? e >= 2 : (mt & 1) != 0) return;  // the second of a pair
        const int mt2 = OP == kInt8 ? mt : mt + 1, e2 = OP == kInt8 ? e + 2 : e;
        *reinterpret_cast<__half2*>(out + r * ld + dv) = __halves2half2(value(mt, e), value(mt2, e2));
      } else {
        out[r * ld + dv] = value(mt, e);
      }
    });
    if constexpr (kCopyPastEnd) cp_async_wait<0>();  // the copies past the last block land first
    return;
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its ring: the reduction reuses it

  // ---- Cross-warp reduction of the V x DV partial outputs, then one rounding to fp16.
  using RedT = typename std::conditional<C::kFp16, float, int64_t>::type;
  RedT* red = reinterpret_cast<RedT*>(smem);
  for_each_output([&](int mt, int e, int r, int dv) {
    if constexpr (C::kFp16) {
      red[(warp * 8 + r) * DV + dv] = acc[0][mt][e];
    } else {
      red[(warp * 8 + r) * DV + dv] = total(mt, e);
    }
  });
  // A thread writes output columns c, c + 1 of rows r, r + 2 kThreads / DV, ...: its columns and
  // their value scales are the same in every row, so the scales are loaded before the barrier.
  static_assert((2 * kThreads) % DV == 0, "a thread keeps its output columns");
  const int c0 = (2 * threadIdx.x) % DV;
  float sv[2] = {0.f, 0.f};
  if constexpr (!C::kFp16) {
    sv[0] = *strided(sv_base, c0, p.scale_v.step);
    sv[1] = *strided(sv_base, c0 + 1, p.scale_v.step);
  }
  __syncthreads();

  __half* const out = out_rows() + c0;
  for (int idx = 2 * threadIdx.x; idx < v * DV; idx += 2 * kThreads) {
    const int r = idx / DV;
    __half2* const o = reinterpret_cast<__half2*>(out + r * ld);
    RedT tot[2] = {red[idx], red[idx + 1]};
#pragma unroll
    for (int w = 1; w < kWarps; ++w)
#pragma unroll
      for (int x = 0; x < 2; ++x) tot[x] += red[w * 8 * DV + idx + x];
    if constexpr (C::kFp16) {
      *o = __floats2half2_rn(tot[0], tot[1]);
    } else {
      constexpr float kQmax = static_cast<float>((1 << PB) - 1);
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red_sum[w][r];
      const float rs = count == 0 ? 0.f : 1.f / (s * kQmax);
      *o = __halves2half2(__float2half_rn(__ll2float_rn(tot[0]) * (rs * sv[0])),
                          __float2half_rn(__ll2float_rn(tot[1]) * (rs * sv[1])));
    }
  }
}

// Rasterization: batch x heads go in windows of gridDim.x, sized on the host so that a window's
// keys and values stay in L2. blockIdx.x picks the batch x head in the window, blockIdx.y the row
// group (a CTA's vector rows in row_order, from p.group0: a launch covers at most 65535) and
// blockIdx.z the window. CTAs start in that order (x fastest) and row_order descends in length, so
// the longest rows of every batch x head in a window start first.
//
// UNIFORM_SK (integer modes): the key scale is one number per batch x head (stride 0 along the
// keys, as the attention layer passes it), multiplied into sq once instead of read per key. A
// kernel of its own beats a runtime test of the stride: H200, B 8, H 4, L 4096, sparsity 0.9,
// 8b-8b 116.8 us, against 122.2 with both copies of the row in one kernel (a test per row) and
// some 2 % more with a test per block.
template <int OP, int PB, int D, int DV, bool SPLIT, bool UNIFORM_SK>
__global__ void __launch_bounds__(kThreads) attention_kernel(const Params p) {
  await_inputs();
  const int64_t bh = static_cast<int64_t>(blockIdx.z) * gridDim.x + blockIdx.x;
  if (bh >= p.bh) return;  // the last window may be narrower
  const int group = p.group0 + blockIdx.y;
  if constexpr (SPLIT) {
    attention_row<OP, PB, D, DV, true, UNIFORM_SK>(p, bh, group);
  } else {
    const int pos = group * kWarps + (threadIdx.x >> 5);
    // The last CTA may hold fewer rows.
    if (pos < p.m / p.v) attention_row<OP, PB, D, DV, false, UNIFORM_SK>(p, bh, pos);
  }
}

}  // namespace attention_detail
}  // namespace magicube
