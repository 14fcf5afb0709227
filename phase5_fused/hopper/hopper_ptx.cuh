// PTX wrappers of the Hopper lesson: everything sm_90a adds over the mma.sync kernel, in one place.
//   mbarrier    shared-memory barriers that count arrivals AND bytes (init, arrive, expect_tx, wait)
//   TMA         cp.async.bulk.tensor: one thread copies a whole 2-D box of a tensor into shared
//               memory, described by a CUtensorMap built on the host; completion is signalled on
//               an mbarrier by the number of bytes written
//   wgmma       warpgroup MMA: 4 warps (128 threads) compute one 64 x N x 16 product, A and B read
//               from shared memory through 64-bit descriptors (A may also come from registers),
//               issued asynchronously and waited for in commit groups
//   setmaxnreg  moves registers between warpgroups at run time (producers give, consumers take)
//   bar.sync    named barriers: synchronise a subset of the block's warps
// Every instruction here needs sm_90a (the "a" = architecture-specific features): the extension is
// compiled for -gencode=arch=compute_90a,code=sm_90a only.
#pragma once

#include <cuda.h>  // CUtensorMap (a 128-byte opaque struct; the kernels take it as a __grid_constant__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "the Hopper kernels need sm_90a: compile with -gencode=arch=compute_90a,code=sm_90a"
#endif

namespace hopper {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// ------------------------------------------------------------------------------------------------
// mbarrier. A barrier completes a phase when its pending arrival count reaches zero AND every byte
// announced by expect_tx has landed; it then flips its phase bit and re-arms with the init count.
// Waiters name the phase they wait for by its parity (0, 1, 0, ...): the k-th use of a barrier
// waits for parity k & 1.

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// Make the initialised barriers visible to the async proxy (TMA) and to the other threads.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` more bytes to wait for (the TMA copies' complete_tx).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Block until the phase of parity `parity` has completed. try_wait suspends the thread for a
// hardware-chosen time instead of spinning hot; waiting for the parity of the phase *before* a
// fresh barrier's first one returns at once (how a producer passes its first pass over the ring).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// ------------------------------------------------------------------------------------------------
// TMA. Copies the box at coordinates (c0 = column, c1 = row, c2 = head, c3 = batch) of the tensor
// that `tmap` describes into shared memory at `dst`, laid out (and swizzled) as the map says;
// elements outside the tensor are written as zeros. The bytes are counted on `bar` (complete_tx).

__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* tmap, uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Fetch the tensor map's 128 bytes into the TMA unit's cache ahead of the first copy.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* tmap) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
}

// Order this thread's ordinary shared-memory writes before later async-proxy accesses (wgmma
// reads, TMA writes) of the same bytes.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ------------------------------------------------------------------------------------------------
// Named barriers and register reallocation.

// Wait until `threads` threads (a multiple of 32) have reached barrier `id` (1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Count this thread's warp as arrived at barrier `id` (of `threads` threads) without waiting.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Every thread of the warpgroup must execute these, with the same count (a multiple of 8, 24..256).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ------------------------------------------------------------------------------------------------
// wgmma. A warpgroup's 128 threads issue one wgmma.mma_async together. Protocol:
//   wgmma_fence()            before the first wgmma that reads registers written since (the
//                            accumulators, or A in registers)
//   wgmma ... wgmma          issued asynchronously, in order
//   wgmma_commit()           closes a group of issued wgmmas
//   wgmma_wait<N>()          waits until at most N groups are still in flight
// The accumulators must not be touched between issue and wait: fence_operand() pins each one so
// that the compiler cannot move a read or write of it across the wait.

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// The same pin before wgmma_fence(): the registers' last writes (the O rescale, the packed P) stay
// before the fence instead of being scheduled between it and the wgmma that reads them.
template <int N>
__device__ __forceinline__ void fence_operand(float (&regs)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(regs[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operand(uint32_t (&regs)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(regs[i])::"memory");
}

// Shared-memory matrix descriptor (64 bits): start address, leading- and stride-dimension byte
// offsets (all >> 4), and the swizzle mode (bits 62-63, 1 = 128-byte swizzle). Our tiles are
// stored as the TMA writes them with a 128-byte swizzle: panels of 64 columns (128 bytes), rows of
// 128 bytes, the 16-byte chunks of row r XOR-permuted by r % 8 inside each 1024-byte group of 8
// rows. Every panel starts on a 1024-byte boundary, so the base-offset field stays 0.
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_address, uint32_t leading_bytes, uint32_t stride_bytes) {
  uint64_t desc = (smem_address & 0x3FFFF) >> 4;
  desc |= static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16;
  desc |= static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32;
  desc |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle
  return desc;
}

// K-major operand (A = Q, or B = K for S = Q K^T: the reduction dimension D is contiguous): 8-row
// groups are 1024 bytes apart (stride offset); the leading offset is unused with a swizzle. A k-step
// of 16 elements is +32 bytes inside the 128-byte row, the next panel after 4 of them.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t smem_address) { return make_desc(smem_address, 16, 1024); }

// MN-major operand (B = V for O = P V: the reduction dimension is the key, and the N dimension D is
// contiguous): the leading offset is the distance between 64-column panels, the stride offset the
// distance between groups of 8 keys (1024 bytes). A k-step of 16 keys is +2048 bytes.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t smem_address, uint32_t panel_bytes) {
  return make_desc(smem_address, panel_bytes, 1024);
}

