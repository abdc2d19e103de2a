// SpMM on SR-BCRS: C[bh] (M x N) = A[bh] (sparse M x K, V x 1 vectors, stride 32) @ B[bh] (K x N).
//
// Design (Hopper, measured): every product is an int8 mma.sync m16n8k32 (1279 TOPS, vs 476 for
// the paper's m8n8k16) or, for fp16, m16n8k16 with fp32 accumulation. The kernel computes the
// transposed product C^T = B^T A^T so that the dense operand fills the MMA's M = 16 and the sparse
// V x 32 block, whose rows are contiguous along k, is the MMA's B operand (n = 8 = V) loaded with
// plain 32/64-bit shared loads. For V < 8 the unused MMA columns are zero: the kernel is bound by
// the gather of dense rows (each gathered row feeds only V output rows), not by MMA issue, so
// stacking other vector rows into those columns (which would need their own gathered rows) buys
// nothing here.
//
// Two kernels. The gather kernel (spmm_kernel) suits wide B; the resident-B kernel
// (spmm_resident_kernel, at the end of this file) suits narrow B, as the attention pipeline's
// P x V with N = head dim, and is described there. The host picks one (csrc/spmm.cu).
//
// Gather kernel: one CTA = one vector row x a kTileBytes-wide slice of B's rows; 4 warps split the
// slice. Per 32-slot block, the 32 gathered dense rows go to shared memory through a 4-stage
// cp.async pipeline. The gather is the limiter: every kept vector re-reads a whole row slice of B
// from L2 (measured on an H200: ~7-8 TB/s effective at large problems; latency-bound when the grid
// is small), so the pipeline keeps three blocks in flight per CTA with several CTAs per SM, and
// the column indices of the next blocks are prefetched into registers one or two steps ahead
// (Kind::kColsAhead) so the gather addresses seldom wait on a dependent load. Where rows average
// two blocks or more, most integer kinds take two blocks a step, with two or three blocks in flight
// (PAIR_RING, below).
// The online transpose of the gathered tile happens on the way out of shared memory: ldmatrix.trans
// transposes byte pairs and one prmt per register finishes the 8-bit transpose (16-bit planes fall
// out of the same prmt). Slots are placed in shared memory rows so that each ldmatrix 8x8 matrix
// reads 8 consecutive rows, and the 16-byte chunks are XOR-swizzled with the row so those reads and
// the cp.async writes are bank-conflict free. Because the MMA's k order is free as long as both
// operands agree, the sparse fragment is loaded in whatever order its container makes cheapest (no
// int4 column shuffle is needed; the kernel works on shuffled and unshuffled patterns alike). A row
// runs on one group of 4 warps: two groups taking its even and odd blocks, a ring each, their sums
// added at the end, took 1.32x the time over 44 H200 cells (kernel_checks.md, sixty-ninth round).
//
// Wide operands: 16-bit values are two byte planes, x = hi * 256 + lo (hi signed, or unsigned for
// u16; lo unsigned), multiplied plane by plane with mixed-signedness MMAs and recombined with
// shifts in int64. At V 2 both planes of 16-bit A share one MMA (Kind's STACK): the sparse operand
// has 8 columns and the vector 2 rows, so its columns take the rows' high planes, their low planes
// and, for signed A, a column of ones. Signed high planes are offset by 128 to unsigned bytes, and
// the ones column sums the gathered rows, which undoes the offset: x = 256 (hi + 128) + lo - 32768
// per gathered row. One MMA a tile instead of two, and half the accumulators. At V 4 the four rows'
// high planes and their low ones fill the 8 columns, with no room for a ones column: unsigned
// values stack as they are, and 12-bit ones as balanced base-256 digits, x = 256 h + l with l =
// (int8) x and h = (x + 128) >> 8 in [-8, 8], all signed, with no offset. Signed 16-bit values stay
// in two MMAs there: their offset would need the gathered rows' sums by other means (dp4a over the
// dense fragments, four instructions a tile, cost more than the MMA they saved: kernel_checks.md,
// fiftieth round). int4 values are widened in registers to 16 * value (a mask, no sign arithmetic)
// and the exact multiple of 16 is shifted out at the end. The int32 accumulators are folded into
// int64 every 512 blocks, before any plane product could overflow (a block adds at most 32 * 255 *
// 255 < 2^21 per plane).
#pragma once

#include <cstdint>
#include <cuda_fp16.h>
#include <type_traits>

#include "mma.cuh"

namespace magicube {
namespace spmm_detail {

constexpr int kSlots = 32;        // SR-BCRS stride of the ops
// Bytes of each gathered dense row per CTA: 256 for 8/16-bit B (256 int8 / 128 int16 or fp16
// columns); int4 B takes 128 (again 256 columns), which keeps the accumulators of its four m-tiles
// in registers. Wide tiles move more bytes per pipeline step (the barrier, index fetch and address
// math are per step): 256 beat 128 by 1.1-1.3x on the largest problems measured. Rows of at most
// 128 bytes take the narrow tile whatever B's width (csrc/spmm.cu: launch), since in a wide one
// half of every step's copies and products would be of zeros. Rows of at most 64 bytes of 8- and
// 4-bit B (N <= 64 and 128) take a quarter tile for the same reason.
constexpr int kWideTileBytes = 256;
constexpr int kNarrowTileBytes = kWideTileBytes / 2;
constexpr int kQuarterTileBytes = kWideTileBytes / 4;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 4;
constexpr int kPairedColBlocks = 64;  // 8 KB of indices
constexpr int kFlushBlocks = 512;

struct Params {
  const int* row_ptr;
  const int* col_idx;
  const int* row_order;  // or null in the gather kernel: vector row i in CTA i (launch_tiles)
  const uint8_t* a;     // sparse values, [BH, nnz_pad * V] containers (bytes)
  const uint8_t* b;     // dense, [BH, K, row_bytes], 16-byte aligned
  const float* scale_a; // [BH, M] or null
  const float* scale_b; // [BH, N] or null
  void* out;            // [BH, M, N]: int64, or fp16
  int64_t a_bh_bytes;
  int64_t b_bh_bytes;
  int m, n, k, v;
  int row_bytes;        // bytes of one dense row of B: a multiple of 16 (spmm_cuda pads B's rows)
  bool out_int64;
  // Resident-B kernel: warps take rows of about equal work (some row may be long, or it is not
  // known), else every warps-th row.
  bool balance;
  // Gather kernel, V 2 rows merged four at a time (spmm_kernel's MERGE): the blocks of the union
  // that its dynamic shared memory holds (a window; at most 32, -1 where rows do not merge). One
  // byte, where the bools leave room: the struct's size, and the other kernels' code, stay as
  // they were (an int field changed the fp16 kernel's SASS, a 16-bit one the L16-R8 kernel's).
  int8_t merge_blocks;
};

// AB/BB: sparse/dense bits (16, 8, 4); 0/0 is the fp16 kernel. AS: sparse values signed. TB: bytes
// of each gathered dense row per CTA (the gather kernel's tile; see kWideTileBytes and launch).
// STACK: the V at which 16-bit containers put both planes in one MMA (the file comment; the gather
// kernel only), 0 for two MMAs: 2 for any 16-bit values, 4 for unsigned ones and for 12-bit ones
// as balanced digits (signed A at V 4).
template <int AB, bool AS, int BB, int TB = (BB == 4 ? kNarrowTileBytes : kWideTileBytes), int STACK = 0>
struct Kind {
  static_assert(STACK == 0 || (AB == 16 && (STACK == 2 || STACK == 4)), "16-bit containers stack at V 2 or 4");
  static constexpr bool kFp16 = AB == 0;
  static constexpr int kABits = AB;
  static constexpr bool kASigned = AS;
  static constexpr int kBBits = BB;
  static constexpr bool kStacked = STACK != 0;
  static constexpr int kStackV = STACK;
  static constexpr bool kDigits = STACK == 4 && AS;
  // A's planes in separate MMAs, and whether the top one is a signed operand (stacked, planes are
  // unsigned bytes; digits are signed).
  static constexpr int kAPlanes = AB == 16 && !kStacked ? 2 : 1;
  static constexpr bool kTopSigned = STACK == 0 ? AS : kDigits;
  static constexpr int kBPlanes = BB == 16 ? 2 : 1;
  static constexpr int kSparseRowBytes = kFp16 ? 64 : kSlots * AB / 8;
  static constexpr int kTileBytes = TB;
  static constexpr int kChunks = kTileBytes / 16;
  static_assert((kChunks >= 8 || (kChunks == 4 && (BB == 8 || BB == 4))) && kChunks <= 16 && kChunks % kWarps == 0,
                "tiles of 8 to 16 chunks, or 4 for 8- and 4-bit B (a warp's chunk: one m-tile or two)");
  // Each thread copies one 16-byte chunk of kCopyRows of the 32 gathered rows per block.
  static constexpr int kCopyRows = kSlots * kChunks / kThreads;
  // Dense columns per 16-byte chunk and per CTA.
  static constexpr int kColsPerChunk = kFp16 ? 8 : 128 / BB;
  static constexpr int kTileCols = kChunks * kColsPerChunk;
  // MMA m-tiles (16 dense columns each) per warp and 32-slot block.
  static constexpr int kWarpChunks = kChunks / kWarps;
  static constexpr int kMTiles = kWarpChunks * kColsPerChunk / 16;
  static constexpr int kShift = (AB == 4 ? 4 : 0) + (BB == 4 ? 4 : 0);
  // Steps before its gather is issued that a block's column indices are loaded (spmm_kernel). Two
  // hide more of their latency and hold kCopyRows more registers. H200, gather kernel, M = K
  // 1024-4096, N 128 and 256, V 2-8, sparsity 0.7-0.98, two steps against one: L4-R4 0.961x the
  // time, L16-R8 0.986x, L16-R4 0.992x, L12-R4 0.994x, but L8-R4 1.021x and L8-R8 1.014x.
  static constexpr int kColsAhead = (AB == 4 || AB == 16) && (BB == 4 || BB == 8) ? 2 : 1;
  // The gather kernel's fold sums (FoldSums) in local memory, out of the main loop's registers,
  // where ptxas then schedules the loop better: 8-bit B's narrow tile. Against them in registers
  // (H200, gather kernel forced, M = K 1024-4096, V 2 / 4 / 8, sparsity 0.7 / 0.9 / 0.98, N 64 and
  // 128): L8-R8 0.94x the time (0.84-1.02x by cell), L16-R8 0.98x. With every kind's sums in local
  // memory the other kinds and tiles took 0.998-1.035x (L16-R16 1.035x, L8-R4 1.019x).
  static constexpr bool kLocalSums = BB == 8 && TB == kNarrowTileBytes;

