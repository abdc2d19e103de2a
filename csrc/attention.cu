// magicube_cuda::sparse_attention: sddmm -> sparse_softmax -> spmm fused into one kernel
// (attention_kernel.cuh), with the pipeline's roundings.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "attention_kernel.cuh"
#include "check.cuh"
#include "launch.cuh"
#include "long_rows.cuh"

namespace {

using magicube::attention_detail::Cfg;
using magicube::attention_detail::Params;
using magicube::attention_detail::attention_kernel;
using magicube::attention_detail::kHalf;
using magicube::attention_detail::kInt16;
using magicube::attention_detail::kInt4;
using magicube::attention_detail::kInt8;
using magicube::attention_detail::kSlots;
using magicube::attention_detail::kThreads;
using magicube::attention_detail::kWarps;

void check_device(const at::Tensor& t, const char* name, const at::Device& device) {
  MAGICUBE_CHECK(t.is_cuda(), "sparse_attention: ", name, " must be a CUDA tensor, got one on ", t.device());
  MAGICUBE_CHECK(t.device() == device, "sparse_attention: ", name, " is on ", t.device(), " but query is on ", device);
}

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  check_device(t, name, device);
  MAGICUBE_CHECK(t.is_contiguous(), "sparse_attention: ", name, " must be contiguous");
}

// Query, key or value as [B, heads, rows, d'] from a contiguous [BH, rows, d'] or a 4-D tensor,
// contiguous or of any strides whose rows are contiguous on strides of whole 16 bytes (the kernels
// read whole 16-byte chunks), such as the per-head views of one Q/K/V projection output
// [B, rows, 3, H, d'], read in place.
at::Tensor heads_view(const at::Tensor& t, const char* name, int64_t heads, const at::Device& device) {
  check_device(t, name, device);
  if (t.dim() == 3) {
    MAGICUBE_CHECK(t.is_contiguous(), "sparse_attention: a 3-D ", name, " [BH, rows, d] must be contiguous");
    MAGICUBE_CHECK(t.size(0) % heads == 0, "sparse_attention: heads must divide BH = ", t.size(0), ", got ", heads);
    return t.view({t.size(0) / heads, heads, t.size(1), t.size(2)});
  }
  MAGICUBE_CHECK(t.dim() == 4, "sparse_attention: ", name, " must be [BH, rows, d] or [B, heads, rows, d], got ",
                 t.dim(), " dims");
  MAGICUBE_CHECK(t.size(1) == heads, "sparse_attention: a 4-D ", name, " [B, heads, rows, d] must have heads = ",
                 heads, " in dim 1, got ", t.size(1));
  const int64_t es = t.element_size();
  bool aligned = t.stride(3) == 1 || t.size(3) <= 1;
  for (int i = 0; i < 3; ++i) aligned = aligned && (t.size(i) <= 1 || t.stride(i) * es % 16 == 0);
  aligned = aligned || t.is_contiguous();
  MAGICUBE_CHECK(aligned, "sparse_attention: ", name, " must be contiguous or have contiguous rows on strides of ",
                 "whole 16 bytes, got strides ", t.strides(), " of ", es, "-byte elements");
  MAGICUBE_CHECK(t.size(2) <= 1 || (t.size(2) - 1) * t.stride(2) * es < (int64_t(1) << 32), "sparse_attention: ",
                 name, "'s rows of one batch x head must span less than 4 GiB");
  return t;
}

magicube::attention_detail::Rows rows_of(const at::Tensor& t) {
  const int64_t es = t.element_size();
  return {static_cast<const uint8_t*>(t.data_ptr()), t.stride(0) * es, t.stride(1) * es,
          static_cast<uint32_t>(t.stride(2) * es)};
}

