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

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// torch.relu semantics: negative -> 0, NaN stays NaN (fmaxf would drop it).
__device__ __forceinline__ float relu_f(float v) { return v < 0.f ? 0.f : v; }

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

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// A compile-time flag passed as a value, for generic lambdas (NVRTC has no <type_traits>).
template <bool B> struct Flag { static constexpr bool value = B; };

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
// (SPLIT_K = 64: four trips), in a loop of its own: one loop over batches for
// both cases made ptxas interleave a single batch's loads with its adds (three
// trips where there was one) and take 10 registers more, which cost 18-42% on
// the fp32 split-K products at K = 784 (experiments/FINDINGS.md, "Split-K").
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

// ---------------------------------------------------------------- fused paths
// What both matmul kernels (matmul_simt.cu, matmul_tc.cu) can fold into a GEMM besides bias and
// ReLU: rows of A read through an index vector (A_ROWS) and one epilogue per EPI code. Each is a
// template argument, so a kernel without them compiles none of their code.

// The EPI codes, the last template argument of both matmul kernels; the Python side reads them
// from here (kernels_cuda/_runtime.py: EPI_CODE).
// EPI_PLAIN: C = act(acc + bias). EPI_RELU_GRAD: C = y <= 0 ? 0 : acc (matmul's relu_grad_of).
// EPI_XENT: linear_cross_entropy (xent_tile). EPI_SGD: linear_sgd (sgd_step, sgd_bias).
#define EPI_PLAIN 0
#define EPI_RELU_GRAD 1
#define EPI_XENT 2
#define EPI_SGD 3

// Both kernels' parameters after the GEMM's own (a variant reads those its flags use; the host
// passes them all, in this order: kernels_cuda/matmul.py, KERNEL_PARAMS).
#define FUSED_PARAMS(T)                                                                              \
    const i64 *a_rows, i64 rows_of_a, const T *relu_y, const i64 *labels, const i64 *label_rows,    \
        i64 n_labels, float *loss, i64 *flag, float *loss_slots, int *loss_counter, float *w,        \
        float *w_buf, T *w_low, float *b, float *b_buf, T *b_low, float lr, float momentum,         \
        float weight_decay

// Entry r of an index vector of `count` entries (matmul's a_rows) as the stored row to read, or
// -1 for a row of zeros: past the vector's end (the tile's ragged edge), or an index outside
// [0, stored), which the contract reads as zeros since a kernel cannot raise.
__device__ __forceinline__ i64 gathered_row(const i64* rows, int r, int count, i64 stored) {
    if (r >= count) return -1;
    const i64 s = rows[r];
    return s >= 0 && s < stored ? s : -1;
}

// linear_cross_entropy's epilogue, in the block that holds rows [m0, m0 + BM) of the logits with
// all N of their columns (the host asks for BLOCK_N >= N, so n0 = 0 and pid_m is the row tile).
// The GEMM's epilogue has stored the logits (+ bias, rounded to the dtype, as matmul stores
// them) to C, the dlogits buffer (ld N). Then one thread per row (rows are few columns wide:
// the trainer's have 10) reads its row back, takes max and logsumexp in fp32, writes
// (softmax - onehot) / M over it and its loss to row_loss (shared memory). A label outside
// [0, N) gives the row a NaN loss, softmax / M and the device's label flag, as loss.cu does.
// The row moves XENT_CHUNK columns at a time through registers, every load of a chunk issued
// before the first is used: a row of N <= XENT_CHUNK costs one trip to L2, where a loop of
// loads one column at a time (three passes of them) made the 32 x 10 x 128 loss GEMM of the
// fp16 seed step 7.1 µs against the plain GEMM's 4.4 (experiments/FINDINGS.md, "Fused step and CUDA graphs").
//
// Each row's label is loaded before the GEMM's main loop (XentLabels: label_rows[m], then
// labels[that], two dependent trips to L2 that the loop's own loads then hide), not after it.
//
// The mean over rows is deterministic: thread 0 sums its tile's rows in row order. One row
// tile writes loss = sum / M itself; more arrive at one counter as split-K's slices do at
// theirs (splitk_arrive_last: release, atomic, acquire), each with its sum in its slot, and
// the last to arrive sums the slots in slot order, writes loss = sum / M and puts the counter
// back to 0. With split-K only the last slice of a tile runs this, so each row tile arrives once.
struct XentArgs {
    const i64* labels;      // [n_labels]
    const i64* label_rows;  // row m's label is labels[label_rows[m]]; labels[m] when null
    i64 n_labels;
    float* loss;            // 0-dim
    i64* flag;              // kernels_core.contract.label_flag
    float* slots;           // one per row tile
    int* counter;           // zero between launches
};

