// magicube_cuda::spmm: SR-BCRS sparse x dense on tensor cores (kernel in spmm_kernel.cuh).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "check.cuh"
#include "launch.cuh"
#include "long_rows.cuh"
#include "spmm_dense.cuh"
#include "spmm_kernel.cuh"

namespace {

using magicube::spmm_detail::Params;
using magicube::spmm_detail::kThreads;
using magicube::spmm_detail::kSlots;

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  MAGICUBE_CHECK(t.is_cuda(), "spmm: ", name, " must be a CUDA tensor");
  MAGICUBE_CHECK(t.device() == device, "spmm: ", name, " must be on b's device");
  MAGICUBE_CHECK(t.is_contiguous(), "spmm: ", name, " must be contiguous");
}

// MAGICUBE_SPMM_KERNEL forces a kernel where it applies (tests, benchmarks): gather, stacked (the
// gather kernel, stacking 16-bit A's planes, or 12-bit A's digits, wherever it can: launch_gather),
// merged (the gather kernel on V 2 rows merged four at a time: launch_merged), resident (the
// resident-B kernel), dense (the dense path) or dense_wgmma (the dense path, and our GEMM on wgmma
// wherever it runs: Hopper); auto, the default, lets the rules below pick; tuned times the ways
// that apply on a problem's first call and runs the fastest from then on (tuned_choice).
enum class Choice { kAuto, kTuned, kGather, kStacked, kMerged, kResident, kDense, kDenseWgmma };

bool forces_dense(Choice choice) { return choice == Choice::kDense || choice == Choice::kDenseWgmma; }

Choice kernel_choice() {
  const char* env = std::getenv("MAGICUBE_SPMM_KERNEL");
  const std::string choice = env ? env : "auto";
  if (choice == "gather") return Choice::kGather;
  if (choice == "stacked") return Choice::kStacked;
  if (choice == "merged") return Choice::kMerged;
  if (choice == "resident") return Choice::kResident;
  if (choice == "dense") return Choice::kDense;
  if (choice == "dense_wgmma") return Choice::kDenseWgmma;
  if (choice == "tuned") return Choice::kTuned;
  MAGICUBE_CHECK(choice == "auto", "MAGICUBE_SPMM_KERNEL must be auto, tuned, gather, stacked, merged, resident, ",
                 "dense or dense_wgmma, got ", choice);
  return Choice::kAuto;
}

// Both kernels are launched overlapped (launch.cuh): on small problems a call's time is mostly
// the launch and one CTA's chain of dependent loads, 2.5-3 us, and letting the next kernel launch
// while this one finishes hides part of it (H100, 288 cells of M = K 512-4096, back to back in a
// CUDA graph: 6.8 % less time on the geometric mean, 11 % at M = K = 512, 3.3 % at 4096). The
// gather kernel allows the next launch after its main loop, not at its start: CTAs of the next
// kernel resident during the gathers took the L1 that cp.async.ca reuses (4-bit B up to 35 %
// slower).
template <int AB, bool AS, int BB, int TB = magicube::spmm_detail::Kind<AB, AS, BB>::kTileBytes, int STACK = 0,
          bool MERGE = false, int PAIR_RING = 0>
void launch_tiles(const Params& p, int64_t vrows, int64_t bh, cudaStream_t stream, int64_t smem = 0) {
  const int64_t tiles = (p.row_bytes + TB - 1) / TB;
  MAGICUBE_CHECK(tiles <= 65535 && vrows <= INT32_MAX, "spmm: N or M too large");
  const dim3 grid(static_cast<unsigned>(MERGE ? vrows / 4 : vrows), static_cast<unsigned>(tiles),
                  static_cast<unsigned>(bh));
  constexpr auto kernel = magicube::spmm_detail::spmm_kernel<AB, AS, BB, TB, STACK, MERGE, PAIR_RING>;
  // Where one wave holds every CTA, the rows' order (longest first, for the tail of a longer grid)
  // buys nothing, and reading it put a round trip to L2 before each CTA's first read of the
  // pattern: there CTA i takes vector row i (row_order null).
  Params q = p;
  if constexpr (!MERGE) {
    if (static_cast<int64_t>(grid.x) * tiles * bh <= magicube::wave_ctas<kernel>(kThreads, smem)) q.row_order = nullptr;
  }
  magicube::launch_overlapped(kernel, grid, dim3(kThreads), static_cast<size_t>(smem), stream, q);
}

// The most blocks of V 2 rows merged four at a time (launch_merged) that one window holds (1024
// columns, 16 KB of 16-bit values).
constexpr int64_t kMergeBlocks = 32;

// Whether rows of `row_bytes` past one `tile`, of at most `most` bytes, end in a tile at most half
// full (on_tile, launch_merged).
bool half_empty_end(int64_t row_bytes, int64_t tile, int64_t most) {
  return row_bytes > tile && row_bytes <= most && row_bytes % tile != 0 && 2 * (row_bytes % tile) <= tile;
}

// The gather kernel on V 2 rows merged four at a time (spmm_kernel.cuh: MergedRows), where
// p.merge_blocks says it applies (V 2, M a multiple of 8), its shared memory fits and it is asked
// for or pays: rows of B of a narrow tile or more (128 bytes; with 4-bit B, below, past the quarter
// tile), rows of A of at most four blocks on the mean, and three merged CTAs an SM or more. There,
// on an H200, it took 0.77-1.01x the time of the choice before it with 8- and 16-bit B of N 256 and
// 512 (the 17 such cells of 420: the seven pairs at V 2, M = K 512-4096, N 128-512, sparsity
// 0.7-0.98, BH 1; mostly M = K 2048 and 4096 at sparsity 0.95 and 0.98), where the merged CTAs'
// union pays for its building; with fewer CTAs or longer rows up to 6.7x (kernel_checks.md,
// fifty-second round). Rows of 128 bytes (8-bit B of N 128, 16-bit of N 64) and 16-bit B of N 128
// merge too: at BH 4 and 16 (M = K 512-4096, sparsity 0.7-0.98) that took 0.59-0.91x the time in
// the 31 of their 140 cells whose time moved by more than 5 %, the other 109 0.95-1.01x; at BH 1,
// 0.83-0.97x (M = K = 4096, sparsity 0.98; fifty-sixth round). 4-bit B merges for fp16 output only:
// there it took 0.76-0.92x the time where the rule takes it (BH 1, M = K = 4096, N 256, sparsity
// 0.98; BH 4, M = K = 1024, sparsity 0.95 and 0.98: 0.61-0.84x), and with int64 output, four times
// the bytes, 1.02-1.24x (fifty-third round). Rows of A of at most two blocks pay from 7/4 merged
// CTAs an SM, except on 8- and 16-bit B's narrow tile: with every way forced on the sweep's grid
// and on cells off it (H200, the seven pairs at V 2, M = K 768-4096, N 96-512, sparsity 0.7-0.985),
// the 53 such cells between 7/4 and 3 an SM (256-384 merged CTAs) took 0.69-1.14x the time of the
// choice before, 0.885x on the geometric mean, while at 192 CTAs merging took 0.89-1.56x (1.11x),
// and on 8-bit B's narrow tile 0.98-1.29x (kernel_checks.md, sixty-fourth round). 4-bit B's rows of
// 65-127 bytes merge by these bounds on the narrow tile, their gather kernel's, except under 8-bit
// A (there 0.80-1.20x the time, 0.988x on the geometric mean); rows of A of up to four blocks from
// 21/8 merged CTAs an SM on the wide tile and with 4-bit B under 12- and 16-bit A. With every way
// forced on 4898 V 2 cells about the bounds (H200; M = K 1280-4096, rows of B of 96-512 bytes,
// sparsity 0.9-0.99, two sets of masks) the 244 cells that move took 0.892x the time of the choice
// before (0.69-1.30x; measured on the second set against the build before, 0.907x); merging took
// 1.05x at 2.25-21/8 CTAs an SM, 1.12x on 8- and 16-bit B's narrow tile, 1.04x with 4-bit B under
// 4- and 8-bit A and 1.12x on 8- and 16-bit B's rows under 128 bytes (ninety-second round). 4-bit
// B's rows whose last narrow tile would be at most half full (129-192 bytes) merge only under rows
// of A of at most two blocks: under three and four the resident kernel took 0.74-0.94x the merged
// rows' time by A and rows (every way forced on 2088 V 2 cells of 4-bit B, H200), and in an A/B
// over 2100 fresh cells (M = K 1280-3840, sparsity 0.9-0.985, BH 1, 4 and 8) the 480 cells that
// move took 0.79-0.84x the time by pair (0.55-1.18x by cell; at M = K = 1792, BH 1, 1.07x;
// ninety-fourth round). It runs before the resident-B kernel (launch_integer).
// Returns whether it ran.
template <int AB, bool AS, int BB, int TB>
bool launch_merged(const Params& p, int64_t vrows, int64_t bh, int64_t nnz_pad, cudaStream_t stream, Choice choice) {
  if constexpr (AB == 0) {
    return false;
  } else {
    if (p.merge_blocks < 0 || (choice != Choice::kMerged && choice != Choice::kAuto)) return false;
    namespace sd = magicube::spmm_detail;
    constexpr auto kernel = sd::spmm_kernel<AB, AS, BB, TB, 0, true>;
    const int64_t smem = sd::MergedRows<sd::Kind<AB, AS, BB, TB>>::smem_bytes(p.merge_blocks, p.k);
    if (smem > magicube::max_dynamic_smem<kernel>()) return false;
    const int64_t ctas = vrows / 4 * ((p.row_bytes + TB - 1) / TB) * bh;
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    // 4-bit B's rows past the quarter tile (under 8-bit A, of a narrow tile or more, as 8- and
    // 16-bit B's).
    constexpr int64_t narrow = sd::kNarrowTileBytes;
    const int64_t least_row = BB == 4 && AB != 8 ? sd::kQuarterTileBytes + 1 : narrow;
    const bool wide = BB == 4 || TB == sd::kWideTileBytes;  // not 8- and 16-bit B's narrow tile
    const bool four_blocks = nnz_pad <= 4 * kSlots * vrows;
    // 4-bit B's rows whose last narrow tile would be at most half full (129-192 bytes), under rows
    // of A of more than two blocks, leave the merged rows to the resident kernel.
    const bool half_empty =
        BB == 4 && half_empty_end(p.row_bytes, narrow, 3 * narrow / 2) && nnz_pad > 2 * kSlots * vrows;
    const bool pays = (BB != 4 || !p.out_int64) && p.row_bytes >= least_row && !half_empty &&
                      ((four_blocks && ctas >= 3 * sms) ||
                       (wide && nnz_pad <= 2 * kSlots * vrows && 4 * ctas >= 7 * sms) ||
                       (wide && (AB >= 12 || BB >= 8) && four_blocks && 8 * ctas >= 21 * sms));
    if (choice == Choice::kAuto && !pays) return false;
    launch_tiles<AB, AS, BB, TB, 0, true>(p, vrows, bh, stream, smem);
    return true;
  }
}