// The instructions (m64nNk16, FP32 accumulators; N = 64 or 128, and 32 for wgmma_ss). d[4j + i] of thread t of warp w
// holds row 16w + (t%32)/4 + 8(i/2), column 8j + 2(t%4) + i%2, as mma.sync's C fragments.
//   wgmma_ss: D (+)= A B with A [64 x 16] and B [16 x N] both in shared memory; scale_d = 0
//             overwrites d (the first k-step), 1 accumulates. kTransA = kTransB = 0: both K-major
//             (S = Q K^T: the reduction dimension D is contiguous in Q and K); 1: that operand is
//             MN-major (its M or N dimension is the contiguous one; FP16/BF16 only).
//   wgmma_rs: O += A B with A [64 x 16] in registers (mma.sync's A fragment layout) and B
//             [16 x N] MN-major in shared memory (imm-trans-b = 1).
//
// The accumulator operands of an m64nNk16 wgmma: N / 2 FP32 registers per thread, read and written
// ("+f"), and their placeholders in the instruction text (%0 .. %(N/2 - 1)); the operands after them
// are numbered from N / 2 on.
#define HOPPER_WGMMA_D16_TEXT "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define HOPPER_WGMMA_D32_TEXT \
  HOPPER_WGMMA_D16_TEXT ", " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define HOPPER_WGMMA_D64_TEXT \
  HOPPER_WGMMA_D32_TEXT ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define HOPPER_WGMMA_D16_OPERANDS \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define HOPPER_WGMMA_D32_OPERANDS \
  HOPPER_WGMMA_D16_OPERANDS, \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define HOPPER_WGMMA_D64_OPERANDS \
  HOPPER_WGMMA_D32_OPERANDS, \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// One wgmma_ss for an N, an input type ("f16" or "bf16") and its operand text: the predicate p from
// scale_d, then the instruction with the transpose flags as immediates.
#define HOPPER_WGMMA_SS(N, TYPE, TEXT, OPERANDS, A, B, SCALE, TA, TB)                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SCALE ", 0;\n"                                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" TEXT "}, %" #A   \
               ", %" #B ", p, 1, 1, %" #TA ", %" #TB ";\n}\n"                                         \
               : OPERANDS                                                                             \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB))

template <typename T, int N, int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(N == 32 || N == 64 || N == 128, "compiled wgmma shapes: m64n32k16, m64n64k16 and m64n128k16");
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 32 && kBf16)
    HOPPER_WGMMA_SS(32, "bf16", HOPPER_WGMMA_D16_TEXT, HOPPER_WGMMA_D16_OPERANDS, 16, 17, 18, 19, 20);
  if constexpr (N == 32 && !kBf16)
    HOPPER_WGMMA_SS(32, "f16", HOPPER_WGMMA_D16_TEXT, HOPPER_WGMMA_D16_OPERANDS, 16, 17, 18, 19, 20);
  if constexpr (N == 64 && kBf16)
    HOPPER_WGMMA_SS(64, "bf16", HOPPER_WGMMA_D32_TEXT, HOPPER_WGMMA_D32_OPERANDS, 32, 33, 34, 35, 36);
  if constexpr (N == 64 && !kBf16)
    HOPPER_WGMMA_SS(64, "f16", HOPPER_WGMMA_D32_TEXT, HOPPER_WGMMA_D32_OPERANDS, 32, 33, 34, 35, 36);
  if constexpr (N == 128 && kBf16)
    HOPPER_WGMMA_SS(128, "bf16", HOPPER_WGMMA_D64_TEXT, HOPPER_WGMMA_D64_OPERANDS, 64, 65, 66, 67, 68);
  if constexpr (N == 128 && !kBf16)
    HOPPER_WGMMA_SS(128, "f16", HOPPER_WGMMA_D64_TEXT, HOPPER_WGMMA_D64_OPERANDS, 64, 65, 66, 67, 68);
}

// The same for wgmma_rs (A: the 4 registers of mma.sync's A fragment, operands A0..A3; B MN-major).
#define HOPPER_WGMMA_RS(N, TYPE, TEXT, OPERANDS, A0, A1, A2, A3, B)                                 \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" TEXT "}, {%" #A0 \
               ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #B ", 1, 1, 1, 1;\n"                               \
               : OPERANDS                                                                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))

template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 64 || N == 128, "compiled wgmma shapes: m64n64k16 and m64n128k16");
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64 && kBf16)
    HOPPER_WGMMA_RS(64, "bf16", HOPPER_WGMMA_D32_TEXT, HOPPER_WGMMA_D32_OPERANDS, 32, 33, 34, 35, 36);
  if constexpr (N == 64 && !kBf16)
    HOPPER_WGMMA_RS(64, "f16", HOPPER_WGMMA_D32_TEXT, HOPPER_WGMMA_D32_OPERANDS, 32, 33, 34, 35, 36);
  if constexpr (N == 128 && kBf16)
    HOPPER_WGMMA_RS(128, "bf16", HOPPER_WGMMA_D64_TEXT, HOPPER_WGMMA_D64_OPERANDS, 64, 65, 66, 67, 68);
  if constexpr (N == 128 && !kBf16)
    HOPPER_WGMMA_RS(128, "f16", HOPPER_WGMMA_D64_TEXT, HOPPER_WGMMA_D64_OPERANDS, 64, 65, 66, 67, 68);
}

}  // namespace hopper
