// The persistent training kernel: many SGD steps of the MLP IN -> H x LAYERS -> OUT in one launch,
// the CUDA twin of kernels_triton/persistent.py (its module docstring has the why; the flat
// parameter layout and the residency rule are kernels_core/persistent.py's).
// Build alone, no GPU needed (registers and spills of the default config at the default protocol's
// 784-128-128-10, batch 128, fp32 and fp16):
//   nvcc -cubin -arch=sm_90 -std=c++17 -DSTANDALONE --resource-usage -o /dev/null kernels_cuda/persistent.cu
//
// One block a multiprocessor (or PROGRAMS) walks each step's phases, a grid barrier
// (grid_barrier.cuh) after each: 2 * LAYERS + 1 a step (kernels_core.persistent.barriers_per_step).
// Each phase is a list of tiles handed out over the grid, tile t to block t mod blocks, so a phase
// takes about one tile's chain of k-steps:
//   forward  l = 0 .. LAYERS-1: A_{l+1} = relu(A_l @ W_l + b_l) (A_0 = x[batches[s]]) in BM x BN
//            tiles; the first layer's K may split into SPLIT_K slices summed into fp32 partials,
//            which each tile's last slice to arrive adds up in order (forward).
//   loss     tiles of BL rows x BN columns of D_{L-1}: the rows' logits = A_L @ W_L + b_L and
//            D_L = (softmax - onehot(y)) / M (into grads' last M x OUT, the row block's summed
//            loss into slots[row block], by the row block's first tile); and at once D_{L-1} =
//            (D_L @ W_L^T) * (A_L > 0), since each tile works out its rows' whole D_L.
//   backward l = LAYERS-1 .. 1: D_{l-1} = (D_l @ W_l^T) * (A_l > 0) in BM x BN tiles beside W_{l+1}'s
//            update in BR x BC tiles (gradient A_{l+1}^T @ D_{l+1}, the batch BK rows at a time;
//            fused.cuh's sgd_step, the rule of optim.cu; the tiles of row block 0 also update
//            b_{l+1}); last, W_1's and W_0's updates (W_0's in BR0 x BC tiles). A weight is updated
//            one phase after the phase that reads it for an input gradient, so no tile reads a
//            weight another tile of its phase writes.
// After the loss barrier the last block sums the slots in slot order (the same bits every run) into
// losses[s]: the phase's tiles go to the first blocks, so where they are fewer than the blocks the
// sum's trip to L2 keeps no tile waiting (measured no faster than block 0: that tile was not the
// phase's slowest; experiments/FINDINGS.md, "The persistent training kernel"). The step's slot s
// is (*pos + i) % epoch_steps; block 0 writes *pos + steps at the end (every block read *pos
// before its first arrival).
//
// Rounding, the fused step's and the Triton twin's: fp32 master weights; with 16-bit T the
// products read the weights rounded to T, activations, gradients and logits are stored in T, and
// every sum accumulates in fp32. Products are FMAs on the CUDA cores; a product of two 16-bit
// values is exact in fp32, as on the tensor cores, so only the order of the sums differs. fp32
// products are IEEE (no TF32).
//
// What one block writes and another reads later in the launch (activations, gradients, partials,
// weights and biases, the loss slots) is loaded with ld.global.cg: L2, never a line this
// multiprocessor's L1 kept from before the writer's store. The barrier orders the phases. A tile
// of W, its momentum buffer and (row block 0) its bias are updated by the same block every step:
// plain loads there; x, y and batches are written by no one.
//
// Shared memory (dynamic: two steps' rows and the largest phase's; kernels_cuda/persistent.py's
// smem_bytes mirrors PersistentSmem, held to it by static_asserts in tests/test_persistent_cuda.py's
// build): see PersistentSmem.
#include "dtypes.cuh"
#include "fused.cuh"
#include "grid_barrier.cuh"
#include "ptx.cuh"
#include "splitk.cuh"

__host__ __device__ constexpr int cdiv_c(int a, int b) { return (a + b - 1) / b; }

__host__ __device__ constexpr int max_c(int a, int b) { return a > b ? a : b; }

__host__ __device__ constexpr int pow2_ceil(int v) { return v <= 1 ? 1 : 2 * pow2_ceil((v + 1) / 2); }

__host__ __device__ constexpr int pow2_floor(int v) { return v <= 1 ? 1 : 2 * pow2_floor(v / 2); }

// A product's shared memory: two stages, one filled while the other is multiplied, each a BK x BMT
// tile of the left operand and a BK x BNT one of the right, both k-major (rows of k), so a thread
// reads its TM rows' (TN columns') values at one k as 16-byte vectors. Rows are padded by 4 floats:
// a warp's stores of a k-contiguous operand (32 k of one row) then fall on 8 banks, not one (4-way
// conflicts, not 32-way). BNT is rounded up to a power of two (the loss's 10 classes: 16), the
// columns past BNT computed on zeros.
template <int BMT, int BNT, int BK>
struct ProductSmem {
    static constexpr int LDA = BMT + 4, LDB = pow2_ceil(BNT) + 4, STAGE = BK * (LDA + LDB), FLOATS = 2 * STAGE;
};