  // Shared-memory row of block slot s (0..31): ldmatrix matrix j reads rows 8j..8j+7, and the
  // MMA k order it yields must match the sparse fragment's (see the file comment).
  __device__ static __forceinline__ int smem_row(int s) {
    if constexpr (AB == 4) {
      // sparse k order: k = 4t + j <-> slot 8t + 2j, k = 16 + 4t + j <-> slot 8t + 2j + 1
      return 8 * (2 * (s & 1) + ((s >> 2) & 1)) + 2 * (s >> 3) + ((s >> 1) & 1);
    } else {
      // sparse k order = slot order
      return 8 * (2 * (s >> 4) + ((s >> 1) & 1)) + 2 * ((s >> 2) & 3) + (s & 1);
    }
  }

  // Where 16-byte chunk c of shared row r lies in its row: ldmatrix reads one chunk of 8 consecutive
  // rows, and the swizzle puts those 8 reads in distinct bank groups. Rows of 8 chunks or more XOR
  // the chunk with r % 8; rows of 4, two to a 128-byte line, with (r / 2) % 4, so that the row's
  // parity and the swizzled chunk name the group.
  __device__ static __forceinline__ int swizzle(int c, int r) {
    if constexpr (kChunks >= 8) {
      return c ^ (r & 7);
    } else {
      return c ^ ((r >> 1) & 3);
    }
  }

  // Dense column (within the warp's chunks) of MMA row rr (0..15) of m-tile mt.
  __device__ static __forceinline__ int tile_col(int mt, int rr) {
    if constexpr (kFp16 || BB == 16) {
      return 16 * mt + rr;
    } else if constexpr (BB == 8) {
      return 16 * mt + 2 * (rr & 7) + (rr >> 3);
    } else {
      return 32 * (mt >> 1) + 4 * (rr & 7) + 2 * (rr >> 3) + (mt & 1);
    }
  }
};

// The int64 sums that the int32 accumulators fold into (Accumulators): in registers, zeroed at the
// start, or in the caller's local memory, out of the main loop's registers (Kind::kLocalSums). Those
// are untouched until a row's first fold: zeroed at the start and folded into at the end, they made
// the narrow tile 1.19x slower for L16-R8 and 1.02x for L8-R8 than in registers.
template <int MT, bool LOCAL>
struct FoldSums {
  int64_t x[MT][4];
  __device__ __forceinline__ void reset(int64_t (&)[MT * 4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j) x[mt][j] = 0;
  }
  __device__ __forceinline__ void before_fold() {}
  __device__ __forceinline__ int64_t& operator()(int mt, int j) { return x[mt][j]; }
  __device__ __forceinline__ int64_t value(int mt, int j) const { return x[mt][j]; }
};

template <int MT>
struct FoldSums<MT, true> {
  int64_t* x;
  bool folded;
  __device__ __forceinline__ void reset(int64_t (&local)[MT * 4]) {
    // An offset that ptxas cannot see through keeps the array in local memory.
    int offset = 0;
    asm volatile("" : "+r"(offset));
    x = local + offset;
    folded = false;
  }
  __device__ __forceinline__ void before_fold() {
    if (folded) return;
#pragma unroll
    for (int e = 0; e < MT * 4; ++e) x[e] = 0;
    folded = true;
  }
  __device__ __forceinline__ int64_t& operator()(int mt, int j) { return x[4 * mt + j]; }
  // The sum so far, zero before the first fold.
  __device__ __forceinline__ int64_t value(int mt, int j) const { return folded ? x[4 * mt + j] : 0; }
};

// The accumulators of MT m-tiles of kind K: int32 per bit-plane pair, their int64 folds (in the
// caller's local_sums where K::kLocalSums), and the fp16 kind's fp32 ones.
template <class K, int MT>
struct Accumulators {
  int acc[K::kAPlanes][K::kBPlanes][MT][4];
  FoldSums<MT, K::kLocalSums> wide;
  float accf[MT][4];

  __device__ __forceinline__ void zero(int64_t (&local_sums)[MT * 4]) {
    wide.reset(local_sums);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        accf[mt][j] = 0.f;
#pragma unroll
        for (int pa = 0; pa < K::kAPlanes; ++pa)
#pragma unroll
          for (int pb = 0; pb < K::kBPlanes; ++pb) acc[pa][pb][mt][j] = 0;
      }
  }

  // Plane pair (pa, pb)'s product, as its place in the value (plane 0 = high byte).
  __device__ __forceinline__ int64_t weighted(int pa, int pb, int mt, int j) const {
    return static_cast<int64_t>(acc[pa][pb][mt][j]) << (8 * ((K::kAPlanes - 1 - pa) + (K::kBPlanes - 1 - pb)));
  }

  // The sum of every block so far: the folds and the products since, added as read.
  __device__ __forceinline__ int64_t total(int mt, int j) const {
    int64_t x = wide.value(mt, j);
#pragma unroll
    for (int pa = 0; pa < K::kAPlanes; ++pa)
#pragma unroll
      for (int pb = 0; pb < K::kBPlanes; ++pb) x += weighted(pa, pb, mt, j);
    return x;
  }

  __device__ __forceinline__ void fold() {
    wide.before_fold();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int pa = 0; pa < K::kAPlanes; ++pa)
#pragma unroll
          for (int pb = 0; pb < K::kBPlanes; ++pb) {
            wide(mt, j) += weighted(pa, pb, mt, j);
            acc[pa][pb][mt][j] = 0;
          }
  }

  // `blocks` more blocks multiplied, counted in `since_fold` (the caller's, zero at the start): the
  // integer accumulators fold every kFlushBlocks (callers count in a fixed step that divides it, so
  // the count meets kFlushBlocks exactly).
  __device__ __forceinline__ void multiplied(int blocks, int& since_fold) {
    if constexpr (!K::kFp16) {
      since_fold += blocks;
      if (since_fold == kFlushBlocks) {
        fold();
        since_fold = 0;
      }
    }
  }

  // m-tile mt += dense fragment da (per B plane, plane 0 = high byte) x sparse fragment sb (per A
  // plane): the top planes carry the sign (kTopSigned for A's), the low ones are unsigned.
  __device__ __forceinline__ void mma(int mt, const uint32_t (&da)[K::kBPlanes][4],
                                      const uint32_t (&sb)[K::kAPlanes][2]) {
#pragma unroll
    for (int pa = 0; pa < K::kAPlanes; ++pa)
#pragma unroll
      for (int pb = 0; pb < K::kBPlanes; ++pb) {
        if (pb == 0) {
          if (pa == 0) mma_16832<true, K::kTopSigned>(acc[pa][pb][mt], da[pb], sb[pa][0], sb[pa][1]);
          else mma_16832<true, false>(acc[pa][pb][mt], da[pb], sb[pa][0], sb[pa][1]);
        } else {
          if (pa == 0) mma_16832<false, K::kTopSigned>(acc[pa][pb][mt], da[pb], sb[pa][0], sb[pa][1]);
          else mma_16832<false, false>(acc[pa][pb][mt], da[pb], sb[pa][0], sb[pa][1]);
        }
      }
  }
};

