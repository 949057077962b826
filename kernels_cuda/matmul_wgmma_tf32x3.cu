// fp32 matmul in 3xTF32 on Hopper's warpgroup tensor cores (wgmma), from operands split ahead:
// C (M x N fp32, row-major) = A @ B, given A's TF32 parts (A = a_big + a_small, M x K) and B^T's
// (N x K), all four k-contiguous fp32 arrays holding TF32 numbers. sm_90a only. Build alone, no
// GPU needed (registers, spills; with -o w.cubin, `cuobjdump -sass w.cubin` shows HGMMA ... TF32):
//   nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -std=c++17 -DSTANDALONE --resource-usage -o /dev/null kernels_cuda/matmul_wgmma_tf32x3.cu
//
// The probe behind experiments.tf32x3_split_ahead's CUDA rows, not yet a kernel of the twin: can
// three TF32 products on wgmma beat cuBLAS fp32 twice over at 4096^3? The Triton kernels reach
// 0.76x of cuBLAS fp32 at best, neither the split nor the per-slice sum what holds them back
// (experiments/FINDINGS.md, "fp32 on TF32 tensor cores"); this one is matmul_wgmma.cu's pipeline
// with tf32 operands.
//
// What differs from matmul_wgmma.cu (read that first: roles, barriers, the ring, the swizzle):
//  - wgmma's tf32 form reads both operands k-major from shared memory (no transpose for 32-bit
//    types), so B arrives transposed: the split pass that makes the parts writes B^T's.
//  - A k slice is BK = 32 fp32, one 128-byte swizzled row per operand row, as a 64-half slice is
//    for fp16: the same descriptors, the k8 step moving the start by 32 bytes. A stage holds the
//    four parts: a_big, a_small (BM rows each), b_big, b_small (BN rows each).
//  - Each k8 step issues three wgmmas, small x big, big x small, big x big (the small products
//    first, while the sum is small).
//  - SUM = n >= 1: the tensor cores add into their accumulator rounding toward zero, a bias that
//    grows with K (experiments/FINDINGS.md), so the products of n slices go into a step
//    accumulator that the first wgmma of its first slice starts from zero (scale-d 0), and once
//    they are all done (wait_group 0: reading a step while any of its wgmmas is in flight would
//    make ptxas serialize them, warning C7514) the consumer adds the step into the fp32
//    accumulator, rounding to nearest. Between the slices of a step one group stays in flight as
//    in matmul_wgmma.cu; at a step's end the warpgroup drains, and the other consumer's wgmmas keep
//    the tensor cores busy (the promotion interval of CUTLASS's fp8 kernels, the same idea).
//    SUM = 0: every product into the one accumulator (biased over a long K: priced, not used).
//  - PARTS = 1 prices the pipeline itself: plain TF32, one wgmma of the big parts a k8 step, the
//    stages holding a_big and b_big only (the small parts' maps unread); use it with SUM = 0.
//  - C is fp32, stored as 8-byte pairs where C_PAIRS (N even, C 8-byte aligned).
// A consumer warpgroup owns one m64 slab (BM = 64 x CONSUMERS), which the step accumulators'
// registers need.
#include "dtypes.cuh"
#include "hopper.cuh"
#include "ptx.cuh"
#include "swizzle.cuh"

// d (64 x N fp32 per warpgroup, N / 2 a thread) = (scale_d ? d : 0) + A (64 x 8) * B (8 x N),
// tf32, both k-major in shared memory.
template <int N>
__device__ __forceinline__ void wgmma_tf32(float (&d)[N / 2], u64 da, u64 db, int scale_d) {
    if constexpr (N == 64) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " WGMMA_D32 ", %32, %33, p, 1, 1; }\n"
                     : WGMMA_OUT32(d) : "l"(da), "l"(db), "r"(scale_d));
    } else {
        static_assert(N == 128, "n64 or n128");
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 " WGMMA_D64 ", %64, %65, p, 1, 1; }\n"
                     : WGMMA_OUT64(d) : "l"(da), "l"(db), "r"(scale_d));
    }
}

