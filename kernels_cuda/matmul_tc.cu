// fp16 / bf16 matmul on the tensor cores with warp-level mma.sync, and fp32 on their TF32 path:
// C = act(op(A) @ op(B) + bias), C row-major M x N in the inputs' dtype.
// Build alone, no GPU needed (registers, shared memory and spills of the default configs):
//   nvcc -cubin -arch=sm_90 -std=c++17 -DSTANDALONE --resource-usage -o /dev/null kernels_cuda/matmul_tc.cu
//
// Bound by arithmetic at large sizes: 2 * M * N * K FLOPs, 4096^3 is 137 GFLOP, 0.18 ms at the
// 756 TFLOP/s cuBLAS reaches in fp16 on the H200 with wgmma; mma.sync, which this kernel issues,
// reaches little more than half of that there (experiments/FINDINGS.md, "Large square GEMMs").
// Per BK slice a block loads (BM + BN) * BK * 2 bytes for 2 * BM * BN * BK FLOPs: 128 x 256
// tiles give ~85 FLOP/byte of global traffic, under the H200's ~990 TFLOP/s / 4.8 TB/s ~ 200
// FLOP/byte, so neighbouring blocks must find their operand tiles in L2 (the GROUP_M block
// order). Inside the block a warp reads (WM + WN) * 16 * 2 bytes of shared memory per
// 2 * WM * WN * 16 FLOPs, which is why warp tiles are at least 32 x 32, except where outputs are
// too small for anything but latency to matter: in one-warp blocks (tiles down to 16 x 16) and in
// blocks of at most 512 outputs on 2-4 warps (warp tiles down to 16 x 8, the n-tile count NT then
// odd), where more warps per block halve each warp's chain of mmas and copies
// (experiments/FINDINGS.md, "Tensor-core kernel: small blocks and the one-warp cost").
//
// What the template arguments select:
//  - BM x BN tile of C per block, BK of K per k step, on WARPS_M x WARPS_N warps: each warp owns
//    a WM x WN = (BM / WARPS_M) x (BN / WARPS_N) sub-tile, MT x NT accumulator fragments of 16 x 8
//    (one m16n8k16 mma each per 16-wide k step).
//  - SM80 = 1 (sm_80 and newer): global -> shared with cp.async in a STAGES-deep ring (copies of
//    tile k + STAGES - 1 fly while tile k is multiplied); cp.async's src-size operand zero-fills
//    the ragged edges of M, N and K, so the inner loop has no bounds checks. SM80 = 0 (sm_75: no
//    cp.async, no m16n8k16): the next tile is staged through registers while the current one is
//    multiplied (STAGES = 2 shared buffers), and each k16 mma is two m16n8k8.
//  - A_KC / B_KC: k is the operand's contiguous dimension. Shared tiles keep it contiguous (no
//    transposing copies): A is [BM][BK] if A_KC, else [BK][BM]; B is [BN][BK] or [BK][BN].
//    ldmatrix reads the first layout and ldmatrix.trans the second, both giving the same mma
//    fragments. Shared rows are unpadded and their 16-byte units swizzled (TcTile::at), so that
//    the 8 row addresses of an ldmatrix phase land in 8 distinct 16-byte bank groups and every
//    32-byte sector a copy reads lands whole in one aligned 32 bytes.
//  - VA / VB: halves per copy along the contiguous dimension (8 = 16 bytes); the host lowers
//    them when pointer or leading dimension alignment does not allow 16 bytes.
//  - GROUP_M: the block order (swizzle.cuh). DT: fp16 or bf16 (sm_80 and newer). ACC16:
//    accumulation in fp16 registers (mma .f16 accumulators), for fp16 only. HAS_BIAS, RELU: the
//    plain epilogue's bias and ReLU.
//  - SPLIT_K > 1 (outputs of few tiles, e.g. 32 x 1024 with K = 8192): the grid is tiles x slices
//    (at most SPLIT_K), each block runs the same loop over its K slice, and the last block of a
//    tile to finish adds the fp32 partials in slice order before the epilogue (splitk.cuh:
//    enter_slice, splitk_reduce). SPLIT_K == 1 compiles none of that: the same code as without
//    the parameter.
//  - A_ROWS, EPI: the fused paths (fused.cuh), each compiling nothing when off. A_ROWS reads A's
//    stored rows through the index vector a_rows (matmul's a_rows, linear_sgd's x_rows); EPI
//    picks the epilogue: matmul's relu_grad_of, linear_cross_entropy, linear_sgd.
//  - DT = fp32 with TF32 = 1 or 3 (sm_80 and newer): the same tiles, copies and epilogues on fp32
//    elements, which the tiles move as pairs of halves (TcTile's EH), and m16n8k8 TF32 mmas. TF32
//    = 1 rounds each fragment register to TF32 (cvt.rna: to nearest, ties away) and takes one
//    product: about 2^-11 relative error per product, a lower precision. TF32 = 3 (3xTF32) splits
//    each register as it leaves shared memory, x = big + small with big = tf32(x) and small =
//    tf32(x - big), and sums small * big + big * small + big * big: what it drops is at most
//    3 * 2^-22 |a||b| per product, below the fp32 sum's error past small K, and infinities and
//    NaNs come out as IEEE's (kernels_triton/matmul.py's docstring has both). The three products
//    of each k8 step are summed from zero and added to the fp32 accumulators outside the tensor
//    cores: an mma adds into its accumulator rounding toward zero, and over K / 8 steps that
//    bias, not the split, set the error (2.9e-5 of the result's norm at 4096^3 on the H200,
//    against 1.15e-6 for fp32 on the FMA units; experiments/FINDINGS.md, "fp32 on TF32 tensor
//    cores"). Three times the mmas of TF32 = 1 on
//    the same tile, about a third of the tensor cores' TF32 rate, which is several times the
//    FMA units' fp32. Where k is the tiles' contiguous dimension ldmatrix still gives the
//    fragments (mma_stage); where it runs along their rows each register is a 32-bit shared load.
#include "dtypes.cuh"
#include "fused.cuh"
#include "ptx.cuh"
#include "splitk.cuh"
#include "swizzle.cuh"
#include "tf32.cuh"

// A compile-time flag passed as a value, for generic lambdas (NVRTC has no <type_traits>).
template <bool B> struct Flag { static constexpr bool value = B; };

// ---------------------------------------------------------------- PTX wrappers

