// Split-K for both matmul kernels (matmul_simt.cu, matmul_tc.cu, SPLIT_K > 1): a block's slice
// of K, its arrival at the tile's counter, and the last arrival's sums of the partial tiles.
//
// The kernel cuts K into slices of k_slice elements, a multiple of BK (the host computes it:
// kernels_core/workspace.py, splitk_slices), so only the last slice meets K's ragged end,
// which the operand loads already zero-fill. The grid is tiles x slices:
// blockIdx.x is the tile, blockIdx.y the slice, and only slices with work
// are launched (gridDim.y <= SPLIT_K). Each block writes its fp32 partial
// tile to the workspace (kernels_core/workspace.py) and arrives at its
// tile's counter; the block that arrives last sums the partials in slice
// order 0, 1, ... (so the bits never depend on who came last), applies the
// epilogue once and puts the counter back to 0 for the next launch.
#ifndef KERNELS_CUDA_SPLITK_CUH
#define KERNELS_CUDA_SPLITK_CUH

#include "dtypes.cuh"
#include "ptx.cuh"

// Moves A, B and K to this block's slice: k from blockIdx.y * k_slice, K its
// length, so the main loop runs unchanged on a shorter K and its loads
// zero-fill exactly past the slice's end.
// With A_ROWS (A's stored rows read through the index vector a_rows) and k along A's rows,
// the slice starts k0 entries into the vector instead.
template <int A_KC, int B_KC, int A_ROWS, typename T>
__device__ __forceinline__ void enter_slice(const T*& A, const T*& B, const i64*& a_rows, int& K, i64 lda, i64 ldb,
                                            int k_slice) {
    const int k0 = (int)blockIdx.y * k_slice;
    if constexpr (A_ROWS && !A_KC)
        a_rows += k0;
    else
        A += A_KC ? (i64)k0 : k0 * lda;  // op(A) is M x K: k runs along A's rows or its columns
    B += B_KC ? (i64)k0 : k0 * ldb;  // op(B) is K x N
    K = K - k0 < k_slice ? K - k0 : k_slice;
}

// Called by every thread of a block once its partial tile is stored; true in
// every thread of the block whose arrival is the `arrivals`-th at `counter`.
// Who waits on what:
//  1. bar.sync: every thread's partial stores happen before thread 0's fence
//     (CTA scope), so the fence below covers the whole block's tile.
//  2. Release: __threadfence (membar.gl = fence.sc.gpu), then the atomicAdd. A block
//     whose atomic reads this increment is ordered after every store of 1.
//  3. Acquire (last arrival only): its atomic read the other slices'
//     increments; the second __threadfence orders the loads that follow
//     after it, so they see those slices' partial tiles.
//  4. bar.red.or: hands thread 0's verdict to the block and orders its
//     acquire before every thread's loads of the partials (ldcg4).
// Nothing ever waits for another block, so no residency assumption is made
// and a launch larger than the GPU cannot deadlock. The last arrival writes
// 0 back: every arrival of this launch is in, and the next launch on the
// stream starts after this one ends.
__device__ __forceinline__ bool splitk_arrive_last(int* counter, int arrivals) {
    __syncthreads();
    u32 last = 0;
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counter, 1) == arrivals - 1;
        if (last) {
            *counter = 0;
            __threadfence();
        }
    }
    u32 any;
    asm volatile("{ .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, 0, p;\n selp.u32 %0, 1, 0, q; }"
                 : "=r"(any) : "r"(last) : "memory");
    return any;
}

// The last arrival's sums of G float4s of its tile (the first `count` of v):
// v[g] holds this block's own slice (blockIdx.y) of float4 g, which the other
// slices have at p + g * g_stride + s * slice_stride. Every load of a batch
// is issued before the first add, so a batch costs one trip to L2, not one
// per slice; the adds then go in slice order 0, 1, ... whoever arrived last,
// so the result's bits are always the same. Slot t holds slice t below the
// own one and slice t + 1 above it: SPLIT_K - 1 slots, indexed by constants
// (a run-time index would put x in local memory). Up to SPLIT_K = 17 the
// slots are one batch. Past that G is 1 and the slots go 16 at a time
// (SPLIT_K = 64: four trips), in a loop of its own: under one loop over batches
// for both cases ptxas interleaves a single batch's loads with its adds (three
// trips where there is one) and takes more registers (experiments/FINDINGS.md, "Split-K").
template <int SPLIT_K, int G>
__device__ __forceinline__ void splitk_sum(float (&v)[G][4], const Pack<float, 4>* p, i64 g_stride, i64 slice_stride,
                                           int slices, int count) {
    constexpr int SLOTS = SPLIT_K - 1;
    const int own = blockIdx.y;
    if constexpr (SLOTS <= 16) {
        Pack<float, 4> x[G][SLOTS];
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int t = 0; t < SLOTS; ++t) {
                const int s = t < own ? t : t + 1;
                if (g < count && s < slices) x[g][t] = ldcg4(p + g * g_stride + s * slice_stride);
            }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= count) break;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float sum = -0.f;  // -0 + x is x, bit for bit, for every x