constexpr int XENT_CHUNK = 16;

// The labels of the rows thread t handles in xent_tile (rows t, t + T, ... of the tile), loaded with
// the epilogue's other reads, before the main loop; label 0 for an index outside labels (the contract's zero row) and for rows
// past M, which xent_tile skips.
template <int BM, int T>
struct XentLabels {
    static constexpr int PER = (BM + T - 1) / T;
    i64 v[PER];

    __device__ __forceinline__ void load(const XentArgs& x, int m0, int M) {
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int r = threadIdx.x + p * T, m = m0 + r;
            v[p] = 0;
            if ((BM % T != 0 && r >= BM) || m >= M) continue;
            const i64 at = x.label_rows ? x.label_rows[m] : m;
            if (at >= 0 && at < x.n_labels) v[p] = x.labels[at];
        }
    }
};

// Columns j0 .. j0 + XENT_CHUNK - 1 of row z into v, -inf past column N - 1 (it never wins a max).
template <int DT>
__device__ __forceinline__ void xent_chunk(float (&v)[XENT_CHUNK], const typename Elt<DT>::T* z, int j0, int N) {
#pragma unroll
    for (int j = 0; j < XENT_CHUNK; ++j) v[j] = j0 + j < N ? Elt<DT>::load(z[j0 + j]) : neg_inf();
}

template <int DT, int BM, int T>
__device__ __forceinline__ void xent_tile(typename Elt<DT>::T* C, int M, int N, int m0, int pid_m, const XentArgs& x,
                                          const XentLabels<BM, T>& labels, float* row_loss) {
    typedef Elt<DT> E;
    // Orders every thread's stores of the tile's logits before the reads below, and every
    // warp's last reads of the shared operand tiles before row_loss reuses that memory.
    __syncthreads();
    const float inv_rows = 1.f / (float)M;
    const bool one_chunk = N <= XENT_CHUNK;  // then v holds the whole row from the first pass on
#pragma unroll
    for (int p = 0; p < XentLabels<BM, T>::PER; ++p) {
        const int r = threadIdx.x + p * T, m = m0 + r;
        if ((BM % T != 0 && r >= BM) || m >= M) break;
        typename E::T* z = C + (i64)m * N;
        const i64 label = labels.v[p];
        const bool valid = label >= 0 && label < N;
        float v[XENT_CHUNK];
        float mx = neg_inf();
        for (int j0 = 0; j0 < N; j0 += XENT_CHUNK) {
            xent_chunk<DT>(v, z, j0, N);
#pragma unroll
            for (int j = 0; j < XENT_CHUNK; ++j) mx = fmaxf(mx, v[j]);
        }
        // A logit equal to the max counts 1 rather than exp(inf - inf) = NaN (loss.cu's
        // lse_merge does the same); a NaN logit still makes s NaN (fmaxf skipped it above).
        float s = 0.f, z_label = 0.f;
        for (int j0 = 0; j0 < N; j0 += XENT_CHUNK) {
            if (!one_chunk) xent_chunk<DT>(v, z, j0, N);
#pragma unroll
            for (int j = 0; j < XENT_CHUNK; ++j) {
                if (j0 + j >= N) break;
                s += v[j] == mx ? 1.f : expf(v[j] - mx);
                if (j0 + j == label) z_label = v[j];
            }
        }
        row_loss[r] = valid ? mx + logf(s) - z_label : quiet_nan();
        const float inv_s = 1.f / s;
        for (int j0 = 0; j0 < N; j0 += XENT_CHUNK) {
            if (!one_chunk) xent_chunk<DT>(v, z, j0, N);
#pragma unroll
            for (int j = 0; j < XENT_CHUNK; ++j) {
                if (j0 + j >= N) break;
                const float g = expf(v[j] - mx) * inv_s - (j0 + j == label ? 1.f : 0.f);
                z[j0 + j] = E::store(g * inv_rows);
            }
        }
        if (!valid) {  // racing rows all write a bad label and the same N
            x.flag[0] = 1;
            x.flag[1] = label;
            x.flag[2] = N;
        }
    }
    __syncthreads();
    const int tiles = (M + BM - 1) / BM;
    if (threadIdx.x == 0) {
        const int rows = M - m0 < BM ? M - m0 : BM;
        float sum = 0.f;
        for (int r = 0; r < rows; ++r) sum += row_loss[r];
        if (tiles == 1)
            *x.loss = sum / (float)M;  // the bits of the protocol below with one slot: 0 + sum is sum
        else
            x.slots[pid_m] = sum;
    }
    if (tiles == 1 || !splitk_arrive_last(x.counter, tiles)) return;
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int t = 0; t < tiles; ++t) sum += ldcg1(x.slots + t);
        *x.loss = sum / (float)M;
    }
}

