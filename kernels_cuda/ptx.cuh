// PTX wrappers the kernels share: shared-memory addresses, cp.async (sm_80 and newer), loads
// through L2 only and L1 prefetches.
#ifndef KERNELS_CUDA_PTX_CUH
#define KERNELS_CUDA_PTX_CUH

#include "dtypes.cuh"

// 32-bit shared-memory address for PTX instructions that take one.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// cp.async (sm_80 and newer): global -> shared without registers between, for the operand rings
// of both matmul kernels.
template <int BYTES>
__device__ __forceinline__ void cp_async(u32 dst, const void* src, int src_bytes) {
    // 16-byte copies bypass L1 (.cg); smaller ones must use .ca.
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(BYTES), "r"(src_bytes));
}

// A copy wholly inside the source: no src-size operand, which ptxas lowers into extra
// address arithmetic per copy even when it is the full size.
template <int BYTES>
__device__ __forceinline__ void cp_async_whole(u32 dst, const void* src) {
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(BYTES));
}

// A dependent launch's start (kernels_core/dependent_launch.py): wait until the kernel before on
// the stream has finished and its writes are visible, then (DEPENDENT_LAUNCH 1, early) let the
// next kernel's blocks be placed; 2 (exit) leaves that to this kernel's end. Every kernel of the
// sources in _runtime.DEPENDENT_SOURCES calls it first, before any access to global memory; built
// without DEPENDENT_LAUNCH (every launch but a dependent one) it is empty.
__device__ __forceinline__ void dependent_start() {
#if DEPENDENT_LAUNCH
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
#if DEPENDENT_LAUNCH == 1
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// 16 bytes from global memory through L2 only (ld.global.cg): another SM
// wrote them during this launch, so a line this SM's L1 might hold for the
// address (from an earlier launch that used the same workspace) is stale.
__device__ __forceinline__ Pack<float, 4> ldcg4(const Pack<float, 4>* p) {
    Pack<float, 4> r;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(r.v[0]), "=f"(r.v[1]), "=f"(r.v[2]), "=f"(r.v[3]) : "l"(p));
    return r;
}

__device__ __forceinline__ float ldcg1(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}

// A 16-bit element (fp16 / bf16 bits) the same way.
__device__ __forceinline__ u16 ldcg1(const u16* p) {
    u16 r;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

// ldcg1(p) where `in`, else 0: one predicated load. A volatile asm behind a condition compiles to a
// branch around it (a convergence barrier and up to three branches an element in a tile's copy),
// so a copy of many elements with edges to check passes its predicate into the load instead.
__device__ __forceinline__ float ldcg1_if(bool in, const float* p) {
    float r;
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n mov.b32 %0, 0;\n @q ld.global.cg.f32 %0, [%1];\n}"
                 : "=f"(r) : "l"(p), "r"((int)in));
    return r;
}

__device__ __forceinline__ u16 ldcg1_if(bool in, const u16* p) {
    u16 r;
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n mov.b16 %0, 0;\n @q ld.global.cg.u16 %0, [%1];\n}"
                 : "=h"(r) : "l"(p), "r"((int)in));
    return r;
}

// Sends for p's line into L1 and goes on: a read of it later finds it there.
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// Sends for p's line into L2 and goes on: a read of it later, from any multiprocessor, finds it there.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

#endif  // KERNELS_CUDA_PTX_CUH
