// Tensor-core and data-movement primitives shared by the Magicube kernels (PTX wrappers).
//
// Hopper has no int4 tensor cores (ptxas lowers int4 mma.sync to int8 IMMA plus unpacking, and
// wgmma rejects int4), and the int8 m16n8k32 shape runs at 2.7x the paper's m8n8k16. So every
// integer product here is an m16n8k32 (or, in the SpMM's dense GEMM on Hopper, a wgmma m64nNk32) on
// 8-bit operands: 16-bit data is split into bit planes (signed high byte, unsigned low byte) and
// 4-bit data is widened in registers.
#pragma once

#include <cstdint>
#include <cuda_fp16.h>

namespace magicube {

// ---------------------------------------------------------------------------------------------
// A loop-invariant value kept in a register: the compiler would otherwise recompute it (from the
// thread index, or a 64-bit base from its parts) at every use inside the loop (in the fused
// attention some 20 instructions per tile copy).
__device__ __forceinline__ uint32_t pinned(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}
template <typename T>
__device__ __forceinline__ T* pinned(T* x) {
  auto u = reinterpret_cast<uintptr_t>(x);
  asm volatile("" : "+l"(u));
  return reinterpret_cast<T*>(u);
}

// A kernel launched by launch_overlapped (launch.cuh) may start while its predecessor on the
// stream still runs: await_inputs() waits until that grid has finished and its writes are visible.
// Once every CTA has called allow_next_launch() (or exited), the next overlapped kernel may start
// launching; called near the end, its CTAs do not hold shared memory (the L1 carve-out) while this
// kernel's still gather.
__device__ __forceinline__ void await_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------
// Shared memory and asynchronous copies.

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy that zero-fills the bytes past `src_bytes` (0 reads nothing).
// L1: .ca, which keeps the line in L1 for other vector rows of the CTAs resident on the same SM
// that gather the same dense row; else .cg, which reads through L2 only.
template <bool L1 = true>
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  if constexpr (L1) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Four 8x8 b16 matrices: lane l gives the address of row l % 8 of matrix l / 8 and gets, of
// matrix j in register j, row l / 4, elements 2 (l % 4) and the next (bytes 4 (l % 4) to +3 on
// 8-bit data: the m16n8k32 fragments' layout).
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// Four 8x8 b16 matrices, transposed on the way: lane l gets rows 2(l%4), 2(l%4)+1 of column
// l/4 of matrix j in register j. On 8-bit data this is a transpose of byte pairs, finished by
// one byte permute per register (see transpose_pairs).
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                              uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Byte-pair transpose completion: x = [a(r0,c0) a(r0,c1) a(r1,c0) a(r1,c1)],
// y = [a(r2,c0) a(r2,c1) a(r3,c0) a(r3,c1)]  ->  column c0 over rows r0..r3, and column c1.
__device__ __forceinline__ uint32_t even_bytes(uint32_t x, uint32_t y) { return prmt(x, y, 0x6420); }
__device__ __forceinline__ uint32_t odd_bytes(uint32_t x, uint32_t y) { return prmt(x, y, 0x7531); }

// Four packed nibbles per byte pair -> bytes holding 16 * nibble. As int8 that is the signed
// nibble times 16 (as uint8 the unsigned nibble times 16), with no sign-extension arithmetic;
// the accumulator is divided by 16 (exactly) per widened operand.
__device__ __forceinline__ uint32_t low_nibbles_x16(uint32_t x) { return (x << 4) & 0xF0F0F0F0u; }
__device__ __forceinline__ uint32_t high_nibbles_x16(uint32_t x) { return x & 0xF0F0F0F0u; }

// ---------------------------------------------------------------------------------------------
// MMA. C(16x8, s32) += A(16x32, row) * B(32x8, col); A_SIGNED / B_SIGNED pick s8 or u8.

template <bool A_SIGNED, bool B_SIGNED>
__device__ __forceinline__ void mma_16832(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#define MAGICUBE_MMA_16832(AT, BT)                                                                   \
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32." AT "." BT ".s32 "                           \
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                   \
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (A_SIGNED && B_SIGNED) {
    MAGICUBE_MMA_16832("s8", "s8");
  } else if constexpr (A_SIGNED) {
    MAGICUBE_MMA_16832("s8", "u8");
  } else if constexpr (B_SIGNED) {
    MAGICUBE_MMA_16832("u8", "s8");
  } else {
    MAGICUBE_MMA_16832("u8", "u8");
  }
#undef MAGICUBE_MMA_16832
}

// C(16x8, f32) += A(16x16, f16, row) * B(16x8, f16, col).
__device__ __forceinline__ void mma_16816_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------------------
// wgmma (sm_90a): a warpgroup's D(64 x N, s32) += A(64 x 32) * B(32 x N), both operands 8-bit,
// K-major in shared memory (the only major wgmma takes for 8-bit), named by descriptors. The
// calling code guards on __CUDA_ARCH_FEAT_SM90_ALL: these instructions exist only on sm_90a.

