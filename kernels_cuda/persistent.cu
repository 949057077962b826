// The persistent training kernel: many SGD steps of the MLP IN -> H x LAYERS -> OUT in one launch,
// the CUDA twin of kernels_triton/persistent.py (its module docstring has the why; the flat
// parameter layout and the residency rule are kernels_core/persistent.py's).
// Build alone, no GPU needed (registers and spills of the default config at the default protocol's
// 784-128-128-10, batch 128, fp32 and fp16):
//   nvcc -cubin -arch=sm_90 -std=c++17 -DSTANDALONE --resource-usage -o /dev/null kernels_cuda/persistent.cu
//
// One block a multiprocessor (or PROGRAMS) walks each step's phases, a grid barrier
// (grid_barrier.cuh) after each: 2 * LAYERS + 2 barriers a step.
//   forward  l = 0 .. LAYERS-1: A_{l+1} = relu(A_l @ W_l + b_l) (A_0 = x[batches[s]]) in BM x BN
//            output tiles; reads A_l (x in place for l = 0), W_l, b_l; writes A_{l+1} (acts).
//   loss     blocks of BL rows: logits = A_L @ W_L + b_L, D_L = (softmax - onehot(y)) / M into
//            grads' last M x OUT, the block's summed loss into slots[block].
//   backward l = LAYERS .. 0: a block owns BR rows of W_l (every step the same rows) and walks
//            their columns BC at a time: dx = D_l @ W_l^T for those rows (A_l's columns), then SGD
//            on them with a^T D_l (fused.cuh's sgd_step, the rule of optim.cu); the owner of row
//            block 0 also updates b_l with D_l's column sums. Reading the rows for dx before
//            updating them needs no barrier: no other block touches them in this phase. Last,
//            D_{l-1} = dx * (A_l > 0) (not for l = 0: x needs no gradient).
// After the loss barrier block 0 sums the slots in slot order (the same bits every run) into
// losses[s]. The step's slot s is (*pos + i) % epoch_steps; block 0 writes *pos + steps at the end
// (every block read *pos before its first arrival).
//
// Rounding, the fused step's and the Triton twin's: fp32 master weights; with 16-bit T the
// products read the weights rounded to T, activations, gradients and logits are stored in T, and
// every sum accumulates in fp32. Products are FMAs on the CUDA cores; a product of two 16-bit
// values is exact in fp32, as on the tensor cores, so only the order of the sums differs. fp32
// products are IEEE (no TF32).
//
// What one block writes and another reads later in the launch (activations, gradients, weights
// and biases outside the backward's own rows, the loss slots) is loaded with ld.global.cg: L2,
// never a line this multiprocessor's L1 kept from before the writer's store. The barrier orders
// the phases. A block's own rows of W and their momentum buffers, and the bias of its owner, are
// read and written by that block alone, and x, y and batches by no one: plain loads.
//
// Shared memory (dynamic, the largest phase's; kernels_cuda/persistent.py's smem_bytes mirrors
// PersistentSmem, held to it by static_asserts in tests/test_persistent_cuda.py's build): the
// forward and loss products stage a BM x BK tile of a (rows padded by one float, so the
// k-contiguous stores spread over the banks) and a BK x BN tile of W; the backward holds a's
// M x BR columns, D's M x BC chunk and W's BR x BC chunk (rows padded: dx reads it across rows).
#include "dtypes.cuh"
#include "fused.cuh"
#include "grid_barrier.cuh"
#include "ptx.cuh"

__host__ __device__ constexpr int cdiv_c(int a, int b) { return (a + b - 1) / b; }

__host__ __device__ constexpr int max_c(int a, int b) { return a > b ? a : b; }

// Floats of shared memory a phase uses; the host sizes the launch with its mirror.
template <int M, int OUT, int BM, int BN, int BK, int BR, int BC, int BL>
struct PersistentSmem {
    static constexpr int FORWARD = BM * (BK + 1) + BK * BN;
    static constexpr int LOSS = BL * (BK + 1) + BK * OUT + BL * OUT + BL;
    static constexpr int BACKWARD = M * BR + M * BC + BR * (BC + 1);
    static constexpr int FLOATS = max_c(FORWARD, max_c(LOSS, BACKWARD));
};

