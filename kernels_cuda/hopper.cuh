// What the wgmma kernels (sm_90a) share: PTX wrappers of Hopper's asynchronous machinery (the
// mbarriers, the tensor memory accelerator's copies, wgmma's fences and shared-memory
// descriptors), the register lists of its accumulators, and the operand ring's barriers and producer.
#ifndef KERNELS_CUDA_HOPPER_CUH
#define KERNELS_CUDA_HOPPER_CUH

#include "dtypes.cuh"
#include "ptx.cuh"
#include "swizzle.cuh"

// A CUtensorMap (cuda.h's opaque 128-byte, 64-byte aligned struct), passed by value as a
// __grid_constant__ parameter so the TMA unit reads it from the kernel's parameter space.
struct alignas(64) TmaMap {
    u64 words[16];
};

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar), "r"(parity) : "memory");
}

// One box of a 2-D tensor map into shared memory, completing on `bar`; c0 indexes the contiguous
// dimension.
__device__ __forceinline__ void tma_load(u32 dst, const TmaMap* map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
        ::"r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// A shared-memory matrix descriptor: start address, leading and stride byte offsets (all in
// 16-byte units, 14 bits each), 128-byte swizzle (mode 1 in bits 62-63).
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}

// Pins the accumulators in place around a batch of wgmmas: their register writes are
// asynchronous, which the compiler cannot see, so without this it may move the zeroing into a
// batch (ptxas then serializes the wgmmas: warning C7515) or a read above the wait that ends it.
template <int R>
__device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The operand ring in a kernel's dynamic shared memory `smem`: STAGES stages of `stage_bytes`,
// 1024-aligned (the swizzle's period), then its barriers full[0 .. STAGES) and empty[0 .. STAGES),
// 8 bytes each, from `bars` on. Returns the ring's shared address.
template <int STAGES>
__device__ __forceinline__ u32 ring_in(unsigned char* smem, u32 stage_bytes, u32& bars) {
    const u32 ring = (smem_addr(smem) + 1023u) & ~1023u;
    bars = ring + STAGES * stage_bytes;
    return ring;
}

// The operand ring's barriers at `bars`, two per stage: full[s] (count 1: the producer arrives with
// expect_tx, the TMA completes the bytes) and empty[s] (count `consumers`: each consumer
// warpgroup releases the stage), made visible to the TMA unit (the async proxy) by
// fence.mbarrier_init, then a __syncthreads, before anyone waits or copies.
template <int STAGES>
__device__ __forceinline__ void ring_barriers_init(u32 bars, u32 consumers) {
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bars + 8 * s, 1);
            mbar_init(bars + 8 * (STAGES + s), consumers);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}

// The producer's walk (one thread): the block's tiles blockIdx.x, blockIdx.x + gridDim.x, ... in
// grouped order, each tile's `ktiles` k slices counted on across tiles (it), so the ring's stages
// and phases run on from one tile into the next. For each slice it waits until stage it % STAGES
// is empty, then load(stage, full barrier, kt, m0, n0) issues its copies.
template <int STAGES, int GROUP_M, int BM, int BN, typename Load>
__device__ __forceinline__ void produce(u32 bars, int tiles_m, int tiles, int ktiles, Load load) {
    int it = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int pid_m, pid_n;
        swizzle_block<GROUP_M>(tile, tiles_m, tiles / tiles_m, pid_m, pid_n);
        const int m0 = pid_m * BM, n0 = pid_n * BN;
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
            const int s = it % STAGES;
            if (it >= STAGES) mbar_wait(bars + 8 * (STAGES + s), ((it / STAGES) + 1) & 1);
            load(s, bars + 8 * s, kt, m0, n0);
        }
    }
}

// A warpgroup's m64nN fp32 accumulators, N / 2 a thread: the register list of a wgmma's asm
// (WGMMA_D<N/2>, operands %0 .. %(N/2 - 1)) and its read-write outputs (WGMMA_OUT<N/2>(d)).
#define WGMMA_D32 "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" "}"
#define WGMMA_D64 "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" "}"
#define WGMMA_D128 "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" "}"
#define WGMMA_OUT32(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WGMMA_OUT64(d) WGMMA_OUT32(d), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WGMMA_OUT128(d) WGMMA_OUT64(d), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

#endif  // KERNELS_CUDA_HOPPER_CUH