// linear_sgd: torch.optim.SGD's rule (dampening 0, no Nesterov) on float32 params p in place,
// from fp32 gradients g, written with optim.cu's sgd_kernel's expressions so that it compiles
// to the same fused multiply-adds and gives the same bits from the same gradient:
//   d = g + wd * p;  buf = momentum * buf + d, d = buf (when buf, i.e. momentum != 0);  p -= lr * d
// and low (the dtype's copy, optional) = p rounded. `count` of the CNT elements exist; `vec`
// (every pointer aligned to CNT elements) lets a whole group move as one vector.
template <typename T>
struct SgdArgs {
    float* buf;
    T* low;
    float lr, momentum, weight_decay;
};

// p and buf of CNT elements, read apart from the update (sgd_load, then sgd_apply) so that an
// epilogue can put a batch of reads in flight before its first store: the stores may alias the
// reads as far as the compiler knows, so it keeps every read after the stores written before it.
template <int CNT>
struct SgdIn {
    Pack<float, CNT> p, buf;
};

template <int DT, int CNT>
__device__ __forceinline__ SgdIn<CNT> sgd_load(const float* p, const SgdArgs<typename Elt<DT>::T>& s, int count,
                                               bool vec) {
    typedef Pack<float, CNT> PF;
    SgdIn<CNT> in;
    if (vec && count >= CNT) {
        in.p = *reinterpret_cast<const PF*>(p);
        if (s.buf) in.buf = *reinterpret_cast<const PF*>(s.buf);
    } else {
#pragma unroll
        for (int j = 0; j < CNT; ++j) {
            in.p.v[j] = j < count ? p[j] : 0.f;
            in.buf.v[j] = s.buf && j < count ? s.buf[j] : 0.f;
        }
    }
    return in;
}