// Shared memory's copy of SIZE elements, element e = i * THREADS + tid of each thread: load(e) for
// all of them, then store(e, value) for all, so that a thread's loads are in flight together (the
// .cg loads are volatile asm, which the compiler keeps in program order).
template <int SIZE, int THREADS, typename Load, typename Store>
__device__ __forceinline__ void stage(Load load, Store store) {
    constexpr int EACH = cdiv_c(SIZE, THREADS);
    float v[EACH];
#pragma unroll
    for (int i = 0; i < EACH; ++i) {
        const int e = i * THREADS + threadIdx.x;
        v[i] = e < SIZE ? load(e) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < EACH; ++i) {
        const int e = i * THREADS + threadIdx.x;
        if (e < SIZE) store(e, v[i]);
    }
}

// Another block wrote it during this launch: through L2 (ptx.cuh's ldcg1).
template <int DT>
__device__ __forceinline__ float load_cg(const EltT<DT>* p) {
    return Elt<DT>::load(ldcg1(p));
}

// An fp32 weight as the products read it: rounded to the activations' dtype.
template <int DT>
__device__ __forceinline__ float as_operand(float w) {
    return Elt<DT>::load(Elt<DT>::store(w));
}

// Element k of the batch's row m of a (M x K): x[rows[m]] in place (GATHER: the dataset, which
// nothing writes) or a scratch activation (written by other blocks).
template <int DT, int K, bool GATHER>
__device__ __forceinline__ float a_elem(const EltT<DT>* a, const i64* rows, int m, int k) {
    if constexpr (GATHER)
        return Elt<DT>::load(a[rows[m] * K + k]);
    else
        return load_cg<DT>(a + (i64)m * K + k);
}

// acc[i] = sum over k of a[m0 + m, k] * w[k, n0 + n] for the outputs idx = i * THREADS + tid of
// the BMT x BNT tile (m = idx / BNT, n = idx % BNT), k in order; rows and columns past M and N
// (and k past K) read zeros.
template <int DT, int M, int K, int N, int BMT, int BNT, int BK, int THREADS, bool GATHER>
__device__ __forceinline__ void tile_product(const EltT<DT>* a, const i64* rows, const float* w, int m0, int n0,
                                             float (&acc)[cdiv_c(BMT * BNT, THREADS)], float* smem) {
    constexpr int OUTS = cdiv_c(BMT * BNT, THREADS), LDA = BK + 1;
    float* as = smem;
    float* ws = smem + BMT * LDA;
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < OUTS; ++i) acc[i] = 0.f;
    for (int k0 = 0; k0 < K; k0 += BK) {
        __syncthreads();  // the last tile's (or phase's) reads of the shared tiles are done
        stage<BMT * BK, THREADS>(
            [&](int e) {
                const int m = e / BK, k = e % BK;
                return m0 + m < M && k0 + k < K ? a_elem<DT, K, GATHER>(a, rows, m0 + m, k0 + k) : 0.f;
            },
            [&](int e, float v) { as[(e / BK) * LDA + e % BK] = v; });
        stage<BK * BNT, THREADS>(
            [&](int e) {
                const int k = e / BNT, n = e % BNT;
                return k0 + k < K && n0 + n < N ? as_operand<DT>(ldcg1(w + (i64)(k0 + k) * N + n0 + n)) : 0.f;
            },
            [&](int e, float v) { ws[e] = v; });
        __syncthreads();
#pragma unroll 4
        for (int k = 0; k < BK; ++k) {
#pragma unroll
            for (int i = 0; i < OUTS; ++i) {
                const int idx = i * THREADS + tid;
                if (idx < BMT * BNT)
                    acc[i] = fmaf(as[(idx / BNT) * LDA + k], ws[k * BNT + idx % BNT], acc[i]);
            }
        }
    }
}