#pragma unroll
                for (int t = 0; t < SLOTS; ++t) {
                    if (t == own) sum += v[g][j];
                    if ((t < own ? t : t + 1) < slices) sum += x[g][t].v[j];
                }
                if (own == SLOTS) sum += v[g][j];
                v[g][j] = sum;
            }
        }
    } else {
        static_assert(G == 1, "past 17 slices a batch is 16 slots of one float4");
        float sum[4] = {-0.f, -0.f, -0.f, -0.f};
#pragma unroll
        for (int t0 = 0; t0 < SLOTS; t0 += 16) {
            Pack<float, 4> x[16];
#pragma unroll
            for (int c = 0; c < 16; ++c) {
                const int t = t0 + c, s = t < own ? t : t + 1;
                if (count > 0 && t < SLOTS && s < slices) x[c] = ldcg4(p + s * slice_stride);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int c = 0; c < 16 && t0 + c < SLOTS; ++c) {
                    const int t = t0 + c;
                    if (t == own) sum[j] += v[0][j];
                    if ((t < own ? t : t + 1) < slices) sum[j] += x[c].v[j];
                }
        }
        if (count > 0)
#pragma unroll
            for (int j = 0; j < 4; ++j) v[0][j] = own == SLOTS ? sum[j] + v[0][j] : sum[j];
    }
}

// float4s per splitk_sum batch: G * min(SPLIT_K - 1, 16) loads in flight, at most 16
// (64 registers) whatever SPLIT_K is.
__host__ __device__ constexpr int splitk_batch(int split_k) { return split_k > 17 ? 1 : 16 / (split_k - 1); }

// The split-K end of a block's work, once its loop over its slice is done:
// stores its partial tile, arrives, and in the last arrival turns the N
// float4s each thread holds (get(f, e) / set(f, e, x), f < N, e < 4) into
// the sums of all slices. False in every other block: it is done. The
// workspace is partials[tile][slice][f][thread] in float4s (slice <
// gridDim.y), float4 f of every thread together, so each warp's store or
// load is 512 contiguous bytes.
template <int SPLIT_K, int N, int T, typename Get, typename Set>
__device__ __forceinline__ bool splitk_reduce(float* partials, int* counters, Get get, Set set) {
    const int slices = gridDim.y;
    Pack<float, 4>* part = reinterpret_cast<Pack<float, 4>*>(partials) + (i64)blockIdx.x * slices * N * T + threadIdx.x;
#pragma unroll
    for (int f = 0; f < N; ++f) {
        Pack<float, 4> p;
#pragma unroll
        for (int e = 0; e < 4; ++e) p.v[e] = get(f, e);
        part[((i64)blockIdx.y * N + f) * T] = p;
    }
    if (!splitk_arrive_last(counters + blockIdx.x, slices)) return false;
    constexpr int G = splitk_batch(SPLIT_K);
#pragma unroll
    for (int f0 = 0; f0 < N; f0 += G) {
        float v[G][4];
#pragma unroll
        for (int g = 0; g < G && f0 + g < N; ++g)
#pragma unroll
            for (int e = 0; e < 4; ++e) v[g][e] = get(f0 + g, e);
        splitk_sum<SPLIT_K, G>(v, part + (i64)f0 * T, T, (i64)N * T, slices, N - f0);
#pragma unroll
        for (int g = 0; g < G && f0 + g < N; ++g)
#pragma unroll
            for (int e = 0; e < 4; ++e) set(f0 + g, e, v[g][e]);
    }
    return true;
}

#endif  // KERNELS_CUDA_SPLITK_CUH