// Whether the gather kernel can stack A's planes into one MMA at V v (spmm_kernel.cuh): 16-bit
// containers at V 2, and at V 4 unsigned values and 12-bit ones (as digits).
bool can_stack(int64_t a_bits, bool a_signed, int64_t v) {
  return a_bits >= 12 && (v == 2 || (v == 4 && (!a_signed || a_bits == 12)));
}

// The gather kernel on tile TB. 12- and 16-bit A can stack their planes into one MMA (can_stack;
// spmm_kernel.cuh): half the MMAs, at another register count, so the grid decides where it pays.
// Not by default on the quarter tile (4-bit B's rows there, forced: 1.07-1.22x the two-MMA form's
// time by A, V and BH; eighty-fourth round), nor on 8-bit B's narrow tile, whose fold sums two MMAs
// keep in local memory (1.01-1.09x).
// - At V 2 where rows average two blocks or more and the grid holds four CTAs an SM or more:
//   0.85-0.96x the time at M = K = 4096 by pair; smaller grids and rows of one block up to 1.10x
//   (forty-sixth round). With 16-bit B's four MMAs a step, rows of one block too where the two-MMA
//   form's grid takes more than one wave (sixty-fifth round: the cells moved 0.94x the time; a draft
//   from four CTAs an SM lost up to 1.05x in one wave).
// - At V 4 (12-bit A as digits, unsigned 16-bit A) where the grid holds ten CTAs an SM or more, the
//   fewer registers letting more CTAs share an SM (12-bit A with 4-bit B: 80 against 110, six CTAs,
//   not four): L12-R4 0.91x the time over 89 cells, unsigned A 0.90x over 117; on smaller grids,
//   where each CTA's chain of latencies counts, up to 1.20x (forty-ninth and fiftieth rounds). There
//   too where the stacked form's occupancy runs the grid in fewer waves: the cells moved took 0.836x
//   and 0.834x the time in two A/Bs over 432 fresh cells (sixty-fifth round).
template <int AB, bool AS, int BB, int TB>
void launch_gather(const Params& p, int64_t vrows, int64_t bh, int64_t nnz_pad, cudaStream_t stream, Choice choice,
                   int64_t a_bits) {
  namespace sd = magicube::spmm_detail;
  const int64_t ctas = vrows * ((p.row_bytes + TB - 1) / TB) * bh;
  const auto waves = [ctas](int64_t wave) { return (ctas + wave - 1) / wave; };
  constexpr auto one = sd::spmm_kernel<AB, AS, BB, TB, 0, false>;  // one block a step
  const auto one_waves = [&] { return waves(magicube::wave_ctas<one>(kThreads, 0)); };
  if constexpr (AB == 16 && !sd::Kind<AB, AS, BB, TB>::kLocalSums) {
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const bool forced = choice == Choice::kStacked;
    const bool open = choice != Choice::kGather && choice != Choice::kMerged && TB != sd::kQuarterTileBytes;
    const auto rows_pay = [&] { return nnz_pad >= 2 * kSlots * vrows || (BB == 16 && one_waves() > 1); };
    if (p.v == 2 && can_stack(a_bits, AS, 2) && (forced || (open && ctas >= 4 * sms && rows_pay())))
      return launch_tiles<AB, AS, BB, TB, 2>(p, vrows, bh, stream);
    // Signed A stacks at V 4 as 12-bit values only, which meet 4-bit B only (spmm_cuda's checks).
    if constexpr (!AS || BB == 4) {
      constexpr auto stacked = sd::spmm_kernel<AB, AS, BB, TB, 4, false>;
      const auto fewer_waves = [&] { return waves(magicube::wave_ctas<stacked>(kThreads, 0)) < one_waves(); };
      if (p.v == 4 && can_stack(a_bits, AS, 4) && (forced || (open && (ctas >= 10 * sms || fewer_waves()))))
        return launch_tiles<AB, AS, BB, TB, 4>(p, vrows, bh, stream);
    }
  }
  // The integer kinds take two blocks a step (spmm_kernel's PAIR_RING, a ring of four slots) where
  // rows average two blocks or more and the paired grid takes no more waves than the one-block one:
  // 0.958-0.976x the time by pair (seventy-first round); where it takes more, pairing cost up to
  // 1.20x (on the narrow tile L8-R8 holds 8 paired CTAs an SM against 10, and L16-R16 held 7
  // against 8 until the hundred-and-first round; seventy-third round). Not 4-bit B under 4-bit A
  // (1.002x, up to 1.07x). 8-bit A with 4-bit B pairs on rows of more than three blocks where the
  // paired grid fits one wave (five CTAs an SM, not six): 0.950x the time over 35 fresh cells, and
  // 1.15x where only the one-block grid fits one wave (seventy-third round). On the wide tile 8-bit
  // A and B and 16-bit A and B take a ring of five (three blocks in flight, four CTAs an SM) where
  // its grid fits one wave: 0.963-0.967x the four's time, the target 9.01 -> 8.37 us with fp16
  // output; past one wave 1.04x, and L16-R8's wide tile 1.016x even in one wave (seventy-second
  // round).
  if constexpr (!sd::Kind<AB, AS, BB, TB>::kFp16 && AB != 4) {
    constexpr auto four = sd::spmm_kernel<AB, AS, BB, TB, 0, false, 4>;
    const int64_t wave = magicube::wave_ctas<four>(kThreads, 0);
    const bool pays = AB == 8 && BB == 4 ? nnz_pad > 3 * kSlots * vrows && ctas <= wave
                                         : nnz_pad >= 2 * kSlots * vrows && waves(wave) <= one_waves();
    if (pays) {
      if constexpr (AB == BB && TB == sd::kWideTileBytes) {
        constexpr auto five = sd::spmm_kernel<AB, AS, BB, TB, 0, false, 5>;
        if (ctas <= magicube::wave_ctas<five>(kThreads, 0))
          return launch_tiles<AB, AS, BB, TB, 0, false, 5>(p, vrows, bh, stream);
      }
      return launch_tiles<AB, AS, BB, TB, 0, false, 4>(p, vrows, bh, stream);
    }
  }
  launch_tiles<AB, AS, BB, TB>(p, vrows, bh, stream);
}

// Rows of at most 128 bytes (8-bit B of N <= 128, 16-bit and fp16 B of N <= 64) take the narrow
// tile. With the wide one, half of every step's copies and products were of zeros: on an H200 the
// narrow tile took 18-28 % less time (geometric means over M = K 1024-4096, V 2 / 4 / 8, sparsity
// 0.7 / 0.9 / 0.98: L8-R8 and L16-R8 at N 64 and 128, L16-R16 and fp16 at N 32 and 64), and the
// fp16 pipeline's P x V (batch x heads 32, L 4096, head dim 64) 188 -> 112 us. 4-bit B's rows of at
// most 64 bytes (N <= 128) take the quarter tile for the same reason: on an H200, gather kernel
// forced, M = K 1024-4096, V 2 / 4 / 8, sparsity 0.7 / 0.9 / 0.98, N 64 and 128, it took 0.74-0.81x
// the narrow tile's time on the geometric mean by pair (0.60-0.90x by cell; L8-R4 at M = K 4096, N
// 128, V 8, sparsity 0.9: 7.87 -> 5.89 us), and the automatic choice 0.85-0.88x (up to 1.004x where
// it runs another way; kernel_checks.md, eighty-third round). So do 8-bit B's (N <= 64), where a
// warp's chunk is one m-tile: gather kernel forced (M = K 512-4096, V 2 / 4 / 8, sparsity 0.5-0.98,
// N 16-64, BH 1-16, 992 cells), 0.85x and 0.83x the narrow tile's time with 8- and 16-bit A on rows
// of 64 bytes (0.67-1.00x by cell; L8-R8 at M = K 4096, N 64, V 8, sparsity 0.9: 6.36 -> 5.17 us),
// 0.89x and 0.86x on rows of 32, 0.94-0.97x on rows of 16 and 48 (up to 1.05x; eighty-sixth round).
// Rows of more than one tile whose last tile would be at most half full take the tile of half the
// width where the bytes it leaves empty are fewer by more than the smaller tile costs: 8-, 16-bit
// and fp16 B's rows of 257-384 and 513-640 bytes the narrow tile, 4-bit B's rows of 129-192 bytes
// the quarter tile (not under 4-bit A). On an H200, every way forced (M = K 1024-4096, V 2 / 4 / 8,
// sparsity 0.7-0.98), the gather kernel on the narrow tile took 0.84-0.94x the wide tile's time on
// rows of 320 and 384 bytes by pair and V, 0.93-0.98x on 640, 0.99-1.16x on 192 (one wide tile,
// two narrow ones); 4-bit B's on the quarter tile 0.90-0.98x the narrow tile's on rows of 160 and
// 192 bytes, 0.96-1.09x on 320. In an A/B over 2844 fresh cells (M = K 1280-3584, V 2 / 4 / 8,
// sparsity 0.75-0.97, BH 1 and 4) the choice took 0.943x the time on the 1930 cells the rule moves
// (0.69-1.11x by cell; L16-R8 0.916x, fp16 0.903x, L8-R8 0.940x, L16-R16 0.947x, L16-R4 0.962x,
// L12-R4 0.976x, L8-R4 0.984x), and L4-R4's 0.999x (up to 1.20x) on the quarter tile. Off the
// grid (bench_spmm --off-grid) fp16's smallest such problems (2-3.5 us) took up to 1.12x, and
// L12-R4 at V 4, whose digits stack on the narrow tile but not on the quarter one, 1.13x
// (kernel_checks.md, ninety-third round).
// Returns what `f.template operator()<TB>()` returns with that tile TB.
template <int AB, bool AS, int BB, class F>
decltype(auto) on_tile(const Params& p, F&& f) {
  namespace sd = magicube::spmm_detail;
  constexpr int quarter = sd::kQuarterTileBytes, narrow = sd::kNarrowTileBytes, wide = sd::kWideTileBytes;
  const int64_t rb = p.row_bytes;
  if constexpr (BB == 8 || BB == 4) {
    if (rb <= quarter || (BB == 4 && AB != 4 && half_empty_end(rb, narrow, 3 * narrow / 2)))
      return f.template operator()<quarter>();
  }
  if (rb <= narrow || (BB != 4 && half_empty_end(rb, wide, 5 * wide / 2))) return f.template operator()<narrow>();
  return f.template operator()<sd::Kind<AB, AS, BB>::kTileBytes>();
}