// A lane's share of one 32-slot block of sparse values, as stored (n = row g of the vector, k
// order as in Kind::smem_row): one word of 4-bit values, two of 8-bit, four of 16-bit. Blocks in
// flight are held in this form, the fewest registers their container allows, and widened into
// MMA fragments by sparse_fragment when used. ld32 / ld64 read at a byte offset from the block's
// first sparse row, wherever it lies. Rows past v are zero.
template <class K>
struct SparseWords {
  uint32_t w[K::kABits / 4];
};

template <class K, class Ld32, class Ld64>
__device__ __forceinline__ void load_sparse_words(int g, int t, bool row_live, Ld32&& ld32, Ld64&& ld64,
                                                  SparseWords<K>& a) {
  static_assert(K::kABits == 4 || K::kABits == 8 || K::kABits == 16, "integer sparse values only");
#pragma unroll
  for (int i = 0; i < K::kABits / 4; ++i) a.w[i] = 0;
  if (!row_live) return;
  const int row = g * K::kSparseRowBytes;
  if constexpr (K::kABits == 4) {
    a.w[0] = ld32(row + 4 * t);
  } else if constexpr (K::kABits == 8) {
    a.w[0] = ld32(row + 4 * t);
    a.w[1] = ld32(row + 16 + 4 * t);
  } else {
    const uint2 w0 = ld64(row + 8 * t), w1 = ld64(row + 32 + 8 * t);
    a.w[0] = w0.x, a.w[1] = w0.y, a.w[2] = w1.x, a.w[3] = w1.y;
  }
}

// The high digits h = (x + 128) >> 8 of four 12-bit values in two words of 16-bit containers, as
// signed bytes (the file comment): each container offset to unsigned, whose high byte is then h +
// 128 (x + 32768 + 128 < 2^16, so no carry crosses into the next container), and 128 taken off.
// Exact for any x up to 32639; the op's contract keeps 12-bit containers within [-2048, 2047].
__device__ __forceinline__ uint32_t high_digits(uint32_t w0, uint32_t w1) {
  constexpr uint32_t kOffset = 0x80008000u, kHalf = 0x00800080u;
  return odd_bytes((w0 ^ kOffset) + kHalf, (w1 ^ kOffset) + kHalf) ^ 0x80808080u;
}

// The sparse MMA fragment of a block's words for the lane of column g, plane 0 = high byte (or the
// only plane): int4 widened to 16 * value, 16-bit split into its byte planes or, stacked, the plane
// or digit of column g (the file comment; the words are row g % V's).
template <class K>
__device__ __forceinline__ void sparse_fragment(const SparseWords<K>& a, int g, uint32_t (&sb)[K::kAPlanes][2]) {
  if constexpr (K::kStacked) {
    // Columns g < V take row g's high plane (offset for signed A at V 2) or high digit, the others
    // its low byte; signed A at V 2 adds the ones column.
    auto top = [](uint32_t w0, uint32_t w1) {
      if constexpr (K::kDigits) return high_digits(w0, w1);
      else return odd_bytes(w0, w1) ^ (K::kASigned ? 0x80808080u : 0u);
    };
    const bool high = g < K::kStackV;
    sb[0][0] = high ? top(a.w[0], a.w[1]) : even_bytes(a.w[0], a.w[1]);
    sb[0][1] = high ? top(a.w[2], a.w[3]) : even_bytes(a.w[2], a.w[3]);
    if (K::kASigned && K::kStackV == 2 && g == 4) sb[0][0] = sb[0][1] = 0x01010101u;
  } else if constexpr (K::kABits == 8) {
    sb[0][0] = a.w[0];
    sb[0][1] = a.w[1];
  } else if constexpr (K::kABits == 4) {
    sb[0][0] = low_nibbles_x16(a.w[0]);
    sb[0][1] = high_nibbles_x16(a.w[0]);
  } else {
    sb[0][0] = odd_bytes(a.w[0], a.w[1]);
    sb[0][1] = odd_bytes(a.w[2], a.w[3]);
    sb[1][0] = even_bytes(a.w[0], a.w[1]);
    sb[1][1] = even_bytes(a.w[2], a.w[3]);
  }
}

// An 8-bit dense fragment from ldmatrix.x4.trans registers (byte pairs -> bytes).
__device__ __forceinline__ void dense8_fragment(const uint32_t (&r)[4], uint32_t (&da)[1][4]) {
  da[0][0] = even_bytes(r[0], r[1]);
  da[0][1] = odd_bytes(r[0], r[1]);
  da[0][2] = even_bytes(r[2], r[3]);
  da[0][3] = odd_bytes(r[2], r[3]);
}

// The two 4-bit dense fragments of one ldmatrix.x4.trans read (16 bytes = 32 columns a row): the
// low nibbles (m-tile 2c) and the high ones (2c + 1), each widened to 16 * value.
__device__ __forceinline__ void dense4_fragments(const uint32_t (&r)[4], uint32_t (&lo)[1][4],
                                                 uint32_t (&hi)[1][4]) {
  uint32_t da[1][4];
  dense8_fragment(r, da);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    lo[0][i] = low_nibbles_x16(da[0][i]);
    hi[0][i] = high_nibbles_x16(da[0][i]);
  }
}

__device__ __forceinline__ float to_float(int x) { return __int2float_rn(x); }
__device__ __forceinline__ float to_float(int64_t x) { return __ll2float_rn(x); }

