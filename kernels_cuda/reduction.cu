// bias_grad: column sums of a gradient, in fp32.
// Build alone, no GPU needed (registers, shared memory and spills of the default configs):
//   nvcc -cubin -arch=sm_90 -std=c++17 -DSTANDALONE --resource-usage -o /dev/null kernels_cuda/reduction.cu
#include "dtypes.cuh"

// db[c] = sum_m grad[m, c] in fp32, grad a contiguous [M, ncols] array.
//
// Reads M * N * elt bytes and writes N * 4: bandwidth bound. A block covers
// 32 * VEC columns (each lane one VEC-wide vector, so a warp reads one
// contiguous row segment) and WARPS * ITEMS rows (warp w takes rows
// w, w + WARPS, ...); per-warp partial sums meet in shared memory and the
// block adds its column totals to db with atomics, so any M splits over
// enough blocks to fill the GPU. db must be zeroed first; the order of the
// atomic adds, hence the last bits of the sum, varies from run to run.
// grid.x walks row blocks, grid.y column blocks.
template <int DT, int VEC, int ITEMS, int THREADS>
__global__ void __launch_bounds__(THREADS)
bias_grad_kernel(const typename Elt<DT>::T* grad, float* db, i64 nrows, i64 ncols) {
    typedef Elt<DT> E;
    typedef Pack<typename E::T, VEC> P;
    constexpr int WARPS = THREADS / 32;
    constexpr int COLS = 32 * VEC;
    __shared__ float partial[WARPS][COLS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const i64 col = (i64)blockIdx.y * COLS + lane * VEC;
    const i64 row0 = (i64)blockIdx.x * (WARPS * ITEMS) + warp;
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
    if (col < ncols) {  // the host picks VEC dividing ncols: the whole vector is in range
        P in[ITEMS];
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            i64 r = row0 + (i64)i * WARPS;
            if (r < nrows) in[i] = *reinterpret_cast<const P*>(grad + r * ncols + col);
        }
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            if (row0 + (i64)i * WARPS < nrows) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[j] += E::load(in[i].v[j]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) partial[warp][lane * VEC + j] = acc[j];
    __syncthreads();
    for (int c = threadIdx.x; c < COLS; c += THREADS) {
        i64 gc = (i64)blockIdx.y * COLS + c;
        if (gc < ncols) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) s += partial[w][c];
            atomicAdd(db + gc, s);
        }
    }
}

#ifdef STANDALONE
// The default configs (kernels_cuda/reduction.py: SPACE), instantiated for the build line at the top.
void* const standalone_kernels[] = {
    (void*)&bias_grad_kernel<DT_FP32, 4, 8, 256>
};
#endif