// The gather kernel on its tile (on_tile), or on half of its own tile (8-bit B's narrow tile, 4-bit
// B's quarter tile) where rows of B are whole tiles and the grid on them leaves SMs to spare: twice
// the CTAs, each gathering half of every row, set SMs to work that would wait idle. Each CTA still
// fetches all of its row's indices and sparse values, so the bound falls as A widens: at most 2.5
// CTAs an SM for 8-bit A and B, 2 for 4-bit B under 4- and 8-bit A, 1.5 for 12- and 16-bit A (2
// where A's rows average at most two blocks). On an H200, each tile timed on 5100 cells about the
// bounds (the six pairs of 8- and 4-bit B, M = K 256-3328, V 2 / 4 / 8, N 256 and 512, sparsity
// 0.55-0.97, BH 1-4), half the tile over the whole one by CTAs an SM (<= 1.5 / 1.5-2 / 2-2.5 /
// more): 8-bit A and B 0.924 / 0.933 / 0.973 / 1.014; 4-bit B under 4- and 8-bit A 0.905 / 0.963 /
// 1.045 / 1.071; 12- and 16-bit A 0.951 / 1.030 / 1.037 / 1.093, on rows of at most two blocks 0.938
// / 0.983 / 1.017 / 1.043 (kernel_checks.md, hundredth round). At the SpMM target (512 CTAs, four
// an SM) half the tile took 1.15x the time (ninety-eighth round). 16-bit and fp16 B, whose rows are
// twice as wide, mostly lost even on small grids (ninety-eighth round).
template <int AB, bool AS, int BB>
void launch(const Params& p, int64_t vrows, int64_t bh, int64_t nnz_pad, cudaStream_t stream, Choice choice,
            int64_t a_bits) {
  if constexpr (BB == 8 || BB == 4) {
    constexpr int tile = magicube::spmm_detail::Kind<AB, AS, BB>::kTileBytes;
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    // Twice the bound, in CTAs an SM on the whole tile.
    const int64_t twice_bound = AB == 16 ? (nnz_pad <= 2 * kSlots * vrows ? 4 : 3) : AB == 8 && BB == 8 ? 5 : 4;
    if (p.row_bytes % tile == 0 && 2 * vrows * (p.row_bytes / tile) * bh <= twice_bound * sms)
      return launch_gather<AB, AS, BB, tile / 2>(p, vrows, bh, nnz_pad, stream, choice, a_bits);
  }
  on_tile<AB, AS, BB>(
      p, [&]<int TB>() { launch_gather<AB, AS, BB, TB>(p, vrows, bh, nnz_pad, stream, choice, a_bits); });
}

// The resident kernel's CTAs a (slice, bh) at WARPS warps a CTA: as many as one wave holds, at most
// one a WARPS vector rows; and the vector rows each warp then runs.
template <auto Kernel, int WARPS>
std::pair<int64_t, int64_t> resident_groups(int64_t smem, int64_t slices, int64_t vrows, int64_t bh) {
  const int64_t ctas = magicube::wave_ctas<Kernel>(32 * WARPS, smem);
  const int64_t groups = std::clamp<int64_t>(ctas / (slices * bh), 1, (vrows + WARPS - 1) / WARPS);
  return {groups, (vrows + groups * WARPS - 1) / (groups * WARPS)};
}

// The resident kernel's estimated time (us), which the dense path's is weighed against
// (against_resident): 3.45, plus 12.4 per MB of B's slices that the CTAs of an SM load, plus per
// thousand columns of A that a warp runs (its vector rows x a vector row's padded columns on the
// average) 5.55 (L8-R8), 6.35 (L16-R8), 7.65 (L4-R4), 7.85 (L8-R4) or 10.45 (L16-R4; 12-bit A runs
// in the same containers): a warp's chain of columns sets the time, not the bytes gathered
// (with those in its place, 0.58-1.33x the measured time, 5th-95th percentile). Fitted on an H200
// on rows of B of at most 64 bytes with every way forced (2350 cells: L8-R8 and L16-R8 at N 16-64,
// L8-R4, L4-R4 and L16-R4 at N 32-128; M = K 1024-4096, V 2 / 4 / 8, sparsity 0.5-0.9, BH 1, 4 and
// 16): 0.86-1.09x the measured time (5th-95th percentile), and 0.90-1.07x on 1620 cells it had not
// seen (M = K 1536-3584, sparsity 0.55-0.85, BH 1, 2 and 8; kernel_checks.md, eighty-ninth round).
template <int AB, int BB>
double resident_us(double load_mb, double warp_kcolumns) {
  constexpr double per_kcolumn = BB == 8 ? (AB == 16 ? 6.35 : 5.55) : AB == 16 ? 10.45 : AB == 8 ? 7.85 : 7.65;
  return 3.45 + 12.4 * load_mb + per_kcolumn * warp_kcolumns;
}