// A scale of the integer modes: fp32 [BH, rows], or [BH / heads, heads, rows] (a scale per head,
// expanded over the batch with stride 0, is read in place), at any non-negative strides. The kernel
// steps along the rows by a 32-bit byte offset.
magicube::attention_detail::Scale scale_of(const at::Tensor& t, const char* name, int64_t bh, int64_t heads,
                                           int64_t rows, const at::Device& device) {
  check_device(t, name, device);
  const bool flat = t.dim() == 2 && t.size(0) == bh && t.size(1) == rows;
  const bool split = t.dim() == 3 && t.size(0) * heads == bh && t.size(1) == heads && t.size(2) == rows;
  MAGICUBE_CHECK(t.scalar_type() == at::kFloat && (flat || split), "sparse_attention: ", name,
                 " must be a float32 [BH, ", rows, "] = [", bh, ", ", rows, "] or [B, heads, ", rows, "] = [",
                 bh / heads, ", ", heads, ", ", rows, "] tensor, got ", t.scalar_type(), " of shape ", t.sizes());
  const at::Tensor s = flat ? t.view({bh / heads, heads, rows}) : t;
  const int64_t step = rows > 1 ? s.stride(2) * static_cast<int64_t>(sizeof(float)) : 0;
  MAGICUBE_CHECK(s.stride(0) >= 0 && s.stride(1) >= 0 && step >= 0 && (rows - 1) * step < (int64_t(1) << 32),
                 "sparse_attention: ", name, " must have non-negative strides spanning less than 4 GiB along its "
                 "rows, got strides ", t.strides());
  return {s.data_ptr<float>(), s.stride(0), s.stride(1), static_cast<uint32_t>(step)};
}

// The kernel over `groups` row groups of every batch x head, rasterized in windows of batch x heads
// (the kernel's comment): as many as keep their keys and values within a third of L2. On an H100
// (50 MB L2, B 8, H 4, L 4096, sparsity 0.9), all 32 batch x heads of 8-bit inputs (16 MB) together
// took 148 us against 158 one after the other, and 64 together 479 against 305 for 32; fp16 (1 MB
// each) 331 us for 32 together, 292 for 16. A launch covers at most 65535 row groups.
template <int OP, int PB, int D, int DV, bool SPLIT, bool USK>
void rasterized(Params p, int64_t groups, int64_t bh, int smem, const cudaDeviceProp* prop, cudaStream_t stream) {
  using C = Cfg<OP, PB, D, DV>;
  const int64_t per_bh = static_cast<int64_t>(p.n) * (C::kKeyBytes + C::kValBytes);
  const int64_t window = std::clamp<int64_t>(prop->l2CacheSize / 3 / std::max<int64_t>(per_bh, 1), 1, bh);
  for (int64_t g0 = 0; g0 < groups; g0 += 65535) {
    p.group0 = static_cast<int>(g0);
    const dim3 grid(static_cast<unsigned>(window), static_cast<unsigned>(std::min<int64_t>(groups - g0, 65535)),
                    static_cast<unsigned>((bh + window - 1) / window));
    magicube::launch_overlapped(attention_kernel<OP, PB, D, DV, SPLIT, USK>, grid,
                                dim3(kThreads), static_cast<size_t>(smem), stream, p);
  }
}

