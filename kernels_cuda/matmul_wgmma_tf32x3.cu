// fp32 matmul in 3xTF32 (or plain TF32) on Hopper's warpgroup tensor cores (wgmma), from operands
// split ahead: the CUDA twin's fp32 matmul with WGMMA = 1 (kernels_cuda/matmul.py), sm_90a only.
// C = act(A @ B + bias) (M x N fp32, row-major), in two kernels:
//  1. tf32_split_kernel, once per operand: A (M x K) and B^T (N x K), read in any layout, written
//     k-contiguous as their TF32 parts, x = big + small (3xTF32), or big alone (plain TF32).
//  2. matmul_wgmma_tf32x3_kernel: the parts through matmul_wgmma.cu's pipeline, three wgmmas a k8
//     step (small x big, big x small, big x big), or one.
// Build alone, no GPU needed (registers, spills; with -o w.cubin, `cuobjdump -sass w.cubin` shows
// HGMMA ... TF32):
//   nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -std=c++17 -DSTANDALONE --resource-usage -o /dev/null kernels_cuda/matmul_wgmma_tf32x3.cu
//
// Why ahead: wgmma's tf32 form reads both operands k-major from shared memory (no transpose for
// 32-bit types), and the split per tile that the mma.sync kernel does in registers would send B's
// parts back through shared memory every k step, outside the pipeline's prefetch. Split once, the
// parts reach the tensor cores through the TMA as any TF32 GEMM's operands do, at twice the bytes;
// at 4096^3 on the H200 the GEMM took 0.97 ms and the split of both operands 0.24 ms, 2.2x cuBLAS
// fp32 with an error below its (experiments/FINDINGS.md, "fp32 on TF32 tensor cores").
//
// The split pass: the element (r, k) of X at x[r * s_r + k * s_k], for A r = m, for B^T r = n. A
// block splits a 32 x 32 tile through shared memory, reading along whichever dimension X is
// contiguous in (K_CONTIG) and writing along k, so a row-major B is transposed on the way at
// coalesced reads and writes. The parts' rows are `ld` floats apart (K rounded up to 4: the TMA
// wants rows 16 bytes apart); the columns from K to ld are never read (the TMA zero-fills a box
// past K). The rounding is the mma.sync kernel's (tf32.cuh): ties away from zero, infinities and
// NaNs split so that their products come out as IEEE's.
//
// The GEMM, beside matmul_wgmma.cu (read that first: roles, barriers, the ring, the swizzle):
//  - A k slice is BK = 32 fp32, one 128-byte swizzled row per operand row, as a 64-half slice is
//    for fp16: the same descriptors, the k8 step moving the start by 32 bytes. A stage holds the
//    four parts: a_big, a_small (BM rows each), b_big, b_small (BN rows each).
//  - SUM = n >= 1: the tensor cores add into their accumulator rounding toward zero, a bias that
//    grows with K (experiments/FINDINGS.md), so the products of n slices go into a step
//    accumulator that the first wgmma of its first slice starts from zero (scale-d 0), and once
//    they are all done (wait_group 0: reading a step while any of its wgmmas is in flight would
//    make ptxas serialize them, warning C7514) the consumer adds the step into the fp32
//    accumulator, rounding to nearest. Between the slices of a step one group stays in flight as
//    in matmul_wgmma.cu; at a step's end the warpgroup drains, and the other consumer's wgmmas keep
//    the tensor cores busy (the promotion interval of CUTLASS's fp8 kernels, the same idea). The
//    twin runs SUM = 1; experiments.tf32x3_split_ahead prices 4 and 0 (every product into the one
//    accumulator: biased over a long K).
//  - PARTS = 1 is plain TF32 (the twin's TF32 = 1, a lower precision): one wgmma of the big parts
//    a k8 step, the stages holding a_big and b_big only (the small parts' maps unread), SUM = 0.
//  - The epilogue adds the bias and applies the ReLU (HAS_BIAS, RELU) as matmul_wgmma.cu's does;
//    C is stored as 8-byte pairs where C_PAIRS (N even, C 8-byte aligned).
// A consumer warpgroup owns one m64 slab (BM = 64 x CONSUMERS), which the step accumulators'
// registers need.
#include "dtypes.cuh"
#include "hopper.cuh"
#include "ptx.cuh"
#include "swizzle.cuh"
#include "tf32.cuh"