// Two 8x8 matrices, rows addressed by lanes 0-15 (the other lanes' addresses are not read).
template <int TRANS>
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 addr) {
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

template <int TRANS>
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Accumulator fragment of one 16 x 8 tile: (row g, cols 2t, 2t+1) then
// (row g + 8, same cols), g = lane / 4, t = lane % 4. fp32: 4 floats;
// fp16: 2 registers of two halves, lower column in the low half.
template <int ACC16> struct Acc { float v[4]; };
template <> struct Acc<1> { u32 v[2]; };

// c += a (16 x 16, row) * b (16 x 8, col).
template <int DT, int SM80>
__device__ __forceinline__ void mma_16816(Acc<0>& c, const u32 (&a)[4], const u32 (&b)[2]) {
    if constexpr (SM80) {
        if constexpr (DT == DT_BF16)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                         : "+f"(c.v[0]), "+f"(c.v[1]), "+f"(c.v[2]), "+f"(c.v[3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
        else
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                         : "+f"(c.v[0]), "+f"(c.v[1]), "+f"(c.v[2]), "+f"(c.v[3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {  // sm_75, fp16 only: k 0..7 uses a0, a1, b0; k 8..15 uses a2, a3, b1.
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                     : "+f"(c.v[0]), "+f"(c.v[1]), "+f"(c.v[2]), "+f"(c.v[3])
                     : "r"(a[0]), "r"(a[1]), "r"(b[0]));
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                     : "+f"(c.v[0]), "+f"(c.v[1]), "+f"(c.v[2]), "+f"(c.v[3])
                     : "r"(a[2]), "r"(a[3]), "r"(b[1]));
    }
}

template <int DT, int SM80>
__device__ __forceinline__ void mma_16816(Acc<1>& c, const u32 (&a)[4], const u32 (&b)[2]) {
    if constexpr (SM80) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};\n"
                     : "+r"(c.v[0]), "+r"(c.v[1])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3}, {%4}, {%0,%1};\n"
                     : "+r"(c.v[0]), "+r"(c.v[1]) : "r"(a[0]), "r"(a[1]), "r"(b[0]));
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3}, {%4}, {%0,%1};\n"
                     : "+r"(c.v[0]), "+r"(c.v[1]) : "r"(a[2]), "r"(a[3]), "r"(b[1]));
    }
}

