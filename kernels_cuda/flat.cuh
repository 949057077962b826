// The flat work split of the elementwise kernels (elementwise.cu, optim.cu): the
// tensor is n / VEC vectors; block b owns vectors [b * THREADS * ITEMS, +THREADS * ITEMS)
// and thread t takes vector b * THREADS * ITEMS + i * THREADS + t for i < ITEMS,
// so each i is one fully coalesced sweep of the block. The n % VEC tail
// elements go one by one to the first threads of block 0.
#ifndef KERNELS_CUDA_FLAT_CUH
#define KERNELS_CUDA_FLAT_CUH

#include "dtypes.cuh"

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

#endif  // KERNELS_CUDA_FLAT_CUH