// The resident-B kernel, where it applies: 8- or 4-bit B whose rows take 16-byte copies and a
// 32-byte slice of all of B's rows fitting one CTA's shared memory. It loads B's slices once and
// gathers from them, where the gather kernel reads a row of B from L2 for every kept vector, so it
// pays from a count of those gathers (`gathers`: bytes per SM and unit of V), and only on rows of up
// to one narrow tile (128 bytes), or two of 4-bit B: wider rows take the gather kernel's wide tile at
// L2 bandwidth, where its shared-memory gathers lose to bank conflicts (N 256: 8.6 against 14.5 us at
// the SpMM target).
// Each count was fitted with every way forced and checked by A/Bs on cells it had not seen;
// kernel_checks.md gives, under the round named, the data, the figures and the bounds that lost.
// - By the share of the narrow tile a row fills: an eighth from 6 KB, a quarter from 12 KB, half
//   from 24 KB, a whole tile from 96 KB, two tiles from 48 KB (fortieth and forty-first rounds, H100
//   and H200: 0.34-0.74 % over the faster kernel per row width on the sweep's cells).
// - Rows of 65-96 bytes (`three_quarters`: three slices) count from 32 KB at BH 2 and up and where
//   A keeps a quarter of its columns or more (ninety-seventh round: with 8-bit B the cells that
//   moved took 0.85x the time by the ways forced over 2304 cells and 0.77x in an A/B over 1512 it
//   had not seen; with 4-bit B 0.85x by the ways forced there). At BH 1 on sparser A the resident
//   kernel, which loads all of B's slices, gained nothing (8-bit B 1.006x over 26 cells, up to
//   1.26x; 4-bit B 1.056x over 24).
// - 4-bit B's rows of at most 64 bytes run on the gather kernel's quarter tile and count against
//   it: a quarter from 10 KB, half from 20 KB, more from 80 KB (eighty-fourth round: 1.014x the
//   fastest way's time against 1.032x). 8-bit B's rows of 64 bytes, on that tile too, count from 60
//   KB (eighty-sixth round: 1.012x against 1.062x).
// - Rows of 48 bytes where A's rows average eight blocks or more (`long_48`), but 4-bit B's under
//   12- and 16-bit A, count from 8 KB (8-bit B) and 32 KB (4-bit B); under shorter rows of A the
//   kernel still loads all of B's slices for few columns (ninetieth round: 0.995x the time of
//   before, the cells moved 0.86x; without the bound up to 1.58x).
// - Batched (`batched`), the count falls with BH, as the resident kernel's time hardly grows with
//   BH while the gather kernel's does: to a quarter from BH 4 on rows of up to half a narrow tile
//   and on 4-bit B's rows of up to a whole one at V 8 (fifty-eighth round: 0.86-0.97x the time by
//   BH), and down to a sixteenth at BH 16 on the quarter tile (eighty-fourth round). To a quarter
//   from BH 8 too on 4-bit B's rows at V 4 where A's rows average four blocks or more, of 65-128
//   bytes under 12- and 16-bit A and of 65-96 bytes up to BH 16 under 4- and 8-bit A
//   (`quarter_at_v4`; fifty-ninth and sixtieth rounds: 0.85x, 0.82x and 0.84x the time), and on
//   grids of 4-warp CTAs (`split`) on rows of 65-96 bytes, and 4-bit B's of up to 112 where A's rows
//   average four blocks or more (`quarter_split`; sixty-first round: 0.83x and 0.94x).
// - 4-bit B's rows of 33-64 bytes keep a quarter at any BH where the grid keeps ten warps an SM or
//   more in rows and a warp runs a block or more per 32 rows of its slice (`quarter_busy`): under
//   4-bit A, and under 12- and 16-bit A where the gather kernel's last wave is under half full
//   (sixty-sixth and eighty-fifth rounds: the cells moved 0.804x and 0.956x the time); 8-bit A's
//   gather kernel runs them faster.
// - 8-bit B's rows of 128 bytes at BH 1 stay on the gather kernel whatever the count
//   (`gather_wins`; sixty-third round: 0.982x the time, 0.75-1.005x by cell).
// Where it pays, it runs unless the dense path's estimate (dense_us, weighed by against_resident;
// infinite where the dense path does not pay) is under its own (resident_us; eighty-ninth round).
// Returns whether it ran.
template <int AB, bool AS, int BB>
bool launch_resident(const Params& p, int64_t vrows, int64_t bh, int64_t nnz_pad, cudaStream_t stream,
                     Choice choice, double dense_us) {
  namespace sd = magicube::spmm_detail;
  if (choice == Choice::kGather || choice == Choice::kStacked || choice == Choice::kMerged || forces_dense(choice))
    return false;
  constexpr auto wide = sd::spmm_resident_kernel<AB, AS, BB, 16>;
  constexpr auto small = sd::spmm_resident_kernel<AB, AS, BB, 4>;
  const int64_t smem = (static_cast<int64_t>(p.k) + 1) * sd::kResidentSliceBytes;
  // Asks both instances: the 4-warp one's static arrays are smaller, so its limit is never the lower,
  // but the query also raises its attribute, which must be set before it launches.
  if (smem > magicube::max_dynamic_smem<wide>() || smem > magicube::max_dynamic_smem<small>()) return false;
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const int64_t slices = (p.row_bytes + sd::kResidentSliceBytes - 1) / sd::kResidentSliceBytes;
  // CTAs of 4 warps where they give a warp fewer rows (the kernel's comment).
  const auto [wide_groups, wide_rows] = resident_groups<wide, 16>(smem, slices, vrows, bh);
  const auto [small_groups, small_rows] = resident_groups<small, 4>(smem, slices, vrows, bh);
  const bool split = small_rows < wide_rows;
  // The CTAs a (slice, bh), the vector rows each warp runs, and the warps with rows an SM.
  const int64_t groups = split ? small_groups : wide_groups, rows = split ? small_rows : wide_rows;
  const int64_t busy_warps = slices * bh * ((vrows + rows - 1) / rows) / props->multiProcessorCount;
  // The gather kernel's bytes per SM and unit of V (each gathered row feeds V output rows), and
  // where the resident kernel starts to pay, by the share of the tile that a row fills: the narrow
  // tile, or the quarter tile for 4-bit B's rows on it (quarter_counts; 8-bit B's rows there count
  // against the narrow tile, but those of 64 bytes).
  const int64_t tile = sd::kNarrowTileBytes, quarter_tile = sd::kQuarterTileBytes, rb = p.row_bytes;
  const int64_t gathers = bh * nnz_pad * rb / (props->multiProcessorCount * p.v);
  const bool narrow = rb <= tile || (BB == 4 && rb <= 2 * tile);
  const bool long_rows = nnz_pad >= 4 * kSlots * vrows;
  const bool quarter_at_v4 = BB == 4 && p.v == 4 && bh >= 8 && long_rows &&
                             (AB == 16 ? rb <= tile : 4 * rb <= 3 * tile && bh <= 16);
  const bool quarter_split = split && bh >= 8 && (4 * rb <= 3 * tile || (BB == 4 && 8 * rb <= 7 * tile && long_rows));
  const bool quarter_counts = BB == 4 && rb <= quarter_tile;
  // Whether the gather kernel's grid (one CTA a vector row on the quarter tile) ends in a wave under
  // half full.
  const auto gather_tail = [&] {
    constexpr auto gather = sd::spmm_kernel<AB, AS, BB, sd::kQuarterTileBytes, 0, false>;
    const int64_t ctas = vrows * bh, wave = magicube::wave_ctas<gather>(kThreads, 0);
    return ctas > wave && 2 * ((ctas - 1) % wave + 1) < wave;
  };
  const bool quarter_busy = quarter_counts && 4 * rb > tile && busy_warps >= 10 &&
                            32 * rows * nnz_pad >= vrows * p.k && (AB == 4 || (AB == 16 && gather_tail()));
  const int64_t batched = quarter_counts ? std::max<int64_t>(quarter_busy ? 4 : 1, std::min<int64_t>(bh, 16))
                          : 2 * rb <= tile || (BB == 4 && p.v == 8 && rb <= tile) || quarter_at_v4 || quarter_split
                              ? std::min<int64_t>(bh, 4)
                              : 1;
  // Rows of 48 bytes (three quarters of the quarter tile) where A's rows average eight blocks or more,
  // but 4-bit B's under 12- and 16-bit A.
  const bool long_48 = 4 * rb == 3 * quarter_tile && nnz_pad >= 8 * kSlots * vrows && (BB == 8 || AB <= 8);
  // Rows of 65-96 bytes (three slices), at BH 2 and up or where A keeps a quarter of its columns or
  // more.
  const bool three_quarters = 2 * rb > tile && 4 * rb <= 3 * tile && (bh >= 2 || 4 * nnz_pad >= vrows * p.k);
  const int64_t pays_from = (quarter_counts ? (4 * rb <= quarter_tile   ? 10 << 10
                                                : 2 * rb <= quarter_tile ? 20 << 10
                                                : long_48                ? 32 << 10
                                                                         : 80 << 10)
                             : 8 * rb <= tile ? 6 << 10
                             : 4 * rb <= tile ? 12 << 10
                             : BB == 8 && rb == quarter_tile ? 60 << 10
                             : 2 * rb <= tile ? (long_48 ? 8 << 10 : 24 << 10)
                             : three_quarters ? 32 << 10
                             : rb <= tile     ? 96 << 10
                                              : 48 << 10) /
                            batched;
  // 8-bit B's rows of a whole narrow tile (N 128) at BH 1 leave the resident kernel: in the whole
  // sweep at 589c3cb (M = K 512-4096, V 2-8, sparsity 0.5-0.98) it took 1.04-1.33x the gather
  // kernel's time from 96 KB to 300 KB, and past that the dense path ran ahead of both; in an A/B
  // over 90 such cells (L8-R8, L16-R8, M = K 1024-4096, sparsity 0.7-0.98) the gather kernel took
  // 0.75-1.005x the time (0.982x on the geometric mean). Rows of 96 and 112 bytes keep the count:
  // there the same rule took up to 1.34x (kernel_checks.md, sixty-third round).
  const bool gather_wins = BB == 8 && bh == 1 && rb == tile;
  const bool pays = narrow && !gather_wins && gathers >= pays_from;
  // Where the dense path pays too, the faster of the two by their estimates (resident_us).
  const double load_mb = 1e-6 * bh * slices * groups * p.k * sd::kResidentSliceBytes / props->multiProcessorCount;
  const double warp_kcolumns = 1e-3 * rows * nnz_pad / vrows;
  if (choice == Choice::kAuto && (!pays || dense_us < resident_us<AB, BB>(load_mb, warp_kcolumns))) return false;
  MAGICUBE_CHECK(slices <= 65535, "spmm: N too large");
  const dim3 grid(static_cast<unsigned>(groups), static_cast<unsigned>(slices), static_cast<unsigned>(bh));
  if (split) magicube::launch_overlapped(small, grid, dim3(32 * 4), static_cast<size_t>(smem), stream, p);
  else magicube::launch_overlapped(wide, grid, dim3(32 * 16), static_cast<size_t>(smem), stream, p);
  return true;
}

// Which of our GEMMs multiplies the planes where cuBLAS's does not (pick_gemm).
enum class Gemm {
  kMma,
  kWgmmaLarge,
  kWgmmaSmall,
  kWgmmaSmallOneWave,
  kWgmmaLeast,
  kWgmmaLeastOneWave,
  kWgmmaLeastSplit
};

// The dense path (spmm_dense.cuh): the GEMM's operands, padded to kAlign rows and columns (cuBLAS's
// int8 GEMM takes K and N in multiples of 8 and more than 16 rows of A; ours, K in 16-byte chunks),
// the largest magnitude of a byte of each operand's planes, and our GEMM.
struct DenseShape {
  int64_t m_pad, n_pad, k_pad, a_planes, b_planes, a_max, b_max;
  Gemm gemm;
  // Each plane product stays below 2^31 in its int32 accumulator.
  bool applies() const { return a_max * b_max * k_pad < (int64_t{1} << 31); }
  // A's planes for `bh` batch x heads within 1 GiB: past that the automatic and tuned choices run
  // the gather kernels, slower, instead of the allocator failing.
  bool fits(int64_t bh) const { return bh * a_planes * m_pad * k_pad <= (int64_t{1} << 30); }
  // One plane each, both signed bytes (A's values at most 128), where our wgmma GEMM does not run:
  // cuBLAS's int8 GEMM and a pass that stores its products, faster there than our mma.sync GEMM
  // (H200, M = K = 2048, N 256: 6.9 us and the pass against 9.4, before its paired stores). Where
  // ours runs on wgmma, ours (M = K = 4096, N 256: 10.3 us against 15.3 and 4.6 for the pass; N 512:
  // 14.1 against 25.8 and the pass; M = K = 2048, N 256, in its least tile: 6.5 against 9.8 for
  // both; and one launch for every batch x head). Ours takes several products in one pass (two at N
  // 256: 18.5 us, four: 25.0) and unsigned bytes, which cuBLAS's does not.
  bool cublas() const { return a_planes * b_planes == 1 && a_max <= 128 && gemm == Gemm::kMma; }
};

// Each SM takes in about 50 GB/s from L2 (H200), which bounds both of our GEMMs: their time is the
// bytes of operand tiles an SM reads, and larger output tiles read fewer bytes per product but
// leave SMs idle where there are fewer tiles than SMs. On Hopper (in an sm_90a build), the wgmma
// GEMM's larger tile where its tiles fill 3/4 of the SMs, else its smaller one where that does,
// else its least where that does (either with a deeper ring where its tiles fit one wave), else,
// for one or two plane products, its least tile with each tile's K split between the two CTAs of
// a cluster, else (and on other GPUs) the mma.sync GEMM; `force_wgmma` takes the wgmma GEMM's
// smaller tile there instead (tests).
//
// Split, each CTA reads half a tile's operand bytes, and twice the CTAs run; the halves' sums are
// added through distributed shared memory (spmm_dense.cuh: store_split). Forced on the dense path
// (H200, BH 1, V 2, sparsity 0.7), the least tile split in two took 0.68-0.73x the time of
// cuBLAS's GEMM and its pass (8-bit A and B at M = K 1024-2048, N 128-256, where no tile fills the
// SMs) and 0.73-0.80x the mma.sync GEMM's with two plane products; with four, 0.92-1.05x, so those
// stay on mma.sync. Where a tile fills the SMs, splitting took 0.94-4.4x the time (any tile, 2 or
// 4 CTAs a cluster; under 1.0 in two cells only, M = K = 4096, N 128, BH 1): the sums' round trip
// through shared memory costs about what the halved operand bytes save (kernel_checks.md,
// sixty-second round).
template <int AP, int BP>
Gemm pick_gemm(int64_t m_pad, int64_t n_pad, int64_t bh, bool force_wgmma) {
#ifdef MAGICUBE_SM90A
  namespace dn = magicube::spmm_dense;
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  if (props->major == 9) {
    using Large = typename dn::WgmmaTiles<AP, BP>::Large;
    using Small = typename dn::WgmmaTiles<AP, BP>::Small;
    using Least = typename dn::WgmmaTiles<AP, BP>::Least;
    const int64_t sms = props->multiProcessorCount, fill = sms * 3 / 4;
    auto ctas = [&](int64_t tile_m, int64_t tile_n) {
      return bh * ((m_pad + tile_m - 1) / tile_m) * ((n_pad + tile_n - 1) / tile_n);
    };
    if (ctas(Large::kM, Large::kN) >= fill) return Gemm::kWgmmaLarge;
    const int64_t small = ctas(Small::kM, Small::kN), least = ctas(Least::kM, Least::kN);
    if (small >= fill || (force_wgmma && least < fill))
      return small <= sms ? Gemm::kWgmmaSmallOneWave : Gemm::kWgmmaSmall;
    if (least >= fill) return least <= sms ? Gemm::kWgmmaLeastOneWave : Gemm::kWgmmaLeast;
    if (AP * BP <= 2) return Gemm::kWgmmaLeastSplit;
  }
#endif
  return Gemm::kMma;
}