// c += a (16 x 8, row) * b (8 x 8, col) on TF32 tensor cores (sm_80 and newer): a0 (g, t),
// a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); b0 (k t, n g), b1 (k t + 4, n g); fp32 bits
// whose low 13 mantissa bits the tensor cores ignore.
__device__ __forceinline__ void mma_1688_tf32(Acc<0>& c, const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c.v[0]), "+f"(c.v[1]), "+f"(c.v[2]), "+f"(c.v[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 32 bits of shared memory at a shared-space address.
__device__ __forceinline__ u32 lds32(u32 addr) {
    u32 r;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(r) : "r"(addr));
    return r;
}

__device__ __forceinline__ float acc_get(const Acc<0>& c, int i) { return c.v[i]; }

__device__ __forceinline__ float acc_get(const Acc<1>& c, int i) {
    return f16_to_f32((u16)(c.v[i / 2] >> (16 * (i % 2))));
}

__device__ __forceinline__ void acc_set(Acc<0>& c, int i, float x) { c.v[i] = x; }

__device__ __forceinline__ void acc_set(Acc<1>& c, int i, float x) {
    const int shift = 16 * (i % 2);
    c.v[i / 2] = (c.v[i / 2] & ~(0xffffu << shift)) | ((u32)f32_to_f16(x) << shift);
}

// ------------------------------------------------------------ operand tiles

// A ROWS x COLS tile of a matrix whose COLS dimension is contiguous:
// element (r, c) of the tile is X[(r0 + r) * ld + c0 + c], valid for
// r0 + r < R and c0 + c < CN, zero outside. Shared copy: [ROWS][COLS], element (r, c) at at(r, c).
// GATHER: X's rows are read through the index vector `rows` of X's
// `stored` rows: row r0 + r is X + rows[r0 + r] * ld, a row of zeros where
// fused.cuh's gathered_row says so.
// The tile is kept and copied in halves (16-bit units): an fp32 matrix (TF32) is read as one of
// EH = 2 times the columns, each element two consecutive halves. COLS, V, the shared layout and
// the copies count halves; the callers' coordinates along the columns (c0, CN, a k step's k0
// there) and leading dimensions count elements, and are scaled here.
template <int ROWS, int COLS, int V, int T, int GATHER = 0, int EH = 1>
struct TcTile {
    static_assert(COLS % 16 == 0, "rows of whole 32-byte sectors");
    static constexpr int LD_S = COLS;          // halves per shared row
    static constexpr int STAGE = ROWS * LD_S;  // halves per pipeline stage
    static constexpr int CHUNKS = ROWS * COLS / V;

    // The shared layout. Unit u (16 bytes, 8 halves) of row r sits at unit u ^ swz(r) of that row:
    // swz takes each of 8 consecutive rows (the rows of an ldmatrix phase, 8-aligned) to its own
    // 16-byte slot of the 128-byte bank lines (rows of 32, 64 bytes share a line: 4, 2 to one),
    // and, an XOR on whole units that keeps units 2i and 2i + 1 a pair, leaves each 32-byte sector
    // of a row whole and aligned. Rows padded by 8 halves would do the first but leave every odd
    // row's sectors straddling two
    // (experiments/FINDINGS.md, "Tensor-core kernel: the main loop at 32 x N"). swz(r + 8i) = swz(r).
    static constexpr int UNITS = COLS / 8, LINE_ROWS = UNITS >= 8 ? 1 : 8 / UNITS, SWZ = UNITS >= 8 ? 8 : UNITS;
    static __device__ __forceinline__ int swz(int r) { return r / LINE_ROWS % SWZ; }
    static __device__ __forceinline__ int at(int r, int c) { return r * COLS + (((c / 8) ^ swz(r)) * 8 + c % 8); }
    static constexpr int PER_THREAD = (CHUNKS + T - 1) / T;
    typedef Pack<u16, V> P;

    // Where chunk c goes and how many of its V elements exist in X.
    static __device__ __forceinline__ int chunk(int c, const u16* X, i64 ld, int r0, int c0, int R, int CN,
                                                const i64* rows, i64 stored, const u16*& src, int& s_off) {
        const int r = c / (COLS / V), col = (c % (COLS / V)) * V;
        const int gr = r0 + r, gc = c0 * EH + col;
        s_off = at(r, col);
        const int left = CN * EH - gc;
        if constexpr (GATHER) {
            const i64 row = gathered_row(rows, gr, R, stored);
            const int n_ok = row >= 0 ? (left < 0 ? 0 : (left < V ? left : V)) : 0;
            src = n_ok > 0 ? X + row * ld * EH + gc : X;
            return n_ok;
        }
        const int n_ok = gr < R ? (left < 0 ? 0 : (left < V ? left : V)) : 0;
        src = n_ok > 0 ? X + (i64)gr * ld * EH + gc : X;  // never form an address past the edge
        return n_ok;
    }

    // sm_80+, operands read straight (no gathered rows) in chunks of V >= 2: this thread's copies of
    // every k step, what no k step changes worked out once. Its chunks are c = threadIdx.x + p * T,
    // chunk p DR rows or DC columns past chunk 0 (CPR, the chunks of a row, and T are powers of two,
    // so one divides the other), which holds while a row has no more chunks than the block has
    // threads or a thread's chunks all lie in one row (STRIDED); past that chunk p wraps into the
    // next row (e.g. one warp reading 128-wide rows 4 bytes at a time), and the kernel takes
    // load_async. Working out every chunk's address and edges from scratch at each k step, as
    // load_async does, costs several times the instructions, and in a one-warp block every
    // instruction's latency is waited on
    // (experiments/FINDINGS.md, "Tensor-core kernel: small blocks and the one-warp cost").
    // K_ROWS: k runs along the tile's rows (element (r, c) of the step at k0 is
    // X[(k0 + r) * ld + origin + c] with R = K), else along its columns
    // (X[(origin + r) * ld + k0 + c], CN = K).
    static constexpr int CPR = COLS / V;
    static constexpr int DR = T >= CPR ? T / CPR : 0, DC = T >= CPR ? 0 : T * V;
    static constexpr bool STRIDED = T >= CPR || PER_THREAD * T <= CPR;  // Async's chunk map holds
    // Chunk p's shared address is chunk p % NDST's plus (p / NDST) * 8 rows (or p * DC columns, DC
    // a multiple of 8 units: the swizzle leaves both offsets alone); NDST = 8 / DR when chunks DR
    // < 8 rows apart fall under different swizzles.
    static constexpr int NDST = DR > 0 && DR < 8 ? 8 / DR : 1;

    template <int K_ROWS>
    struct Async {
        const u16* next;  // chunk 0's element of X in the next k step to queue
        i64 step, dp;     // elements from one k step to the next; from a thread's chunk to its next
        int rows_left;    // the tile's rows from chunk 0's on that lie inside X, at k0 = 0
        int cols_left;    // its columns from chunk 0's on inside X, at k0 = 0
        u32 dst[NDST];    // chunks 0 .. NDST - 1's shared addresses in stage 0
        // GATHER (k along the columns only): each chunk's row is looked up once, here, where
        // load_async looked it up at every k step (the tuner times the first layer's products so,
        // and the trainer runs them so). A row of zeros (gathered_row's -1) copies no bytes.
        static constexpr int NG = GATHER && !K_ROWS ? PER_THREAD : 1;
        const u16* row_at[NG];  // chunk p's element of X at k0 = 0
        int row_bytes[NG];      // what a whole copy of it reads: 2V bytes, or 0 for a row of zeros

        __device__ __forceinline__ Async(const u16* X, u16* Xs, i64 ld, int origin, int R, int CN,
                                         const i64* rows = nullptr, i64 stored = 0) {
            const int r = threadIdx.x / CPR, col = (threadIdx.x % CPR) * V;
            const i64 ldh = ld * EH;  // halves
            next = X + (K_ROWS ? (i64)r * ldh + origin * EH + col : (i64)(origin + r) * ldh + col);
            step = K_ROWS ? (i64)ROWS * ldh : COLS;
            dp = DR * ldh + DC;
            rows_left = R - r - (K_ROWS ? 0 : origin);
            cols_left = CN * EH - col - (K_ROWS ? origin * EH : 0);
#pragma unroll
            for (int d = 0; d < NDST; ++d) dst[d] = smem_addr(Xs + at(r + d * DR, col));
            if constexpr (GATHER && !K_ROWS) {
#pragma unroll
                for (int p = 0; p < PER_THREAD; ++p) {
                    const i64 row = gathered_row(rows, origin + r + p * DR, R, stored);
                    row_at[p] = row >= 0 ? X + row * ldh + col + p * DC : X;
                    row_bytes[p] = row >= 0 ? 2 * V : 0;
                }
            }
        }

        // Chunk p's shared address in stage s.
        __device__ __forceinline__ u32 to(int s, int p) const {
            return dst[p % NDST] + 2 * (s * STAGE + p / NDST * (NDST * DR * COLS + DC));
        }

        // Queues the copies of the k step at k0 into stage s, and moves on to the next k step: the
        // kernel queues every k step once, in order, so the source address is a running pointer
        // (worked out from k0 and the leading dimension, it would be a chain of 64-bit multiplies
        // and adds ahead of each copy:
        // experiments/FINDINGS.md, "Tensor-core kernel: the main loop at 32 x N"). WHOLE: the
        // caller knows every chunk of the step lies inside X, and the copies are whole with no test
        // at all. Else a thread whose chunks all lie inside X copies them
        // whole; at an edge cp.async's src-size zero-fills what lies outside X, and no address
        // outside it is passed to a copy.
        template <bool WHOLE>
        __device__ __forceinline__ void load(const u16* X, int s, int k0) {
            static_assert(V >= 2 && (!GATHER || !K_ROWS) && STRIDED, "2-byte chunks, gathered rows along k, rows "
                                                                     "of more chunks than threads take load_async");
            const int rows = rows_left - (K_ROWS ? k0 : 0), cols = cols_left - (K_ROWS ? 0 : k0 * EH);
            if constexpr (GATHER) {
#pragma unroll
                for (int p = 0; p < PER_THREAD; ++p) {
                    if (CHUNKS % T != 0 && threadIdx.x + p * T >= CHUNKS) break;
                    const int left = cols - p * DC;
                    const int n_bytes = WHOLE ? row_bytes[p] : row_bytes[p] && left > 0 ? 2 * (left < V ? left : V) : 0;
                    cp_async<2 * V>(to(s, p), n_bytes ? row_at[p] + k0 * EH : X, n_bytes);
                }
                return;
            }
            const u16* from = next;
            next += step;
            constexpr int LAST = PER_THREAD - 1;
            if (WHOLE || (rows > LAST * DR && cols - LAST * DC >= V)) {
#pragma unroll
                for (int p = 0; p < PER_THREAD; ++p) {
                    if (CHUNKS % T != 0 && threadIdx.x + p * T >= CHUNKS) break;
                    cp_async_whole<2 * V>(to(s, p), from + p * dp);
                }
                return;
            }
#pragma unroll
            for (int p = 0; p < PER_THREAD; ++p) {
                if (CHUNKS % T != 0 && threadIdx.x + p * T >= CHUNKS) break;
                const int left = cols - p * DC;
                const int n_ok = p * DR < rows ? (left < 0 ? 0 : (left < V ? left : V)) : 0;
                const u16* src = n_ok > 0 ? from + p * dp : X;
                cp_async<2 * V>(to(s, p), src, 2 * n_ok);
            }
        }
    };

    // sm_80+, every case: asynchronous copies straight into the stage.
    static __device__ __forceinline__ void load_async(u16* Xs, const u16* X, i64 ld, int r0, int c0, int R, int CN,
                                                      const i64* rows, i64 stored) {
#pragma unroll
        for (int p = 0; p < PER_THREAD; ++p) {
            const int c = threadIdx.x + p * T;
            if (CHUNKS % T != 0 && c >= CHUNKS) break;
            const u16* src;
            int s_off;
            const int n_ok = chunk(c, X, ld, r0, c0, R, CN, rows, stored, src, s_off);
            if constexpr (V >= 2) {
                cp_async<2 * V>(smem_addr(Xs + s_off), src, 2 * n_ok);
            } else {  // 2-byte chunks are below cp.async's minimum: plain copy
                Xs[s_off] = n_ok ? *src : (u16)0;
            }
        }
    }

    // sm_75: global -> registers now, registers -> shared later.
    struct Staged {
        P r[PER_THREAD];

        __device__ __forceinline__ void fetch(const u16* X, i64 ld, int r0, int c0, int R, int CN, const i64* rows,
                                              i64 stored) {
#pragma unroll
            for (int p = 0; p < PER_THREAD; ++p) {
                const int c = threadIdx.x + p * T;
                if (CHUNKS % T != 0 && c >= CHUNKS) break;
                const u16* src;
                int s_off;
                const int n_ok = chunk(c, X, ld, r0, c0, R, CN, rows, stored, src, s_off);
                if (n_ok == V) {
                    r[p] = *reinterpret_cast<const P*>(src);
                } else {
#pragma unroll
                    for (int j = 0; j < V; ++j) r[p].v[j] = j < n_ok ? src[j] : (u16)0;
                }
            }
        }

        __device__ __forceinline__ void store(u16* Xs) const {
#pragma unroll
            for (int p = 0; p < PER_THREAD; ++p) {
                const int c = threadIdx.x + p * T;
                if (CHUNKS % T != 0 && c >= CHUNKS) break;
                const int row = c / (COLS / V), col = (c % (COLS / V)) * V;
                *reinterpret_cast<P*>(Xs + at(row, col)) = r[p];
            }
        }
    };
};

// ---------------------------------------------------------------- the block's stages

// One block of the kernel: its shape, which the template arguments fix, where it and its warp
// sit in C, and the steps of its main loop the kernel calls: the sends for the epilogue's reads,
// a stage's mmas, linear_sgd's bias sums and split-K's sums.
template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, int VA, int VB, int DT, int A_KC, int B_KC,
          int HAS_BIAS, int RELU, int ACC16, int SM80, int TF32, int A_ROWS, int EPI>
struct TcBlock {
    static constexpr int T = 32 * WARPS_M * WARPS_N;
    static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    static constexpr int MT = WM / 16, NT = WN / 8;
    typedef typename Elt<DT>::T ET;                   // the operands' and C's element type
    static constexpr int EH = sizeof(ET) / 2;         // halves per element: 2 for fp32 (TF32)
    static constexpr int KH = 16;                     // halves of k per mma step: k16 (16-bit), k8 (TF32)
    // Blocks of more than 512 outputs stage their tile in shared memory and store it in rows of
    // 16-byte (fp32) or 8-byte (C) vectors, every epilogue but the loss's (a tile of the logits'
    // 10 columns). Stored straight from the fragments, a warp's store covers 8 rows of 16 bytes,
    // one L2 request per sector written, and on large outputs the requests, not the bytes, are
    // the bound (experiments/FINDINGS.md, "Tensor-core kernel: large tiles and the staged epilogue").
    // Smaller blocks are latency-bound, where the staging's two barriers would only add.
    static constexpr bool STAGED = EPI != EPI_XENT && BM * BN > 512;
    // A warp tile of one or two mma tiles (16 x 8, 16 x 16: the small blocks of 32 x N outputs)
    // makes one chain of BK / 16 dependent mmas per k step, each waiting on the one before for its
    // accumulator. A second set of accumulators takes every other 16-wide k slice and halves that
    // chain; the two are added once, after the loop (fp32 accumulators only: ACC16 keeps its one
    // rounding per mma; experiments/FINDINGS.md, "Tensor-core kernel: the main loop at 32 x N").
    // So these tiles sum in another order than larger ones: the same bits are promised only
    // between tiles of one order (tests/test_cuda_host_side.py: summation_order mirrors this rule).
    // 3xTF32 has no such chain: each k8 step sums its products apart and adds them in one fp32 add.
    static constexpr bool TWO_SETS = !ACC16 && TF32 != 3 && MT * NT <= 2;
    // A tile: rows m, cols k when k is contiguous, else rows k, cols m (same for B with n).
    typedef TcTile<A_KC ? BM : BK, (A_KC ? BK : BM) * EH, VA, T, A_ROWS, EH> TileA;  // rows: m when A_KC, else k
    typedef TcTile<B_KC ? BN : BK, (B_KC ? BK : BN) * EH, VB, T, 0, EH> TileB;
    typedef Elt<DT> E;
    typedef Acc<ACC16> Frag;
    typedef EpilogueReads<EPI, HAS_BIAS, BM, BN, T> Reads;

    u16* As;    // the operand ring: STAGES stages of A's tile, then of B's
    u16* Bs;
    int m0, n0;  // the block's tile of C
    int lane;
    int wm, wn;  // the warp's tile of the block's
    int g, t;    // the lane's outputs: rows g, g + 8 of each 16-row tile, columns 2t, 2t + 1 of each 8-column tile

    // Sends for what the epilogue reads from memory (fused.cuh: EpilogueReads): a thread's outputs
    // are its accumulator fragments'.
    __device__ __forceinline__ void send_reads(Reads& reads, const XentArgs& xent, int M, int N, const ET* bias,
                                               const ET* relu_y, const float* w, const float* w_buf, const float* b,
                                               const float* b_buf) const {
        reads.send(
            xent, m0, M, n0, N, bias, relu_y, w, w_buf, b, b_buf,
            [&](auto f) {
#pragma unroll
                for (int j = 0; j < NT; ++j) f(n0 + wn * WN + j * 8 + 2 * t);
            },
            [&](auto f) {  // the staged epilogue sends for its own reads, a batch at a time
                if constexpr (!STAGED) {
#pragma unroll
                    for (int i = 0; i < MT; ++i)
#pragma unroll
                        for (int h = 0; h < 2; ++h) f(m0 + wm * WM + i * 16 + g + 8 * h);
                }
            });
    }

    // ldmatrix x4 lane roles: lane l gives the address of row l % 8 of 8x8
    // matrix l / 8; matrix q of A is (m + 8 * (q & 1), k + 8 * (q >> 1)), i.e.
    // fragments a0..a3; matrix q of B is (n + 8 * (q >> 1), k + 8 * (q & 1)),
    // i.e. b0, b1 of n-tile 2j and b0, b1 of n-tile 2j + 1.
    // Each lane's row r in stage 0 and the swizzled unit u ^ swz(r) of its row it reads at i = j =
    // kk = 0 are worked out once, in the shared space: an ldmatrix adds the stage's offset, its
    // rows' (dr, a multiple of 8: the same swizzle) and its units' (du, whose bits are clear in u,
    // so that (u + du) ^ swz(r) = (u ^ swz(r)) ^ du). Formed from a generic pointer at every
    // ldmatrix (smem_addr's cvta is opaque to the compiler), each address would cost about six
    // 64-bit instructions ahead of its ldmatrix, in the chain every k step of a one- or two-warp
    // block waits on (experiments/FINDINGS.md, "Tensor-core kernel: the main loop at 32 x N").
    struct Lanes {
        u32 a, b;   // the lane's row of A's and of B's tile in stage 0
        int ax, bx;  // the unit of that row it reads at i = j = kk = 0
        u32 a_base, b_base;  // stage 0 of A's and of B's tile (frag_rows)
    };

    __device__ __forceinline__ Lanes lanes() const {
        const int q = lane / 8, qr = lane % 8;
        const int a_r = A_KC ? wm * WM + (q & 1) * 8 + qr : (q >> 1) * 8 + qr;
        const int a_u = A_KC ? q >> 1 : (wm * WM + (q & 1) * 8) / 8;
        // For B's odd n-tile (ldmatrix x2, NT odd) only lanes 0-15 give addresses, and for them q >> 1 is 0.
        const int b_r = B_KC ? wn * WN + (q >> 1) * 8 + qr : (q & 1) * 8 + qr;
        const int b_u = B_KC ? q & 1 : (wn * WN + (q >> 1) * 8) / 8;
        const u32 a_lane = smem_addr(As) + 2 * a_r * TileA::LD_S, b_lane = smem_addr(Bs) + 2 * b_r * TileB::LD_S;
        return {a_lane, b_lane, a_u ^ TileA::swz(a_r), b_u ^ TileB::swz(b_r), smem_addr(As), smem_addr(Bs)};
    }

    // Stage s's tiles into the accumulators: per k slice of KH halves (16 elements of 16 bits, or
    // 8 of fp32), this warp's fragments of both tiles, then an mma per 16 x 8 output tile
    // (TWO_SETS: the odd k slices into acc_odd). ldmatrix reads 8x8 matrices of 16-bit elements:
    // an fp32 row of 8 halves is 4 elements, so where k is the tiles' contiguous dimension the same
    // addresses give the TF32 fragments, a lane's register its row's element t (and t + 4 from the
    // next matrix); where k runs along the rows its transposing form would split the fp32 elements,
    // and each register is one 32-bit shared load (frag_rows).
    __device__ __forceinline__ void mma_stage(Frag (&acc)[MT][NT], Frag (&acc_odd)[MT][NT], const Lanes& at,
                                              int s) const {
        auto a_at = [&](u32 as, int dr, int du) { return as + 2 * dr * TileA::LD_S + 16 * (at.ax ^ du); };
        auto b_at = [&](u32 bs, int dr, int du) { return bs + 2 * dr * TileB::LD_S + 16 * (at.bx ^ du); };
        const u32 as = at.a + 2 * s * TileA::STAGE, bs = at.b + 2 * s * TileB::STAGE;
#pragma unroll
        for (int kk = 0; kk < BK * EH; kk += KH) {
            u32 af[MT][4], bf[NT][2];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                if (A_KC)         ldmatrix_x4<0>(af[i], a_at(as, i * 16, kk / 8));
                else if (EH == 1) ldmatrix_x4<1>(af[i], a_at(as, kk, 2 * i));
                else              frag_rows<TileA, 4>(af[i], at.a_base, s, kk / EH, wm * WM + i * 16);
            }
#pragma unroll
            for (int j = 0; j < NT / 2; ++j) {
                u32 r[4];
                if (B_KC) {
                    ldmatrix_x4<0>(r, b_at(bs, j * 16, kk / 8));
                } else if (EH == 1) {
                    ldmatrix_x4<1>(r, b_at(bs, kk, 2 * j));
                } else {
                    frag_rows<TileB, 2>(bf[2 * j], at.b_base, s, kk / EH, wn * WN + j * 16);
                    frag_rows<TileB, 2>(bf[2 * j + 1], at.b_base, s, kk / EH, wn * WN + j * 16 + 8);
                    continue;
                }
                bf[2 * j][0] = r[0];
                bf[2 * j][1] = r[1];
                bf[2 * j + 1][0] = r[2];
                bf[2 * j + 1][1] = r[3];
            }
            if constexpr (NT % 2) {  // a 16 x 8 warp tile's one n-tile: matrix q < 2 of B is (n, k + 8 * q)
                if (B_KC)         ldmatrix_x2<0>(bf[NT - 1], b_at(bs, (NT - 1) * 8, kk / 8));
                else if (EH == 1) ldmatrix_x2<1>(bf[NT - 1], b_at(bs, kk, NT - 1));
                else              frag_rows<TileB, 2>(bf[NT - 1], at.b_base, s, kk / EH, wn * WN + (NT - 1) * 8);
            }
            // One mma per 16 x 8 output tile of the warp, from the fragments `a` and `b`.
            auto mma_tiles = [&](const u32 (&a)[MT][4], const u32 (&b)[NT][2]) {
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        Frag& c = TWO_SETS && kk / KH % 2 ? acc_odd[i][j] : acc[i][j];
                        if constexpr (TF32) mma_1688_tf32(c, a[i], b[j]);
                        else                mma_16816<DT, SM80>(c, a[i], b[j]);
                    }
            };
            if constexpr (TF32 == 1) {
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) af[i][e] = to_tf32(af[i][e]);
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) bf[j][e] = to_tf32(bf[j][e]);
            } else if constexpr (TF32 == 3) {
                u32 a_small[MT][4], b_small[NT][2];
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) split_tf32(af[i][e], af[i][e], a_small[i][e]);
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) split_tf32(bf[j][e], bf[j][e], b_small[j][e]);
                // The step's three products sum from zero on the tensor cores, small ones first, and
                // join the accumulator through an fp32 add that rounds to nearest: the tensor cores
                // add into their accumulator rounding toward zero, a bias that grows with K (the
                // module comment).
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        Frag& c = TWO_SETS && kk / KH % 2 ? acc_odd[i][j] : acc[i][j];
                        Frag step = {};
                        mma_1688_tf32(step, a_small[i], bf[j]);
                        mma_1688_tf32(step, af[i], b_small[j]);
                        mma_1688_tf32(step, af[i], bf[j]);