template <int BM, int BN, int STAGES, int CONSUMERS, int GROUP_M, int SUM, int C_PAIRS, int PARTS>
__global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
matmul_wgmma_tf32x3_kernel(const __grid_constant__ TmaMap map_a_big, const __grid_constant__ TmaMap map_a_small,
                           const __grid_constant__ TmaMap map_b_big, const __grid_constant__ TmaMap map_b_small,
                           float* __restrict__ C, int M, int N, int K) {
    constexpr int BK = 32;
    constexpr u32 A_BYTES = BM * BK * 4, B_BYTES = BN * BK * 4;
    constexpr u32 STAGE_BYTES = PARTS * (A_BYTES + B_BYTES);
    constexpr int R = BN / 2;  // accumulators a thread
    static_assert(BK * 4 == 128, "one 128-byte swizzled row per k slice");
    static_assert(BM == 64 * CONSUMERS, "a consumer owns one m64 slab");
    static_assert(BN == 64 || BN == 128, "one wgmma spans the tile's columns");
    static_assert(STAGES >= 2, "a slice is loaded while the one before is read");
    static_assert(PARTS == 2 || (PARTS == 1 && SUM == 0), "3xTF32 from two parts, or plain TF32 in one accumulator");

    // Dynamic shared memory: the ring, 1024-aligned (the swizzle's period), then the barriers
    // full[0 .. STAGES) and empty[0 .. STAGES), 8 bytes each.
    extern __shared__ unsigned char smem_raw[];
    const u32 ring = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 bars = ring + STAGES * STAGE_BYTES;

    const int tiles_m = (M + BM - 1) / BM, tiles = tiles_m * ((N + BN - 1) / BN);
    const int ktiles = (K + BK - 1) / BK;
    const int wg = threadIdx.x / 128;

    ring_barriers_init<STAGES>(bars, CONSUMERS);

    if (wg == 0) {
        // ------------------------------------------------ producer
        if constexpr (CONSUMERS == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x == 0)
            produce<STAGES, GROUP_M, BM, BN>(bars, tiles_m, tiles, ktiles, [&](int s, u32 full, int kt, int m0, int n0) {
                const u32 a_dst = ring + s * STAGE_BYTES, b_dst = a_dst + PARTS * A_BYTES;
                mbar_expect_tx(full, STAGE_BYTES);
                tma_load(a_dst, &map_a_big, full, kt * BK, m0);
                tma_load(b_dst, &map_b_big, full, kt * BK, n0);
                if constexpr (PARTS == 2) {
                    tma_load(a_dst + A_BYTES, &map_a_small, full, kt * BK, m0);
                    tma_load(b_dst + B_BYTES, &map_b_small, full, kt * BK, n0);
                }
            });
    } else {
        // ------------------------------------------------ consumers
        if constexpr (CONSUMERS == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int c = wg - 1;
        const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
        float acc[R], step[R];
#pragma unroll
        for (int r = 0; r < R; ++r) step[r] = 0.f;
        int it = 0, released = 0;  // slices issued, and whose stages went back to the producer

        // Slice it's wgmmas into d (twelve; four with PARTS = 1), committed as one group; `first`
        // starts d from zero.
        auto issue = [&](float (&d)[R], bool first) {
            const int s = it % STAGES;
            mbar_wait(bars + 8 * s, (it / STAGES) & 1);
            const u32 a_big = ring + s * STAGE_BYTES + c * 64 * 128, a_small = a_big + A_BYTES;
            const u32 b_big = ring + s * STAGE_BYTES + PARTS * A_BYTES, b_small = b_big + B_BYTES;
            fence_acc(d);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 8; ++kk) {
                const u64 dab = smem_desc(a_big + kk * 32, 16, 1024), das = smem_desc(a_small + kk * 32, 16, 1024);
                const u64 dbb = smem_desc(b_big + kk * 32, 16, 1024), dbs = smem_desc(b_small + kk * 32, 16, 1024);
                if constexpr (PARTS == 2) {
                    wgmma_tf32<BN>(d, das, dbb, first && kk == 0 ? 0 : 1);
                    wgmma_tf32<BN>(d, dab, dbs, 1);
                }
                wgmma_tf32<BN>(d, dab, dbb, PARTS == 2 || !(first && kk == 0) ? 1 : 0);
            }
            wgmma_commit();
            fence_acc(d);
        };
        // The stages of the slices before `upto` back to the producer, once their wgmmas are done.
        auto release = [&](int upto) {
            for (; released < upto; ++released)
                if (threadIdx.x % 128 == 0) mbar_arrive(bars + 8 * (STAGES + released % STAGES));
        };

        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int pid_m, pid_n;
            swizzle_block<GROUP_M>(tile, tiles_m, tiles / tiles_m, pid_m, pid_n);
            const int m0 = pid_m * BM, n0 = pid_n * BN;
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = 0.f;

            if constexpr (SUM) {
                for (int k0 = 0; k0 < ktiles; k0 += SUM) {
                    const int n = min(SUM, ktiles - k0);  // the slices of this step
#pragma unroll
                    for (int j = 0; j < SUM; ++j) {
                        if (j < n) {
                            issue(step, j == 0);
                            ++it;
                            if (j < n - 1) {
                                wgmma_wait<1>();  // the slice before this one is done reading its stage
                                release(it - 1);
                            }
                        }
                    }
                    // The step's last slice issued: wait for all of it (reading the step while
                    // any of its wgmmas is in flight would make ptxas serialize them), then add.
                    wgmma_wait<0>();
                    release(it);
                    fence_acc(step);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r] += step[r];
                }
            } else {
                for (int kt = 0; kt < ktiles; ++kt) {
                    issue(acc, false);
                    ++it;
                    if (kt > 0) {
                        wgmma_wait<1>();  // the slice before this one is done reading its stage
                        release(it - 1);
                    }
                }
                wgmma_wait<0>();
                release(it);
                fence_acc(acc);
            }

            // ------------------------------------------------ epilogue
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = n0 + 8 * j + 2 * (lane % 4);
                if (col >= N) continue;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = m0 + c * 64 + 16 * warp + lane / 4 + 8 * h;
                    if (row >= M) continue;
                    float* out = C + (i64)row * N + col;
                    if (C_PAIRS && col + 1 < N) {
                        *reinterpret_cast<float2*>(out) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                    } else {
                        out[0] = acc[4 * j + 2 * h];
                        if (col + 1 < N) out[1] = acc[4 * j + 2 * h + 1];
                    }
                }
            }
        }
    }
}

#ifdef STANDALONE
template __global__ void matmul_wgmma_tf32x3_kernel<128, 128, 3, 2, 8, 1, 1, 2>(
    const __grid_constant__ TmaMap, const __grid_constant__ TmaMap, const __grid_constant__ TmaMap,
    const __grid_constant__ TmaMap, float*, int, int, int);
template __global__ void matmul_wgmma_tf32x3_kernel<128, 128, 3, 2, 8, 4, 1, 2>(
    const __grid_constant__ TmaMap, const __grid_constant__ TmaMap, const __grid_constant__ TmaMap,
    const __grid_constant__ TmaMap, float*, int, int, int);
template __global__ void matmul_wgmma_tf32x3_kernel<128, 128, 3, 2, 8, 0, 1, 2>(
    const __grid_constant__ TmaMap, const __grid_constant__ TmaMap, const __grid_constant__ TmaMap,
    const __grid_constant__ TmaMap, float*, int, int, int);
#endif
