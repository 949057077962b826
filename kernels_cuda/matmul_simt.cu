// fp32 matmul on the CUDA cores: C = act(op(A) @ op(B) + bias), C row-major M x N.
// Build alone, no GPU needed (registers, shared memory and spills of the default configs):
//   nvcc -cubin -arch=sm_90 -std=c++17 -DSTANDALONE --resource-usage -o /dev/null kernels_cuda/matmul_simt.cu
//
// Bound by arithmetic at large sizes: 2 * M * N * K FLOPs, 4096^3 is 137 GFLOP,
// 2.7 ms at the 51 TFLOP/s cuBLAS reaches in fp32 on the H200 (TF32 off).
//
// A block computes a BM x BN tile of C; each of its BM*BN/(TM*TN) threads
// owns a TM x TN sub-tile in registers (siboehm's SGEMM kernels 6 and 9).
// Per k step a thread reads TM + TN floats from shared memory and does
// TM * TN FMAs, so 8 x 8 gives 4 FMAs per shared load, enough to keep the
// FP32 pipes rather than shared memory the limit. 2 x 2 gives 1, and a
// quarter of 4 x 4's serial FMAs per thread: for the small outputs of a
// training step at H = 128 (a 128 x 128 product is 16 blocks of 32 x 32
// but 64 of 16 x 16), where the chip idles and each block's latency is the
// call's, not its throughput (Triton's winners there are 16 x 16 on 2 warps:
// experiments/FINDINGS.md, "SIMT fp32 kernel"). Per BK slice the block
// reads (BM + BN) * BK floats from global memory for BM * BN * BK FMAs:
// 128 x 128 tiles reuse each loaded float 64 times, far above the H200's
// ~67 TFLOP/s / 4.8 TB/s ~ 14 FLOP/byte balance point.
//
// Both operand tiles sit in shared memory k-major (Xs[k][m or n]) so that the
// compute loop reads 4 consecutive rows (or columns) as one 16-byte load; a
// k-contiguous operand is transposed while being stored, and the rows are
// padded by 4 floats so that those scattered stores do not all hit one bank.
// A thread's TM rows are TM/GM groups of GM = min(TM, 4), the groups GM * RM
// apart, so the 16-byte (GM = 2: 8-byte) reads of a warp are consecutive and
// conflict-free (same for TN).
//
// Global loads move VA (VB) floats per instruction along the operand's
// contiguous dimension; the host picks the width from pointer and leading
// dimension alignment. Vectors that cross the matrix edge fall back to
// bounds-checked element loads that fill zeros. With STAGES == 2 the next
// tile's global loads are issued before the current tile's FMAs and stored
// to the other shared buffer afterwards (one barrier per k step); with
// STAGES == 1 a single buffer is reloaded between two barriers.
//
// STAGES 3 and 4 (sm_80 and newer): a ring of shared buffers filled by cp.async, the copies of
// tile k + STAGES - 1 in flight while tile k is multiplied, as Triton's fp32 winners at the
// trainer's K = 784..1024 products run (4 stages; the two-buffer loop above has one tile in
// flight, and its registers hold it). Every operand moves its vectors whole, src-size
// zero-filling the edges: a k-contiguous one stays k-contiguous in shared memory (SimtTile::DK),
// and the FMA loop reads 4 k of its rows at a time. The FMAs, their order and the zeros are the
// two-buffer loop's, so both give the same bits.
//
// SPLIT_K > 1 (outputs of few tiles, e.g. 128 x 10 with K = 1024): the grid
// is tiles x slices (at most SPLIT_K), each block runs the same loop over its
// K slice, and the last block of a tile to finish adds the fp32 partials in
// slice order before the epilogue (splitk.cuh: enter_slice, splitk_reduce).
// SPLIT_K == 1 compiles none of that: the same code as without the parameter.
//
// Fused paths (fused.cuh), each a template argument that compiles nothing when
// off: A_ROWS reads A's stored rows through the index vector a_rows (matmul's a_rows, linear_sgd's
// x_rows); EPI picks the epilogue: matmul's relu_grad_of, linear_cross_entropy, linear_sgd.
#include "dtypes.cuh"
#include "fused.cuh"
#include "ptx.cuh"
#include "splitk.cuh"
#include "swizzle.cuh"