#pragma unroll
                        for (int e = 0; e < 4; ++e) c.v[e] += step.v[e];
                    }
                continue;
            }
            mma_tiles(af, bf);
        }
    }

    // TF32 fragments of a tile whose rows are k (fp32, k not contiguous): R registers, element
    // (k0 + t + 4 * (e / 2 % 2), c0 + g + 8 * (e % 2)) of stage s in register e for A's (R = 4:
    // a0..a3), (k0 + t + 4 * e, c0 + g) for B's (R = 2: b0, b1). base: the tile's stage 0.
    template <typename Tile, int R>
    __device__ __forceinline__ void frag_rows(u32 (&f)[R], u32 base, int s, int k0, int c0) const {
#pragma unroll
        for (int e = 0; e < R; ++e) {
            const int k = k0 + t + 4 * (R == 4 ? e / 2 : e), c = c0 + g + (R == 4 ? 8 * (e % 2) : 0);
            f[e] = lds32(base + 2 * (s * Tile::STAGE + Tile::at(k, 2 * c)));
        }
    }

    // With linear_sgd's bias update: adds stage s's rows of op(B) to the bias sums.
    __device__ __forceinline__ void add_bias(Reads& reads, int s) const {
        if (!reads.bias_step) return;
        const u16* bs = Bs + s * TileB::STAGE;
        // Element (r, c) of the stage: halves EH * c .. EH * c + EH - 1 of row r.
        auto elem = [&](int r, int c) { return E::load(*reinterpret_cast<const ET*>(bs + TileB::at(r, EH * c))); };
        reads.bias_grad.template add<BK>([&](int k, int c) { return B_KC ? elem(c, k) : elem(k, c); });
    }

    // Split-K: this slice's sums to the workspace, and in the last slice to arrive the sums of all
    // (false in the others: they are done). One float4 per fragment. fp16 accumulators get the
    // fp32 sum of the slices rounded once, and the epilogue rounds again after the bias: with
    // ACC16 the result may differ from the Triton twin (which adds the bias to the fp32 sum) by
    // an fp16 ulp.
    template <int SPLIT_K>
    static __device__ __forceinline__ bool sum_slices(Frag (&acc)[MT][NT], float* partials, int* counters) {
        auto get = [&](int f, int e) { return acc_get(acc[f / NT][f % NT], e); };
        auto set = [&](int f, int e, float x) { acc_set(acc[f / NT][f % NT], e, x); };
        return splitk_reduce<SPLIT_K, MT * NT, T>(partials, counters, get, set);
    }

};