// W consecutive output elements of one row starting at column c (< ncols when vec): one vector
// store when the row layout keeps it aligned (vec: N % W == 0), else element by element.
template <int W, typename T>
__device__ __forceinline__ void store_run(T* row, int c, int ncols, bool vec, const T (&x)[W]) {
  if (vec) {
    if (c >= ncols) return;
    if constexpr (W == 1) {
      row[c] = x[0];
    } else if constexpr (sizeof(T) == 2 && W == 2) {
      *reinterpret_cast<__half2*>(row + c) = __halves2half2(x[0], x[1]);
    } else if constexpr (sizeof(T) == 2 && W == 4) {
      *reinterpret_cast<uint2*>(row + c) =
          make_uint2(__half_as_ushort(x[0]) | (uint32_t)__half_as_ushort(x[1]) << 16,
                     __half_as_ushort(x[2]) | (uint32_t)__half_as_ushort(x[3]) << 16);
    } else {
#pragma unroll
      for (int i = 0; i < W; i += 2) *reinterpret_cast<longlong2*>(row + c + i) = make_longlong2(x[i], x[i + 1]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i)
      if (c + i < ncols) row[c + i] = x[i];
  }
}

// Writes vector row vrow (of V v) of batch x head bh, output columns n0 + [0, 16 * MT) from this
// warp's accumulators, after nblocks blocks: int64, or fp16 dequantized by the row and column
// scales. Element j of m-tile mt is output row 2t + (j & 1) of the vector row and column
// n0 + tile_col(mt, g + 8 * (j >> 1)). v is even, so a thread's two rows are both live or both not.
template <class K, int MT>
__device__ __forceinline__ void write_vector_row(const Params& p, Accumulators<K, MT>& r, int bh, int vrow, int v,
                                                 int n0, int nblocks) {
  constexpr int BB = K::kBBits;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ncols = p.n - n0;
  const bool rows_live = 2 * t < v;
  const int64_t orow = (int64_t)bh * p.m + (int64_t)vrow * v + 2 * t;
  auto col_of = [&](int mt, int j) { return K::tile_col(mt, g + 8 * (j >> 1)); };

  // Stores fragment elements that are adjacent columns of one output row as one vector: (j, j+2)
  // for 8-bit B; (2c, j), (2c+1, j), (2c, j+2), (2c+1, j+2) for 4-bit B. 16-bit and fp16 B hold
  // columns g and g + 8, so neighbouring lanes swap halves to form pairs (int64 is stored singly).
  auto store = [&](auto&& value) {
    using T = std::remove_cv_t<std::remove_reference_t<decltype(value(0, 0))>>;
    T* out = reinterpret_cast<T*>(p.out);
    if constexpr (BB == 8 || BB == 4) {
      constexpr int W = BB == 8 ? 2 : 4;
      const bool vec = p.n % W == 0;
#pragma unroll
      for (int c = 0; c < MT * 2 / W; ++c)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          T x[W];
          if constexpr (W == 2) {
            x[0] = value(c, i);
            x[1] = value(c, i + 2);
          } else {
            x[0] = value(2 * c, i);
            x[1] = value(2 * c + 1, i);
            x[2] = value(2 * c, i + 2);
            x[3] = value(2 * c + 1, i + 2);
          }
          if (rows_live) store_run<W>(out + (orow + i) * p.n + n0, col_of(W == 2 ? c : 2 * c, 0), ncols, vec, x);
        }
    } else if constexpr (sizeof(T) == 2) {
      const bool vec = p.n % 2 == 0;
      const bool odd = g & 1;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const T h[4] = {value(mt, 0), value(mt, 1), value(mt, 2), value(mt, 3)};
        const __half2 y =
            __shfl_xor_sync(0xffffffffu, odd ? __halves2half2(h[0], h[1]) : __halves2half2(h[2], h[3]), 4);
        const T yr[2] = {__low2half(y), __high2half(y)};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const T x[2] = {odd ? yr[i] : h[i], odd ? h[i + 2] : yr[i]};
          if (rows_live) store_run<2>(out + (orow + i) * p.n + n0, col_of(mt, 0) + (odd ? 7 : 0), ncols, vec, x);
        }
      }
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const T x[1] = {value(mt, j)};
          if (rows_live) store_run<1>(out + (orow + (j & 1)) * p.n + n0, col_of(mt, j), ncols, true, x);
        }
    }
  };

  if constexpr (K::kFp16) {
    store([&](int mt, int j) { return __float2half_rn(r.accf[mt][j]); });
  } else {
    auto dequantize = [&](auto&& integer) {
      if (p.out_int64) {
        store([&](int mt, int j) { return static_cast<int64_t>(integer(mt, j)); });
      } else {
        // All scales are loaded before the first store: `out` may alias them as far as the
        // compiler knows, so later loads could not move above a store.
        float sa[2] = {0.f, 0.f}, sb[MT][2];
        if (rows_live) {
          sa[0] = p.scale_a[orow];
          sa[1] = p.scale_a[orow + 1];
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int c = col_of(mt, 2 * h);
            sb[mt][h] = rows_live && c < ncols ? p.scale_b[(int64_t)bh * p.n + n0 + c] : 0.f;
          }
        store([&](int mt, int j) {
          return __float2half_rn(to_float(integer(mt, j)) * (sa[j & 1] * sb[mt][j >> 1]));
        });
      }
    };
    if constexpr (K::kStacked) {
      // Columns 2t and 2t + 1 of the sparse operand are lane t's. At V 2, lane 0 holds the sums of
      // the rows' high planes, lane 1 of their low planes, lane 2 of the ones column (its even
      // elements), and lane 0 writes the rows; at V 4, lanes 0 and 1 hold the high planes' (or
      // digits') sums of the rows they write, lanes 2 and 3 the low ones'. column(mt, j) is this
      // lane's sum: the int32 accumulator where it is the whole sum (as below), else the int64
      // total.
      int64_t y[MT][4];
      auto combine = [&](auto&& column) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int64_t high = column(mt, j);
            const int64_t low = __shfl_down_sync(0xffffffffu, column(mt, j), K::kStackV / 2);
            if constexpr (K::kStackV == 4) {
              y[mt][j] = 256 * high + low;
            } else {
              const int64_t rows = __shfl_down_sync(0xffffffffu, column(mt, j & 2), 2);
              y[mt][j] = 256 * high + low - (K::kASigned ? 32768 * rows : 0);
            }
          }
      };
      if (K::kBPlanes == 1 && nblocks < kFlushBlocks) combine([&](int mt, int j) { return r.acc[0][0][mt][j]; });
      else combine([&](int mt, int j) { return r.total(mt, j); });
      dequantize([&](int mt, int j) { return y[mt][j] >> K::kShift; });
    } else if (K::kAPlanes * K::kBPlanes == 1 && nblocks < kFlushBlocks) {
      // A single-plane accumulator that was never folded (the loop folds after kFlushBlocks
      // blocks) holds the exact result in int32.
      dequantize([&](int mt, int j) { return r.acc[0][0][mt][j] >> K::kShift; });
    } else if constexpr (K::kLocalSums) {
      // The last blocks' plane products added to the sums as read, without writing them back.
      dequantize([&](int mt, int j) { return r.total(mt, j) >> K::kShift; });
    } else {
      r.fold();
      dequantize([&](int mt, int j) { return r.wide(mt, j) >> K::kShift; });
    }
  }
}

// Exclusive prefix sum of x over the CTA's threads (WARPS warps), through a word of shared memory
// a warp (`warp_totals`); adds the CTA's sum to `total`. To run again, the CTA passes a barrier
// first (the totals are still being read).
template <int WARPS, typename T>
__device__ __forceinline__ int cta_exclusive_scan(int x, T& total, int* warp_totals) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) warp_totals[warp] = incl;
  __syncthreads();
  int before = 0, sum = 0;
#pragma unroll
  for (int i = 0; i < WARPS; ++i) {
    before += i < warp ? warp_totals[i] : 0;
    sum += warp_totals[i];
  }
  total += sum;
  return before + incl - x;
}

// Four V 2 rows merged into one V 8 row (spmm_kernel's MERGE). At high sparsity a V 2 row is a
// block or three long, and the gather kernel's CTAs spend much of their time filling and draining
// the pipeline, and multiplying padding, rather than gathering; four rows' union has about as many
// columns as the four together (at density d, 1 - (1 - d)^4 against 4 d), so it gathers about as
// many rows of B, in a quarter as many CTAs four times as long, and fills the MMA's eight columns
// where V 2 fills two. The CTA builds the union in shared memory: every kept column sets its bit
// in a bitmap of K bits, and a scan of the bitmap's words numbers the union's columns in ascending
// order (a column's rank: its word's prefix and the bits below it). The union is then multiplied
// in windows of p.merge_blocks blocks (one, where the host sized it from the longest row; a wrong
// hint only costs windows): the window's columns, and each kept slot's two values at its rank, in
// rows 2j and 2j + 1 of merged row j (zero where a row lacks the column), laid out as a V 8 row's
// blocks. The dynamic shared memory holds, in this order: the window's values (merge_blocks
// blocks of 8 sparse rows), its columns (kSlots a block, -1 past the union), the bitmap and
// the prefixes (K / 32 words, rounded up, each). (Loading the first window's values with the
// columns, before the scan, in registers, took 1.04x the time; kernel_checks.md, fifty-second
// round.)
template <class K>
struct MergedRows {
  static constexpr int kRowBytes = K::kSparseRowBytes;
  static constexpr int kBlockBytes = 8 * kRowBytes;

  // The dynamic shared memory of the layout above (the host sizes the launch by it).
  __host__ __device__ static constexpr int64_t smem_bytes(int merge_blocks, int k) {
    return int64_t{merge_blocks} * (kBlockBytes + kSlots * 4) + 2 * ((int64_t{k} + 31) / 32) * 4;
  }

  // The kernel constructs one for each step (build, each window) rather than keeping one through
  // the main loop: the row bounds are loaded again, and no register holds them meanwhile.
  uint8_t* values;
  int* cols;
  uint32_t* bitmap;
  int* prefix;
  int words;
  int start[4], ends[4];  // row j's first slot, and the end of its padded slots among the four's

  // Where the window's column indices lie in `smem` (the layout above).
  __device__ __forceinline__ static int* cols_in(const Params& p, uint8_t* smem) {
    return reinterpret_cast<int*>(smem + p.merge_blocks * kBlockBytes);
  }