// X's TF32 parts, k-contiguous, `ld` floats a row (see above); small is unwritten for PARTS = 1.
// Blocks run along r (gridDim.x) and stride over k's 32-wide tiles (gridDim.y of them at a time:
// at most 65535, so any K).
template <int PARTS, int K_CONTIG>
__global__ void __launch_bounds__(256)
tf32_split_kernel(const float* __restrict__ x, float* __restrict__ big, float* __restrict__ small, int rows, int K,
                  i64 s_r, i64 s_k, i64 ld) {
    dependent_start();
    __shared__ float tile[32][33];  // [r][k]; the odd row length keeps the transposing accesses conflict-free
    const int r0 = blockIdx.x * 32;
    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    for (int k0 = blockIdx.y * 32; k0 < K; k0 += gridDim.y * 32) {
        for (int i = ty; i < 32; i += 8) {
            const int r = r0 + (K_CONTIG ? i : tx), k = k0 + (K_CONTIG ? tx : i);
            const float v = r < rows && k < K ? x[r * s_r + k * s_k] : 0.f;
            if (K_CONTIG) tile[i][tx] = v;
            else tile[tx][i] = v;
        }
        __syncthreads();
        for (int i = ty; i < 32; i += 8) {
            const int r = r0 + i, k = k0 + tx;
            if (r >= rows || k >= K) continue;
            const u32 v = __float_as_uint(tile[i][tx]);
            if constexpr (PARTS == 2) {
                u32 b, s;
                split_tf32(v, b, s);
                big[r * ld + k] = __uint_as_float(b);
                small[r * ld + k] = __uint_as_float(s);
            } else {
                big[r * ld + k] = __uint_as_float(to_tf32(v));
            }
        }
        __syncthreads();  // the tile is read before the next k tile overwrites it
    }
}

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

template <int BM, int BN, int STAGES, int CONSUMERS, int GROUP_M, int SUM, int C_PAIRS, int PARTS, int HAS_BIAS,
          int RELU>
__global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
matmul_wgmma_tf32x3_kernel(const __grid_constant__ TmaMap map_a_big, const __grid_constant__ TmaMap map_a_small,
                           const __grid_constant__ TmaMap map_b_big, const __grid_constant__ TmaMap map_b_small,
                           const float* __restrict__ bias, float* __restrict__ C, int M, int N, int K) {
    dependent_start();
    constexpr int BK = 32;
    constexpr u32 A_BYTES = BM * BK * 4, B_BYTES = BN * BK * 4;
    constexpr u32 STAGE_BYTES = PARTS * (A_BYTES + B_BYTES);
    constexpr int R = BN / 2;  // accumulators a thread
    static_assert(BK * 4 == 128, "one 128-byte swizzled row per k slice");
    static_assert(BM == 64 * CONSUMERS, "a consumer owns one m64 slab");
    static_assert(BN == 64 || BN == 128, "one wgmma spans the tile's columns");
    static_assert(STAGES >= 2, "a slice is loaded while the one before is read");
    static_assert(PARTS == 2 || (PARTS == 1 && SUM == 0), "3xTF32 from two parts, or plain TF32 in one accumulator");

    extern __shared__ unsigned char smem_raw[];
    u32 bars;  // the ring's barriers, after it
    const u32 ring = ring_in<STAGES>(smem_raw, STAGE_BYTES, bars);

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
                float b0 = 0.f, b1 = 0.f;
                if constexpr (HAS_BIAS) {
                    b0 = bias[col];
                    if (col + 1 < N) b1 = bias[col + 1];
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = m0 + c * 64 + 16 * warp + lane / 4 + 8 * h;
                    if (row >= M) continue;
                    float v0 = acc[4 * j + 2 * h] + b0, v1 = acc[4 * j + 2 * h + 1] + b1;
                    if constexpr (RELU) {
                        v0 = relu_f(v0);
                        v1 = relu_f(v1);
                    }
                    float* out = C + (i64)row * N + col;
                    if (C_PAIRS && col + 1 < N) {
                        *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
                    } else {
                        out[0] = v0;
                        if (col + 1 < N) out[1] = v1;
                    }
                }
            }
        }
    }
}

#ifdef STANDALONE
// The twin's 3xTF32 at 128 x 128 on two consumers, plain and with bias + ReLU; the split pass of a
// k-contiguous operand and of a transposed one.
template __global__ void matmul_wgmma_tf32x3_kernel<128, 128, 3, 2, 8, 1, 1, 2, 0, 0>(
    const __grid_constant__ TmaMap, const __grid_constant__ TmaMap, const __grid_constant__ TmaMap,
    const __grid_constant__ TmaMap, const float*, float*, int, int, int);
template __global__ void matmul_wgmma_tf32x3_kernel<128, 128, 3, 2, 8, 1, 1, 2, 1, 1>(
    const __grid_constant__ TmaMap, const __grid_constant__ TmaMap, const __grid_constant__ TmaMap,
    const __grid_constant__ TmaMap, const float*, float*, int, int, int);
template __global__ void tf32_split_kernel<2, 1>(const float*, float*, float*, int, int, i64, i64, i64);
template __global__ void tf32_split_kernel<2, 0>(const float*, float*, float*, int, int, i64, i64, i64);
#endif
