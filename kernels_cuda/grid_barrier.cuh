// The grid-wide barrier of the persistent training kernel (persistent.cu), also the one
// experiments/grid_barrier.py times: the CUDA twin of kernels_triton/persistent.py's grid_barrier.
//
// Every block of the grid must be resident at once (kernels_core/persistent.py: check_coresident),
// or a block spinning here holds the multiprocessor a missing one waits for.
#ifndef KERNELS_CUDA_GRID_BARRIER_CUH
#define KERNELS_CUDA_GRID_BARRIER_CUH

#include "dtypes.cuh"

// Waits until `counter`, zeroed before the launch, reaches `arrivals` (barriers so far x blocks).
// The block's threads meet first, so every thread's stores precede thread 0's arrival, whose
// release (cumulative, at GPU scope) publishes them; the acquire poll orders every later load of
// the block (after the second bar.sync) after all blocks' stores. One atomic a block, not a thread.
__device__ __forceinline__ void grid_barrier(u32* counter, u32 arrivals) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 seen;
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        } while (seen < arrivals);
    }
    __syncthreads();
}

#endif  // KERNELS_CUDA_GRID_BARRIER_CUH