// ---------------------------------------------------------------- the kernel

template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, int VA, int VB, int GROUP_M, int SPLIT_K,
          int DT, int A_KC, int B_KC, int HAS_BIAS, int RELU, int ACC16, int SM80, int TF32, int A_ROWS, int EPI>
__global__ void __launch_bounds__(32 * WARPS_M * WARPS_N)
matmul_tc_kernel(const EltT<DT>* A, const EltT<DT>* B, const EltT<DT>* bias, EltT<DT>* C, int M, int N, int K, i64 lda,
                 i64 ldb, float* partials, int* counters, int k_slice, FUSED_PARAMS(EltT<DT>)) {
    dependent_start();
    static_assert(SM80 || STAGES == 2, "sm_75 double-buffers through registers: exactly 2 stages");
    static_assert(SM80 || DT == DT_FP16, "sm_75 tensor cores have no bf16 mma");
    static_assert((DT == DT_FP32) == (TF32 == 1 || TF32 == 3), "fp32 runs on the tensor cores as TF32 or 3xTF32 only");
    static_assert(SM80 || DT != DT_FP32, "TF32 tensor cores start at sm_80");
    static_assert(DT == DT_FP16 || !ACC16, "fp16 accumulation is for fp16 inputs only");
    static_assert(EPI == EPI_PLAIN || EPI == EPI_XENT || !(HAS_BIAS || RELU), "relu_grad_of and linear_sgd: no bias, no ReLU");
    static_assert(EPI != EPI_XENT || !RELU, "linear_cross_entropy: no ReLU");
    static_assert(EPI != EPI_SGD || SPLIT_K == 1, "linear_sgd: no split-K");
    typedef TcBlock<BM, BN, BK, WARPS_M, WARPS_N, STAGES, VA, VB, DT, A_KC, B_KC, HAS_BIAS, RELU, ACC16, SM80, TF32,
                    A_ROWS, EPI> Block;
    typedef typename Block::TileA TileA;
    typedef typename Block::TileB TileB;
    typedef typename Block::E E;
    typedef typename Block::ET ET;
    constexpr int T = Block::T, WM = Block::WM, WN = Block::WN, MT = Block::MT, NT = Block::NT;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* As = reinterpret_cast<u16*>(smem_raw);
    u16* Bs = As + STAGES * TileA::STAGE;

    // Where the block and its warp sit in C.
    int pid_m, pid_n;
    const int num_pid_m = (M + BM - 1) / BM;
    // linear_sgd of a layer with no inputs (M = K_in = 0) still updates its bias: one tile row of no weights.
    swizzle_block<GROUP_M>(blockIdx.x, EPI == EPI_SGD && num_pid_m == 0 ? 1 : num_pid_m, (N + BN - 1) / BN, pid_m, pid_n);
    const int m0 = pid_m * BM, n0 = pid_n * BN;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    if constexpr (SPLIT_K > 1) enter_slice<A_KC, B_KC, A_ROWS>(A, B, a_rows, K, lda, ldb, k_slice);  // from here on: its slice
    // The tiles copy halves (TcTile): the operands as 16-bit units, leading dimensions still in elements.
    const u16* Ah = reinterpret_cast<const u16*>(A);
    const u16* Bh = reinterpret_cast<const u16*>(B);
    const int g = lane / 4, t = lane % 4;
    const Block blk = {As, Bs, m0, n0, lane, wm, wn, g, t};

    // What the epilogue reads from memory, sent for once the first k steps' copies are queued.
    const XentArgs xent = {labels, label_rows, n_labels, loss, flag, loss_slots, loss_counter};
    typename Block::Reads reads(pid_m);
    auto epilogue_reads = [&]() { blk.send_reads(reads, xent, M, N, bias, relu_y, w, w_buf, b, b_buf); };

    // The main loop. The k loops, and all code that reads or writes the accumulators but for the
    // mmas and the split-K sums (their zeroing, the two sets' sum, both epilogues), are written
    // out in the kernel rather than in TcBlock: as functions of their own, inlined here, they
    // compile to other machine code (other loop transformations, other registers).
    typename Block::Frag acc[MT][NT], acc_odd[MT][NT];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < (ACC16 ? 2 : 4); ++e) acc[i][j].v[e] = acc_odd[i][j].v[e] = 0;
    const typename Block::Lanes lanes = blk.lanes();
    auto compute = [&](int s) { blk.mma_stage(acc, acc_odd, lanes, s); };
    auto add_bias = [&](int s) { blk.add_bias(reads, s); };
    const int KT = (K + BK - 1) / BK;
    if constexpr (SM80) {  // the cp.async ring
        // TcTile::Async's cases; the rest take load_async.
        // Gathered rows: a pointer per chunk, in registers for the whole loop; past 4 chunks a
        // thread (wide tiles on few warps) ptxas spills.
        constexpr bool A_ASYNC = (!A_ROWS || (A_KC && TileA::PER_THREAD <= 4)) && VA >= 2 && TileA::STRIDED;
        constexpr bool B_ASYNC = VB >= 2 && TileB::STRIDED;
        typename TileA::template Async<!A_KC> async_a(Ah, As, lda, m0, A_KC ? M : K, A_KC ? K : M, a_rows, rows_of_a);
        typename TileB::template Async<!B_KC> async_b(Bh, Bs, ldb, n0, B_KC ? N : K, B_KC ? K : N);
        // Queues copies of k step kt of both operands into stage s (whole: every chunk lies inside them).
        auto load_stage = [&](int s, int kt, auto whole) {
            constexpr bool WHOLE = decltype(whole)::value;
            const int k0 = kt * BK;
            if constexpr (A_ASYNC) async_a.template load<WHOLE>(Ah, s, k0);
            else if (A_KC) TileA::load_async(As + s * TileA::STAGE, Ah, lda, m0, k0, M, K, a_rows, rows_of_a);
            else           TileA::load_async(As + s * TileA::STAGE, Ah, lda, k0, m0, K, M, a_rows, rows_of_a);
            if constexpr (B_ASYNC) async_b.template load<WHOLE>(Bh, s, k0);
            else if (B_KC) TileB::load_async(Bs + s * TileB::STAGE, Bh, ldb, n0, k0, N, K, nullptr, 0);
            else           TileB::load_async(Bs + s * TileB::STAGE, Bh, ldb, k0, n0, K, N, nullptr, 0);
        };
        // One commit group per k step (empty past the end), so that "all but STAGES - 2 groups
        // done" means k step kt has landed.
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < KT) load_stage(s, s, Flag<false>());
            cp_async_commit();
        }
        epilogue_reads();
        // Step kt reads stage kt % STAGES and refills stage (kt - 1) % STAGES with k step kt + STAGES - 1.
        auto step = [&](int kt, auto whole, int read, int write) {
            cp_async_wait<STAGES - 2>();
            // Makes every thread's copies of k step kt visible, and guarantees
            // all warps are done with k step kt - 1, whose stage is refilled next.
            __syncthreads();
            const int next = kt + STAGES - 1;
            if (decltype(whole)::value || next < KT) load_stage(write, next, whole);
            cp_async_commit();
            compute(read);
            add_bias(read);
        };
        // Tiles of up to 64 x 64: the k steps of an inner tile whose refills lie wholly inside K
        // run a loop of their own, with copies free of edge tests, which the short k steps of
        // small tiles cannot afford behind a branch
        // (experiments/FINDINGS.md, "Tensor-core kernel: the main loop at 32 x N"). Larger tiles
        // spend many mmas a step, where the second loop only adds code (and, on 64 x 128 with the loss's epilogue, spills). It runs STAGES steps
        // a turn, so that every step's stages, and with them its shared addresses, are known at
        // compile time, unless A's gathered rows go through load_async: a turn of those, each
        // chunk's row looked up at every step, spills at 16 x 16 x 128 on one warp.
        constexpr bool TURNS = !A_ROWS || A_ASYNC;
        const int KT_WHOLE = BM * BN <= 64 * 64 && m0 + BM <= M && n0 + BN <= N ? K / BK : 0;
        int kt = 0;
        if constexpr (TURNS) {
            for (; kt + 2 * STAGES - 2 < KT_WHOLE; kt += STAGES) {
#pragma unroll
                for (int u = 0; u < STAGES; ++u) step(kt + u, Flag<true>(), u, (u + STAGES - 1) % STAGES);
            }
        }
        // The stages counted rather than divided out: with a division by 3 in each ldmatrix's
        // address ptxas rebuilds the stage's offset per ldmatrix instead of folding it once.
        int read = 0, write = STAGES - 1;  // kt % STAGES == 0 here
        auto counted = [&](int kt, auto whole) {
            step(kt, whole, read, write);
            write = read;
            read = read + 1 == STAGES ? 0 : read + 1;
        };
        if constexpr (!TURNS)
            for (; kt + STAGES - 1 < KT_WHOLE; ++kt) counted(kt, Flag<true>());
        for (; kt < KT; ++kt) counted(kt, Flag<false>());
    } else {  // sm_75: the next k step's tiles through registers while this one's are multiplied
        typename TileA::Staged sa;
        typename TileB::Staged sb;
        auto fetch = [&](int kt) {
            const int k0 = kt * BK;
            if (A_KC) sa.fetch(Ah, lda, m0, k0, M, K, a_rows, rows_of_a);
            else      sa.fetch(Ah, lda, k0, m0, K, M, a_rows, rows_of_a);
            if (B_KC) sb.fetch(Bh, ldb, n0, k0, N, K, nullptr, 0);
            else      sb.fetch(Bh, ldb, k0, n0, K, N, nullptr, 0);
        };
        fetch(0);
        epilogue_reads();
        sa.store(As);
        sb.store(Bs);
        __syncthreads();
        for (int kt = 0; kt < KT; ++kt) {
            if (kt + 1 < KT) fetch(kt + 1);  // in flight during the mmas
            compute(kt % 2);
            add_bias(kt % 2);
            if (kt + 1 < KT) {
                // Stage (kt + 1) % 2 was last read in step kt - 1, before the barrier ending it.
                sa.store(As + ((kt + 1) % 2) * TileA::STAGE);
                sb.store(Bs + ((kt + 1) % 2) * TileB::STAGE);
            }
            __syncthreads();
        }
    }

    if constexpr (Block::TWO_SETS) {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j].v[e] += acc_odd[i][j].v[e];
    }
    if constexpr (SPLIT_K > 1)
        if (!Block::template sum_slices<SPLIT_K>(acc, partials, counters)) return;

    // The epilogue: C's tile (linear_sgd: w's update), then the loss and the bias update.
    const SgdArgs<ET> sgd = {w_buf, w_low, lr, momentum, weight_decay};  // linear_sgd's weights
    if constexpr (Block::STAGED) {
        // The tile goes through shared memory in passes of G 16-row strips of each warp's tile, as
        // many as the operand ring holds (rows of floats padded by 8, which keeps the fragments'
        // float2 writes free of bank conflicts). Thread t then takes columns n .. n + 3 of staged
        // rows t / CPR, + STEP, ...: a warp's accesses are runs of whole rows. The epilogue's reads
        // (relu_grad_of's y, linear_sgd's w and its buffer) go out NB chunks at a time, all of them
        // before the first store of their batch. Same arithmetic per element as below: same bits.
        constexpr int CPR = BN / 4, STEP = T / CPR, LDC = BN + 8;
        constexpr int STRIP = WARPS_M * 16 * LDC * 4;  // bytes: one 16-row strip of every warp row
        constexpr int RING = STAGES * (TileA::STAGE + TileB::STAGE) * 2;
        constexpr int G = MT * STRIP <= RING ? MT : (MT >= 2 && MT / 2 * STRIP <= RING) ? MT / 2 : 1;
        constexpr int R = WARPS_M * 16 * G, PER = R / STEP, NB = PER < 4 ? PER : 4;
        static_assert(T % CPR == 0 && R % STEP == 0 && PER % NB == 0, "a thread keeps its columns");
        static_assert(G * STRIP <= RING, "a pass fits in the operand ring");
        float* cs = reinterpret_cast<float*>(smem_raw);
        const int col = (threadIdx.x % CPR) * 4, row0 = threadIdx.x / CPR, n = n0 + col;
        constexpr u64 VEC_ALIGN = 4 * sizeof(ET) - 1;  // a Pack<ET, 4>
        const bool vec = N % 4 == 0 && (reinterpret_cast<u64>(C) & VEC_ALIGN) == 0 &&
                         (EPI != EPI_RELU_GRAD || (reinterpret_cast<u64>(relu_y) & VEC_ALIGN) == 0);
        const bool sgd_vec = EPI == EPI_SGD && sgd_vec_ok<DT, 4>(w, sgd, N);
        float bv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) bv[e] = HAS_BIAS && n + e < N ? E::load(bias[n + e]) : 0.f;
        if constexpr (SM80) cp_async_wait<0>();
