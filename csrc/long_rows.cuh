// Which vector rows count as long, for the kernels that give such a row a CTA of its own
// (attention.cu, sddmm.cu, softmax.cu), or whose warps take shares of equal work (spmm.cu).
// Host code only.
//
// A row keeping more than 8 mean rows' worth of slots (a global token's row) would be its
// kernel's tail on one warp. At most nnz_pad / (slots + 1) rows can be that long, so a launch of
// that many CTAs, one per leading position of row_order, finds every one of them when row_order
// descends in length (as SRBCRS.from_mask builds it); a long row further back in another order
// stays on a warp, slower but exact. longest_row (SRBCRS.longest_row, -1 if not known) spares a
// mask without long rows those CTAs, which would all return at once.
#pragma once

#include <algorithm>
#include <cstdint>

#include "check.cuh"

namespace magicube {

struct LongRows {
  int64_t slots;       // a row is long if it keeps more slots than this
  int64_t candidates;  // leading positions of row_order a long row may hold; 0: no launch for them
};

// Blocks of `stride` slots in a row of mean length, rounded up; known without reading the pattern.
inline int64_t mean_blocks(int64_t nnz_pad, int64_t vrows, int64_t stride) {
  return vrows > 0 ? (nnz_pad / stride + vrows - 1) / vrows : 0;
}

// The ops take longest_row from the caller; a wrong hint only costs time, a negative one is a bug.
inline void check_longest_row(const char* op, int64_t longest_row) {
  MAGICUBE_CHECK(longest_row >= -1, op, ": longest_row must be -1 (not known) or the most vectors a vector row ",
                 "keeps, got ", longest_row);
}

inline LongRows long_rows(int64_t nnz_pad, int64_t vrows, int64_t longest_row, int64_t stride) {
  const int64_t slots = 8 * mean_blocks(nnz_pad, vrows, stride) * stride;
  const bool may_be_long = slots < INT32_MAX && (longest_row < 0 || longest_row > slots);
  return {slots, may_be_long ? std::min<int64_t>(vrows, nnz_pad / (slots + 1)) : 0};
}

}  // namespace magicube