// A descriptor of a K-major tile whose rows are 128 bytes, stored in 8-row atoms of 1024 bytes
// with the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)); `addr` is the tile's
// first row (atoms 1024-byte aligned), plus 32 k bytes to start at K step k. The leading offset is
// unused by this layout; the stride (next 8 rows) is 1024 bytes.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Thread t of the warpgroup holds, of each n8 block j of D, d[4j], d[4j + 1] at row 16 (t / 32) +
// (t % 32) / 4, columns 8j + 2 (t % 4) and the next, and d[4j + 2], d[4j + 3] eight rows down.
template <int N, bool A_SIGNED, bool B_SIGNED>
__device__ __forceinline__ void wgmma_k32(int (&d)[N / 2], uint64_t a, uint64_t b) {
  static_assert(N == 64 || N == 128);
#define MAGICUBE_D8(i)                                                                       \
  "+r"(d[i]), "+r"(d[i + 1]), "+r"(d[i + 2]), "+r"(d[i + 3]), "+r"(d[i + 4]), "+r"(d[i + 5]), \
      "+r"(d[i + 6]), "+r"(d[i + 7])
#define MAGICUBE_WGMMA_N64(AT, BT)                                                                               \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.s32." AT "." BT " {"                                      \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                          \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1;\n" \
               : MAGICUBE_D8(0), MAGICUBE_D8(8), MAGICUBE_D8(16), MAGICUBE_D8(24)                                \
               : "l"(a), "l"(b))
#define MAGICUBE_WGMMA_N128(AT, BT)                                                                              \
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.s32." AT "." BT " {"                                     \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                          \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1;\n" \
               : MAGICUBE_D8(0), MAGICUBE_D8(8), MAGICUBE_D8(16), MAGICUBE_D8(24),                               \
                 MAGICUBE_D8(32), MAGICUBE_D8(40), MAGICUBE_D8(48), MAGICUBE_D8(56)                              \
               : "l"(a), "l"(b))
#define MAGICUBE_WGMMA(AT, BT)        \
  if constexpr (N == 64) {            \
    MAGICUBE_WGMMA_N64(AT, BT);       \
  } else {                            \
    MAGICUBE_WGMMA_N128(AT, BT);      \
  }
  if constexpr (A_SIGNED && B_SIGNED) {
    MAGICUBE_WGMMA("s8", "s8")
  } else if constexpr (A_SIGNED) {
    MAGICUBE_WGMMA("s8", "u8")
  } else if constexpr (B_SIGNED) {
    MAGICUBE_WGMMA("u8", "s8")
  } else {
    MAGICUBE_WGMMA("u8", "u8")
  }
#undef MAGICUBE_WGMMA
#undef MAGICUBE_WGMMA_N128
#undef MAGICUBE_WGMMA_N64
#undef MAGICUBE_D8
}

// ---------------------------------------------------------------------------------------------
// Hopper's tensor memory accelerator (TMA) and its transaction barriers (sm_90; the calling code
// guards on __CUDA_ARCH__).

// A barrier in shared memory that `count` arrivals and the bytes named by expect_tx complete.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes barriers just initialized visible to the asynchronous copies that complete on them.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival.
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival, and `bytes` more to come from asynchronous copies before the phase completes.
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// Barrier `id` (1-15; 0 is __syncthreads's) among the `count` threads (a multiple of 32) that reach
// it.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// A store of v's low sizeof(T) bytes (1, 2 or 4) to shared memory.
template <class T>
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4);
  if constexpr (sizeof(T) == 1) asm volatile("st.shared.u8 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
  else if constexpr (sizeof(T) == 2) asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
  else asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_v2(uint32_t addr, int x, int y) {
  asm volatile("st.shared.v2.s32 [%0], {%1, %2};\n" ::"r"(addr), "r"(x), "r"(y) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 ld_shared_v2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ int4 ld_shared_v4(uint32_t addr) {
  int4 v;
  asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// The box of a 3-D tensor map (`map`, a __grid_constant__ kernel parameter) at coordinates (x, y,
// z), innermost first, into shared memory at `dst`, completing its bytes on barrier `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int x, int y, int z, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
}

// ---------------------------------------------------------------------------------------------
// Thread block clusters (sm_90). A launch without a cluster is one of a single CTA.

// This CTA's rank in its cluster.
__device__ __forceinline__ int cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return static_cast<int>(r);
}
// Every (non-exited) thread of the cluster: the shared-memory writes before it are seen by the
// reads after it, in any CTA of the cluster.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// 16 bytes at `addr` in the shared memory of the cluster's CTA `rank` (addr as in its own).
__device__ __forceinline__ int4 ld_cluster_v4(uint32_t addr, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  int4 v;
  // No memory clobber: the loads of one batch stay in flight together (the cluster barrier before
  // them, volatile too, keeps them after it).
  asm volatile("ld.shared::cluster.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(remote));
  return v;
}

}  // namespace magicube