// One operand tile: BK x BD of op(X) (BD = BM for A, BN for B), staged
// through registers, or (RING) copied by cp.async. KC says k is X's contiguous dimension: op(X)[d, k] is
// X[d * ld + k] when KC, else X[k * ld + d]. With ROWS, X's stored rows (d
// when KC, else k) are read through the index vector `rows` of X's `stored`
// rows: row r is X + rows[r] * ld, a row of zeros where fused.cuh's
// gathered_row says so; within a row the vector loads stay as they are.
// In shared memory the tile is k-major (Xs[k][d]), except a k-contiguous one in the ring (DK:
// Xs[d][k], as X holds it, so its copies move whole vectors).
template <int BD, int BK, int V, int T, int KC, int ROWS = 0, int RING = 0>
struct SimtTile {
    static constexpr int VECS = BD * BK / V;
    static constexpr int PER_THREAD = (VECS + T - 1) / T;
    static constexpr bool DK = KC && RING;
    // Padded shared rows, in floats: 4 more than a row, so that the 16-byte reads of a warp's
    // rows land in different banks.
    static constexpr int LD_S = DK ? BK + 4 : BD + 4;
    static constexpr int STAGE = DK ? BD * LD_S : BK * LD_S;
    static __device__ __forceinline__ float at(const float* Xs, int d, int k) {
        return DK ? Xs[d * LD_S + k] : Xs[k * LD_S + d];
    }
    typedef Pack<float, V> P;
    P r[PER_THREAD];

    // f(p, d, k) for each of this thread's vectors p, at tile coordinates (d, k).
    template <class F>
    static __device__ __forceinline__ void each(F f) {
#pragma unroll
        for (int p = 0; p < PER_THREAD; ++p) {
            const int c = threadIdx.x + p * T;
            if (VECS % T != 0 && c >= VECS) break;
            if (KC)
                f(p, c / (BK / V), c % (BK / V) * V);
            else
                f(p, c % (BD / V) * V, c / (BD / V));
        }
    }

    __device__ __forceinline__ void load(const float* X, i64 ld, int d0, int k0, int D, int K, const i64* rows,
                                        i64 stored) {
        each([&](int p, int d, int k) {
            const int gd = d0 + d, gk = k0 + k;
            if constexpr (ROWS) {
                const i64 row = KC ? gathered_row(rows, gd, D, stored) : gathered_row(rows, gk, K, stored);
                const int col = KC ? gk : gd, cols = KC ? K : D;
                if (row >= 0 && col + V <= cols) {
                    r[p] = *reinterpret_cast<const P*>(X + row * ld + col);
                } else {
#pragma unroll
                    for (int j = 0; j < V; ++j) r[p].v[j] = row >= 0 && col + j < cols ? X[row * ld + col + j] : 0.f;
                }
                return;
            }
            const bool full = KC ? (gd < D && gk + V <= K) : (gk < K && gd + V <= D);
            if (full) {
                r[p] = *reinterpret_cast<const P*>(KC ? X + (i64)gd * ld + gk : X + (i64)gk * ld + gd);
            } else {
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const bool in = KC ? (gd < D && gk + j < K) : (gk < K && gd + j < D);
                    r[p].v[j] = in ? (KC ? X[(i64)gd * ld + gk + j] : X[(i64)gk * ld + gd + j]) : 0.f;
                }
            }
        });
    }

    // The tile straight into shared buffer Xs by cp.async (RING): the values load() + store()
    // put there, zeros included (src-size 0 copies none and fills the rest), each vector whole.
    __device__ __forceinline__ void issue(float* Xs, const float* X, i64 ld, int d0, int k0, int D, int K,
                                         const i64* rows, i64 stored) const {
        static_assert(RING, "the two-buffer loop stages through registers");
        each([&](int, int d, int k) {
            const int gd = d0 + d, gk = k0 + k;
            // The stored row that holds the vector, and how many of its V floats lie inside op(X).
            const i64 row = KC ? (ROWS ? gathered_row(rows, gd, D, stored) : gd < D ? gd : -1)
                               : (ROWS ? gathered_row(rows, gk, K, stored) : gk < K ? gk : -1);
            const int left = KC ? K - gk : D - gd, n = row < 0 || left <= 0 ? 0 : left < V ? left : V;
            cp_async<4 * V>(smem_addr(Xs + (DK ? d * LD_S + k : k * LD_S + d)), n ? X + row * ld + (KC ? gk : gd) : X,
                            4 * n);
        });
    }

    __device__ __forceinline__ void store(float* Xs) const {
        each([&](int p, int d, int k) {
            if (KC) {
#pragma unroll
                for (int j = 0; j < V; ++j) Xs[(k + j) * LD_S + d] = r[p].v[j];
            } else {
                *reinterpret_cast<P*>(Xs + k * LD_S + d) = r[p];
            }
        });
    }
};