template <int OP, int PB, int D, int DV, bool SPLIT, bool USK>
void launch(Params p, int64_t vrows, int64_t bh, int64_t nnz_pad, int64_t longest_row, cudaStream_t stream) {
  using C = Cfg<OP, PB, D, DV>;
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int max_smem = magicube::max_dynamic_smem<attention_kernel<OP, PB, D, DV, SPLIT, USK>>();
  // Score cache: the blocks a warp gets from a row of mean length (every row, for the balanced
  // masks of the paper). Longer rows recompute their last blocks' scores. Whole rows take a cache
  // that leaves room for 4 CTAs (16 warps) per SM where a mean row's fits, else 3; split rows as
  // large as one CTA allows. The SM then runs as many CTAs as shared memory and registers admit:
  // at L = 4096, sparsity 0.9, d = 64 a warp caches 13 blocks, and 8-bit inputs run 5 CTAs per SM
  // (43 KB each), fp16 3. Capping the cache below a mean row for more CTAs was slower on an H200
  // (247 us against 229 for 8b-8b, when 12 blocks gave a 4th CTA): the recomputed blocks cost
  // more than the extra warps gain.
  const int64_t mean_blocks = magicube::mean_blocks(nnz_pad, vrows, kSlots);
  int64_t cached = SPLIT ? (mean_blocks + kWarps - 1) / kWarps : mean_blocks;
  const int64_t static_smem = static_cast<int64_t>(prop->sharedMemPerBlockOptin) - max_smem;
  // The cached blocks that fit beside the ring in `budget` bytes of dynamic shared memory.
  auto fit = [&](int64_t budget) {
    return (std::min<int64_t>(budget, max_smem) - C::kStageSmem) / C::kCachedBlockBytes;
  };
  auto per_sm = [&](int ctas) {
    return static_cast<int64_t>(prop->sharedMemPerMultiprocessor) / ctas -
           static_cast<int64_t>(prop->reservedSharedMemPerBlock) - static_smem;
  };
  int64_t room = SPLIT ? fit(max_smem) : fit(per_sm(4));
  if constexpr (!SPLIT) {
    // Whole rows pay off only with every block of a mean row cached: a recomputed block gathers
    // its key tile twice (three times with fp16 probabilities).
    if (cached > room) room = fit(per_sm(3));
    if (cached > room) return launch<OP, PB, D, DV, true, USK>(p, vrows, bh, nnz_pad, longest_row, stream);
  }
  cached = std::max<int64_t>(1, std::min<int64_t>(cached, room));
  const int smem = C::smem_bytes(static_cast<int>(cached));
  MAGICUBE_CHECK(smem <= max_smem, "sparse_attention: needs ", smem,
                 " bytes of shared memory per block, the device has ", max_smem);
  p.cached = static_cast<int>(cached);
  if constexpr (!SPLIT) {
    // Long rows (long_rows.cuh) go to the split kernel, one CTA a row on a high-priority side
    // stream so that they start first and run beside the rest; the whole-row launch skips them.
    // H100, B 8, H 4, L 4096, window 32 + CLS row and column + random fill (the CLS row alone has
    // 128 blocks, 8 to 18 times the others), 8b-8b: 206-209 -> 149 us at sparsity 0.9 (the random
    // mask's time), 201 -> 92 us at 0.95; fp16 501 -> 295 us at 0.9. Without the longest_row hint a
    // random mask pays for the CTAs that return at once: 149.0 -> 150.5 us.
    const magicube::LongRows lr = magicube::long_rows(nnz_pad, vrows, longest_row, kSlots);
    if (lr.candidates > 0) {
      const int split_smem = magicube::max_dynamic_smem<attention_kernel<OP, PB, D, DV, true, USK>>();
      MAGICUBE_CHECK(smem <= split_smem, "sparse_attention: needs ", smem,
                     " bytes of shared memory per block for the long rows, the device has ", split_smem);
      p.long_rows = static_cast<int>(lr.candidates);
      p.long_count = static_cast<int>(lr.slots);
      const at::cuda::CUDAStream main = at::cuda::getCurrentCUDAStream();
      const at::cuda::CUDAStream side = at::cuda::getStreamFromPool(/*isHighPriority=*/true, main.device_index());
      at::cuda::CUDAEvent fork, join;
      fork.record(main);
      fork.block(side);
      rasterized<OP, PB, D, DV, true, USK>(p, lr.candidates, bh, smem, prop, side.stream());
      join.record(side);
      rasterized<OP, PB, D, DV, false, USK>(p, (vrows + kWarps - 1) / kWarps, bh, smem, prop, stream);
      join.block(main);
      return;
    }
  }
  rasterized<OP, PB, D, DV, SPLIT, USK>(p, SPLIT ? vrows : (vrows + kWarps - 1) / kWarps, bh, smem, prop, stream);
}