  __device__ __forceinline__ MergedRows(const Params& p, int group, uint8_t* smem)
      : values(smem),
        cols(cols_in(p, smem)),
        bitmap(reinterpret_cast<uint32_t*>(cols + p.merge_blocks * kSlots)),
        words((p.k + 31) / 32) {
    prefix = reinterpret_cast<int*>(bitmap + words);
    int total = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      start[j] = p.row_ptr[2 * (4 * group + j)];
      total += (p.row_ptr[2 * (4 * group + j) + 1] - start[j] + kSlots - 1) / kSlots * kSlots;
      ends[j] = total;
    }
  }

  // Slot e of the four rows' padded slots (padding, -1, may lie among a last block's kept slots
  // in int4-shuffled patterns, so every padded slot is looked at), as row j and slot of col_idx.
  __device__ __forceinline__ int slot(int e, int& j) const {
    // Selects, not indexing by j, which would put the arrays in local memory.
    int first = start[0], before = 0;
    j = 0;
#pragma unroll
    for (int i = 1; i < 4; ++i)
      if (e >= ends[i - 1]) j = i, first = start[i], before = ends[i - 1];
    return first + e - before;
  }

  // The two values of slot s (rows 0 and 1 of its vector), as stored, in one word.
  __device__ __forceinline__ static uint32_t load_pair(const Params& p, int bh, int s) {
    const uint8_t* src = p.a + bh * p.a_bh_bytes + (int64_t)(s / kSlots) * 2 * kRowBytes;
    if constexpr (K::kABits == 4) {
      // Slot x's nibble is byte x / 2 of its row, the low one for even x.
      const int shift = 4 * (s & 1), byte = (s % kSlots) / 2;
      return (src[byte] >> shift & 0xFu) | (src[kRowBytes + byte] >> shift & 0xFu) << 4;
    } else if constexpr (K::kABits == 8) {
      return src[s % kSlots] | uint32_t{src[kRowBytes + s % kSlots]} << 8;
    } else {
      const uint16_t* x = reinterpret_cast<const uint16_t*>(src);
      return x[s % kSlots] | uint32_t{x[kRowBytes / 2 + s % kSlots]} << 16;
    }
  }

  // Stores a pair (load_pair) at rank u of the window, merged row j (values zero before).
  __device__ __forceinline__ void store_pair(int u, int j, uint32_t pair) const {
    uint8_t* dst = values + u / kSlots * kBlockBytes + 2 * j * kRowBytes;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (K::kABits == 4) {
        const int byte = r * kRowBytes + (u % kSlots) / 2;
        atomicOr(reinterpret_cast<uint32_t*>(dst + (byte & ~3)),
                 (pair >> (4 * r) & 0xFu) << (8 * (byte & 3) + 4 * (u & 1)));
      } else if constexpr (K::kABits == 8) {
        dst[r * kRowBytes + u % kSlots] = static_cast<uint8_t>(pair >> (8 * r));
      } else {
        reinterpret_cast<uint16_t*>(dst + r * kRowBytes)[u % kSlots] = static_cast<uint16_t>(pair >> (16 * r));
      }
    }
  }

  // Rank of column c in the window that starts at rank `first`.
  __device__ __forceinline__ int rank(int c, int first) const {
    return prefix[c >> 5] + __popc(bitmap[c >> 5] & ((1u << (c & 31)) - 1)) - first;
  }

  // The thread's run of the bitmap's words.
  __device__ __forceinline__ void own_words(int& w0, int& w1) const {
    const int per_thread = (words + kThreads - 1) / kThreads;
    w0 = min(static_cast<int>(threadIdx.x) * per_thread, words);
    w1 = min(w0 + per_thread, words);
  }

  // Zeroes the values of a window of `size` ranks, marks its padding and writes the columns of the
  // thread's words that fall in it.
  __device__ __forceinline__ void lay_out(int first, int size) const {
    const int tid = threadIdx.x;
    const int padded = (size + kSlots - 1) / kSlots * kSlots;
    uint4* zero = reinterpret_cast<uint4*>(values);
    for (int i = tid; i < padded / kSlots * kBlockBytes / 16; i += kThreads) zero[i] = make_uint4(0, 0, 0, 0);
    for (int i = size + tid; i < padded; i += kThreads) cols[i] = -1;
    int w0, w1;
    own_words(w0, w1);
    for (int w = w0; w < w1; ++w) {
      int r = prefix[w] - first;
      if (r >= size || r + __popc(bitmap[w]) <= 0) continue;
      for (uint32_t bits = bitmap[w]; bits && r < size; bits &= bits - 1, ++r)
        if (r >= 0) cols[r] = 32 * w + __ffs(bits) - 1;
    }
  }

  // The values of the four rows' slots that fall in the window.
  __device__ __forceinline__ void store_values(const Params& p, int bh, int first, int size) const {
    for (int e = threadIdx.x; e < ends[3]; e += kThreads) {
      int j;
      const int s = slot(e, j);
      const int c = p.col_idx[s];
      const int u = c < 0 ? -1 : rank(c, first);
      if (u >= 0 && u < size) store_pair(u, j, load_pair(p, bh, s));
    }
  }

  // The bitmap and the prefixes; returns the union's length.
  __device__ __forceinline__ int build(const Params& p) {
    __shared__ int warp_totals[kWarps];
    const int tid = threadIdx.x;
    for (int i = tid; i < words; i += kThreads) bitmap[i] = 0;
    __syncthreads();
    for (int e = tid; e < ends[3]; e += kThreads) {
      int j;
      const int c = p.col_idx[slot(e, j)];
      if (c >= 0) atomicOr(bitmap + (c >> 5), 1u << (c & 31));
    }
    __syncthreads();
    // Exclusive scan of the words' bit counts, a run of words a thread.
    int w0, w1;
    own_words(w0, w1);
    int own = 0;
    for (int w = w0; w < w1; ++w) own += __popc(bitmap[w]);
    int length = 0;
    int before = cta_exclusive_scan<kWarps>(own, length, warp_totals);
    for (int w = w0; w < w1; ++w) {
      prefix[w] = before;
      before += __popc(bitmap[w]);
    }
    return length;
  }

  // Lays out the window of ranks [first, first + merge_blocks * kSlots) of a union of `length`
  // columns (the shared memory of the window before it no longer read); returns its size.
  __device__ __forceinline__ int window(const Params& p, int bh, int first, int length) const {
    const int size = min(p.merge_blocks * kSlots, length - first);
    lay_out(first, size);
    __syncthreads();
    store_values(p, bh, first, size);
    __syncthreads();
    return size;
  }
};