// Floats of shared memory a block uses; the host sizes the launch with its mirror. First two steps'
// M batch rows (int64, 2 floats each, each step's rounded up to 16 bytes): a step's rows are staged
// during the step before (train_steps), so a gathered load of x waits for one round trip, not for
// the row's index and then the row, and the step's start waits for neither; then the largest
// phase's: a product's stages (ProductSmem); the loss keeps its rows' logits, their gradient and
// losses past those, and stages BN rows of W_L (its dx step) where the product's were.
template <int M, int OUT, int BM, int BN, int BK, int BR, int BR0, int BC, int BL>
struct PersistentSmem {
    static constexpr int ROW_STEP = 4 * cdiv_c(2 * M, 4), ROWS = 2 * ROW_STEP;
    static constexpr int FORWARD = ProductSmem<BM, BN, BK>::FLOATS;
    static constexpr int UPDATE = max_c(ProductSmem<BR, BC, BK>::FLOATS, ProductSmem<BR0, BC, BK>::FLOATS);
    static constexpr int LOSS = max_c(ProductSmem<BL, OUT, BK>::FLOATS, BN * OUT) + 2 * BL * OUT + BL;
    static constexpr int FLOATS = ROWS + max_c(FORWARD, max_c(UPDATE, LOSS));
};

// A thread's share of a SIZE-element copy into shared memory, element e = i * THREADS + tid:
// load(e, e < SIZE) for all of them into registers (a loader returns 0 where its `in` is false),
// later store(e, value) for all, so that a thread's loads are in flight together (the .cg loads
// are volatile asm, which the compiler keeps in program order) and, in a product, while the last
// k-step's FMAs run.
template <int SIZE, int THREADS>
struct Staged {
    static constexpr int EACH = cdiv_c(SIZE, THREADS);
    float v[EACH];

    template <typename Load>
    __device__ __forceinline__ void load(Load load) {
#pragma unroll
        for (int i = 0; i < EACH; ++i) {
            const int e = i * THREADS + threadIdx.x;
            v[i] = load(e, e < SIZE);
        }
    }

    template <typename Store>
    __device__ __forceinline__ void store(Store store) const {
#pragma unroll
        for (int i = 0; i < EACH; ++i) {
            const int e = i * THREADS + threadIdx.x;
            if (e < SIZE) store(e, v[i]);
        }
    }
};

// The GPU's clock, in ns.
__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// *p where `in`, else 0; another block wrote it during this launch: through L2 (ptx.cuh's
// ldcg1_if, a predicated load).
template <int DT>
__device__ __forceinline__ float load_cg(bool in, const EltT<DT>* p) {
    return Elt<DT>::load(ldcg1_if(in, p));
}

// An fp32 weight as the products read it: rounded to the activations' dtype.
template <int DT>
__device__ __forceinline__ float as_operand(float w) {
    return Elt<DT>::load(Elt<DT>::store(w));
}

// Element k of the batch's row m of a (M x K) where `in`, else 0: x[rows[m]] in place (GATHER: the
// dataset, which nothing writes) or a scratch activation (written by other blocks).
template <int DT, int K, bool GATHER>
__device__ __forceinline__ float a_elem(const EltT<DT>* a, const i64* rows, int m, int k, bool in) {
    if constexpr (GATHER)
        return in ? Elt<DT>::load(a[rows[m] * K + k]) : 0.f;
    else
        return load_cg<DT>(in, a + (i64)m * K + k);
}

// k-groups of a product (TileMap): the most, a power of two, that leave each thread at most 8
// outputs, each group a whole number of warps and at least one k of a k-step, and whose partial
// tiles but one fit in the product's FLOATS of shared memory.
__host__ __device__ constexpr int k_groups(int tile, int bk, int threads, int floats, int g = 1) {
    return 2 * g * tile <= 8 * threads && 2 * g * 32 <= threads && 2 * g <= bk && (2 * g - 1) * tile <= floats
               ? k_groups(tile, bk, threads, floats, 2 * g)
               : g;
}

// How a product's BMT x BNT outputs fall to THREADS threads (BNP: BNT rounded up to a power of
// two): KG k-groups of GT threads each sum the whole tile over their KG-th of every k-step's BK,
// each thread of a group a block of TM x TN outputs in registers, RN threads along n. A k reads
// TM + TN values from shared memory for TM x TN FMAs: with one or two outputs a thread (a small
// tile on many threads) the shared loads, not the FMAs, bound a k-step, hence the groups.
template <int BMT, int BNT, int BK, int THREADS, int FLOATS>
struct TileMap {
    static constexpr int BNP = pow2_ceil(BNT), KG = k_groups(BMT * BNP, BK, THREADS, FLOATS), GT = THREADS / KG;
    static constexpr int OUTS = BMT * BNP / GT, TN = OUTS < 4 ? OUTS : 4, TM = OUTS / TN, RN = BNP / TN;
    static_assert(OUTS >= 1 && OUTS * GT == BMT * BNP && GT % RN == 0 && GT / RN * TM == BMT && BK % KG == 0,
                  "tile sides powers of two, a tile at least one output a thread");
    static __device__ __forceinline__ int group() { return threadIdx.x / GT; }
    static __device__ __forceinline__ int row(int i) { return threadIdx.x % GT / RN * TM + i; }
    static __device__ __forceinline__ int col(int j) { return threadIdx.x % RN * TN + j; }
};