template <int DT, int CNT>
__device__ __forceinline__ void sgd_apply(float* p, const SgdArgs<typename Elt<DT>::T>& s, const float (&g)[CNT],
                                          SgdIn<CNT> in, int count, bool vec) {
    typedef Elt<DT> E;
    typedef Pack<float, CNT> PF;
    typedef Pack<typename E::T, CNT> PL;
    PF& pp = in.p;
    PF& bb = in.buf;
    PL ll;
#pragma unroll
    for (int j = 0; j < CNT; ++j) {
        float d = g[j];
        // Skipped, not multiplied by 0, when off: 0 * inf would turn an inf param into NaN.
        if (s.weight_decay != 0.f) d += s.weight_decay * pp.v[j];
        if (s.buf) {
            d = s.momentum * bb.v[j] + d;
            bb.v[j] = d;
        }
        pp.v[j] = pp.v[j] - s.lr * d;
        ll.v[j] = E::store(pp.v[j]);
    }
    if (vec && count >= CNT) {
        *reinterpret_cast<PF*>(p) = pp;
        if (s.buf) *reinterpret_cast<PF*>(s.buf) = bb;
        if (s.low) *reinterpret_cast<PL*>(s.low) = ll;
    } else {
#pragma unroll
        for (int j = 0; j < CNT; ++j) {
            if (j >= count) break;
            p[j] = pp.v[j];
            if (s.buf) s.buf[j] = bb.v[j];
            if (s.low) s.low[j] = ll.v[j];
        }
    }
}

template <int DT, int CNT>
__device__ __forceinline__ void sgd_step(float* p, const SgdArgs<typename Elt<DT>::T>& s, const float (&g)[CNT],
                                         int count, bool vec) {
    sgd_apply<DT, CNT>(p, s, g, sgd_load<DT, CNT>(p, s, count, vec), count, vec);
}

// The epilogues' operands from memory (the bias, relu_grad_of's y, linear_sgd's w and its
// buffer) are prefetched into L1 before the main loop, once its first copies are queued, so that
// their trips to L2 overlap the loop (experiments/FINDINGS.md, "Tensor-core kernel: small blocks and the one-warp cost"). linear_sgd's epilogue
// reads w and its buffer group by group, each read followed by stores the compiler cannot move it
// past (the pointers may alias, as far as it knows): unprefetched, every group waited for its own
// L2 round trip (on an H200 the fused dW of a 128 x 784 x 128 layer took 13.3 µs against the
// plain GEMM's 7.3, section 13).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// Whether groups of CNT elements starting at multiples of CNT of row-major [., N] arrays p, buf
// and low are aligned for sgd_step's vectors.
template <int DT, int CNT>
__device__ __forceinline__ bool sgd_vec_ok(const float* p, const SgdArgs<typename Elt<DT>::T>& s, int N) {
    constexpr u64 PF_ALIGN = alignof(Pack<float, CNT>), PL_ALIGN = alignof(Pack<typename Elt<DT>::T, CNT>);
    return N % CNT == 0 && reinterpret_cast<u64>(p) % PF_ALIGN == 0 && reinterpret_cast<u64>(s.buf) % PF_ALIGN == 0 &&
           reinterpret_cast<u64>(s.low) % PL_ALIGN == 0;
}

// The bias of linear_sgd, in the blocks of tile row 0: gb[n] = sum over the batch of
// op(B)[k, n] (B = dy, K = the batch), in fp32 in k order (deterministic), then sgd_step on
// bias, b_buf and b_low for columns n0 .. n0 + BN - 1. The sums come from the tiles of dy the
// main loop stages in shared memory anyway (add, once per k step, while the stage is live):
// summed again from global memory after the loop, one thread per column, dy's columns cost the
// one-warp linear_sgd configs two more trips to L2 for K = 32 (SASS: 16-load batches); with the
// sums from the staged tiles and the w lines prefetched, the seed step's linear_sgd calls took
// 0.35-0.73 µs less on the H200 (experiments/FINDINGS.md, "Tensor-core kernel: small blocks and the one-warp cost"). Thread t owns columns
// t, t + T, ...; prefetch sends for their bias lines with the epilogue's other reads.
template <int BN, int T>
struct BiasGrad {
    static constexpr int PER = (BN + T - 1) / T;
    float g[PER];