// MERGE: the CTA takes V 2 rows 4x .. 4x + 3 (x = blockIdx.x) as one V 8 row (MergedRows), window
// by window, and reads the sparse values from shared memory, not through the pipeline.
//
// PAIR_RING: 0 for one block a step over the kStages slots; else the main loop takes two blocks a
// step (one wait and one barrier for both, and the two blocks' shared-memory reads and products
// back to back) over a ring of PAIR_RING slots, and the column indices of the row's first
// kColBlocks blocks are copied to shared memory before the first gather, so no step among them
// waits on a global load of indices (past them, the indices are read from global memory at issue).
// launch_gather says where each ring runs.
template <int AB, bool AS, int BB, int TB, int STACK, bool MERGE, int PAIR_RING = 0>
__global__ void __launch_bounds__(kThreads) spmm_kernel(const Params p) {
  using K = Kind<AB, AS, BB, TB, STACK>;
  constexpr bool kPairs = PAIR_RING != 0;
  static_assert(!MERGE || (STACK == 0 && !K::kFp16), "rows merge in the integer kernel");
  static_assert(!kPairs || (PAIR_RING >= 4 && STACK == 0 && !MERGE && !K::kFp16),
                "paired steps are for the integer kernel, over four slots or more");
  constexpr int kTileBytes = K::kTileBytes;
  constexpr int kChunks = K::kChunks;
  constexpr int kCopyRows = K::kCopyRows;
  constexpr int kDenseStage = kSlots * kTileBytes;
  constexpr int kSparseStage = 8 * K::kSparseRowBytes;
  constexpr int kStageBytes = kDenseStage + kSparseStage;
  constexpr int kRing = kPairs ? PAIR_RING : kStages;
  // 64 blocks of indices (8 KB), or as many as fit beside the ring in the 48 KB of static shared
  // memory (44-54 beside the five-slot ring on the wide tile).
  constexpr int kStaticSmem = 48 * 1024;
  constexpr int kFitBlocks = (kStaticSmem - kRing * kStageBytes) / (kSlots * 4);
  constexpr int kColBlocks = kPairs ? (kFitBlocks < kPairedColBlocks ? kFitBlocks : kPairedColBlocks) : 0;
  constexpr int kColBytes = kColBlocks * kSlots * 4;
  static_assert(kRing * kStageBytes + kColBytes <= kStaticSmem, "the ring passes the static shared memory");
  __shared__ __align__(128) uint8_t smem[kRing * kStageBytes + kColBytes];
  extern __shared__ __align__(16) uint8_t merged[];

  await_inputs();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int vrow = MERGE || !p.row_order ? blockIdx.x : p.row_order[blockIdx.x];
  const int bh = blockIdx.z;
  const int v = MERGE ? 8 : p.v;
  const int start = MERGE ? 0 : p.row_ptr[2 * vrow];
  // MERGE: the union's length, and the current window's blocks.
  const int count = MERGE ? MergedRows<K>(p, vrow, merged).build(p) : p.row_ptr[2 * vrow + 1] - start;
  int nblocks = (count + kSlots - 1) / kSlots;
  const int col0_bytes = blockIdx.y * kTileBytes;

  const uint8_t* a_bh = p.a + bh * p.a_bh_bytes + (int64_t)start * v * K::kSparseRowBytes / kSlots;
  const uint8_t* b_bh = p.b + bh * p.b_bh_bytes;
  const int* cols = MERGE ? MergedRows<K>::cols_in(p, merged) : p.col_idx + start;
  const uint32_t smem0 = smem_addr(smem);

  // Copy roles: thread copies chunk `cchunk` of block slots cslot + q * kSlotStep.
  constexpr int kSlotStep = kThreads / kChunks;
  const int cchunk = tid & (kChunks - 1);
  const int cslot = tid / kChunks;
  const int cbyte = col0_bytes + cchunk * 16;
  uint32_t cdst[kCopyRows];
#pragma unroll
  for (int q = 0; q < kCopyRows; ++q) {
    const int r = K::smem_row(cslot + kSlotStep * q);
    cdst[q] = r * kTileBytes + K::swizzle(cchunk, r) * 16;
  }
  const int sparse_chunks = v * K::kSparseRowBytes / 16;

  // The slot of block blk whose dense row the thread copies q-th.
  auto copy_slot = [&](int blk, int q) { return blk * kSlots + cslot + kSlotStep * q; };
  auto fetch_cols = [&](int blk, int (&c)[kCopyRows]) {
    if (blk < nblocks) {
#pragma unroll
      for (int q = 0; q < kCopyRows; ++q) c[q] = cols[copy_slot(blk, q)];
    }
  };
  // The thread's chunk of every row it copies starts here (a chunk past N reads nothing, from
  // the row's start), and a dead slot (padding) reads nothing from row 0: every address stays in
  // B, and with the row and stride unsigned 32-bit it is one wide multiply-add. A chunk past N
  // takes no row as live (rows below k_live), so one compare serves both. The base is pinned in
  // registers for 4-bit B only: there it saved a 64-bit add a row (H100, sweep geomeans of the
  // R4 pairs +1-4 %), while the 8- and 16-bit kinds, at their register cap, recomputed more
  // elsewhere (L16-R8 -4 %).
  const bool chunk_in = cbyte < p.row_bytes;
  const uint8_t* b_chunk = b_bh + (chunk_in ? cbyte : 0);
  if constexpr (BB == 4) b_chunk = pinned(b_chunk);
  const uint32_t k_live = chunk_in ? static_cast<uint32_t>(p.k) : 0u;
  // Block blk lies in ring slot ring_slot (blk % kRing, which the caller tracks).
  auto issue = [&](int blk, int ring_slot, const int (&c)[kCopyRows]) {
    const uint32_t stage = smem0 + ring_slot * kStageBytes;
#pragma unroll
    for (int q = 0; q < kCopyRows; ++q) {
      const bool live = static_cast<uint32_t>(c[q]) < k_live;
      const uint8_t* src =
          b_chunk + static_cast<uint64_t>(live ? static_cast<uint32_t>(c[q]) : 0u) * static_cast<uint32_t>(p.row_bytes);
      const uint32_t dst = stage + cdst[q];
      // 8- and 16-bit B bypass L1 (.cg). H100, M = K 512-4096, V 2 and 8, sparsity 0.7-0.98:
      // L8-R8 and L16-R8 (N 128, 256) 3.3 % less time on the geometric mean, up to 17 % (the
      // target shape 9.8 -> 8.7 us); L16-R16 and fp16 (N 128-512) 5.2 % and 10.7 %, up to 28 %.
      // 4-bit B keeps its L1 lines (.ca): through L2 only it was 1.6 % slower, up to 32 % at N
      // 128 (rows of 64 bytes).
      cp_async16<BB == 4>(dst, src, live ? 16 : 0);
    }
    if (!MERGE && tid < sparse_chunks) {
      const uint8_t* src = a_bh + (int64_t)blk * kSparseStage / 8 * v + tid * 16;
      cp_async16(stage + kDenseStage + tid * 16, src, 16);
    }
  };

  constexpr int kMT = K::kMTiles;
  Accumulators<K, kMT> r;
  int64_t sums[kMT * 4];
  r.zero(sums);

  // ldmatrix lane address: matrix j = lane / 8 reads shared row 8j + lane % 8 (integer kinds).
  const int li = lane & 7, lm = lane >> 3;
  const int wchunk0 = warp * K::kWarpChunks;

  auto compute = [&](int blk, int ring_slot) {
    const uint32_t stage = smem0 + ring_slot * kStageBytes;
    const uint32_t sparse0 = MERGE ? smem_addr(merged) + blk * kSparseStage : stage + kDenseStage;
    const bool row_live = g < v;
    if constexpr (K::kFp16) {
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        uint2 bw = make_uint2(0, 0);
        if (row_live) bw = ld_shared_v2(sparse0 + g * K::kSparseRowBytes + 32 * ks + 8 * t);
        const int row = 16 * ks + 8 * (lm >> 1) + li;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const int chunk = wchunk0 + 2 * mt + (lm & 1);
          uint32_t a[4];
          ldsm_x4_trans(stage + row * kTileBytes + K::swizzle(chunk, li) * 16, a[0], a[1], a[2], a[3]);
          mma_16816_f16(r.accf[mt], a, bw.x, bw.y);
        }
      }
    } else {
      // Stacked, the lanes of columns 0 to 2V - 1 read row g % V.
      SparseWords<K> a;
      load_sparse_words<K>(K::kStacked ? g & (K::kStackV - 1) : g, t, K::kStacked ? g < 2 * K::kStackV : row_live,
                           [&](int off) { return ld_shared_b32(sparse0 + off); },
                           [&](int off) { return ld_shared_v2(sparse0 + off); }, a);
      uint32_t sb[K::kAPlanes][2];
      sparse_fragment<K>(a, g, sb);
      const uint32_t lrow = stage + (8 * lm + li) * kTileBytes;
      auto ldsm = [&](int chunk, uint32_t (&q)[4]) {
        ldsm_x4_trans(lrow + K::swizzle(chunk, li) * 16, q[0], q[1], q[2], q[3]);
      };
      if constexpr (BB == 8) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          uint32_t q[4], da[1][4];
          ldsm(wchunk0 + mt, q);
          dense8_fragment(q, da);
          r.mma(mt, da, sb);
        }
      } else if constexpr (BB == 4) {
#pragma unroll
        for (int c = 0; c < K::kWarpChunks; ++c) {
          uint32_t q[4], lo[1][4], hi[1][4];
          ldsm(wchunk0 + c, q);
          dense4_fragments(q, lo, hi);
          r.mma(2 * c, lo, sb);
          r.mma(2 * c + 1, hi, sb);
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          uint32_t q[4], u[4];
          ldsm(wchunk0 + 2 * mt, q);
          ldsm(wchunk0 + 2 * mt + 1, u);
          const uint32_t da[2][4] = {
              {odd_bytes(q[0], q[1]), odd_bytes(u[0], u[1]), odd_bytes(q[2], q[3]), odd_bytes(u[2], u[3])},
              {even_bytes(q[0], q[1]), even_bytes(u[0], u[1]), even_bytes(q[2], q[3]), even_bytes(u[2], u[3])}};
          r.mma(mt, da, sb);
        }
      }
    }
  };

  int since_fold = 0;
  // MERGE: the blocks of the windows before, and the next window's first rank.
  int blocks_before = 0, next_rank = 0;
  if constexpr (kPairs) {
    // Blocks it + 2 .. it + kRing - 1 are in flight while blocks it and it + 1 are computed; the
    // slots of the pair computed one step before are refilled past the barrier that every warp has
    // then crossed. Each block is its own cp.async group.
    const uint32_t col_smem = smem0 + kRing * kStageBytes;
    const int staged = min(nblocks, kColBlocks) * kSlots;
    for (int i = 4 * tid; i < staged; i += 4 * kThreads) cp_async16(col_smem + 4 * i, cols + i, 16);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    auto issue_at = [&](int blk, int ring_slot) {
      if (blk < nblocks) {
        int c[kCopyRows];
#pragma unroll
        for (int q = 0; q < kCopyRows; ++q) {
          const int at = copy_slot(blk, q);
          c[q] = blk < kColBlocks ? static_cast<int>(ld_shared_b32(col_smem + 4 * at)) : cols[at];
        }
        issue(blk, ring_slot, c);
      }
      cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < kRing - 2; ++s) issue_at(s, s);
    // The ring slots of blocks it and it - 2, stepped: on the ring of five by a compare, where the
    // remainder took a multiply and a shift for every address (L8-R8's loop, 258 -> 227 instructions
    // a step).
    auto next_slot = [](int s) {
      if constexpr ((kRing & (kRing - 1)) == 0) return (s + 1) & (kRing - 1);
      else return s + 1 < kRing ? s + 1 : 0;
    };
    int slot_it = 0, slot_before = kRing - 2;
    for (int it = 0; it < nblocks; it += 2) {
      // Blocks it and it + 1 have landed once no more than the kRing - 4 groups after them pend.
      cp_async_wait<kRing - 4>();
      __syncthreads();
      issue_at(it + kRing - 2, slot_before);
      issue_at(it + kRing - 1, next_slot(slot_before));
      compute(it, slot_it);
      if (it + 1 < nblocks) {
        compute(it + 1, next_slot(slot_it));
        // A step's two blocks counted at once leave one copy of the fold in the loop, and the folds
        // fall where they did block by block (kFlushBlocks is even). A lone last block is not
        // counted: it is under kFlushBlocks since the last fold.
        r.multiplied(2, since_fold);
      }
      slot_before = slot_it;
      slot_it = next_slot(next_slot(slot_it));
    }
  } else {
    // Pipeline: blocks it+1 .. it+kStages-1 are in flight while block it is computed. The column
    // indices of the next kColsAhead blocks to issue are in registers, each loaded kColsAhead steps
    // before its gather is issued.
    constexpr int kColsAhead = K::kColsAhead;
    int next_cols[kColsAhead][kCopyRows];
    do {
      if constexpr (MERGE) {
        nblocks = (MergedRows<K>(p, vrow, merged).window(p, bh, next_rank, count) + kSlots - 1) / kSlots;
        next_rank += p.merge_blocks * kSlots;
      }
#pragma unroll
      for (int a = 0; a < kColsAhead; ++a)
#pragma unroll
        for (int q = 0; q < kCopyRows; ++q) next_cols[a][q] = -1;
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < nblocks) {
          fetch_cols(s, next_cols[0]);
          issue(s, s, next_cols[0]);
        }
        cp_async_commit();
      }