// V consecutive floats of shared memory (16-byte aligned where V >= 4, 8-byte where 2) into v.
template <int V>
__device__ __forceinline__ void read_shared(const float* p, float (&v)[V]) {
    constexpr int W = V < 4 ? V : 4;
#pragma unroll
    for (int q = 0; q < V; q += W) {
        const Pack<float, W> pack = *reinterpret_cast<const Pack<float, W>*>(p + q);
#pragma unroll
        for (int j = 0; j < W; ++j) v[q + j] = pack.v[j];
    }
}

// product's staged hook by default: nothing sees the stages.
struct Unseen {
    __device__ __forceinline__ void operator()(const float*, int) const {}
};

// out(m, n, sum over k in [k_lo, k_hi) of left(m, k) * right(k, n), early(m, n)) for each output of
// a BMT x BNT tile (TileMap's, n < BNT); the loaders, left(m, k, in) and right(k, n, in), return 0
// where `in` is false and past their operand's edges (what other blocks wrote through predicated
// loads, ldcg1_if; the dataset's rows through a plain load under the condition). Each
// k-group sums its k in order, and group 0 adds the groups' sums up in group order and calls out.
// early(m, n) loads what the output's epilogue reads besides the sum (a bias, a ReLU mask, the
// weights an update steps): sent for with the first k-steps' operands, it arrives while the
// product runs rather than after it, a round trip to L2 less on the phase's critical path. LEFT_KC
// (RIGHT_KC): k runs along the operand's memory, so a copy's consecutive elements step along k,
// else along m (n): either way consecutive threads load consecutive addresses. Two shared stages
// and two sets of registers: while a k-step's FMAs run, the next k-step's operands (loaded one
// k-step earlier) wait in one set and the one after's are loaded into the other, so each load has
// two k-steps to arrive; then the next k-step's set is stored into the other stage, one
// __syncthreads a k-step (four sets, each load four k-steps to arrive, measured no faster:
// experiments/FINDINGS.md, "The persistent training kernel"). staged(right, ld), if given, sees
// each k-step's tile of the right operand while its stage is live (row k at right + k * ld holds
// right(k0 + k, n) for n < BNT, zeros past the operand's edges).
template <int BMT, int BNT, int BK, int THREADS, bool LEFT_KC, bool RIGHT_KC, typename Left, typename Right,
          typename Early, typename Out, typename Seen = Unseen>
