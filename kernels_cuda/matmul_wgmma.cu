// fp16 / bf16 matmul on Hopper's warpgroup tensor cores (wgmma) fed by the tensor memory
// accelerator (TMA): C = act(op(A) @ op(B) + bias), C row-major M x N in the inputs' dtype,
// fp32 accumulation. sm_90a only (wgmma and setmaxnreg are not in plain sm_90, nor in any later
// arch); matmul_tc.cu (mma.sync) stays the kernel of sm_75 .. sm_89 and of calls this one cannot
// take. Build alone, no GPU needed (registers, spills):
//   nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -std=c++17 -DSTANDALONE --resource-usage -o /dev/null kernels_cuda/matmul_wgmma.cu
// (with -o w.cubin, `cuobjdump -sass w.cubin` shows its SASS: HGMMA, not HMMA; UTMALDG copies).
//
// Why a second tensor-core kernel: at 4096^3 fp16 (137 GFLOP) cuBLAS takes 0.18 ms on the H200
// (756 TFLOP/s) with wgmma; matmul_tc.cu's mma.sync reaches little more than half of that, and
// only wgmma reaches cuBLAS there (experiments/FINDINGS.md, "Large square GEMMs").
// One m64nNk16 wgmma is issued by a warpgroup (4 warps) and reads both operands straight from
// shared memory, so no ldmatrix, no fragment registers for A or B, and the tensor cores run while
// the warps do something else.
//
// Roles (producer/consumer warp specialization). A block has 1 + CONSUMERS warpgroups of 128
// threads and computes BM x BN tiles of C one after another (persistent: the host launches no
// more blocks than the SMs' shared memory holds at once, see the kernel):
//  - warpgroup 0, the producer: one thread issues the TMA copies of each BK = 64 slice of K
//    (A: BM x 64, B: 64 x BN) into a STAGES-deep ring of shared buffers. It gives its registers
//    away (setmaxnreg.dec to 40), the consumers take them (setmaxnreg.inc to 232).
//  - warpgroups 1 .. CONSUMERS: each owns BM / CONSUMERS rows of the tile (one or two m64 slabs),
//    all BN columns, BM * BN / (128 * CONSUMERS) fp32 accumulators per thread, and issues
//    4 k16 steps of wgmma per slice.
//
// Who waits on what (two mbarriers per stage s):
//  - full[s] (count 1): the producer arrives with expect_tx(bytes of the stage) and the TMA unit
//    completes the transaction as its bytes land; a consumer waits on full[s]'s phase
//    (kt / STAGES) & 1 before its wgmma read slice kt. The TMA writes by the async proxy, wgmma
//    reads by it too, and the mbarrier's completion makes those writes visible: no extra fence.
//  - empty[s] (count CONSUMERS): after issuing slice kt's wgmmas a consumer waits (wait_group 1)
//    until the wgmmas of slice kt - 1 are done reading, then one thread of it arrives on
//    empty[(kt - 1) % STAGES]. The producer waits for that phase before it overwrites the stage
//    with slice kt - 1 + STAGES. So one group of wgmmas is always in flight while the next
//    slice's barrier is waited on.
// Barrier init is made visible to the TMA unit (async proxy) by fence.mbarrier_init, then a
// __syncthreads, before anyone waits or copies.
//
// Shared layout: a stage holds A then B, each as 128-byte rows (64 halves of the contiguous
// dimension) in the TMA's 128-byte swizzle (16-byte chunk c of row r lands at chunk c ^ (r % 8)),
// which is exactly the canonical layout wgmma's descriptors name "128B swizzle", so shared memory
// is read without bank conflicts and without any repacking. The swizzle repeats every 1024 bytes
// and is computed from address bits, so every tile starts 1024-byte aligned.
//  - k contiguous (K-major: A row-major, B given as B^T row-major): one box of 64 (k) x rows; row
//    r at r * 128 bytes; descriptor: 8-row groups 1024 bytes apart (SBO), the k16 step moves the
//    start address by 32 bytes inside the swizzled rows.
//  - m or n contiguous (MN-major: A given as A^T, B row-major): boxes of 64 (m or n) x 64 (k),
//    one per 64 columns, 8 KiB apart (LBO); row k at k * 128 bytes, 8-row k groups 1024 bytes
//    apart (SBO); the k16 step moves the start by 16 rows (2048 bytes); the wgmma's transpose
//    flag for that operand is set (allowed for 16-bit types).
// Ragged edges cost nothing in the main loop: the TMA fills elements outside the tensor with
// zeros (K's tail, the last tiles of M and N) and still counts the whole box's bytes toward
// expect_tx, so every stage's byte count is the same constant.
//
// Epilogue: each thread holds, per 64 x 8 piece of its slab, rows r and r + 8, columns c, c + 1
// (r = 16 * warp + lane / 4, c = 2 * (lane % 4): mma.sync's fragment layout, repeated), adds the
// bias, applies ReLU, rounds once and stores pairs as one 32-bit store where C_PAIRS (N even,
// C 4-byte aligned).
//
// The host (kernels_cuda/matmul.py, _tma.py) checks what the TMA needs: 16-byte aligned base
// addresses and row strides that are multiples of 16 bytes (K and N multiples of 8 for
// contiguous operands); a call that breaks it is refused as a config error, so the tuner prunes
// the config for that shape and the mma.sync kernel takes it.
#include "dtypes.cuh"
#include "hopper.cuh"
#include "ptx.cuh"
#include "swizzle.cuh"