#pragma unroll
      for (int a = 0; a < kColsAhead; ++a) fetch_cols(kStages - 1 + a, next_cols[a]);
      for (int it = 0; it < nblocks; ++it) {
        cp_async_wait<kStages - 2>();
        __syncthreads();
        if (it + kStages - 1 < nblocks) issue(it + kStages - 1, (it + kStages - 1) % kStages, next_cols[0]);
        cp_async_commit();
#pragma unroll
        for (int a = 0; a + 1 < kColsAhead; ++a)
#pragma unroll
          for (int q = 0; q < kCopyRows; ++q) next_cols[a][q] = next_cols[a + 1][q];
        fetch_cols(it + kStages - 1 + kColsAhead, next_cols[kColsAhead - 1]);
        compute(it, it % kStages);
        r.multiplied(1, since_fold);
      }
      if constexpr (MERGE) {
        blocks_before += nblocks;
        // The next window overwrites the ring and the union's shared memory.
        if (next_rank < count) __syncthreads();
      }
    } while (MERGE && next_rank < count);
  }
  allow_next_launch();
  // Every block that carried data was waited for in the loop, and the epilogue reads no shared
  // memory, so no barrier remains. (V read again, not held through the loop in a register.)
  write_vector_row(p, r, bh, vrow, MERGE ? 8 : p.v, blockIdx.y * K::kTileCols + wchunk0 * K::kColsPerChunk,
                   MERGE ? blocks_before : nblocks);
}

// Resident B (8- and 4-bit B): one CTA holds a 32-byte column slice of B[bh] for every k in shared
// memory, (K + 1) rows of 32 bytes with row K zero, and its warps run vector rows of that slice
// one after another. The gather kernel above re-reads a B row slice from L2 for every kept vector:
// 54 MB at the SpMM target (M = K = 4096, N = 256, V = 8, sparsity 0.9) against B's 1 MB, and it
// runs at L2 bandwidth (10.5 us on an H100). Here each CTA reads its slice once (K * 32 bytes)
// and the gathers become ldmatrix reads of shared memory at gathered row addresses: no copy
// stage, no barrier after the load. A warp reads the block's column indices and its sparse
// fragment straight from global memory, kAhead blocks ahead, each lane the column of the slot its
// ldmatrix address serves (the same slot order as the copied tile of the gather kernel, so the
// fragments are identical).
//
// Where a row may be long (csrc/long_rows.cuh), a warp's rows add up to an equal share of its
// (slice, bh)'s blocks (plus one per row, for its epilogue), not a fixed count: with every
// warps-th row of row_order, the warp holding a global token's row (128 blocks beside rows of 13,
// L = 4096) ran 115 blocks more than the others and was the kernel's tail. The shares come from
// a scan of the row lengths that each CTA runs while its slice loads (no host read of the
// pattern); a mask without long rows (the longest_row hint) skips the scan (1.5-3 us at L = 4096).
//
// A CTA has WARPS warps: 16, or 4 where the grid of 16-warp CTAs would leave SMs idle (the host's
// choice, launch_resident). At 128 registers a thread one CTA of 16 warps fills an SM's register
// file, so the grid gives each (slice, bh) floor(SMs / (slices x BH)) CTAs and a warp runs
// vrows / (16 x that) rows: at BH 24 and 3 slices 72 CTAs run on 132 SMs. Four CTAs of 4 warps
// share an SM, each with its own slice, and split the rows four times finer.
constexpr int kResidentSliceBytes = 32;  // two 16-byte chunks: 32 columns of 8-bit B, 64 of 4-bit

// The slice is chunk-major: 16-byte chunk c of B row r lies at byte (c (K + 1) + r) 16, row K the
// zero row that dead slots read. One ldmatrix phase reads one chunk of 8 gathered rows, 16 bytes
// apart, so rows of distinct r % 8 never share a bank, and a block's second chunk lies a fixed
// stride past its first. (Row-major 32-byte rows needed a swizzle for the banks, whose address
// arithmetic took 6 instructions a block where this takes 2.)
//
// The slice loads by cp.async, 16 bytes a thread. Its time is set by the 128-byte lines L1
// handles, one a cycle, not by bytes: a row's 32 bytes lie in one line, and on rows of 128 bytes
// or more a warp's copies touch 16 lines. Hopper's other paths were slower (H200): the TMA, in
// boxes one 16-byte chunk wide, 1.04-2.15x the kernel's time; multicast to a cluster's CTAs of one
// slice 1.02-2.46x; each CTA of a pair loading half the lines and sending them to the other by a
// bulk copy into its shared memory 1.00-1.33x (kernel_checks.md, sixty-ninth round).

// Position in row_order of entry q of the order that lists the round robin's rows warp by warp
// (described in spmm_resident_kernel).
__device__ __forceinline__ int round_robin_position(int q, int per_warp, int share_warps) {
  return q % per_warp * share_warps + q / per_warp;
}

