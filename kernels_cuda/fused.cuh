// The fused paths of both matmul kernels (matmul_simt.cu, matmul_tc.cu): what they can fold into
// a GEMM besides bias and ReLU. Rows of A read through an index vector (A_ROWS: gathered_row) and
// one epilogue per EPI code: relu_grad_of's mask, linear_cross_entropy's loss (xent_tile),
// linear_sgd's update (sgd_step, BiasGrad), with what each reads from memory sent for before the
// main loop (EpilogueReads). Each is a template argument, so a kernel without them compiles none
// of their code.
#ifndef KERNELS_CUDA_FUSED_CUH
#define KERNELS_CUDA_FUSED_CUH

#include "dtypes.cuh"
#include "ptx.cuh"
#include "splitk.cuh"

// The EPI codes, the last template argument of both matmul kernels; the Python side reads them
// from here (kernels_cuda/_runtime.py: EPI_CODE).
// EPI_PLAIN: C = act(acc + bias). EPI_RELU_GRAD: C = y <= 0 ? 0 : acc (matmul's relu_grad_of).
// EPI_XENT: linear_cross_entropy (xent_tile). EPI_SGD: linear_sgd (sgd_step, BiasGrad).
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
// before the first is used: a row of N <= XENT_CHUNK costs one trip to L2, not one per column
// and pass (experiments/FINDINGS.md, "Fused step and CUDA graphs").
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
// summed again from global memory after the loop, dy's columns would cost more trips to L2
// (experiments/FINDINGS.md, "Tensor-core kernel: small blocks and the one-warp cost"). Thread t
// owns columns t, t + T, ...; prefetch sends for their bias lines with the epilogue's other reads.
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

// What a matmul kernel's epilogue reads from memory besides C's tile: the loss's labels
// (XentLabels), in linear_sgd's blocks of tile row 0 (bias_step: they update the bias too) the
// bias lines (BiasGrad), and per output the lines of the bias, of relu_grad_of's y, of
// linear_sgd's w and its buffer. They are prefetched into L1 so that their trips to L2 overlap
// the main loop: linear_sgd's epilogue reads w and its buffer group by group, each read followed
// by stores the compiler cannot move it past (the pointers may alias, as far as it knows), and
// unprefetched every group would wait for its own round trip. They are sent for once the loop's
// first operand copies are queued, not ahead of them, where they would delay the loop's first
// wait (experiments/FINDINGS.md, "Tensor-core kernel: small blocks and the one-warp cost"). The
// kernels differ only in which outputs a thread holds: each hands send() its columns and rows,
// cols(f) calling f(n) for each and rows(f) f(m).
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

#endif  // KERNELS_CUDA_FUSED_CUH