#pragma unroll
        for (int pass = 0; pass < MT / G; ++pass) {
            __syncthreads();  // every warp is done with the ring, or with the pass before
#pragma unroll
            for (int ii = 0; ii < G; ++ii)
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {  // rows g and g + 8
                        Pack<float, 2> v;
                        v.v[0] = acc_get(acc[pass * G + ii][j], 2 * h);
                        v.v[1] = acc_get(acc[pass * G + ii][j], 2 * h + 1);
                        *reinterpret_cast<Pack<float, 2>*>(cs + (wm * 16 * G + ii * 16 + g + 8 * h) * LDC + wn * WN +
                                                           j * 8 + 2 * t) = v;
                    }
            __syncthreads();
#pragma unroll
            for (int p0 = 0; p0 < PER; p0 += NB) {
                Pack<float, 4> v[NB];
                i64 at[NB];
                bool ok[NB];
#pragma unroll
                for (int q = 0; q < NB; ++q) {
                    const int s = row0 + (p0 + q) * STEP;  // staged row: strip s / 16G's row s % 16G
                    const int m = m0 + (s / (16 * G)) * WM + pass * G * 16 + s % (16 * G);
                    v[q] = *reinterpret_cast<const Pack<float, 4>*>(cs + s * LDC + col);
                    at[q] = (i64)m * N + n;
                    ok[q] = m < M && n < N;
                }
                if constexpr (EPI == EPI_SGD) {  // gw (m, n .. n + 3) updates w there; never stored
                    SgdIn<4> in[NB];
                    auto here = [&](int q) {
                        return SgdArgs<ET>{w_buf ? w_buf + at[q] : nullptr, w_low ? w_low + at[q] : nullptr, lr,
                                           momentum, weight_decay};
                    };
#pragma unroll
                    for (int q = 0; q < NB; ++q)
                        if (ok[q]) in[q] = sgd_load<DT, 4>(w + at[q], here(q), N - n, sgd_vec);
#pragma unroll
                    for (int q = 0; q < NB; ++q)
                        if (ok[q]) sgd_apply<DT, 4>(w + at[q], here(q), v[q].v, in[q], N - n, sgd_vec);
                } else {
                    Pack<ET, 4> y[NB];
                    if constexpr (EPI == EPI_RELU_GRAD) {
#pragma unroll
                        for (int q = 0; q < NB; ++q) {
                            if (!ok[q]) continue;
                            if (vec) {
                                y[q] = *reinterpret_cast<const Pack<ET, 4>*>(relu_y + at[q]);
                            } else {
#pragma unroll
                                for (int e = 0; e < 4; ++e) y[q].v[e] = n + e < N ? relu_y[at[q] + e] : (ET)0;
                            }
                        }
                    }
#pragma unroll
                    for (int q = 0; q < NB; ++q) {
                        if (!ok[q]) continue;
                        Pack<ET, 4> c;
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            float o = v[q].v[e] + bv[e];
                            if (RELU) o = relu_f(o);
                            if (EPI == EPI_RELU_GRAD && E::load(y[q].v[e]) <= 0.f) o = 0.f;  // a NaN y passes
                            c.v[e] = E::store(o);
                        }
                        if (vec) {
                            *reinterpret_cast<Pack<ET, 4>*>(C + at[q]) = c;
                        } else {
#pragma unroll
                            for (int e = 0; e < 4; ++e)
                                if (n + e < N) C[at[q] + e] = c.v[e];
                        }
                    }
                }
            }
        }
    } else {
        // Epilogue straight from the fragments: + bias, relu, round, and stores of column pairs
        // (4 bytes, 8 for fp32) when C's rows (and y's) keep them aligned.
        constexpr u64 PAIR_ALIGN = 2 * sizeof(ET) - 1;  // a Pack<ET, 2>
        const bool pair_ok = (N % 2 == 0) && ((reinterpret_cast<u64>(C) & PAIR_ALIGN) == 0) &&
                             (EPI != EPI_RELU_GRAD || (reinterpret_cast<u64>(relu_y) & PAIR_ALIGN) == 0);
        const bool sgd_vec = EPI == EPI_SGD && sgd_vec_ok<DT, 2>(w, sgd, N);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int n = n0 + wn * WN + j * 8 + 2 * t;
            float b0 = 0.f, b1 = 0.f;
            if (HAS_BIAS) {
                if (n < N) b0 = E::load(bias[n]);
                if (n + 1 < N) b1 = E::load(bias[n + 1]);
            }
#pragma unroll
            for (int i = 0; i < MT; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // rows g and g + 8
                    const int m = m0 + wm * WM + i * 16 + g + 8 * h;
                    if (m >= M || n >= N) continue;
                    float v0 = acc_get(acc[i][j], 2 * h) + b0;
                    float v1 = acc_get(acc[i][j], 2 * h + 1) + b1;
                    if (RELU) {
                        v0 = relu_f(v0);
                        v1 = relu_f(v1);
                    }
                    const i64 at = (i64)m * N + n;
                    if constexpr (EPI == EPI_SGD) {  // gw (m, n .. n + 1) updates w there; never stored
                        const SgdArgs<ET> here = {w_buf ? w_buf + at : nullptr, w_low ? w_low + at : nullptr, lr,
                                                  momentum, weight_decay};
                        const float gw[2] = {v0, v1};
                        sgd_step<DT, 2>(w + at, here, gw, N - n, sgd_vec);
                        continue;
                    }
                    if constexpr (EPI == EPI_RELU_GRAD) {  // 0 where y <= 0; a NaN y passes the gradient
                        float y0, y1 = 1.f;
                        if (pair_ok && n + 1 < N) {
                            const Pack<ET, 2> y = *reinterpret_cast<const Pack<ET, 2>*>(relu_y + at);
                            y0 = E::load(y.v[0]);
                            y1 = E::load(y.v[1]);
                        } else {
                            y0 = E::load(relu_y[at]);
                            if (n + 1 < N) y1 = E::load(relu_y[at + 1]);
                        }
                        if (y0 <= 0.f) v0 = 0.f;
                        if (y1 <= 0.f) v1 = 0.f;
                    }
                    ET* c = C + at;
                    if (pair_ok && n + 1 < N) {
                        Pack<ET, 2> pair;
                        pair.v[0] = E::store(v0);
                        pair.v[1] = E::store(v1);
                        *reinterpret_cast<Pack<ET, 2>*>(c) = pair;
                    } else {
                        c[0] = E::store(v0);
                        if (n + 1 < N) c[1] = E::store(v1);
                    }
                }
            }
        }
    }
    if constexpr (EPI == EPI_XENT)
        xent_tile<DT, BM, T>(C, M, N, m0, pid_m, xent, reads.xent_labels, reinterpret_cast<float*>(smem_raw));
    if (reads.bias_step) reads.bias_grad.template step<DT>(b, n0, N, SgdArgs<ET>{b_buf, b_low, lr, momentum, weight_decay});
}