    __device__ __forceinline__ BiasGrad() {
#pragma unroll
        for (int p = 0; p < PER; ++p) g[p] = 0.f;
    }

    __device__ __forceinline__ void prefetch(const float* bias, const float* buf, int n0, int N) const {
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int n = n0 + threadIdx.x + p * T;
            if ((BN % T != 0 && n - n0 >= BN) || n >= N) break;
            prefetch_l1(bias + n);
            if (buf) prefetch_l1(buf + n);
        }
    }

    // Rows 0 .. ROWS - 1 of one staged k step: at(k, c) is op(B)[k0 + k, n0 + c] as fp32 (the
    // stage's zero fill past K and N adds +0, which changes no sum that starts at +0).
    template <int ROWS, typename At>
    __device__ __forceinline__ void add(At at) {
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int c = threadIdx.x + p * T;
            if (BN % T != 0 && c >= BN) break;
#pragma unroll
            for (int k = 0; k < ROWS; ++k) g[p] += at(k, c);
        }
    }

    template <int DT>
    __device__ __forceinline__ void step(float* bias, int n0, int N, const SgdArgs<typename Elt<DT>::T>& s) const {
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int n = n0 + threadIdx.x + p * T;
            if ((BN % T != 0 && n - n0 >= BN) || n >= N) break;
            const SgdArgs<typename Elt<DT>::T> at = {s.buf ? s.buf + n : nullptr, s.low ? s.low + n : nullptr, s.lr,
                                                     s.momentum, s.weight_decay};
            const float gb[1] = {g[p]};
            sgd_step<DT, 1>(bias + n, at, gb, 1, false);
        }
    }
};

// What a matmul kernel's epilogue reads from memory besides C's tile, sent for once the main
// loop's first operand copies are queued (ahead of them the prefetches delayed the loop's first
// wait: 0.1-0.3 µs on the H200's one-warp GEMMs, experiments/FINDINGS.md, "Tensor-core kernel: small blocks and the one-warp cost"): the loss's
// labels (XentLabels), in linear_sgd's blocks of tile row 0 (bias_step: they update the bias too)
// the bias lines (BiasGrad), and per output the lines of the bias, of relu_grad_of's y, of
// linear_sgd's w and its buffer. The kernels differ only in which outputs a thread holds: each
// hands send() its columns and rows, cols(f) calling f(n) for each and rows(f) f(m).
template <int EPI, int HAS_BIAS, int BM, int BN, int T>
struct EpilogueReads {
    XentLabels<BM, T> xent_labels;
    BiasGrad<BN, T> bias_grad;
    const bool bias_step;

    __device__ __forceinline__ explicit EpilogueReads(int pid_m) : bias_step(EPI == EPI_SGD && pid_m == 0) {}

    template <typename TB, typename TY, typename Cols, typename Rows>
    __device__ __forceinline__ void send(const XentArgs& xent, int m0, int M, int n0, int N, const TB* bias,
                                         const TY* relu_y, const float* w, const float* w_buf, const float* b,
                                         const float* b_buf, Cols cols, Rows rows) {
        if constexpr (EPI == EPI_XENT) xent_labels.load(xent, m0, M);
        if (bias_step) bias_grad.prefetch(b, b_buf, n0, N);
        if constexpr (HAS_BIAS || EPI == EPI_RELU_GRAD || EPI == EPI_SGD)
            cols([&](int n) {
                if (n >= N) return;
                if (HAS_BIAS) prefetch_l1(bias + n);
                if constexpr (EPI == EPI_RELU_GRAD || EPI == EPI_SGD)
                    rows([&](int m) {
                        if (m >= M) return;
                        const i64 at = (i64)m * N + n;
                        if constexpr (EPI == EPI_RELU_GRAD) prefetch_l1(relu_y + at);
                        if constexpr (EPI == EPI_SGD) {
                            prefetch_l1(w + at);
                            if (w_buf) prefetch_l1(w_buf + at);
                        }
                    });
            });
    }
};

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