// One head dim for query/key and value: every (d, dv) pair would triple the instantiations (and
// the build) for shapes attention layers do not use.
template <int OP, int PB, bool SPLIT, bool USK>
void dispatch_dims(const Params& p, int64_t d, int64_t vrows, int64_t bh, int64_t nnz_pad, int64_t longest_row,
                   cudaStream_t stream) {
  switch (d) {
    case 32: launch<OP, PB, 32, 32, SPLIT, USK>(p, vrows, bh, nnz_pad, longest_row, stream); break;
    case 64: launch<OP, PB, 64, 64, SPLIT, USK>(p, vrows, bh, nnz_pad, longest_row, stream); break;
    default: launch<OP, PB, 128, 128, SPLIT, USK>(p, vrows, bh, nnz_pad, longest_row, stream); break;
  }
}

// Split rows where a whole row would overflow one warp's int32 accumulators, or (launch) where a
// whole mean row does not fit in the score cache.
template <int OP, int PB>
void dispatch_layout(const Params& p, bool split, int64_t d, int64_t vrows, int64_t bh, int64_t nnz_pad,
                     int64_t longest_row, cudaStream_t stream) {
  // A key scale of stride 0 along the keys takes the kernels that read it once (UNIFORM_SK in
  // attention_kernel.cuh); fp16 has no scales.
  constexpr bool kUniform = OP != kHalf;
  const bool uniform = kUniform && p.scale_k.step == 0;
  if (split && uniform) dispatch_dims<OP, PB, true, kUniform>(p, d, vrows, bh, nnz_pad, longest_row, stream);
  else if (split) dispatch_dims<OP, PB, true, false>(p, d, vrows, bh, nnz_pad, longest_row, stream);
  else if (uniform) dispatch_dims<OP, PB, false, kUniform>(p, d, vrows, bh, nnz_pad, longest_row, stream);
  else dispatch_dims<OP, PB, false, false>(p, d, vrows, bh, nnz_pad, longest_row, stream);
}