#ifdef STANDALONE
// The default configs (kernels_cuda/matmul.py: TC_SPACE, fp16, row-major A and B), instantiated for the build line at
// the top: the plain matmul, then the fused ops' (kernels_cuda/fused.py: report_variant) on the same config.
void* const standalone_kernels[] = {
    (void*)&matmul_tc_kernel<128, 128, 32, 2, 2, 4, 8, 8, 8, 1, DT_FP16, 1, 0, 0, 0, 0, 1, 0, 0, EPI_PLAIN>,
    (void*)&matmul_tc_kernel<128, 128, 32, 2, 2, 4, 8, 8, 8, 1, DT_FP16, 1, 0, 1, 0, 0, 1, 0, 0, EPI_XENT>,
    (void*)&matmul_tc_kernel<128, 128, 32, 2, 2, 4, 8, 8, 8, 1, DT_FP16, 0, 0, 0, 0, 0, 1, 0, 0, EPI_SGD>,
    // fp32 in 3xTF32 on the same tile (16-byte copies: 8 halves), and linear_sgd's on 8 warps (its
    // space's 3xTF32 warp tiles are at most 64 x 32: kernels_cuda/fused.py).
    (void*)&matmul_tc_kernel<128, 128, 32, 2, 2, 4, 8, 8, 8, 1, DT_FP32, 1, 0, 0, 0, 0, 1, 3, 0, EPI_PLAIN>,
    (void*)&matmul_tc_kernel<128, 128, 32, 2, 4, 4, 8, 8, 8, 1, DT_FP32, 0, 0, 0, 0, 0, 1, 3, 0, EPI_SGD>
};
#endif