// d (64 x N fp32 per warpgroup, N / 2 per thread) += A (64 x 16) * B (16 x N), both from shared
// memory; TA / TB: the operand is MN-major. scale-d is 1: the accumulators start at zero.
#define WGMMA_N64(TY)                                                                           \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"                                         \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " WGMMA_D32 ", %32, %33, p, 1, 1, %35, %36; }\n" \
                 : WGMMA_OUT32(d) : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB))

#define WGMMA_N128(TY)                                                                          \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"                                         \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " WGMMA_D64 ", %64, %65, p, 1, 1, %67, %68; }\n" \
                 : WGMMA_OUT64(d) : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB))

#define WGMMA_N256(TY)                                                                          \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %130, 0;\n"                                        \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " " WGMMA_D128 ", %128, %129, p, 1, 1, %131, %132; }\n" \
                 : WGMMA_OUT128(d) : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB))

template <int DT, int N, int TA, int TB>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], u64 da, u64 db) {
    if constexpr (DT == DT_BF16) {
        if constexpr (N == 64) WGMMA_N64("bf16");
        else if constexpr (N == 128) WGMMA_N128("bf16");
        else WGMMA_N256("bf16");
    } else {
        if constexpr (N == 64) WGMMA_N64("f16");
        else if constexpr (N == 128) WGMMA_N128("f16");
        else WGMMA_N256("f16");
    }
}

// ---------------------------------------------------------------- kernel

template <int DT, int BM, int BN, int STAGES, int CONSUMERS, int GROUP_M, int A_KC, int B_KC, int HAS_BIAS,
          int RELU, int C_PAIRS>