// out = relu(a @ w + b), a (M x K), w (K x N), out (M x N) in T.
template <int DT, int M, int K, int N, int BM, int BN, int BK, int THREADS, bool GATHER>
__device__ __forceinline__ void forward(const EltT<DT>* a, const i64* rows, const float* w, const float* b,
                                        EltT<DT>* out, float* smem) {
    constexpr int OUTS = cdiv_c(BM * BN, THREADS), TILES_N = cdiv_c(N, BN);
    for (int t = blockIdx.x; t < cdiv_c(M, BM) * TILES_N; t += gridDim.x) {
        const int m0 = (t / TILES_N) * BM, n0 = (t % TILES_N) * BN;
        float acc[OUTS];
        tile_product<DT, M, K, N, BM, BN, BK, THREADS, GATHER>(a, rows, w, m0, n0, acc, smem);
#pragma unroll
        for (int i = 0; i < OUTS; ++i) {
            const int idx = i * THREADS + threadIdx.x, m = m0 + idx / BN, n = n0 + idx % BN;
            if (idx < BM * BN && m < M && n < N)
                out[m * N + n] = Elt<DT>::store(relu_f(acc[i] + ldcg1(b + n)));
        }
    }
}

// logits = a @ w + b (a M x K, w K x N), rounded to T; d = (softmax - onehot(y[rows])) / M in T;
// each block of BL rows' summed loss into slots[block], its rows' losses added in row order.
template <int DT, int M, int K, int N, int BL, int BK, int THREADS>
__device__ __forceinline__ void loss(const EltT<DT>* a, const i64* rows, const float* w, const float* b,
                                     const i64* y, EltT<DT>* d, float* slots, float inv_m, float* smem) {
    constexpr int OUTS = cdiv_c(BL * N, THREADS);
    float* logits = smem + BL * (BK + 1) + BK * N;  // past tile_product's tiles
    float* row_loss = logits + BL * N;
    for (int t = blockIdx.x; t < cdiv_c(M, BL); t += gridDim.x) {
        const int m0 = t * BL;
        float acc[OUTS];
        tile_product<DT, M, K, N, BL, N, BK, THREADS, false>(a, rows, w, m0, 0, acc, smem);
#pragma unroll
        for (int i = 0; i < OUTS; ++i) {
            const int idx = i * THREADS + threadIdx.x;
            if (idx < BL * N) logits[idx] = Elt<DT>::load(Elt<DT>::store(acc[i] + ldcg1(b + idx % N)));
        }
        __syncthreads();
        for (int r = threadIdx.x; r < BL; r += THREADS) {
            const int m = m0 + r;
            float* z = logits + r * N;
            float top = neg_inf(), total = 0.f, picked = 0.f;
            for (int n = 0; n < N; ++n) top = fmaxf(top, z[n]);
            for (int n = 0; n < N; ++n) total += expf(z[n] - top);
            if (m < M) {
                const i64 label = y[rows[m]];
                for (int n = 0; n < N; ++n) picked = n == label ? z[n] : picked;  // a label past N picks nothing
                row_loss[r] = top + logf(total) - picked;
                for (int n = 0; n < N; ++n)
                    d[m * N + n] = Elt<DT>::store((expf(z[n] - top) / total - (n == label ? 1.f : 0.f)) * inv_m);
            } else {
                row_loss[r] = 0.f;
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float sum = 0.f;
            for (int r = 0; r < BL; ++r) sum += row_loss[r];
            slots[t] = sum;
        }
    }
}

// For the layer a (M x K) -> (M x N) with weights w (K x N) and output gradient d (M x N): DX,
// dx = (d @ w^T) * (a > 0); then SGD on w with a^T d and (the owner of row block 0) on b with d's
// column sums. A block owns BR rows of w and reads each BC columns of them for dx before it
// updates them.
template <int DT, int M, int K, int N, int BR, int BC, int THREADS, bool GATHER, bool DX, int HAS_MOMENTUM,
          int HAS_WEIGHT_DECAY>
__device__ __forceinline__ void backward(const EltT<DT>* a, const i64* rows, const EltT<DT>* d, float* w,
                                         float* b, float* w_buf, float* b_buf, EltT<DT>* dx, float lr,
                                         float momentum, float weight_decay, float* smem) {
    constexpr int DXS = DX ? cdiv_c(M * BR, THREADS) : 0, GS = cdiv_c(BR * BC, THREADS), LDW = BC + 1;
    float* as = smem;             // M x BR: a's columns of the owned rows
    float* ds = as + M * BR;      // M x BC: d's chunk
    float* ws = ds + M * BC;      // BR x LDW: the owned rows' chunk, rounded to T
    const int tid = threadIdx.x;
    const float wd = HAS_WEIGHT_DECAY ? weight_decay : 0.f;  // a constant 0 compiles sgd_step's term away
    for (int t = blockIdx.x; t < cdiv_c(K, BR); t += gridDim.x) {
        const int r0 = t * BR;
        __syncthreads();  // the last rows' (or phase's) reads of the shared tiles are done
        stage<M * BR, THREADS>(
            [&](int e) { return r0 + e % BR < K ? a_elem<DT, K, GATHER>(a, rows, e / BR, r0 + e % BR) : 0.f; },
            [&](int e, float v) { as[e] = v; });
        float acc[DXS > 0 ? DXS : 1];
#pragma unroll
        for (int i = 0; i < DXS; ++i) acc[i] = 0.f;
        for (int c0 = 0; c0 < N; c0 += BC) {
            __syncthreads();  // the last chunk's reads are done
            stage<M * BC, THREADS>(
                [&](int e) { return c0 + e % BC < N ? load_cg<DT>(d + (e / BC) * N + c0 + e % BC) : 0.f; },
                [&](int e, float v) { ds[e] = v; });
            stage<BR * BC, THREADS>(
                [&](int e) {
                    const int r = e / BC, c = e % BC;
                    return r0 + r < K && c0 + c < N ? as_operand<DT>(w[(i64)(r0 + r) * N + c0 + c]) : 0.f;
                },
                [&](int e, float v) { ws[(e / BC) * LDW + e % BC] = v; });
            __syncthreads();
#pragma unroll
            for (int i = 0; i < DXS; ++i) {
                const int idx = i * THREADS + tid, m = idx / BR, r = idx % BR;
                if (idx < M * BR) {
#pragma unroll
                    for (int c = 0; c < BC; ++c) acc[i] = fmaf(ds[m * BC + c], ws[r * LDW + c], acc[i]);
                }
            }
#pragma unroll
            for (int i = 0; i < GS; ++i) {
                const int idx = i * THREADS + tid, r = idx / BC, c = idx % BC;
                if (idx < BR * BC && r0 + r < K && c0 + c < N) {
                    float g[1] = {0.f};
#pragma unroll 4
                    for (int m = 0; m < M; ++m) g[0] = fmaf(as[m * BR + r], ds[m * BC + c], g[0]);
                    const i64 at = (i64)(r0 + r) * N + c0 + c;
                    sgd_step<DT, 1>(w + at, {HAS_MOMENTUM ? w_buf + at : nullptr, nullptr, lr, momentum, wd}, g, 1,
                                    false);
                }
            }
            if (t == 0) {
                for (int c = tid; c < BC && c0 + c < N; c += THREADS) {
                    float g[1] = {0.f};
                    for (int m = 0; m < M; ++m) g[0] += ds[m * BC + c];
                    sgd_step<DT, 1>(b + c0 + c, {HAS_MOMENTUM ? b_buf + c0 + c : nullptr, nullptr, lr, momentum, wd},
                                    g, 1, false);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < DXS; ++i) {
            const int idx = i * THREADS + tid, m = idx / BR, r = idx % BR;
            if (idx < M * BR && r0 + r < K)
                dx[m * K + r0 + r] = Elt<DT>::store(as[idx] > 0.f ? acc[i] : 0.f);
        }
    }
}

// `steps` steps from the epoch's slot *pos on (wrapping at epoch_steps), then *pos += steps. x is
// (images, IN) in T; y the images' int64 labels; batches (epoch_steps, M) int64 rows of x; params
// and bufs flat fp32 (W_0, b_0, W_1, b_1, ...; bufs untouched without momentum); acts LAYERS x M x H
// and grads LAYERS x M x H + M x OUT of T; slots cdiv(M, BL) fp32; counter zeroed by the host.
template <int DT, int LAYERS, int IN, int H, int OUT, int M, int BM, int BN, int BK, int BR, int BC, int BL,
          int THREADS, int HAS_MOMENTUM, int HAS_WEIGHT_DECAY>
__global__ void __launch_bounds__(THREADS, 1)
train_steps(const EltT<DT>* x, const i64* y, const i64* batches, float* params, float* bufs, EltT<DT>* acts,
            EltT<DT>* grads, float* slots, float* losses, u32* counter, i64* pos, int steps, int epoch_steps,
            float lr, float momentum, float weight_decay, float inv_m) {
    extern __shared__ __align__(16) float smem[];
    constexpr int HIDDEN = H * H + H;            // W_l and b_l of a hidden layer
    constexpr int W_LAST = IN * H + H + (LAYERS - 1) * HIDDEN, B_LAST = W_LAST + H * OUT;
    constexpr int MH = M * H;
    EltT<DT>* const d_last = grads + LAYERS * MH;
    const i64 first = *pos;
    u32 arrivals = 0;
    for (int step = 0; step < steps; ++step) {
        const i64 s = (first + step) % epoch_steps;
        const i64* rows = batches + s * M;
        forward<DT, M, IN, H, BM, BN, BK, THREADS, true>(x, rows, params, params + IN * H, acts, smem);
        grid_barrier(counter, arrivals += gridDim.x);
        for (int l = 1; l < LAYERS; ++l) {
            const int at = IN * H + H + (l - 1) * HIDDEN;
            forward<DT, M, H, H, BM, BN, BK, THREADS, false>(acts + (l - 1) * MH, rows, params + at,
                                                             params + at + H * H, acts + l * MH, smem);
            grid_barrier(counter, arrivals += gridDim.x);
        }
        loss<DT, M, H, OUT, BL, BK, THREADS>(acts + (LAYERS - 1) * MH, rows, params + W_LAST, params + B_LAST, y,
                                             d_last, slots, inv_m, smem);
        grid_barrier(counter, arrivals += gridDim.x);
        if (blockIdx.x == 0 && threadIdx.x == 0) {  // the step's loss: the row blocks' sums in slot order
            float total = 0.f;
            for (int i = 0; i < cdiv_c(M, BL); ++i) total += ldcg1(slots + i);
            losses[s] = total * inv_m;
        }
        backward<DT, M, H, OUT, BR, BC, THREADS, false, true, HAS_MOMENTUM, HAS_WEIGHT_DECAY>(
            acts + (LAYERS - 1) * MH, rows, d_last, params + W_LAST, params + B_LAST, bufs + W_LAST, bufs + B_LAST,
            grads + (LAYERS - 1) * MH, lr, momentum, weight_decay, smem);
        grid_barrier(counter, arrivals += gridDim.x);
        for (int l = LAYERS - 1; l >= 1; --l) {  // hidden layers, last first: W_l (H x H) between A_l and A_{l+1}
            const int at = IN * H + H + (l - 1) * HIDDEN;
            backward<DT, M, H, H, BR, BC, THREADS, false, true, HAS_MOMENTUM, HAS_WEIGHT_DECAY>(
                acts + (l - 1) * MH, rows, grads + l * MH, params + at, params + at + H * H, bufs + at,
                bufs + at + H * H, grads + (l - 1) * MH, lr, momentum, weight_decay, smem);
            grid_barrier(counter, arrivals += gridDim.x);
        }
        backward<DT, M, IN, H, BR, BC, THREADS, true, false, HAS_MOMENTUM, HAS_WEIGHT_DECAY>(
            x, rows, grads, params, params + IN * H, bufs, bufs + IN * H, nullptr, lr, momentum, weight_decay,
            smem);
        grid_barrier(counter, arrivals += gridDim.x);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) *pos = first + steps;
}

#ifdef STANDALONE
// The default config (kernels_cuda/persistent.py: CUDA_DEFAULT) at the default protocol's shape, with
// momentum, instantiated for the build line at the top.
void* const standalone_kernels[] = {
    (void*)&train_steps<DT_FP32, 2, 784, 128, 10, 128, 32, 32, 32, 16, 16, 16, 256, 1, 0>,
    (void*)&train_steps<DT_FP16, 2, 784, 128, 10, 128, 32, 32, 32, 16, 16, 16, 256, 1, 0>,
};
#endif
