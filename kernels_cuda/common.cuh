// Shared device helpers for every kernel of kernels_cuda.
//
// The same text is compiled by NVRTC at run time (CuPy, where the Python side
// pastes it in front of each kernel source) and by nvcc offline (resource
// reports). NVRTC ships no C library headers by default and cuda_fp16.h /
// cuda_bf16.h are not guaranteed to be found, so this file includes nothing:
// half and bfloat16 values travel as raw 16-bit patterns and are converted
// with PTX (fp16) or bit arithmetic (bf16).
#ifndef KERNELS_CUDA_COMMON_CUH
#define KERNELS_CUDA_COMMON_CUH

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// Element type codes, the first template argument of every kernel; the Python
// side reads them from here (kernels_cuda/_runtime.py: DT_CODE).
#define DT_FP32 0
#define DT_FP16 1
#define DT_BF16 2

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// bf16 is the top half of an fp32, so widening is a shift.
__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round to nearest even by hand: cvt.rn.bf16.f32 needs sm_80 and these
// kernels also build for sm_75. A NaN keeps its sign and gets the quiet bit
// so truncation cannot turn it into an infinity.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}

// Storage type and conversions of one element type.
template <int DT> struct Elt;
template <> struct Elt<DT_FP32> {
    typedef float T;
    static __device__ __forceinline__ float load(T v) { return v; }
    static __device__ __forceinline__ T store(float v) { return v; }
};
template <> struct Elt<DT_FP16> {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) { return f16_to_f32(v); }
    static __device__ __forceinline__ T store(float v) { return f32_to_f16(v); }
};
template <> struct Elt<DT_BF16> {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ T store(float v) { return f32_to_bf16(v); }
};

// N elements moved by one (or, past 16 bytes, a few) vector instructions.
// The host only picks N when the pointer is aligned to min(N * sizeof(T), 16).
template <typename T, int N>
struct alignas((sizeof(T) * N) < 16 ? (sizeof(T) * N) : 16) Pack {
    T v[N];
};

// torch.relu semantics: negative -> 0, NaN stays NaN (fmaxf would drop it).
__device__ __forceinline__ float relu_f(float v) { return v < 0.f ? 0.f : v; }

// 32-bit shared-memory address for PTX instructions that take one.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// Block order with GROUP_M row panels: consecutive blocks walk down a panel of
// GROUP_M tile rows before moving right, so the B tiles they share stay in
// L2 (same mapping as the Triton matmul tutorial).
template <int GROUP_M>
__device__ __forceinline__ void swizzle_block(int pid, int num_pid_m, int num_pid_n, int& pid_m, int& pid_n) {
    int in_group = GROUP_M * num_pid_n;
    int first_m = (pid / in_group) * GROUP_M;
    int group_m = num_pid_m - first_m < GROUP_M ? num_pid_m - first_m : GROUP_M;
    pid_m = first_m + (pid % in_group) % group_m;
    pid_n = (pid % in_group) / group_m;
}

// ---------------------------------------------------------------- split-K
// A split-K matmul (matmul_simt.cu, matmul_tc.cu, SPLIT_K > 1) cuts K into
// slices of k_slice elements, a multiple of BK (the host computes it:
// kernels_core/workspace.py, splitk_slices), so only the last slice meets K's ragged end,
// which the operand loads already zero-fill. The grid is tiles x slices:
// blockIdx.x is the tile, blockIdx.y the slice, and only slices with work
// are launched (gridDim.y <= SPLIT_K). Each block writes its fp32 partial
// tile to the workspace (kernels_core/workspace.py) and arrives at its
// tile's counter; the block that arrives last sums the partials in slice
// order 0, 1, ... (so the bits never depend on who came last), applies the
// epilogue once and puts the counter back to 0 for the next launch.

// Moves A, B and K to this block's slice: k from blockIdx.y * k_slice, K its
// length, so the main loop runs unchanged on a shorter K and its loads
// zero-fill exactly past the slice's end.
template <int A_KC, int B_KC, typename T>
__device__ __forceinline__ void enter_slice(const T*& A, const T*& B, int& K, i64 lda, i64 ldb, int k_slice) {
    const int k0 = (int)blockIdx.y * k_slice;
    A += A_KC ? (i64)k0 : k0 * lda;  // op(A) is M x K: k runs along A's rows or its columns
    B += B_KC ? (i64)k0 : k0 * ldb;  // op(B) is K x N
    K = K - k0 < k_slice ? K - k0 : k_slice;
}

// 16 bytes from global memory through L2 only (ld.global.cg): another SM
// wrote them during this launch, so a line this SM's L1 might hold for the
// address (from an earlier launch that used the same workspace) is stale.
__device__ __forceinline__ Pack<float, 4> ldcg4(const Pack<float, 4>* p) {
    Pack<float, 4> r;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(r.v[0]), "=f"(r.v[1]), "=f"(r.v[2]), "=f"(r.v[3]) : "l"(p));
    return r;
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
// slices have at p + g * g_stride + s * slice_stride. Every load of the batch
// is issued before the first add, so the batch costs one trip to L2, not one
// per slice; the adds then go in slice order 0, 1, ... whoever arrived last,
// so the result's bits are always the same. Slot t of x holds slice t below
// the own one and slice t + 1 above it: SPLIT_K - 1 slots, indexed by
// constants (a run-time index would put x in local memory).
template <int SPLIT_K, int G>
__device__ __forceinline__ void splitk_sum(float (&v)[G][4], const Pack<float, 4>* p, i64 g_stride, i64 slice_stride,
                                           int slices, int count) {
    const int own = blockIdx.y;
    Pack<float, 4> x[G][SPLIT_K - 1];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int t = 0; t < SPLIT_K - 1; ++t) {
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
            for (int t = 0; t < SPLIT_K - 1; ++t) {
                if (t == own) sum += v[g][j];
                if ((t < own ? t : t + 1) < slices) sum += x[g][t].v[j];
            }
            if (own == SPLIT_K - 1) sum += v[g][j];
            v[g][j] = sum;
        }
    }
}

// float4s per splitk_sum batch: G * (SPLIT_K - 1) loads in flight, at most 16
// (64 registers) whatever SPLIT_K is.
__host__ __device__ constexpr int splitk_batch(int split_k) { return 16 / (split_k - 1); }

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

// Flat work split of the elementwise kernels (elementwise.cu, optim.cu): the
// tensor is n / VEC vectors; block b owns vectors [b * THREADS * ITEMS, +THREADS * ITEMS)
// and thread t takes vector b * THREADS * ITEMS + i * THREADS + t for i < ITEMS,
// so each i is one fully coalesced sweep of the block. The n % VEC tail
// elements go one by one to the first threads of block 0.
// Vector index of item i of this thread.
template <int ITEMS, int THREADS>
__device__ __forceinline__ i64 vector_index(int i) {
    return (i64)blockIdx.x * (THREADS * ITEMS) + (i64)i * THREADS + threadIdx.x;
}

// Index of this thread's tail element (valid when < n).
template <int VEC>
__device__ __forceinline__ i64 tail_index(i64 n) {
    return blockIdx.x == 0 ? (n / VEC) * VEC + threadIdx.x : n;
}

#endif  // KERNELS_CUDA_COMMON_CUH