__device__ __forceinline__ void product(int k_lo, int k_hi, Left left, Right right, Early early, Out out,
                                        float* smem, Seen staged = Seen()) {
    typedef ProductSmem<BMT, BNT, BK> S;
    typedef TileMap<BMT, BNT, BK, THREADS, S::FLOATS> Map;
    constexpr int BNP = Map::BNP, TM = Map::TM, TN = Map::TN, KG = Map::KG, GT = Map::GT, KS = BK / KG;
    typedef Staged<BMT * BK, THREADS> LeftRegs;
    typedef Staged<BK * BNP, THREADS> RightRegs;
    constexpr int SETS = 2;  // the register sets' ring
    // element e of a copy: (row of the tile, its k)
    auto left_at = [](int e) { return LEFT_KC ? int2{e / BK, e % BK} : int2{e % BMT, e / BMT}; };
    auto right_at = [](int e) { return RIGHT_KC ? int2{e / BK, e % BK} : int2{e % BNP, e / BNP}; };
    auto fetch = [&](LeftRegs& l, RightRegs& r, int k0) {
        l.load([&](int e, bool in) {
            const int2 at = left_at(e);
            return left(at.x, k0 + at.y, in && k0 + at.y < k_hi);
        });
        r.load([&](int e, bool in) {
            const int2 at = right_at(e);
            return right(k0 + at.y, at.x, in && k0 + at.y < k_hi);
        });
    };
    auto put = [&](const LeftRegs& l, const RightRegs& r, int stage) {
        float* base = smem + stage * S::STAGE;
        l.store([&](int e, float v) {
            const int2 at = left_at(e);
            base[at.y * S::LDA + at.x] = v;
        });
        r.store([&](int e, float v) {
            const int2 at = right_at(e);
            base[BK * S::LDA + at.y * S::LDB + at.x] = v;
        });
    };
    float acc[TM][TN] = {};
    // k-step k0 from `stage`: `next` holds k0 + BK's operands (in flight), `free` (k0's, stored)
    // takes k0 + SETS BK's.
    auto k_step = [&](int k0, int stage, LeftRegs& next_l, RightRegs& next_r, LeftRegs& free_l,
                      RightRegs& free_r) {
        if (k0 + SETS * BK < k_hi) fetch(free_l, free_r, k0 + SETS * BK);
        const int k_first = Map::group() * KS;  // the group's k of the stage
        const float* as = smem + stage * S::STAGE + k_first * S::LDA + Map::row(0);
        const float* bs = smem + stage * S::STAGE + BK * S::LDA + k_first * S::LDB + Map::col(0);
#pragma unroll 8
        for (int k = 0; k < KS; ++k) {
            float a[TM], b[TN];
            read_shared<TM>(as + k * S::LDA, a);
            read_shared<TN>(bs + k * S::LDB, b);
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        staged(smem + stage * S::STAGE + BK * S::LDA, S::LDB);
        // The other stage was last read in the k-step before, which every thread finished before
        // the barrier that ended it.
        if (k0 + BK < k_hi) put(next_l, next_r, stage ^ 1);
        __syncthreads();
    };
    LeftRegs l[SETS];
    RightRegs r[SETS];
    decltype(early(0, 0)) pre[TM][TN];
    __syncthreads();  // the last tile's (or phase's) reads of shared memory are done
#pragma unroll
    for (int i = 0; i < SETS; ++i)
        if (k_lo + i * BK < k_hi) fetch(l[i], r[i], k_lo + i * BK);
    if (Map::group() == 0) {
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) pre[i][j] = early(Map::row(i), Map::col(j));
    }
    if (k_lo < k_hi) put(l[0], r[0], 0);
    __syncthreads();
    for (int k0 = k_lo; k0 < k_hi; k0 += SETS * BK) {  // a k-step a set each turn: which set is which stays static
#pragma unroll
        for (int i = 0; i < SETS; ++i)
            if (k0 + i * BK < k_hi) k_step(k0 + i * BK, i % 2, l[(i + 1) % SETS], r[(i + 1) % SETS], l[i], r[i]);
    }
    if constexpr (KG > 1) {  // the stages are free: the last k-step ended at a barrier
        const int g = Map::group(), t = threadIdx.x % GT;
        if (g > 0) {
#pragma unroll
            for (int o = 0; o < TM * TN; ++o) smem[((g - 1) * TM * TN + o) * GT + t] = acc[o / TN][o % TN];
        }
        __syncthreads();
        if (g > 0) return;  // so no barrier may follow in product, nor in an out() it calls
#pragma unroll
        for (int q = 0; q < KG - 1; ++q)
#pragma unroll
            for (int o = 0; o < TM * TN; ++o) acc[o / TN][o % TN] += smem[(q * TM * TN + o) * GT + t];
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j)
            if (BNT == BNP || Map::col(j) < BNT) out(Map::row(i), Map::col(j), acc[i][j], pre[i][j]);
}

// out = relu(a @ w + b), a (M x K), w (K x N), out (M x N) in T, in BM x BN tiles; SPLIT > 1: the
// tile-slice t sums its slice s, k-steps [s S / SPLIT, (s + 1) S / SPLIT) of the S = cdiv(K, BK)
// (as even as whole k-steps go, none empty), into the fp32 partial s of part (SPLIT x M x N), and
// arrives at its tile's count (splitk.cuh's splitk_arrive_last: release, and acquire for the
// last); the last slice to arrive adds the partials up in slice order, whichever it is, so the
// bits never depend on the order of arrival, finishes the tile and sets its count back to 0.
template <int DT, int M, int K, int N, int BM, int BN, int BK, int THREADS, bool GATHER, int SPLIT>
__device__ __forceinline__ void forward(const EltT<DT>* a, const i64* rows, const float* w, const float* b,
                                        EltT<DT>* out, float* part, int* counts, float* smem) {
    constexpr int TILES_N = cdiv_c(N, BN), TILES = cdiv_c(M, BM) * TILES_N, K_STEPS = cdiv_c(K, BK);
    for (int t = blockIdx.x; t < TILES * SPLIT; t += gridDim.x) {
        const int s = t / TILES, tile = t % TILES, m0 = (tile / TILES_N) * BM, n0 = (tile % TILES_N) * BN;
        product<BM, BN, BK, THREADS, true, false>(
            s * K_STEPS / SPLIT * BK, (s + 1) * K_STEPS / SPLIT * BK,
            [&](int m, int k, bool in) { return a_elem<DT, K, GATHER>(a, rows, m0 + m, k, in && m0 + m < M && k < K); },
            [&](int k, int n, bool in) {
                return as_operand<DT>(ldcg1_if(in && k < K && n0 + n < N, w + (i64)k * N + n0 + n));
            },
            [&](int m, int n) { return ldcg1_if(SPLIT == 1 && n0 + n < N, b + n0 + n); },  // the bias
            [&](int m, int n, float v, float bias) {
                m += m0, n += n0;
                if (m < M && n < N) {
                    if constexpr (SPLIT == 1)
                        out[m * N + n] = Elt<DT>::store(relu_f(v + bias));
                    else
                        part[(i64)s * M * N + m * N + n] = v;
                }
            },
            smem);
        if constexpr (SPLIT > 1) {
            if (splitk_arrive_last(counts + tile, SPLIT)) {
                // G of a thread's outputs at a time (about 16 loads), every slice's partial and the
                // bias of each sent for together (predicated loads), so a batch costs one trip to L2.
                constexpr int EACH = BM * BN / THREADS, BATCH = pow2_floor(16 / SPLIT);
                constexpr int G = BATCH < EACH ? BATCH : EACH;
                static_assert(EACH * THREADS == BM * BN && EACH % G == 0, "tile sides and threads powers of two");
#pragma unroll 1
                for (int i0 = 0; i0 < EACH; i0 += G) {
                    float p[G][SPLIT], bias[G];
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        const int e = (i0 + g) * THREADS + threadIdx.x, m = m0 + e / BN, n = n0 + e % BN;
                        const bool in = m < M && n < N;
#pragma unroll
                        for (int q = 0; q < SPLIT; ++q) p[g][q] = ldcg1_if(in, part + (i64)q * M * N + m * N + n);
                        bias[g] = ldcg1_if(in, b + n);
                    }
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        const int e = (i0 + g) * THREADS + threadIdx.x, m = m0 + e / BN, n = n0 + e % BN;
                        if (m < M && n < N) {
                            float v = 0.f;
#pragma unroll
                            for (int q = 0; q < SPLIT; ++q) v += p[g][q];
                            out[m * N + n] = Elt<DT>::store(relu_f(v + bias[g]));
                        }
                    }
                }
            }
        }
    }
}