DenseShape dense_shape(int64_t m, int64_t n, int64_t k, int64_t a_bits, bool a_signed, int64_t b_bits, int64_t bh,
                       bool force_wgmma) {
  namespace dn = magicube::spmm_dense;
  auto pad = [](int64_t x) { return (std::max<int64_t>(x, 1) + dn::kAlign - 1) / dn::kAlign * dn::kAlign; };
  // A low plane is an unsigned byte (up to 255); a single plane is the value itself.
  auto largest = [](int64_t bits, bool is_signed) {
    return bits > 8 ? int64_t{255} : is_signed ? int64_t{1} << (bits - 1) : (int64_t{1} << bits) - 1;
  };
  auto planes = [](int64_t bits) { return bits > 8 ? int64_t{2} : int64_t{1}; };
  DenseShape d{std::max<int64_t>(pad(m), 2 * dn::kAlign), pad(n), pad(k), planes(a_bits), planes(b_bits),
               largest(a_bits, a_signed), largest(b_bits, true), Gemm::kMma};
  d.gemm = d.a_planes == 1 ? pick_gemm<1, 1>(d.m_pad, d.n_pad, bh, force_wgmma)
           : d.b_planes == 1 ? pick_gemm<2, 1>(d.m_pad, d.n_pad, bh, force_wgmma)
                             : pick_gemm<2, 2>(d.m_pad, d.n_pad, bh, force_wgmma);
  return d;
}

// The estimated times (us) of the dense path and of the gather kernel (estimates).
struct Estimates {
  double dense_us;  // infinite where A's planes do not fit
  double gather_us;
};

// Whether the dense path is the faster one, by estimated times (us) of both ways, fitted on an H200
// with every way forced over the bench_spmm sweep's cells (the seven pairs, BH 1; thirty-first to
// thirty-third rounds), where choosing by the two took 0.31-0.35 % more time than the faster way.
// The gather and resident-B kernels: 3.5 + the gathered MB (a row of B per kept vector, from L2)
// over a rate that grows with the row's width: 4.3 MB/us for rows of up to 64 bytes, 5.3 to 128, 6.5
// to 256, 8.0 past; 4-bit B's at 0.85 of it, as the way that runs instead there is mostly the
// resident kernel (fifty-third round: 16 of 864 cells moved to the dense path at 0.71-0.96x their
// time, none slower). The dense path: 10.2 + 0.35 per MB of A's planes + 1.58 per million stored
// values + per GOP of one plane product (2 M N K): 1.45 through cuBLAS (about 2 more for each batch x
// head after the first); on our mma.sync GEMM 1.57, 3.10 or 4.60 for one (unsigned), two or four
// products; on wgmma 0.76, 1.7 and 2.75 (2.1 for four in the smaller tile), the fitted constants
// scaled by what its TMA stages and staged stores saved (thirty-seventh and thirty-ninth rounds);
// the least tile's 0.97 and 2.06, scaled from the GEMMs that ran there before it (forty-fourth
// round), which its split form counts as too (sixty-second round). The expansion has since run
// faster, but refits on it chose no better (thirty-fifth and forty-first rounds). On wgmma the dense
// path ran 0.68-0.80x its estimate (0.91-0.93x on mma.sync), so that estimate counts at 0.8: the
// choice then took 0.987-0.995x the time by pair over the sweep with 8- and 16-bit B, and 0.992-0.997x
// with 4-bit B (fifty-fourth and fifty-fifth rounds).
// Returns both estimates: the dense path pays where its own, weighed by batched_dense, is under the
// gather kernel's.
Estimates estimates(const DenseShape& d, const Params& p, int64_t b_bits, int64_t bh, int64_t nnz_pad) {
  constexpr double kMega = 1e-6;
  const double rate = (p.row_bytes <= 64 ? 4.3 : p.row_bytes <= 128 ? 5.3 : p.row_bytes <= 256 ? 6.5 : 8.0) *
                      (b_bits == 4 ? 0.85 : 1.0);
  const double gather_us = 3.5 + bh * nnz_pad * p.row_bytes * kMega / rate;
  if (!d.fits(bh)) return {std::numeric_limits<double>::infinity(), gather_us};
  const double a_mb = 1.0 * d.a_planes * d.m_pad * d.k_pad * kMega;
  const double product_gop = 2e-9 * d.m_pad * d.n_pad * d.k_pad;
  const int64_t products = d.a_planes * d.b_planes;
  double per_gop;
  if (d.cublas()) per_gop = 1.45;
  else if (d.gemm == Gemm::kMma) per_gop = products == 1 ? 1.57 : products == 2 ? 3.10 : 4.60;
  else if (d.gemm == Gemm::kWgmmaLeast || d.gemm == Gemm::kWgmmaLeastOneWave || d.gemm == Gemm::kWgmmaLeastSplit)
    per_gop = products == 1 ? 0.97 : 2.06;
  else per_gop = products == 1 ? 0.76 : products == 2 ? 1.7 : d.gemm == Gemm::kWgmmaLarge ? 2.75 : 2.1;
  const double values_m = 1.0 * nnz_pad * p.v * kMega;
  const double dense_us = 10.2 + (d.cublas() ? 2.0 * (bh - 1) : 0.0) +
                          bh * (0.35 * a_mb + per_gop * product_gop + 1.58 * values_m);
  const double wgmma_scale = d.gemm != Gemm::kMma ? 0.8 : 1.0;
  return {wgmma_scale * dense_us, gather_us};
}