template <int BM, int BN, int BK, int TM, int TN, int VA, int VB, int STAGES, int GROUP_M, int SPLIT_K,
          int A_KC, int B_KC, int HAS_BIAS, int RELU, int A_ROWS, int EPI>
__global__ void __launch_bounds__(BM * BN / (TM * TN))
matmul_simt_kernel(const float* A, const float* B, const float* bias, float* C, int M, int N, int K,
                   i64 lda, i64 ldb, float* partials, int* counters, int k_slice, FUSED_PARAMS(float)) {
    dependent_start();
    static_assert(EPI == EPI_PLAIN || EPI == EPI_XENT || !(HAS_BIAS || RELU), "relu_grad_of and linear_sgd: no bias, no ReLU");
    static_assert(EPI != EPI_XENT || !RELU, "linear_cross_entropy: no ReLU");
    static_assert(EPI != EPI_SGD || SPLIT_K == 1, "linear_sgd: no split-K");
    constexpr int T = BM * BN / (TM * TN);
    constexpr int RM = BM / TM, RN = BN / TN;  // threads along m and n
    constexpr int GM = TM < 4 ? TM : 4, GN = TN < 4 ? TN : 4;  // a thread's rows (columns) come in groups of GM (GN)
    static_assert(TM % GM == 0 && TN % GN == 0 && TM * TN % 4 == 0, "THREAD_M, THREAD_N: 2, 4 or 8");
    typedef SimtTile<BM, BK, VA, T, A_KC, A_ROWS, (STAGES >= 3)> TileA;
    typedef SimtTile<BN, BK, VB, T, B_KC, 0, (STAGES >= 3)> TileB;
    constexpr int A_STAGE = TileA::STAGE, B_STAGE = TileB::STAGE;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* As = reinterpret_cast<float*>(smem_raw);
    float* Bs = As + STAGES * A_STAGE;

    int pid_m, pid_n;
    const int num_pid_m = (M + BM - 1) / BM;
    // linear_sgd of a layer with no inputs (M = K_in = 0) still updates its bias: one tile row of no weights.
    swizzle_block<GROUP_M>(blockIdx.x, EPI == EPI_SGD && num_pid_m == 0 ? 1 : num_pid_m, (N + BN - 1) / BN, pid_m, pid_n);
    const int m0 = pid_m * BM, n0 = pid_n * BN;
    const int tx = threadIdx.x % RN, ty = threadIdx.x / RN;
    if constexpr (SPLIT_K > 1) enter_slice<A_KC, B_KC, A_ROWS>(A, B, a_rows, K, lda, ldb, k_slice);  // from here on: its slice

    // What the epilogue reads from memory (fused.cuh: EpilogueReads), sent for once the first k
    // step's operand loads are issued: a thread's rows are TM / GM groups of GM, its columns TN / GN
    // groups of GN (see the epilogue).
    // C's row of the thread's i-th row, C's column of the first of its g-th column group.
    auto row_of = [&](int i) { return m0 + (i / GM) * GM * RM + ty * GM + i % GM; };
    auto col_of = [&](int g) { return n0 + g * GN * RN + tx * GN; };
    const XentArgs xent = {labels, label_rows, n_labels, loss, flag, loss_slots, loss_counter};
    EpilogueReads<EPI, HAS_BIAS, BM, BN, T> reads(pid_m);
    auto epilogue_reads = [&]() {
        reads.send(
            xent, m0, M, n0, N, bias, relu_y, w, w_buf, b, b_buf,
            [&](auto f) {
#pragma unroll
                for (int g = 0; g < TN / GN; ++g) f(col_of(g));
            },
            [&](auto f) {
#pragma unroll
                for (int i = 0; i < TM; ++i) f(row_of(i));
            });
    };
    // Adds a staged tile's rows of op(B) to the bias sums.
    auto add_bias = [&](const float* bs) {
        if (reads.bias_step) reads.bias_grad.template add<BK>([&](int k, int c) { return TileB::at(bs, c, k); });
    };

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

    TileA ta;
    TileB tb;
    const int KT = (K + BK - 1) / BK;

    // TM x TN FMAs per k from TM/GM + TN/GN shared loads of GM (GN) floats.
    // A d-major (DK) tile gives a thread 4 consecutive k of each of its rows (columns) per 16-byte
    // read, so those reads come once per 4 k; the FMAs run in the same k order either way.
    auto compute = [&](const float* as, const float* bs) {
#pragma unroll
        for (int k4 = 0; k4 < BK; k4 += 4) {
            float ad[TileA::DK ? TM : 1][4], bd[TileB::DK ? TN : 1][4];
            if constexpr (TileA::DK) {
#pragma unroll
                for (int i = 0; i < TM; ++i) {
                    Pack<float, 4> v = *reinterpret_cast<const Pack<float, 4>*>(as + (row_of(i) - m0) * TileA::LD_S + k4);
#pragma unroll
                    for (int q = 0; q < 4; ++q) ad[i][q] = v.v[q];
                }
            }
            if constexpr (TileB::DK) {
#pragma unroll
                for (int g = 0; g < TN / GN; ++g)
#pragma unroll
                    for (int j = 0; j < GN; ++j) {
                        Pack<float, 4> v =
                            *reinterpret_cast<const Pack<float, 4>*>(bs + (col_of(g) - n0 + j) * TileB::LD_S + k4);
#pragma unroll
                        for (int q = 0; q < 4; ++q) bd[g * GN + j][q] = v.v[q];
                    }
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int kk = k4 + q;
                float a[TM], b[TN];
                if constexpr (TileA::DK) {
#pragma unroll
                    for (int i = 0; i < TM; ++i) a[i] = ad[i][q];
                } else {
#pragma unroll
                    for (int g = 0; g < TM / GM; ++g) {
                        Pack<float, GM> v =
                            *reinterpret_cast<const Pack<float, GM>*>(as + kk * TileA::LD_S + g * GM * RM + ty * GM);
#pragma unroll
                        for (int j = 0; j < GM; ++j) a[g * GM + j] = v.v[j];
                    }
                }
                if constexpr (TileB::DK) {
#pragma unroll
                    for (int j = 0; j < TN; ++j) b[j] = bd[j][q];
                } else {
#pragma unroll
                    for (int g = 0; g < TN / GN; ++g) {
                        Pack<float, GN> v =
                            *reinterpret_cast<const Pack<float, GN>*>(bs + kk * TileB::LD_S + g * GN * RN + tx * GN);
#pragma unroll
                        for (int j = 0; j < GN; ++j) b[g * GN + j] = v.v[j];
                    }
                }
#pragma unroll
                for (int i = 0; i < TM; ++i)
#pragma unroll
                    for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
            }
        }
    };

    if constexpr (STAGES >= 3) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < KT) {
                ta.issue(As + s * A_STAGE, A, lda, m0, s * BK, M, K, a_rows, rows_of_a);
                tb.issue(Bs + s * B_STAGE, B, ldb, n0, s * BK, N, K, nullptr, 0);
            }
            cp_async_commit();  // empty groups too: the wait below counts groups
        }
        epilogue_reads();
        for (int kt = 0; kt < KT; ++kt) {
            cp_async_wait<STAGES - 2>();  // this thread's copies of tile kt have landed
            __syncthreads();              // everyone's have; and everyone is done with tile kt - 1
            const int next = kt + STAGES - 1, cur = kt % STAGES;
            if (next < KT) {  // into the buffer tile kt - 1 left
                ta.issue(As + next % STAGES * A_STAGE, A, lda, m0, next * BK, M, K, a_rows, rows_of_a);
                tb.issue(Bs + next % STAGES * B_STAGE, B, ldb, n0, next * BK, N, K, nullptr, 0);
            }
            cp_async_commit();
            compute(As + cur * A_STAGE, Bs + cur * B_STAGE);
            add_bias(Bs + cur * B_STAGE);
        }
        cp_async_wait<0>();  // only empty groups are left; none may land once the epilogue reuses the ring
    } else if (STAGES == 2) {
        ta.load(A, lda, m0, 0, M, K, a_rows, rows_of_a);
        tb.load(B, ldb, n0, 0, N, K, nullptr, 0);
        epilogue_reads();
        ta.store(As);
        tb.store(Bs);
        __syncthreads();
        for (int kt = 0; kt < KT; ++kt) {
            const int cur = kt % 2;
            if (kt + 1 < KT) {  // in flight while the FMAs below run
                ta.load(A, lda, m0, (kt + 1) * BK, M, K, a_rows, rows_of_a);
                tb.load(B, ldb, n0, (kt + 1) * BK, N, K, nullptr, 0);
            }
            compute(As + cur * A_STAGE, Bs + cur * B_STAGE);
            add_bias(Bs + cur * B_STAGE);
            if (kt + 1 < KT) {
                // The other buffer was last read in step kt - 1, which every
                // thread finished before the barrier that ended it.
                ta.store(As + (1 - cur) * A_STAGE);
                tb.store(Bs + (1 - cur) * B_STAGE);
            }
            __syncthreads();
        }
    } else {
        epilogue_reads();  // one buffer: no load comes before the loop (and K = 0 runs none)
        for (int kt = 0; kt < KT; ++kt) {
            ta.load(A, lda, m0, kt * BK, M, K, a_rows, rows_of_a);
            tb.load(B, ldb, n0, kt * BK, N, K, nullptr, 0);
            ta.store(As);
            tb.store(Bs);
            __syncthreads();
            compute(As, Bs);
            add_bias(Bs);
            __syncthreads();
        }
    }

    if constexpr (SPLIT_K > 1) {  // a thread's TM x TN sums are TM * TN / 4 float4s, row by row
        auto at = [&](int f, int e) -> float& { return acc[(f * 4 + e) / TN][(f * 4 + e) % TN]; };
        if (!splitk_reduce<SPLIT_K, TM * TN / 4, T>(partials, counters, [&](int f, int e) { return at(f, e); },
                                                    [&](int f, int e, float x) { at(f, e) = x; })) return;
    }

    // Epilogue: GN consecutive columns per store when C's rows (and y's) allow 4 * GN bytes.
    constexpr u64 VEC_ALIGN = 4 * GN - 1;
    const bool vec_ok = (N % GN == 0) && ((reinterpret_cast<u64>(C) & VEC_ALIGN) == 0) &&
                        (EPI != EPI_RELU_GRAD || (reinterpret_cast<u64>(relu_y) & VEC_ALIGN) == 0);
    const SgdArgs<float> sgd = {w_buf, w_low, lr, momentum, weight_decay};  // linear_sgd's weights
    const bool sgd_vec = EPI == EPI_SGD && sgd_vec_ok<DT_FP32, GN>(w, sgd, N);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int m = row_of(i);
        if (m >= M) continue;