// logits = a @ w + b (a M x K, w K x N), rounded to T; d = (softmax - onehot(y[rows])) / M in T,
// BL rows at a time; then those rows' input gradient dx = (d @ w^T) * (a > 0) in BN of a's columns.
// The tiles are (row block, BN columns of dx): each works out its rows' whole d (a short product,
// N being the classes), so the last layer's dx needs no barrier and spreads over the grid; the
// first tile of a row block stores d and the block's summed loss (its rows' losses in row order)
// in slots[row block].
template <int DT, int M, int K, int N, int BL, int BN, int BK, int THREADS>
__device__ __forceinline__ void loss(const EltT<DT>* a, const i64* rows, const float* w, const float* b,
                                     const i64* y, EltT<DT>* d, EltT<DT>* dx, float* slots, float inv_m,
                                     float* smem) {
    constexpr int CHUNKS = cdiv_c(K, BN);
    float* wt = smem;  // BN rows of w, once the product's stages are done with
    float* logits = smem + max_c(ProductSmem<BL, N, BK>::FLOATS, BN * N);
    float* dl = logits + BL * N;  // d as stored, the dx product's left operand
    float* row_loss = dl + BL * N;
    const int tid = threadIdx.x;
    for (int t = blockIdx.x; t < cdiv_c(M, BL) * CHUNKS; t += gridDim.x) {
        const int block = t / CHUNKS, m0 = block * BL, k0 = (t % CHUNKS) * BN;
        const bool first = t % CHUNKS == 0;
        // Loaded now, so that they arrive while the product runs: BN rows of w (stored once the
        // product is done with its stages), dx's ReLU mask (its tile of a) and the rows' labels.
        Staged<BN * N, THREADS> w_rows;
        w_rows.load([&](int e, bool in) {
            return as_operand<DT>(ldcg1_if(in && k0 + e / N < K, w + (i64)(k0 + e / N) * N + e % N));
        });
        Staged<BL * BN, THREADS> mask;
        mask.load([&](int e, bool in) {
            const int m = m0 + e / BN, k = k0 + e % BN;
            return load_cg<DT>(in && m < M && k < K, a + (i64)m * K + k);
        });
        constexpr int ROWS_EACH = cdiv_c(BL, THREADS);
        i64 labels[ROWS_EACH];
#pragma unroll
        for (int i = 0; i < ROWS_EACH; ++i) {
            const int r = tid + i * THREADS;
            labels[i] = r < BL && m0 + r < M ? y[rows[m0 + r]] : 0;
        }
        product<BL, N, BK, THREADS, true, false>(
            0, K,
            [&](int m, int k, bool in) { return load_cg<DT>(in && m0 + m < M && k < K, a + (i64)(m0 + m) * K + k); },
            [&](int k, int n, bool in) { return as_operand<DT>(ldcg1_if(in && k < K && n < N, w + (i64)k * N + n)); },
            [&](int m, int n) { return ldcg1_if(n < N, b + n); },  // the bias
            [&](int m, int n, float v, float bias) { logits[m * N + n] = Elt<DT>::load(Elt<DT>::store(v + bias)); },
            smem);
        __syncthreads();  // the logits are whole
        w_rows.store([&](int e, float v) { wt[e] = v; });
#pragma unroll
        for (int i = 0; i < ROWS_EACH; ++i) {
            const int r = tid + i * THREADS, m = m0 + r;
            if (r >= BL) break;
            float* z = logits + r * N;
            float top = neg_inf(), total = 0.f, picked = 0.f;
            for (int n = 0; n < N; ++n) top = fmaxf(top, z[n]);
            for (int n = 0; n < N; ++n) total += expf(z[n] - top);
            if (m < M) {
                const i64 label = labels[i];
                for (int n = 0; n < N; ++n) picked = n == label ? z[n] : picked;  // a label past N picks nothing
                row_loss[r] = top + logf(total) - picked;
                for (int n = 0; n < N; ++n) {
                    const EltT<DT> g = Elt<DT>::store((expf(z[n] - top) / total - (n == label ? 1.f : 0.f)) * inv_m);
                    if (first) d[m * N + n] = g;
                    dl[r * N + n] = Elt<DT>::load(g);
                }
            } else {
                row_loss[r] = 0.f;
            }
        }
        __syncthreads();
        if (first && tid == 0) {
            float sum = 0.f;
            for (int r = 0; r < BL; ++r) sum += row_loss[r];
            slots[block] = sum;
        }
        mask.store([&](int idx, float a_value) {
            const int r = idx / BN, k = k0 + idx % BN;
            if (m0 + r < M && k < K) {
                float g = 0.f;
                for (int n = 0; n < N; ++n) g = fmaf(dl[r * N + n], wt[(idx % BN) * N + n], g);
                dx[(i64)(m0 + r) * K + k] = Elt<DT>::store(a_value > 0.f ? g : 0.f);
            }
        });
    }
}