// One launch expands A's and B's planes (spmm_dense.cuh: expand_kernel), G vector rows a CTA;
// overlapped (run_dense says where).
template <int AB, bool AS, int BB, int G>
void expand_groups(const magicube::spmm_dense::ExpandParams& ep, int64_t bh, cudaStream_t stream, bool overlapped) {
  namespace dn = magicube::spmm_dense;
  const int64_t strips = (ep.k_pad + ep.strip_cols - 1) / ep.strip_cols;
  const int64_t groups = (ep.vrows + G - 1) / G;
  MAGICUBE_CHECK(strips <= 65535 && groups + ep.b_tiles <= INT32_MAX, "spmm: K, N or M too large");
  const dim3 grid(static_cast<unsigned>(groups + ep.b_tiles), static_cast<unsigned>(strips), static_cast<unsigned>(bh));
  const size_t smem = std::max<size_t>(static_cast<size_t>(dn::kPlanesOf<AB>) * G * ep.v * ep.strip_cols,
                                       dn::kBTileBytes);
  if (overlapped) {
    magicube::launch_overlapped(dn::expand_kernel<AB, AS, BB, G>, grid, dim3(dn::kExpandThreads), smem, stream, ep);
    return;
  }
  dn::expand_kernel<AB, AS, BB, G><<<grid, dn::kExpandThreads, smem, stream>>>(ep);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Vector rows of V 2 or 4 in groups of up to 8 a CTA, where a strip is the whole of K, the group's
// strips fill at most 16 KB and 3 CTAs an SM remain: their rows are short, and the CTA's fixed
// work is paid once a group (H200, M = K 512-4096, 1-32 batch x heads: the expansion 0.56-0.96x
// the time; larger groups, fewer CTAs or V 8 took up to 1.5x).
template <int AB, bool AS, int BB>
void expand(const magicube::spmm_dense::ExpandParams& ep, int64_t bh, cudaStream_t stream, bool overlapped) {
  namespace dn = magicube::spmm_dense;
  const int64_t strip_bytes = int64_t{dn::kPlanesOf<AB>} * ep.v * ep.k_pad;
  const int64_t min_ctas = 3 * int64_t{at::cuda::getCurrentDeviceProperties()->multiProcessorCount};
  int g = 1;
  if (ep.v <= 4 && ep.strip_cols == ep.k_pad)
    while (g < 8 && 2 * g * strip_bytes <= (16 << 10) && bh * ((ep.vrows + 2 * g - 1) / (2 * g)) >= min_ctas) g *= 2;
  if (g == 8) return expand_groups<AB, AS, BB, 8>(ep, bh, stream, overlapped);
  if (g == 4) return expand_groups<AB, AS, BB, 4>(ep, bh, stream, overlapped);
  if (g == 2) return expand_groups<AB, AS, BB, 2>(ep, bh, stream, overlapped);
  expand_groups<AB, AS, BB, 1>(ep, bh, stream, overlapped);
}

// One GEMM kernel with tile T, over a grid of T's output tiles x batch x head; `maps` are the
// wgmma GEMM's tensor maps.
template <class T, auto Kernel, class... Maps>
void launch_gemm(const magicube::spmm_dense::GemmParams& gp, int64_t bh, cudaStream_t stream, const Maps&... maps) {
  MAGICUBE_CHECK(T::kSmemBytes <= magicube::max_dynamic_smem<Kernel>(), "spmm: the dense path's GEMM needs ",
                 T::kSmemBytes, " bytes of shared memory a CTA, more than this GPU has");
  const int64_t m_tiles = (gp.m_pad + T::kM - 1) / T::kM, n_tiles = (gp.n_pad + T::kN - 1) / T::kN;
  MAGICUBE_CHECK(m_tiles <= 65535 && n_tiles <= INT32_MAX, "spmm: M or N too large");
  // N's tiles of one row of tiles run side by side, so A's rows come from memory once, then from L2;
  // a cluster of T::kSplit CTAs along x shares the K of one tile.
  const dim3 grid(static_cast<unsigned>(n_tiles * T::kSplit), static_cast<unsigned>(m_tiles),
                  static_cast<unsigned>(bh));
  magicube::launch_overlapped_clusters(Kernel, grid, dim3(T::kThreads), T::kSmemBytes, stream, T::kSplit, gp, maps...);
}

#ifdef MAGICUBE_SM90A
// The driver's tensor-map encoder, looked up once through the runtime (the extension does not link
// the driver library).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    MAGICUBE_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                   "spmm: the CUDA driver does not provide cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// The TMA's view of byte planes [matrices][rows][k_pad], in boxes of 128 bytes of K x `box_rows`
// rows with the 128-byte swizzle (spmm_dense.cuh: wgmma_gemm_kernel).
CUtensorMap plane_map(const int8_t* planes, int64_t matrices, int64_t rows, int64_t k_pad, int box_rows) {
  namespace dn = magicube::spmm_dense;
  CUtensorMap map;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(k_pad), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(matrices)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(k_pad), static_cast<cuuint64_t>(rows * k_pad)};
  const cuuint32_t box[3] = {dn::kStepBytes, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t steps[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<int8_t*>(planes), dims,
                                          strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MAGICUBE_CHECK(r == CUDA_SUCCESS, "spmm: encoding a tensor map of the dense path's planes failed (CUresult ",
                 static_cast<int>(r), ")");
  return map;
}

// The wgmma GEMM with tile T.
template <int AB, bool AS, int BB, class T>
void launch_wgmma_gemm(const magicube::spmm_dense::GemmParams& gp, int64_t bh, cudaStream_t stream) {
  launch_gemm<T, magicube::spmm_dense::wgmma_gemm_kernel<AB, AS, BB, T>>(
      gp, bh, stream, plane_map(gp.a, bh * T::AP, gp.m_pad, gp.k_pad, T::kM),
      plane_map(gp.b, bh * T::BP, gp.n_pad, gp.k_pad, T::kN));
}
#endif

// The GEMM of the planes with its recombining epilogue, as pick_gemm chose.
template <int AB, bool AS, int BB>
void gemm(const magicube::spmm_dense::GemmParams& gp, int64_t bh, Gemm which, cudaStream_t stream) {
  namespace dn = magicube::spmm_dense;
  constexpr int AP = dn::kPlanesOf<AB>, BP = dn::kPlanesOf<BB>;
#ifdef MAGICUBE_SM90A
  using Tiles = dn::WgmmaTiles<AP, BP>;
  if (which == Gemm::kWgmmaLarge) return launch_wgmma_gemm<AB, AS, BB, typename Tiles::Large>(gp, bh, stream);
  if (which == Gemm::kWgmmaSmall) return launch_wgmma_gemm<AB, AS, BB, typename Tiles::Small>(gp, bh, stream);
  if (which == Gemm::kWgmmaSmallOneWave)
    return launch_wgmma_gemm<AB, AS, BB, typename Tiles::SmallOneWave>(gp, bh, stream);
  if (which == Gemm::kWgmmaLeast) return launch_wgmma_gemm<AB, AS, BB, typename Tiles::Least>(gp, bh, stream);
  if (which == Gemm::kWgmmaLeastOneWave)
    return launch_wgmma_gemm<AB, AS, BB, typename Tiles::LeastOneWave>(gp, bh, stream);
  if constexpr (AP * BP <= 2) {
    if (which == Gemm::kWgmmaLeastSplit)
      return launch_wgmma_gemm<AB, AS, BB, typename Tiles::LeastSplit>(gp, bh, stream);
  }
#endif
  using T = typename dn::DefaultGemmTile<AP, BP>::type;
  launch_gemm<T, dn::gemm_kernel<AB, AS, BB, T>>(gp, bh, stream);
}

// Batched, the dense path runs over the estimate that BH 1 fitted (estimates): at BH 8 it took
// 0.98-1.08x the estimate by pair, at BH 16 1.00-1.40x, against 0.79-0.99x at BH 1 and 4, while the
// other ways kept to theirs (M = K 512-2048, N 128-512, V 2 / 4 / 8, sparsity 0.5-0.95, every way
// forced; H200). So it counts this much more against the gather estimate, and against the
// resident kernel's (against_resident).
double batched_dense(int64_t bh) { return bh >= 16 ? 1.3 : bh >= 8 ? 1.15 : 1.0; }

// The dense path's operands, where it runs, and its estimate (us; 0 where it is forced).
struct Dense {
  DenseShape shape;
  at::Tensor out;
  double us;
};

// The dense estimate as weighed against the resident kernel's (resident_us): at 0.8 of itself, 0.96
// with 12- and 16-bit A, and by batched_dense. On rows of at most 64 bytes where both paid (the
// cells of resident_us) the dense path took 0.78x its estimate at BH 1 and 0.84-1.04x at BH 2-16,
// 1.02x with 16-bit A against 0.83-0.84x with 4- and 8-bit A. By the two estimates the choice
// between the two took 1.009x the faster one's time on the geometric mean over those 927 cells
// (1.058x before: the dense path first where its estimate was under 0.6 of the gather kernel's),
// 1.007x over the 424 that the fit had not seen (1.080x before; 1.018x unweighed by BH)
// (kernel_checks.md, eighty-ninth round).
template <int AB>
double against_resident(double dense_us, int64_t bh) {
  return 0.8 * (AB == 16 ? 1.2 : 1.0) * batched_dense(bh) * dense_us;
}

// A and B expanded to byte planes and multiplied: one signed plane each by cuBLAS's int8 GEMM
// (at::_int_mm, one batch x head at a time) and a pass that stores its products, more planes by
// our GEMM, which recombines the plane products in its epilogue. The expansion and our GEMM are
// launched overlapped (launch.cuh), without an early trigger: each launches as the last CTAs of
// the kernel before it exit, which hides the gap between them (H200, the dense path forced, M = K
// 512-4096, N 128-512, V 2 and 8, sparsity 0.7, L8-R8, L16-R8, L16-R16, L8-R4: 0.3-1.2 us less a
// call, 0.89-1.00x the time where our GEMM runs). Triggered early (at the expansion's start, after
// the GEMM's main loop), the next kernel's CTAs took SMs while the last ones still ran, and the
// time went 0.77-1.20x by cell; before cuBLAS's GEMM the overlapped expansion took 1.01-1.03x.
template <int AB, int BB>
void run_dense(const Params& p, const Dense& dense, int64_t vrows, int64_t bh, bool a_signed, cudaStream_t stream) {
  namespace dn = magicube::spmm_dense;
  const DenseShape& d = dense.shape;
  const auto bytes = dense.out.options().dtype(at::kChar);
  // Pad rows past M stay unwritten: they reach only outputs that are not stored.
  at::Tensor a = at::empty({bh, d.a_planes * d.m_pad, d.k_pad}, bytes);
  at::Tensor bt = at::empty({bh, d.b_planes * d.n_pad, d.k_pad}, bytes);
  dn::ExpandParams ep;
  ep.row_ptr = p.row_ptr;
  ep.col_idx = p.col_idx;
  ep.a = p.a;
  ep.a_bh_bytes = p.a_bh_bytes;
  ep.a_out = a.data_ptr<int8_t>();
  ep.vrows = static_cast<int>(vrows);
  ep.m_pad = static_cast<int>(d.m_pad);
  ep.k_pad = static_cast<int>(d.k_pad);
  ep.v = p.v;
  ep.strip_cols = static_cast<int>(std::min<int64_t>(d.k_pad, dn::kStripBytes / (d.a_planes * p.v) / dn::kAlign *
                                                                   dn::kAlign));
  ep.b = p.b;
  ep.b_bh_bytes = p.b_bh_bytes;
  ep.row_bytes = p.row_bytes;
  ep.b_out = bt.data_ptr<int8_t>();
  ep.k = p.k;
  ep.n = p.n;
  ep.n_pad = static_cast<int>(d.n_pad);
  ep.n_tiles = static_cast<int>((d.n_pad + dn::kBTile - 1) / dn::kBTile);
  const int64_t b_tiles = ep.n_tiles * ((d.k_pad + dn::kBTile - 1) / dn::kBTile);
  MAGICUBE_CHECK(b_tiles <= INT32_MAX, "spmm: K or N too large");
  ep.b_tiles = static_cast<int>(b_tiles);
  if (a_signed) expand<AB, true, BB>(ep, bh, stream, !d.cublas());
  else expand<AB, false, BB>(ep, bh, stream, !d.cublas());

  dn::Output o;
  o.out = dense.out.data_ptr();
  o.scale_a = p.scale_a;
  o.scale_b = p.scale_b;
  o.m = p.m;
  o.n = p.n;
  o.out_int64 = p.out_int64;
  if (d.cublas()) {
    at::Tensor c = at::empty({bh, d.m_pad, d.n_pad}, dense.out.options().dtype(at::kInt));
    for (int64_t i = 0; i < bh; ++i) {
      at::Tensor ci = c.select(0, i);
      at::_int_mm_out(ci, a.select(0, i), bt.select(0, i).t());
    }
    MAGICUBE_CHECK(bh * p.m <= INT32_MAX, "spmm: BH x M too large");
    dn::dequantize_kernel<<<static_cast<unsigned>(bh * p.m), dn::kDequantizeThreads, 0, stream>>>(
        c.data_ptr<int>(), static_cast<int>(d.m_pad), static_cast<int>(d.n_pad), o);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  dn::GemmParams gp;
  gp.a = a.data_ptr<int8_t>();
  gp.b = bt.data_ptr<int8_t>();
  gp.m_pad = static_cast<int>(d.m_pad);
  gp.n_pad = static_cast<int>(d.n_pad);
  gp.k_pad = static_cast<int>(d.k_pad);
  gp.o = o;
  if (a_signed) gemm<AB, true, BB>(gp, bh, d.gemm, stream);
  else gemm<AB, false, BB>(gp, bh, d.gemm, stream);
}

// An integer pair: the dense path where `dense` says so, else the merged rows (launch_merged) or
// the resident-B kernel where they apply and pay, else the gather kernel. On rows of at most half a
// narrow tile, and on every row it takes at BH 2-15, the resident kernel is asked first where the
// dense path pays too, and the faster of the two by their estimates runs (launch_resident): the
// dense model weighs the dense path against the gather kernel only, and on the narrower rows the
// resident kernel beat both in most cells (N 32 and 64, both chips: 1.1-1.9x faster than the dense
// path in the 10 cells a chip where the model took it).
// Until the eighty-ninth round the dense path ran first only where its estimate was under 0.6 of
// the gather kernel's: over 3970 cells of such rows (resident_us) that choice took 1.024x the
// fastest way's time on the geometric mean, and by the two estimates 1.013x; the 251 cells that
// moved took 0.84x the time (0.56-1.37x by cell; at V 2, sparsity 0.5-0.8, M = K 1024-4096, BH 1
// and 4: 1.038x the fastest way's time before, 1.012x since). On wider rows (8-bit B's of 65-128
// bytes, 4-bit B's of 65-256) the dense path ran wherever it paid until the ninety-fifth round;
// weighed there too, at BH 4 the cells whose time moved past 3 % took 0.89x and 0.81x the time over
// two sets (213 of 2879 and 125 of 1620 cells; H200, V 2 / 4 / 8, sparsity 0.5-0.95), but at BH 1
// the sweep's cells so reached lost (1.003x over 600, up to 1.23x: L4-R4 and L8-R4 at V 2, N 512,
// sparsity 0.95, M = K = 4096, where the resident kernel took 1.22x the dense path's time in the
// `--ways` sweep), so BH 1 keeps the old order. At BH 2 and 3 (ninety-sixth round) the cells that
// moved past 3 % took 0.94x and 0.87x the time (52 and 61 of 990 each; V 2 / 4 / 8, sparsity
// 0.5-0.95, M = K 1024-4096) and 0.87x and 0.79x on cells the rule had not seen (12 and 18 of 288;
// M = K 1536 and 3072), at BH 8 0.98x (77 of 990); but at BH 16 1.04x on the first set (74: in 35
// the resident kernel ran where the dense path was 1.19x faster) and 0.90x on the second (10), and
// at BH 24 1.29x (34 of 288; up to 2.0x with 12- and 16-bit A on 4-bit B at V 2 and 4), so from BH
// 16 the dense path runs first again. A forced dense path never tries the resident kernel
// (launch_resident). The merged rows come before the resident kernel where they pay: with 4-bit B
// wherever both paid they took 0.65-0.91x its time (the fifty-third round's `--ways` sweep: V 2,
// M = K 2048 and 4096, N 512, sparsity 0.95 and 0.98), and the 4-bit B pairs' cells of the sweep at
// M = K 1024-4096 took 0.993-0.997x the time by pair (A/B, H200; BH 4: 0.986-0.992x; fifty-fourth
// round); with 8-bit B of N 128, where both pay at BH 4 and 16 (V 2, M = K 512-2048, sparsity
// 0.9-0.98), 0.51-0.95x in the 15 such cells of the 288 of L8-R8 and L16-R8 measured with every way
// forced at BH 1, 4 and 16 (fifty-sixth round).
template <int AB, bool AS, int BB>
void launch_integer(const Params& p, int64_t vrows, int64_t bh, int64_t nnz_pad, cudaStream_t stream, int64_t a_bits,
                    Choice choice, const std::optional<Dense>& dense) {
  // Rows merge on the narrow tile or wider (launch_merged).
  const auto merged = [&]<int TB>() {
    return launch_merged<AB, AS, BB, std::max(TB, magicube::spmm_detail::kNarrowTileBytes)>(p, vrows, bh, nnz_pad,
                                                                                           stream, choice);
  };
  if (!dense && on_tile<AB, AS, BB>(p, merged)) return;
  if constexpr (BB == 8 || BB == 4) {
    const bool resident_first =
        (bh >= 2 && bh < 16) || 2 * p.row_bytes <= magicube::spmm_detail::kNarrowTileBytes;
    const double dense_us = dense ? against_resident<AB>(dense->us, bh) : std::numeric_limits<double>::infinity();
    if ((!dense || resident_first) && launch_resident<AB, AS, BB>(p, vrows, bh, nnz_pad, stream, choice, dense_us))
      return;
  }
  if (dense) return run_dense<AB, BB>(p, *dense, vrows, bh, AS, stream);
  launch<AB, AS, BB>(p, vrows, bh, nnz_pad, stream, choice, a_bits);
}

// launch_integer, A's signedness made a template argument.
template <int AB, int BB>
void launch_pair(const Params& p, int64_t vrows, int64_t bh, int64_t nnz_pad, cudaStream_t stream, int64_t a_bits,
                 bool a_signed, Choice choice, const std::optional<Dense>& dense) {
  if (a_signed) launch_integer<AB, true, BB>(p, vrows, bh, nnz_pad, stream, a_bits, choice, dense);
  else launch_integer<AB, false, BB>(p, vrows, bh, nnz_pad, stream, a_bits, choice, dense);
}

// Holds the stream for `ns` nanoseconds, so that the host queues the calls after it before the GPU
// reaches them: timed from the queue, back-to-back calls exclude the host's launch path, as in a
// CUDA graph's replay.
__global__ void hold(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// MAGICUBE_SPMM_KERNEL=tuned, as cuDNN's benchmark mode: the first call of a problem (its key:
// device, precisions, shapes, V, BH, stored slots, longest row, output type)
// times each of the ways `candidates()` lists by `run` and remembers the fastest, which later calls
// run without timing; every way gives the same bits. Each way is called once (attributes,
// workspace), then timed twice over five back-to-back calls queued behind `hold` (CUDA events on
// the caller's stream), its best time counting: timed as called, the calls' times held the host's
// launch path, longest for the dense path's launches and workspace, and the choice took up to 1.5x
// the rules' time in small and middle cells (H200). Inside a CUDA graph capture nothing can be
// timed: a problem not tuned yet takes the automatic choice there, unremembered.
using TuneKey = std::array<int64_t, 12>;

template <class Candidates, class Run>
Choice tuned_choice(const TuneKey& key, cudaStream_t stream, Candidates&& candidates, Run&& run) {
  static std::mutex mutex;
  static std::map<TuneKey, Choice> known;
  std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find(key); it != known.end()) return it->second;
  cudaStreamCaptureStatus capture;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return Choice::kAuto;
  struct Event {
    cudaEvent_t e;
    Event() { C10_CUDA_CHECK(cudaEventCreate(&e)); }
    ~Event() { C10_CUDA_CHECK_WARN(cudaEventDestroy(e)); }
  } start, stop;
  const std::vector<Choice> ways = candidates();
  for (const Choice way : ways) run(way);
  Choice best = ways.front();
  float best_ms = std::numeric_limits<float>::infinity();
  for (int round = 0; round < 2; ++round)
    for (const Choice way : ways) {
      hold<<<1, 1, 0, stream>>>(1000000);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      C10_CUDA_CHECK(cudaEventRecord(start.e, stream));
      for (int call = 0; call < 5; ++call) run(way);
      C10_CUDA_CHECK(cudaEventRecord(stop.e, stream));
      C10_CUDA_CHECK(cudaEventSynchronize(stop.e));
      float ms = 0.f;
      C10_CUDA_CHECK(cudaEventElapsedTime(&ms, start.e, stop.e));
      if (ms < best_ms) best_ms = ms, best = way;
    }
  known.emplace(key, best);
  return best;
}

// B's rows copied into rows of row_words 4-byte words, zeros past row_bytes: a word a thread, kPadRows
// rows a CTA. Launched overlapped, it waits for B's writer and lets the next kernel launch at its
// start (`early`) only where its CTAs take at most a quarter of the SMs. Beside a larger copy the
// gather kernel, forced, took up to 2x the time it took launched at the copy's exit (1.19x on the
// geometric mean; the resident kernel 0.97x), likely as its first CTAs, the longest rows, crowd onto
// the SMs the copy left free; the automatic choice took up to 2.3x the time of aligned rows of the
// padded width (L8-R8, M = K 3584, V 8, sparsity 0.6: 29.8 us against 13.1, 14.7 at the copy's exit).
// Beside a smaller copy the early launch hides part of the launch: 5 % of the time at M = K 256-640
// (kernel_checks.md, eighty-eighth round).
constexpr int kPadRows = 32;
__global__ void pad_rows_kernel(const uint8_t* b, uint32_t* out, int64_t rows, int row_bytes, int row_words,
                                bool early) {
  magicube::await_inputs();
  if (early) magicube::allow_next_launch();
  const int64_t row0 = int64_t{blockIdx.x} * kPadRows;
  const int words = static_cast<int>(std::min<int64_t>(kPadRows, rows - row0)) * row_words;
  for (int w = threadIdx.x; w < words; w += blockDim.x) {
    const int r = w / row_words, byte = (w - r * row_words) * 4;
    const uint8_t* row = b + (row0 + r) * row_bytes;
    uint32_t x = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (byte + j < row_bytes) x |= uint32_t{row[byte + j]} << (8 * j);
    out[row0 * row_words + w] = x;
  }
}

// B as the kernels read it: rows of whole 16-byte chunks from a 16-byte aligned start, as every
// copy of B into shared memory is one cp.async of 16 bytes (the gather kernel's tiles, the resident
// kernel's slices). Other rows are copied first (pad_rows_kernel), padded with zeros, which reach
// only output columns past N, never stored. Before, such rows took copies of 8, 4 or 1 bytes on the
// gather kernel's wide tile and no way but it and the dense path: 8-bit B's rows of 40 and 56 bytes
// took 2.5x the time of rows of 48 on the geometric mean, up to 8.4x (H200, L8-R8 and L16-R8, M = K
// 640-3584, V 2 / 4 / 8, sparsity 0.6-0.97, BH 1, 2 and 8: 348 cells). Padded, the same cells took
// 0.51x the time of before (0.13-1.6x; 25 cells slower: small problems, where the copy's 1.3-1.9 us
// count, and V 2 at low sparsity, where the dense path had run); at::constant_pad_nd (two kernels,
// 3.2 us) took 1.32x this copy's time (kernel_checks.md, eighty-seventh round). Since the copy lets
// the next kernel launch early only where its CTAs take at most a quarter of the SMs
// (pad_rows_kernel), the op takes 1.28-1.34x the time of aligned rows of the padded width by pair
// and width (L16-R16 and L8-R4 too; 1.31x on the geometric mean of 578 cells, 1.01-1.75x by cell;
// eighty-eighth round).
at::Tensor padded_rows(const at::Tensor& b, cudaStream_t stream) {
  const int64_t row_bytes = b.size(2) * b.element_size(), padded_bytes = (row_bytes + 15) / 16 * 16;
  if (padded_bytes == row_bytes) return magicube::aligned16(b);
  at::Tensor out = at::empty({b.size(0), b.size(1), padded_bytes / b.element_size()}, b.options());
  const int64_t rows = b.size(0) * b.size(1), ctas = (rows + kPadRows - 1) / kPadRows;
  if (rows == 0) return out;
  MAGICUBE_CHECK(ctas <= INT32_MAX && padded_bytes * kPadRows / 4 <= INT32_MAX, "spmm: b of ", rows,
                 " rows (BH x K) of ", row_bytes, " bytes is too large to pad to 16-byte rows");
  const bool early = 4 * ctas <= at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  magicube::launch_overlapped(pad_rows_kernel, dim3(static_cast<unsigned>(ctas)), dim3(256), 0, stream,
                              static_cast<const uint8_t*>(b.data_ptr()), static_cast<uint32_t*>(out.data_ptr()), rows,
                              static_cast<int>(row_bytes), static_cast<int>(padded_bytes / 4), early);
  return out;
}

at::Tensor spmm_cuda(const at::Tensor& row_ptr, const at::Tensor& col_idx, const at::Tensor& row_order,
                     const at::Tensor& a_values, const at::Tensor& b, const std::optional<at::Tensor>& scale_a,
                     const std::optional<at::Tensor>& scale_b, int64_t v, int64_t m, int64_t a_bits, bool a_signed,
                     int64_t b_bits, at::ScalarType out_dtype, int64_t longest_row) {
  const at::Device device = b.device();
  check_cuda_tensor(b, "b", device);
  check_cuda_tensor(row_ptr, "row_ptr", device);
  check_cuda_tensor(col_idx, "col_idx", device);
  check_cuda_tensor(row_order, "row_order", device);
  check_cuda_tensor(a_values, "a_values", device);
  MAGICUBE_CHECK(v == 2 || v == 4 || v == 8, "spmm: v must be 2, 4 or 8, got ", v);
  magicube::check_longest_row("spmm", longest_row);
  MAGICUBE_CHECK(row_ptr.scalar_type() == at::kInt && col_idx.scalar_type() == at::kInt &&
                  row_order.scalar_type() == at::kInt,
              "spmm: row_ptr, col_idx and row_order must be int32");
  MAGICUBE_CHECK(row_ptr.numel() % 2 == 0, "spmm: row_ptr must hold 2*(M/V) entries, got ", row_ptr.numel());
  const int64_t vrows = row_ptr.numel() / 2;
  MAGICUBE_CHECK(m == vrows * v, "spmm: m must be (M/V)*V = ", vrows * v, " for this row_ptr, got ", m);
  MAGICUBE_CHECK(row_order.numel() == vrows, "spmm: row_order must hold M/V = ", vrows, " entries, got ",
              row_order.numel());
  MAGICUBE_CHECK(col_idx.numel() % kSlots == 0, "spmm: col_idx length ", col_idx.numel(),
              " is not a multiple of the stride ", kSlots);
  MAGICUBE_CHECK(b.dim() == 3, "spmm: b must be [BH, K, N], got ", b.dim(), " dims");
  const int64_t bh = b.size(0), k = b.size(1), nnz_pad = col_idx.numel();

  const bool fp16 = a_values.scalar_type() == at::kHalf;
  int64_t n;
  if (fp16) {
    MAGICUBE_CHECK(b.scalar_type() == at::kHalf, "spmm: fp16 a_values need fp16 b, got ",
                c10::toString(b.scalar_type()));
    MAGICUBE_CHECK(out_dtype == at::kHalf, "spmm: fp16 inputs give a float16 output, got ",
                c10::toString(out_dtype));
    MAGICUBE_CHECK(!scale_a.has_value() && !scale_b.has_value(), "spmm: fp16 inputs take no scale_a/scale_b");
    n = b.size(2);
  } else {
    const bool pair_ok = (a_bits == 8 && b_bits == 8) || (a_bits == 4 && b_bits == 4) ||
                         (a_bits == 16 && b_bits == 8) || (a_bits == 16 && b_bits == 16) ||
                         (a_bits == 8 && b_bits == 4) || (a_bits == 16 && b_bits == 4) ||
                         (a_bits == 12 && b_bits == 4);
    MAGICUBE_CHECK(pair_ok, "spmm: unsupported (a_bits, b_bits) = (", a_bits, ", ", b_bits, ")");
    MAGICUBE_CHECK(a_signed || a_bits != 12, "spmm: 12-bit a_values are signed only");
    const at::ScalarType a_type = a_bits >= 12 ? at::kShort : (a_bits == 8 && a_signed ? at::kChar : at::kByte);
    MAGICUBE_CHECK(a_values.scalar_type() == a_type, "spmm: a_values of ", a_bits, " bits (",
                a_signed ? "signed" : "unsigned", ") must be ", c10::toString(a_type), ", got ",
                c10::toString(a_values.scalar_type()));
    const at::ScalarType b_type = b_bits == 16 ? at::kShort : (b_bits == 8 ? at::kChar : at::kByte);
    MAGICUBE_CHECK(b.scalar_type() == b_type, "spmm: b of ", b_bits, " bits must be ", c10::toString(b_type),
                ", got ", c10::toString(b.scalar_type()));
    MAGICUBE_CHECK(out_dtype == at::kLong || out_dtype == at::kHalf, "spmm: out_dtype must be int64 or float16, got ",
                c10::toString(out_dtype));
    n = b.size(2) * (b_bits == 4 ? 2 : 1);
    if (out_dtype == at::kHalf) {
      MAGICUBE_CHECK(scale_a.has_value() && scale_b.has_value(), "spmm: a float16 output needs scale_a and scale_b");
    }
  }
  const int64_t a_elems = (!fp16 && a_bits == 4) ? nnz_pad * v / 2 : nnz_pad * v;
  MAGICUBE_CHECK(a_values.dim() == 2 && a_values.size(0) == bh && a_values.size(1) == a_elems,
              "spmm: a_values must be [BH, nnz_pad*V", (!fp16 && a_bits == 4) ? "/2" : "", "] = [", bh, ", ",
              a_elems, "], got a ", a_values.dim(), "-D tensor of ", a_values.numel(), " elements");
  const float* sa = nullptr;
  const float* sb = nullptr;
  if (!fp16 && out_dtype == at::kHalf) {
    const at::Tensor& ta = *scale_a;
    const at::Tensor& tb = *scale_b;
    check_cuda_tensor(ta, "scale_a", device);
    check_cuda_tensor(tb, "scale_b", device);
    MAGICUBE_CHECK(ta.scalar_type() == at::kFloat && ta.dim() == 2 && ta.size(0) == bh && ta.size(1) == m,
                "spmm: scale_a must be float32 [BH, M] = [", bh, ", ", m, "]");
    MAGICUBE_CHECK(tb.scalar_type() == at::kFloat && tb.dim() == 2 && tb.size(0) == bh && tb.size(1) == n,
                "spmm: scale_b must be float32 [BH, N] = [", bh, ", ", n, "]");
    sa = ta.data_ptr<float>();
    sb = tb.data_ptr<float>();
  }
  MAGICUBE_CHECK(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX && bh <= 65535,
              "spmm: sizes out of range (M, N, K < 2^31, BH <= 65535)");

  c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({bh, m, n}, b.options().dtype(out_dtype));
  if (out.numel() == 0) return out;

  // The gather kernel's paired steps and the dense path's expansion copy the indices 16 bytes at a
  // time.
  const at::Tensor a_al = magicube::aligned16(a_values), cols_al = magicube::aligned16(col_idx);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor b_al = padded_rows(b, stream);
  const int64_t row_bytes = b_al.size(2) * b_al.element_size();

  Params p;
  p.row_ptr = row_ptr.data_ptr<int>();
  p.col_idx = cols_al.data_ptr<int>();
  p.row_order = row_order.data_ptr<int>();
  p.a = static_cast<const uint8_t*>(a_al.data_ptr());
  p.b = static_cast<const uint8_t*>(b_al.data_ptr());
  p.scale_a = sa;
  p.scale_b = sb;
  p.out = out.data_ptr();
  p.a_bh_bytes = a_al.size(1) * a_al.element_size();
  p.b_bh_bytes = k * row_bytes;
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.v = static_cast<int>(v);
  p.row_bytes = static_cast<int>(row_bytes);
  p.out_int64 = out_dtype == at::kLong;
  p.balance = magicube::long_rows(nnz_pad, vrows, longest_row, kSlots).candidates > 0;
  // V 2 rows merge four at a time (launch_merged) into a union of at most four rows' columns (of
  // all slots where the longest row is not known) and at most K, multiplied in windows of up to
  // kMergeBlocks blocks.
  const int64_t union_bound = std::min(longest_row >= 0 ? 4 * longest_row : nnz_pad, k);
  const int64_t union_blocks = std::clamp<int64_t>((union_bound + kSlots - 1) / kSlots, 1, kMergeBlocks);
  p.merge_blocks = static_cast<int8_t>(v == 2 && vrows % 4 == 0 ? union_blocks : -1);

  Choice choice = kernel_choice();
  if (fp16) {
    launch<0, true, 0>(p, vrows, bh, nnz_pad, stream, choice, a_bits);
    return out;
  }
  // One call of the integer pair by `way` (auto: the rules' pick).
  auto run = [&](Choice way) {
    const DenseShape d = dense_shape(m, n, k, a_bits, a_signed, b_bits, bh, way == Choice::kDenseWgmma);
    std::optional<Dense> dense;
    if (d.applies() && forces_dense(way)) {
      dense = Dense{d, out, 0.0};
    } else if (d.applies() && way == Choice::kAuto) {
      const Estimates e = estimates(d, p, b_bits, bh, nnz_pad);
      if (e.dense_us * batched_dense(bh) < e.gather_us) dense = Dense{d, out, e.dense_us};
    }
    if (a_bits == 8 && b_bits == 8) {
      launch_pair<8, 8>(p, vrows, bh, nnz_pad, stream, a_bits, a_signed, way, dense);
    } else if (a_bits == 4 && b_bits == 4) {
      launch_pair<4, 4>(p, vrows, bh, nnz_pad, stream, a_bits, a_signed, way, dense);
    } else if (a_bits >= 12 && b_bits == 8) {
      launch_pair<16, 8>(p, vrows, bh, nnz_pad, stream, a_bits, a_signed, way, dense);
    } else if (a_bits >= 12 && b_bits == 16) {
      launch_pair<16, 16>(p, vrows, bh, nnz_pad, stream, a_bits, a_signed, way, dense);
    } else if (a_bits == 8 && b_bits == 4) {
      launch_pair<8, 4>(p, vrows, bh, nnz_pad, stream, a_bits, a_signed, way, dense);
    } else {
      launch_pair<16, 4>(p, vrows, bh, nnz_pad, stream, a_bits, a_signed, way, dense);
    }
  };
  if (choice == Choice::kTuned) {
    // The ways that differ here: the gather kernel, stacked or not, the resident-B kernel and the
    // dense path, where each applies (listed only where a problem is tuned, not on every call).
    auto candidates = [&] {
      std::vector<Choice> ways{Choice::kGather};
      if (can_stack(a_bits, a_signed, v)) ways.push_back(Choice::kStacked);
      if (p.merge_blocks >= 0) ways.push_back(Choice::kMerged);
      if (b_bits != 16) ways.push_back(Choice::kResident);
      const DenseShape d = dense_shape(m, n, k, a_bits, a_signed, b_bits, bh, false);
      if (d.applies() && d.fits(bh)) ways.push_back(Choice::kDense);
      return ways;
    };
    const TuneKey key{b.get_device(), a_bits, a_signed, b_bits, m, n, k, v, bh, nnz_pad, longest_row,
                      p.out_int64};
    choice = tuned_choice(key, stream, candidates, run);
  }
  run(choice);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(magicube_cuda, m) {
  m.def(
      "spmm(Tensor row_ptr, Tensor col_idx, Tensor row_order, Tensor a_values, Tensor b, Tensor? scale_a, "
      "Tensor? scale_b, int v, int m, int a_bits, bool a_signed, int b_bits, ScalarType out_dtype, int longest_row=-1) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(magicube_cuda, CUDA, m) { m.impl("spmm", &spmm_cuda); }