__global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
matmul_wgmma_kernel(const __grid_constant__ TmaMap map_a, const __grid_constant__ TmaMap map_b,
                    const u16* __restrict__ bias, u16* __restrict__ C, int M, int N, int K) {
    dependent_start();
    typedef Elt<DT> E;
    constexpr int BK = 64;
    constexpr int WM = BM / CONSUMERS;  // rows of one consumer warpgroup
    constexpr int MI = WM / 64;         // its m64 slabs
    constexpr u32 A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
    constexpr u32 STAGE_BYTES = A_BYTES + B_BYTES;
    static_assert(BK * 2 == 128, "one 128-byte swizzled row per k slice");
    static_assert(WM % 64 == 0 && (MI == 1 || MI == 2), "a consumer owns one or two m64 slabs");
    static_assert(BN == 64 || BN == 128 || BN == 256, "one wgmma spans the tile's columns");

    extern __shared__ unsigned char smem_raw[];
    u32 bars;  // the ring's barriers, after it
    const u32 ring = ring_in<STAGES>(smem_raw, STAGE_BYTES, bars);

    const int tiles_m = (M + BM - 1) / BM, tiles = tiles_m * ((N + BN - 1) / BN);
    const int ktiles = (K + BK - 1) / BK;
    const int wg = threadIdx.x / 128;

    ring_barriers_init<STAGES>(bars, CONSUMERS);

    // Persistent: the grid is at most one block per SM and each block walks the tiles
    // blockIdx.x, blockIdx.x + gridDim.x, ... Producer and consumers count the same k slices
    // (it) across tiles, so the ring's stages and phases run on from one tile into the next, and
    // the producer fills the next tile's first stages while the consumers store this one.
    if (wg == 0) {
        // ------------------------------------------------ producer
        if constexpr (CONSUMERS == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x == 0)
            produce<STAGES, GROUP_M, BM, BN>(bars, tiles_m, tiles, ktiles, [&](int s, u32 full, int kt, int m0, int n0) {
                const u32 a_dst = ring + s * STAGE_BYTES, b_dst = a_dst + A_BYTES;
                mbar_expect_tx(full, STAGE_BYTES);
                if constexpr (A_KC) {
                    tma_load(a_dst, &map_a, full, kt * BK, m0);
                } else {
#pragma unroll
                    for (int j = 0; j < BM / 64; ++j)
                        tma_load(a_dst + j * 8192, &map_a, full, m0 + 64 * j, kt * BK);
                }
                if constexpr (B_KC) {
                    tma_load(b_dst, &map_b, full, kt * BK, n0);
                } else {
#pragma unroll
                    for (int j = 0; j < BN / 64; ++j)
                        tma_load(b_dst + j * 8192, &map_b, full, n0 + 64 * j, kt * BK);
                }
            });
    } else {
        // ------------------------------------------------ consumers
        if constexpr (CONSUMERS == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int c = wg - 1;
        const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
        float d[MI][BN / 2];
        int it = 0;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int pid_m, pid_n;
            swizzle_block<GROUP_M>(tile, tiles_m, tiles / tiles_m, pid_m, pid_n);
            const int m0 = pid_m * BM, n0 = pid_n * BN;
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int r = 0; r < BN / 2; ++r) d[i][r] = 0.f;

            for (int kt = 0; kt < ktiles; ++kt, ++it) {
                const int s = it % STAGES;
                mbar_wait(bars + 8 * s, (it / STAGES) & 1);
                const u32 a_base = ring + s * STAGE_BYTES, b_base = a_base + A_BYTES;
#pragma unroll
                for (int i = 0; i < MI; ++i) fence_acc(d[i]);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) {
                    const u64 db = B_KC ? smem_desc(b_base + kk * 32, 16, 1024)
                                        : smem_desc(b_base + kk * 2048, 8192, 1024);
#pragma unroll
                    for (int i = 0; i < MI; ++i) {
                        const int row = c * WM + i * 64;
                        const u64 da = A_KC ? smem_desc(a_base + row * 128 + kk * 32, 16, 1024)
                                            : smem_desc(a_base + (row / 64) * 8192 + kk * 2048, 8192, 1024);
                        wgmma<DT, BN, 1 - A_KC, 1 - B_KC>(d[i], da, db);
                    }
                }
                wgmma_commit();
#pragma unroll
                for (int i = 0; i < MI; ++i) fence_acc(d[i]);
                if (kt > 0) {
                    wgmma_wait<1>();  // slice it - 1's wgmmas are done reading their stage
                    if (threadIdx.x % 128 == 0) mbar_arrive(bars + 8 * (STAGES + (it - 1) % STAGES));
                }
            }
            wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < MI; ++i) fence_acc(d[i]);
            if (threadIdx.x % 128 == 0) mbar_arrive(bars + 8 * (STAGES + (it - 1) % STAGES));  // the tile's last

            // ------------------------------------------------ epilogue
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = n0 + 8 * j + 2 * (lane % 4);
                if (col >= N) continue;
                float b0 = 0.f, b1 = 0.f;
                if constexpr (HAS_BIAS) {
                    b0 = E::load(bias[col]);
                    if (col + 1 < N) b1 = E::load(bias[col + 1]);
                }
#pragma unroll
                for (int i = 0; i < MI; ++i) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = m0 + c * WM + i * 64 + 16 * warp + lane / 4 + 8 * h;
                        if (row >= M) continue;
                        float v0 = d[i][4 * j + 2 * h] + b0, v1 = d[i][4 * j + 2 * h + 1] + b1;
                        if constexpr (RELU) {
                            v0 = relu_f(v0);
                            v1 = relu_f(v1);
                        }
                        u16* out = C + (i64)row * N + col;
                        if (C_PAIRS && col + 1 < N) {
                            *reinterpret_cast<u32*>(out) = (u32)E::store(v0) | ((u32)E::store(v1) << 16);
                        } else {
                            out[0] = E::store(v0);
                            if (col + 1 < N) out[1] = E::store(v1);
                        }
                    }
                }
            }
        }
    }
}

#ifdef STANDALONE
// The defaults' neighbours: 128 x 256 with two consumers (nn, bias + ReLU), 128 x 128 with one (tn).
template __global__ void matmul_wgmma_kernel<DT_FP16, 128, 256, 4, 2, 8, 1, 0, 1, 1, 1>(
    const __grid_constant__ TmaMap, const __grid_constant__ TmaMap, const u16*, u16*, int, int, int);
template __global__ void matmul_wgmma_kernel<DT_BF16, 128, 128, 4, 1, 8, 0, 0, 0, 0, 1>(
    const __grid_constant__ TmaMap, const __grid_constant__ TmaMap, const u16*, u16*, int, int, int);
#endif