// Tile t (BM x BN) of a layer's input gradient dx = (d @ w^T) * (a > 0): d (M x N) its output's
// gradient, w (K x N) its weights (before this step's update), a (M x K) its input, dx (M x K).
template <int DT, int M, int K, int N, int BM, int BN, int BK, int THREADS>
__device__ __forceinline__ void input_grad(const EltT<DT>* d, const float* w, const EltT<DT>* a, EltT<DT>* dx, int t,
                                           float* smem) {
    constexpr int TILES_K = cdiv_c(K, BN);
    const int m0 = (t / TILES_K) * BM, k0 = (t % TILES_K) * BN;
    product<BM, BN, BK, THREADS, true, true>(
        0, N, [&](int m, int n, bool in) { return load_cg<DT>(in && m0 + m < M && n < N, d + (i64)(m0 + m) * N + n); },
        [&](int n, int k, bool in) {
            return as_operand<DT>(ldcg1_if(in && n < N && k0 + k < K, w + (i64)(k0 + k) * N + n));
        },
        [&](int m, int k) {  // the ReLU mask
            m += m0, k += k0;
            return load_cg<DT>(m < M && k < K, a + (i64)m * K + k);
        },
        [&](int m, int k, float v, float a_value) {
            m += m0, k += k0;
            if (m < M && k < K) dx[(i64)m * K + k] = Elt<DT>::store(a_value > 0.f ? v : 0.f);
        },
        smem);
}

// Tile t (BR x BC) of a layer's weights w (K x N) takes its SGD step (fused.cuh's sgd_step, the
// rule of optim.cu) with the gradient a^T @ d, the batch BK rows at a time: a (M x K) the layer's
// input (GATHER: rows of the dataset), d (M x N) its output's gradient; the tiles of row block 0
// update b with d's column sums (fused.cuh's BiasGrad, as linear_sgd's): added from the product's
// stages of d while they are live, the bias lines sent for before the product, so the bias costs
// those tiles no trip to L2 after it.
template <int DT, int M, int K, int N, int BR, int BC, int BK, int THREADS, bool GATHER, int HAS_MOMENTUM,
          int HAS_WEIGHT_DECAY>
__device__ __forceinline__ void update(const EltT<DT>* a, const i64* rows, const EltT<DT>* d, float* w, float* b,
                                       float* w_buf, float* b_buf, int t, float lr, float momentum,
                                       float weight_decay, float* smem) {
    constexpr int TILES_C = cdiv_c(N, BC);
    const int block = t / TILES_C, r0 = block * BR, c0 = (t % TILES_C) * BC;
    const float wd = HAS_WEIGHT_DECAY ? weight_decay : 0.f;  // a constant 0 compiles sgd_apply's term away
    auto sgd = [&](i64 at) {
        return SgdArgs<EltT<DT>>{HAS_MOMENTUM ? w_buf + at : nullptr, nullptr, lr, momentum, wd};
    };
    BiasGrad<BC, THREADS> bias;
    if (block == 0) bias.prefetch(b, HAS_MOMENTUM ? b_buf : nullptr, c0, N);
    product<BR, BC, BK, THREADS, false, false>(
        0, M,
        [&](int r, int m, bool in) { return a_elem<DT, K, GATHER>(a, rows, m, r0 + r, in && r0 + r < K && m < M); },
        [&](int m, int c, bool in) { return load_cg<DT>(in && m < M && c0 + c < N, d + (i64)m * N + c0 + c); },
        [&](int r, int c) {  // the weight and its momentum
            r += r0, c += c0;
            const i64 at = (i64)r * N + c;
            return sgd_load<DT, 1>(w + at, sgd(at), r < K && c < N ? 1 : 0, false);
        },
        [&](int r, int c, float v, SgdIn<1> in) {
            r += r0, c += c0;
            if (r < K && c < N) {
                const float g[1] = {v};
                const i64 at = (i64)r * N + c;
                sgd_apply<DT, 1>(w + at, sgd(at), g, in, 1, false);
            }
        },
        smem, [&](const float* right, int ld) {
            if (block == 0) bias.template add<BK>([&](int k, int c) { return right[k * ld + c]; });
        });
    if (block == 0) bias.template step<DT>(b, c0, N, {HAS_MOMENTUM ? b_buf : nullptr, nullptr, lr, momentum, wd});
}