at::Tensor sparse_attention_cuda(const at::Tensor& row_ptr, const at::Tensor& col_idx, const at::Tensor& row_order,
                                 const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
                                 const std::optional<at::Tensor>& scale_q, const std::optional<at::Tensor>& scale_k,
                                 const std::optional<at::Tensor>& scale_v, int64_t v, double softmax_scale,
                                 int64_t qk_bits, int64_t p_bits, int64_t heads, int64_t longest_row) {
  const at::Device device = query_in.device();
  check_device(query_in, "query", device);
  const c10::cuda::CUDAGuard guard(device);
  check_cuda_tensor(row_ptr, "row_ptr", device);
  check_cuda_tensor(col_idx, "col_idx", device);
  check_cuda_tensor(row_order, "row_order", device);
  MAGICUBE_CHECK(v == 2 || v == 4 || v == 8, "sparse_attention: v must be 2, 4 or 8, got ", v);
  MAGICUBE_CHECK(row_ptr.scalar_type() == at::kInt && col_idx.scalar_type() == at::kInt &&
                  row_order.scalar_type() == at::kInt,
              "sparse_attention: row_ptr, col_idx and row_order must be int32");
  MAGICUBE_CHECK(row_ptr.dim() == 1 && col_idx.dim() == 1 && row_order.dim() == 1,
              "sparse_attention: row_ptr, col_idx and row_order must be 1-D");
  MAGICUBE_CHECK(row_ptr.numel() % 2 == 0, "sparse_attention: row_ptr must hold 2*(M/V) entries, got ",
              row_ptr.numel());
  const int64_t vrows = row_ptr.numel() / 2;
  MAGICUBE_CHECK(row_order.numel() == vrows, "sparse_attention: row_order must hold M/V = ", vrows, " entries, got ",
              row_order.numel());
  MAGICUBE_CHECK(col_idx.numel() % 32 == 0, "sparse_attention: col_idx length ", col_idx.numel(),
              " is not a multiple of the stride 32");
  MAGICUBE_CHECK(query_in.dim() == key_in.dim() && key_in.dim() == value_in.dim(),
                 "sparse_attention: query, key and value must all be 3-D [BH, rows, d] or all 4-D ",
                 "[B, heads, rows, d], got ", query_in.dim(), ", ", key_in.dim(), " and ", value_in.dim(), " dims");
  MAGICUBE_CHECK(heads >= 1, "sparse_attention: heads must be positive, got ", heads);
  const at::Tensor q4 = heads_view(query_in, "query", heads, device);
  const at::Tensor k4 = heads_view(key_in, "key", heads, device);
  const at::Tensor v4 = heads_view(value_in, "value", heads, device);

  const bool fp16 = query_in.scalar_type() == at::kHalf;
  int op;
  if (fp16) {
    MAGICUBE_CHECK(key_in.scalar_type() == at::kHalf && value_in.scalar_type() == at::kHalf,
                "sparse_attention: float16 query needs float16 key and value, got ", key_in.scalar_type(), " and ",
                value_in.scalar_type());
    MAGICUBE_CHECK(qk_bits == 16 && p_bits == 0,
                "sparse_attention: float16 inputs take qk_bits=16 and p_bits=0 (fp16 probabilities), got qk_bits=",
                qk_bits, ", p_bits=", p_bits);
    MAGICUBE_CHECK(!scale_q.has_value() && !scale_k.has_value() && !scale_v.has_value(),
                "sparse_attention: float16 inputs take no scale_q/scale_k/scale_v");
    op = kHalf;
  } else {
    const bool pair_ok = (qk_bits == 8 && (p_bits == 8 || p_bits == 16)) ||
                         (qk_bits == 4 && (p_bits == 4 || p_bits == 8 || p_bits == 16)) ||
                         (qk_bits == 16 && p_bits == 16);
    MAGICUBE_CHECK(pair_ok, "sparse_attention: (p_bits, qk_bits) must be one of (8, 8), (16, 8), (4, 4), (8, 4), "
                "(16, 4), (16, 16), got (", p_bits, ", ", qk_bits, ")");
    const at::ScalarType want = qk_bits == 16 ? at::kShort : qk_bits == 8 ? at::kChar : at::kByte;
    MAGICUBE_CHECK(query_in.scalar_type() == want && key_in.scalar_type() == want && value_in.scalar_type() == want,
                "sparse_attention: qk_bits=", qk_bits, " needs ", want, " query, key and value, got ",
                query_in.scalar_type(), ", ", key_in.scalar_type(), ", ", value_in.scalar_type());
    op = qk_bits == 16 ? kInt16 : qk_bits == 8 ? kInt8 : kInt4;
  }

  const int64_t bh = q4.size(0) * heads, m = q4.size(2), n = k4.size(2);
  const int64_t per_byte = op == kInt4 ? 2 : 1;
  const int64_t d = q4.size(3) * per_byte, dv = v4.size(3) * per_byte;
  MAGICUBE_CHECK(m == vrows * v, "sparse_attention: query has ", m, " rows, the pattern M = (M/V)*V = ", vrows * v);
  MAGICUBE_CHECK(k4.size(0) == q4.size(0) && v4.size(0) == q4.size(0), "sparse_attention: key and value must have ",
                 "the batch x heads of query, ", bh, ", got ", k4.size(0) * heads, " and ", v4.size(0) * heads);
  MAGICUBE_CHECK(k4.size(3) == q4.size(3), "sparse_attention: key's last dim (", k4.size(3),
              ") must match query's (", q4.size(3), ")");
  MAGICUBE_CHECK(v4.size(2) == n, "sparse_attention: value must have N = ", n, " rows like key, got ", v4.size(2));
  MAGICUBE_CHECK(d == 32 || d == 64 || d == 128,
                 "sparse_attention: head dim d of query/key must be 32, 64 or 128, got ", d);
  MAGICUBE_CHECK(dv == d, "sparse_attention: head dim dv of value (", dv, ") must equal the head dim d of query/key (",
              d, ")");
  MAGICUBE_CHECK(bh <= 65535 && vrows <= INT32_MAX && n < INT32_MAX && m < INT32_MAX,
              "sparse_attention: BH must be <= 65535 and M, N < 2^31");
  magicube::check_longest_row("sparse_attention", longest_row);
  Params p{};  // fp16 inputs leave the scales null
  bool split = false;
  if (op != kHalf) {
    // int32 accumulators: a warp sums at most ceil(N/32) blocks of 32 slots (whole rows), or
    // ceil(ceil(N/32)/4) (split rows); the largest per-slot term over all accumulators of a
    // precision pair bounds N.
    const int64_t term = (qk_bits == 16) ? 255 * 255 + 255 * 128 : 255 * 128;
    const int64_t row_slots = (n + 31) / 32 * 32;
    const int64_t slots = ((n + 31) / 32 + kWarps - 1) / kWarps * 32;
    split = row_slots * term >= (int64_t(1) << 31);
    MAGICUBE_CHECK(slots * term < (int64_t(1) << 31), "sparse_attention: N = ", n,
                " keys exceed the exact int32 accumulation of this precision pair");
    for (const auto* s : {&scale_q, &scale_k, &scale_v})
      MAGICUBE_CHECK(s->has_value(), "sparse_attention: integer inputs need scale_q, scale_k and scale_v");
    p.scale_q = scale_of(*scale_q, "scale_q", bh, heads, m, device);
    p.scale_k = scale_of(*scale_k, "scale_k", bh, heads, n, device);
    p.scale_v = scale_of(*scale_v, "scale_v", bh, heads, dv, device);
  }

  at::Tensor out = at::empty({bh / heads, m, heads, dv}, query_in.options().dtype(at::kHalf));
  if (bh == 0 || vrows == 0) return out;
  if (n == 0) return out.zero_();
  const at::Tensor query = magicube::aligned16(q4), key = magicube::aligned16(k4), value = magicube::aligned16(v4);

  p.row_ptr = row_ptr.data_ptr<int>();
  p.col_idx = col_idx.data_ptr<int>();
  p.row_order = row_order.data_ptr<int>();
  p.q = rows_of(query);
  p.k = rows_of(key);
  p.val = rows_of(value);
  p.out = reinterpret_cast<__half*>(out.data_ptr());
  p.heads = static_cast<int>(heads);
  p.bh = static_cast<int>(bh);
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.v = static_cast<int>(v);
  p.softmax_scale = static_cast<float>(softmax_scale);

  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t nnz_pad = col_idx.numel();
  if (op == kHalf) {
    dispatch_layout<kHalf, 0>(p, split, d, vrows, bh, nnz_pad, longest_row, stream);
  } else if (op == kInt8) {
    if (p_bits == 8) dispatch_layout<kInt8, 8>(p, split, d, vrows, bh, nnz_pad, longest_row, stream);
    else dispatch_layout<kInt8, 16>(p, split, d, vrows, bh, nnz_pad, longest_row, stream);
  } else if (op == kInt4) {
    if (p_bits == 4) dispatch_layout<kInt4, 4>(p, split, d, vrows, bh, nnz_pad, longest_row, stream);
    else if (p_bits == 8) dispatch_layout<kInt4, 8>(p, split, d, vrows, bh, nnz_pad, longest_row, stream);
    else dispatch_layout<kInt4, 16>(p, split, d, vrows, bh, nnz_pad, longest_row, stream);
  } else {
    dispatch_layout<kInt16, 16>(p, split, d, vrows, bh, nnz_pad, longest_row, stream);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(magicube_cuda, m) {
  m.def(
      "sparse_attention(Tensor row_ptr, Tensor col_idx, Tensor row_order, Tensor query, Tensor key, Tensor value, "
      "Tensor? scale_q, Tensor? scale_k, Tensor? scale_v, int v, float softmax_scale, int qk_bits, int p_bits, "
      "int heads, int longest_row=-1) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(magicube_cuda, CUDA, m) { m.impl("sparse_attention", &sparse_attention_cuda); }