// Both sizes run at up to 128 registers a thread. For 16 warps the thread count alone sets that;
// a stated minimum of one CTA an SM changed ptxas's allocation (L8-R8: 105 -> 111 registers, 3-5 %
// more time), so none is stated (0).
template <int AB, bool AS, int BB, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, WARPS == 16 ? 0 : 4) spmm_resident_kernel(const Params p) {
  static_assert(BB == 8 || BB == 4, "8- or 4-bit B");
  static_assert(WARPS == 16 || WARPS == 4, "16 warps a CTA, or 4 (four CTAs an SM)");
  constexpr int kThreads = 32 * WARPS;
  using K = Kind<AB, AS, BB>;
  constexpr int kChunks = kResidentSliceBytes / 16;
  constexpr int kMT = kChunks * K::kColsPerChunk / 16;
  // Blocks whose indices and sparse values are in flight: 4, or 2 where four would spill at 128
  // registers (16-bit values with four m-tiles).
  constexpr int kAhead = K::kAPlanes * kMT > 4 ? 2 : 4;
  extern __shared__ __align__(128) uint8_t slice[];
  await_inputs();
  const uint32_t slice0 = smem_addr(slice);
  const int bh = blockIdx.z;
  const int byte0 = blockIdx.y * kResidentSliceBytes;
  const uint8_t* b_bh = p.b + bh * p.b_bh_bytes;
  // Where chunk `chunk` of B row `row` lies (the layout above).
  const uint32_t chunk_bytes = (p.k + 1) * 16;
  auto slice_at = [&](uint32_t row, int chunk) { return slice0 + chunk * chunk_bytes + row * 16; };
  for (int i = threadIdx.x; i < kChunks * (p.k + 1); i += kThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    const int byte = byte0 + 16 * chunk;
    const bool in = row < p.k && byte < p.row_bytes;
    cp_async16(slice_at(row, chunk), in ? b_bh + (int64_t)row * p.row_bytes + byte : p.b, in ? 16 : 0);
  }
  cp_async_commit();

  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int warp = threadIdx.x >> 5;
  const int v = p.v;
  const int vrows = p.m / v;

  // A warp runs [run0, run1) of an order q of the positions that lists the round robin's rows
  // warp by warp: q = w R + i stands for position w + i W (W warps in the (slice, bh), R =
  // ceil(vrows / W)). Without p.balance warp w runs [w R, (w + 1) R): every W-th row. With it the
  // runs hold equal work, and rows of equal work still give every warp about its round-robin
  // rows, rows of similar length (neighbours in row_order) side by side: position q costs c_q =
  // blocks + 1 (0 past the rows) and covers (S_q, S_q + c_q] of the running sum S, and warp w
  // starts where the sum first reaches w T / W (T the total), after the one q whose
  // (S_q W, (S_q + c_q) W] holds w T. Two scans of the row lengths: T, then the runs.
  __shared__ int warp_sums[WARPS];
  __shared__ int run_start[WARPS + 1];
  const int share_warps = gridDim.x * WARPS;
  const int per_warp = (vrows + share_warps - 1) / share_warps;
  const int virtual_rows = share_warps * per_warp;
  auto cost = [&](int q) {
    const int pos = q < virtual_rows ? round_robin_position(q, per_warp, share_warps) : vrows;
    if (pos >= vrows) return 0;
    const int vr = p.row_order[pos];
    return (p.row_ptr[2 * vr + 1] - p.row_ptr[2 * vr] + kSlots - 1) / kSlots + 1;
  };
  auto scan = [&](int x, int64_t& total) {
    const int before = cta_exclusive_scan<WARPS>(x, total, warp_sums);
    __syncthreads();
    return before;
  };
  const int w0 = blockIdx.x * WARPS;
  int run0 = (w0 + warp) * per_warp, run1 = run0 + per_warp;  // the round robin
  if (p.balance) {
    int64_t total = 0;
    for (int base = 0; base < virtual_rows; base += kThreads) scan(cost(base + threadIdx.x), total);
    if (threadIdx.x <= WARPS) run_start[threadIdx.x] = (w0 + threadIdx.x == 0) ? 0 : virtual_rows;
    int64_t before = 0;
    for (int base = 0; base < virtual_rows; base += kThreads) {
      const int q = base + threadIdx.x;
      const int c = cost(q);
      int64_t chunk = 0;
      const int64_t s0 = before + scan(c, chunk);  // (the scan's barriers order run_start's init)
      before += chunk;
      if (c > 0) {
        // w with s0 W < w T <= (s0 + c) W, inside this CTA's warps (and the next CTA's first)
        const int64_t lo = s0 * share_warps / total + 1, hi = (s0 + c) * share_warps / total;
        const int64_t first_w = lo > w0 ? lo : w0, last_w = hi < w0 + WARPS ? hi : w0 + WARPS;
        for (int64_t w = first_w; w <= last_w; ++w) run_start[w - w0] = q + 1;
      }
    }
    __syncthreads();
    run0 = run_start[warp];
    run1 = run_start[warp + 1];
  }

  // The slot whose row this lane's ldmatrix address reads: Kind::smem_row inverted.
  int my_slot = 0;
#pragma unroll
  for (int s = 0; s < kSlots; ++s)
    if (K::smem_row(s) == lane) my_slot = s;
  const bool row_live = g < v;
  const uint8_t* a_bh = p.a + bh * p.a_bh_bytes;

  // A warp's rows' pattern entries are read 32 rows at a time, lane i holding row i's, so that no
  // row waits on the chain row_order -> row_ptr -> col_idx; and the first blocks of the next row
  // are fetched while the last ones of the current row compute.
  struct Row {
    int vrow, start, nblocks;
  };
  Row mine{0, 0, 0};
  // A q past the rows (vrow -1) runs as an empty row that writes nothing. The order's shape is
  // read back from shared memory (a copy per warp), not kept in registers across the row loop,
  // which runs at the 128-register cap (kept live, it cost L8-R4 16 bytes of spills).
  __shared__ int order_shape[WARPS][3];
  if (lane < 3) order_shape[warp][lane] = lane == 0 ? per_warp : lane == 1 ? share_warps : vrows;
  __syncwarp();
  auto load_rows = [&](int base) {
    const volatile int* shape = order_shape[warp];
    const int all_rows = shape[2];
    const int q = base + lane;
    const int w = q < run1 ? round_robin_position(q, shape[0], shape[1]) : all_rows;
    mine = Row{-1, 0, 0};
    if (w < all_rows) {
      mine.vrow = p.row_order[w];
      mine.start = p.row_ptr[2 * mine.vrow];
      mine.nblocks = (p.row_ptr[2 * mine.vrow + 1] - mine.start + kSlots - 1) / kSlots;
    }
  };
  auto row_at = [&](int i) {
    return Row{__shfl_sync(0xffffffffu, mine.vrow, i), __shfl_sync(0xffffffffu, mine.start, i),
               __shfl_sync(0xffffffffu, mine.nblocks, i)};
  };

  // Blocks in flight keep their sparse values as stored (SparseWords): widened in flight, L4-R4
  // spilled at four blocks ahead and ran two.
  int col_next[kAhead];
  SparseWords<K> a_next[kAhead];
  // The group's first block's column and sparse words for this lane; the group's other blocks
  // lie at fixed 32-bit strides from them (a row's blocks are far under 2 GB).
  auto fetch = [&](const Row& row, int blk0) {
    const int* cols = p.col_idx + row.start + blk0 * kSlots + my_slot;
    // This lane's row g of the group's first block (load_sparse_words adds only 4 t and the
    // word's fixed offset).
    const uint8_t* a_grp = a_bh + ((int64_t)row.start * v * K::kSparseRowBytes / kSlots +
                                   static_cast<uint32_t>((blk0 * v + g) * K::kSparseRowBytes));
    const uint32_t a_step = static_cast<uint32_t>(v * K::kSparseRowBytes);
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      const bool in = blk0 + j < row.nblocks;
      col_next[j] = in ? cols[j * kSlots] : -1;
      const uint8_t* a_blk = a_grp + j * a_step;
      load_sparse_words<K>(0, t, row_live && in,
                           [&](int off) { return *reinterpret_cast<const uint32_t*>(a_blk + off); },
                           [&](int off) { return *reinterpret_cast<const uint2*>(a_blk + off); }, a_next[j]);
    }
  };

  // Block j's dense fragments: its slots' rows of the slice, read where this lane's ldmatrix
  // address serves (dead slots, padding -1, read the zero row K: as unsigned, -1 lies past K).
  auto load_block = [&](int col, uint32_t (&q)[kChunks][4]) {
    const uint32_t krow = min(static_cast<unsigned>(col), static_cast<unsigned>(p.k));
#pragma unroll
    for (int c = 0; c < kChunks; ++c) ldsm_x4_trans(slice_at(krow, c), q[c][0], q[c][1], q[c][2], q[c][3]);
  };
  auto multiply = [&](const uint32_t (&q)[kChunks][4], const SparseWords<K>& a, Accumulators<K, kMT>& r) {
    uint32_t sb[K::kAPlanes][2];
    sparse_fragment<K>(a, g, sb);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if constexpr (BB == 8) {
        uint32_t da[1][4];
        dense8_fragment(q[c], da);
        r.mma(c, da, sb);
      } else {
        uint32_t lo[1][4], hi[1][4];
        dense4_fragments(q[c], lo, hi);
        r.mma(2 * c, lo, sb);
        r.mma(2 * c + 1, hi, sb);
      }
    }
  };

  // The first rows' entries and blocks load while the slice does.
  if (run0 < run1) {
    load_rows(run0);
    fetch(row_at(0), 0);
  }
  cp_async_wait<0>();
  __syncthreads();

  for (int base = run0; base < run1; base += 32) {
    if (base != run0) {
      load_rows(base);
      fetch(row_at(0), 0);
    }
    const int rows = min(32, run1 - base);
    for (int i = 0; i < rows; ++i) {
      const Row row = row_at(i);
      const bool has_next = i + 1 < rows;
      Accumulators<K, kMT> r;
      int64_t sums[kMT * 4];
      r.zero(sums);
      int since_fold = 0;
      if (row.nblocks == 0 && has_next) fetch(row_at(i + 1), 0);
      for (int blk0 = 0; blk0 < row.nblocks; blk0 += kAhead) {
        int col[kAhead];
        SparseWords<K> a[kAhead];
#pragma unroll
        for (int j = 0; j < kAhead; ++j) {
          col[j] = col_next[j];
          a[j] = a_next[j];
        }
        if (blk0 + kAhead < row.nblocks) fetch(row, blk0 + kAhead);
        else if (has_next) fetch(row_at(i + 1), 0);
        if (blk0 + kAhead <= row.nblocks) {
          // A whole group runs without a branch, so ptxas schedules its blocks' shared-memory
          // reads and products as one stretch (block by block, as the last group runs, a warp
          // waits out each block's chain of ldmatrix and products).
          uint32_t q[kAhead][kChunks][4];
#pragma unroll
          for (int j = 0; j < kAhead; ++j) load_block(col[j], q[j]);
#pragma unroll
          for (int j = 0; j < kAhead; ++j) multiply(q[j], a[j], r);
          static_assert(kFlushBlocks % kAhead == 0);
          r.multiplied(kAhead, since_fold);
          continue;
        }
        // The last, partial group: under kAhead blocks past a multiple of kAhead, so under
        // kFlushBlocks since the last fold.
#pragma unroll
        for (int j = 0; j < kAhead; ++j) {
          if (blk0 + j >= row.nblocks) break;
          uint32_t q[kChunks][4];
          load_block(col[j], q);
          multiply(q, a[j], r);
        }
      }
      if (row.vrow >= 0)
        write_vector_row(p, r, bh, row.vrow, p.v, blockIdx.y * K::kColsPerChunk * kChunks, row.nblocks);
    }
  }
}

}  // namespace spmm_detail
}  // namespace magicube