// The grid barrier after a phase; with STAMPS, block 0 then writes the GPU's nanosecond clock to
// stamps[barriers so far] (stamps[0]: the launch's start), the phases' boundaries.
template <int STAMPS>
__device__ __forceinline__ void end_phase(u32* counter, u32 arrivals, i64* stamps) {
    grid_barrier(counter, arrivals);
    if constexpr (STAMPS) {
        if (blockIdx.x == 0 && threadIdx.x == 0) stamps[arrivals / gridDim.x] = (i64)globaltimer();
    }
}

// `steps` steps from the epoch's slot *pos on (wrapping at epoch_steps), then *pos += steps. x is
// (images, IN) in T; y the images' int64 labels; batches (epoch_steps, M) int64 rows of x; params
// and bufs flat fp32 (W_0, b_0, W_1, b_1, ...; bufs untouched without momentum); acts LAYERS x M x H
// and grads LAYERS x M x H + M x OUT of T; part SPLIT_K x M x H fp32 and counts, one a BM x BN
// tile of the first layer's output, zeroed by the host once (SPLIT_K > 1); slots cdiv(M, BL) fp32;
// counter zeroed by the host; stamps (STAMPS) 1 + steps x barriers int64.
template <int DT, int LAYERS, int IN, int H, int OUT, int M, int BM, int BN, int BK, int BR, int BR0, int BC,
          int BL, int SPLIT_K, int THREADS, int HAS_MOMENTUM, int HAS_WEIGHT_DECAY, int STAMPS>