#pragma unroll
        for (int g = 0; g < TN / GN; ++g) {
            const int n = col_of(g);
            Pack<float, GN> out;
#pragma unroll
            for (int j = 0; j < GN; ++j) {
                float v = acc[i][g * GN + j];
                if (HAS_BIAS) v += (n + j < N) ? bias[n + j] : 0.f;
                out.v[j] = RELU ? relu_f(v) : v;
            }
            const i64 at = (i64)m * N + n;
            if constexpr (EPI == EPI_SGD) {  // gw (m, n .. n + GN - 1) updates w there; never stored
                const SgdArgs<float> here = {w_buf ? w_buf + at : nullptr, w_low ? w_low + at : nullptr, lr, momentum,
                                             weight_decay};
                sgd_step<DT_FP32, GN>(w + at, here, out.v, N - n, sgd_vec);
                continue;
            }
            if constexpr (EPI == EPI_RELU_GRAD) {  // 0 where y <= 0; a NaN y passes the gradient
                Pack<float, GN> y;
                if (vec_ok && n + GN <= N) {
                    y = *reinterpret_cast<const Pack<float, GN>*>(relu_y + at);
                } else {
#pragma unroll
                    for (int j = 0; j < GN; ++j) y.v[j] = n + j < N ? relu_y[at + j] : 1.f;
                }
#pragma unroll
                for (int j = 0; j < GN; ++j)
                    if (y.v[j] <= 0.f) out.v[j] = 0.f;
            }
            float* c = C + at;
            if (vec_ok && n + GN <= N) {
                *reinterpret_cast<Pack<float, GN>*>(c) = out;
            } else {
#pragma unroll
                for (int j = 0; j < GN; ++j)
                    if (n + j < N) c[j] = out.v[j];
            }
        }
    }
    if constexpr (EPI == EPI_XENT)
        xent_tile<DT_FP32, BM, T>(C, M, N, m0, pid_m, xent, reads.xent_labels, reinterpret_cast<float*>(smem_raw));
    if (reads.bias_step)
        reads.bias_grad.template step<DT_FP32>(b, n0, N, SgdArgs<float>{b_buf, b_low, lr, momentum, weight_decay});
}

#ifdef STANDALONE
// The default configs (kernels_cuda/matmul.py: SIMT_SPACE, row-major A and B), instantiated for the build line at
// the top: the plain matmul, then the fused ops' (kernels_cuda/fused.py: report_variant) on the same config.
void* const standalone_kernels[] = {
    (void*)&matmul_simt_kernel<128, 128, 8, 8, 8, 4, 4, 2, 8, 1, 1, 0, 0, 0, 0, EPI_PLAIN>,
    (void*)&matmul_simt_kernel<128, 128, 8, 8, 8, 4, 4, 2, 8, 1, 1, 0, 1, 0, 0, EPI_XENT>,
    (void*)&matmul_simt_kernel<128, 128, 8, 8, 8, 4, 4, 2, 8, 1, 0, 0, 0, 0, 0, EPI_SGD>
};
#endif