__global__ void __launch_bounds__(THREADS, 1)
train_steps(const EltT<DT>* x, const i64* y, const i64* batches, float* params, float* bufs, EltT<DT>* acts,
            EltT<DT>* grads, float* part, int* counts, float* slots, float* losses, u32* counter, i64* pos, i64* stamps,
            int steps, int epoch_steps, float lr, float momentum, float weight_decay, float inv_m) {
    extern __shared__ __align__(16) float shared[];
    typedef PersistentSmem<M, OUT, BM, BN, BK, BR, BR0, BC, BL> Smem;
    float* const smem = shared + Smem::ROWS;  // the phases'
    constexpr int HIDDEN = H * H + H;  // W_l and b_l of a hidden layer
    constexpr int W1 = IN * H + H, W_LAST = W1 + (LAYERS - 1) * HIDDEN, B_LAST = W_LAST + H * OUT;
    constexpr int N1 = LAYERS == 1 ? OUT : H;  // W_1's columns
    constexpr int MH = M * H;
    constexpr int DX_TILES = cdiv_c(M, BM) * cdiv_c(H, BN);
    EltT<DT>* const d_last = grads + LAYERS * MH;
    if (STAMPS && blockIdx.x == 0 && threadIdx.x == 0) stamps[0] = (i64)globaltimer();
    const i64 first = *pos;
    u32 arrivals = 0;
    constexpr int ROWS_EACH = cdiv_c(M, THREADS);
    for (int i = threadIdx.x; i < M; i += THREADS)  // the first step's rows; each later step's come ahead
        reinterpret_cast<i64*>(shared)[i] = batches[first % epoch_steps * M + i];
    for (int step = 0; step < steps; ++step) {
        const i64 s = (first + step) % epoch_steps;
        // rows: this step's batch rows, staged during the step before (the first step's above);
        // next_rows: the next step's, staged during this step's loss phase where the last step's
        // were, whose readers passed its final barrier.
        i64* const rows = reinterpret_cast<i64*>(shared + step % 2 * Smem::ROW_STEP);
        i64* const next_rows = reinterpret_cast<i64*>(shared + (step + 1) % 2 * Smem::ROW_STEP);
        __syncthreads();
        forward<DT, M, IN, H, BM, BN, BK, THREADS, true, SPLIT_K>(x, rows, params, params + IN * H, acts, part,
                                                                  counts, smem);
        end_phase<STAMPS>(counter, arrivals += gridDim.x, stamps);
        for (int l = 1; l < LAYERS; ++l) {
            const int at = W1 + (l - 1) * HIDDEN;
            forward<DT, M, H, H, BM, BN, BK, THREADS, false, 1>(acts + (l - 1) * MH, rows, params + at,
                                                                params + at + H * H, acts + l * MH, part, counts,
                                                                smem);
            end_phase<STAMPS>(counter, arrivals += gridDim.x, stamps);
        }
        i64 ahead[ROWS_EACH];  // the next step's rows, sent for before the loss and stored after it
#pragma unroll
        for (int i = 0; i < ROWS_EACH; ++i) {
            const int r = threadIdx.x + i * THREADS;
            ahead[i] = r < M ? batches[(s + 1) % epoch_steps * M + r] : 0;
        }
        loss<DT, M, H, OUT, BL, BN, BK, THREADS>(acts + (LAYERS - 1) * MH, rows, params + W_LAST, params + B_LAST, y,
                                                 d_last, grads + (LAYERS - 1) * MH, slots, inv_m, smem);
#pragma unroll
        for (int i = 0; i < ROWS_EACH; ++i) {
            const int r = threadIdx.x + i * THREADS;
            if (r < M) next_rows[r] = ahead[i];
        }
        end_phase<STAMPS>(counter, arrivals += gridDim.x, stamps);
        // The next step's rows of x and their labels, sent for into L2 now (row r by block r mod
        // the grid), the step's remaining phases (one or more) before the next step's first reads them.
        for (int r = blockIdx.x; r < M; r += gridDim.x) {
            const u64 from = (u64)(x + next_rows[r] * IN), to = (u64)(x + (next_rows[r] + 1) * IN);  // bytes
            for (u64 line = from / 128 + threadIdx.x; line <= (to - 1) / 128; line += THREADS)
                prefetch_l2(reinterpret_cast<const void*>(line * 128));
            if (threadIdx.x == 0) prefetch_l2(y + next_rows[r]);
        }
        if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) {  // the step's loss: the row blocks' sums in slot order
            float total = 0.f;
            for (int i = 0; i < cdiv_c(M, BL); ++i) total += ldcg1(slots + i);
            losses[s] = total * inv_m;
        }
        for (int l = LAYERS - 1; l >= 1; --l) {  // dx through W_l (H x H), and W_{l+1}'s update
            const int at = W1 + (l - 1) * HIDDEN, next = at + HIDDEN;
            const bool last = l + 1 == LAYERS;  // W_{l+1} is W_L (H x OUT)
            const int tiles = DX_TILES + cdiv_c(H, BR) * (last ? cdiv_c(OUT, BC) : cdiv_c(H, BC));
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                if (t < DX_TILES)
                    input_grad<DT, M, H, H, BM, BN, BK, THREADS>(grads + l * MH, params + at, acts + (l - 1) * MH,
                                                                 grads + (l - 1) * MH, t, smem);
                else if (last)
                    update<DT, M, H, OUT, BR, BC, BK, THREADS, false, HAS_MOMENTUM, HAS_WEIGHT_DECAY>(
                        acts + l * MH, rows, d_last, params + next, params + next + H * OUT, bufs + next,
                        bufs + next + H * OUT, t - DX_TILES, lr, momentum, weight_decay, smem);
                else
                    update<DT, M, H, H, BR, BC, BK, THREADS, false, HAS_MOMENTUM, HAS_WEIGHT_DECAY>(
                        acts + l * MH, rows, grads + (l + 1) * MH, params + next, params + next + H * H, bufs + next,
                        bufs + next + H * H, t - DX_TILES, lr, momentum, weight_decay, smem);
            }
            end_phase<STAMPS>(counter, arrivals += gridDim.x, stamps);
        }
        constexpr int FIRST_TILES = cdiv_c(H, BR) * cdiv_c(N1, BC);  // W_1's, then W_0's (BR0 x BC)
        for (int t = blockIdx.x; t < FIRST_TILES + cdiv_c(IN, BR0) * cdiv_c(H, BC); t += gridDim.x) {
            if (t < FIRST_TILES)
                update<DT, M, H, N1, BR, BC, BK, THREADS, false, HAS_MOMENTUM, HAS_WEIGHT_DECAY>(
                    acts, rows, grads + MH, params + W1, params + W1 + H * N1, bufs + W1, bufs + W1 + H * N1, t, lr,
                    momentum, weight_decay, smem);
            else
                update<DT, M, IN, H, BR0, BC, BK, THREADS, true, HAS_MOMENTUM, HAS_WEIGHT_DECAY>(
                    x, rows, grads, params, params + IN * H, bufs, bufs + IN * H, t - FIRST_TILES, lr, momentum,
                    weight_decay, smem);
        }
        end_phase<STAMPS>(counter, arrivals += gridDim.x, stamps);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) *pos = first + steps;
}

#ifdef STANDALONE
// The default config (kernels_core/persistent.py: DEFAULT) at the default protocol's shape, with
// momentum, instantiated for the build line at the top.
void* const standalone_kernels[] = {
    (void*)&train_steps<DT_FP32, 2, 784, 128, 10, 128, 32, 32, 32, 32, 32, 32, 16, 1, 256, 1, 0, 0>,
    (void*)&train_steps<DT_FP16, 2, 784, 128, 10, 128, 32, 32, 32, 32, 32, 32, 16, 1, 256, 1, 0, 0>,
};
#endif
