// The order in which the matmul kernels' blocks take their output tiles.
#ifndef KERNELS_CUDA_SWIZZLE_CUH
#define KERNELS_CUDA_SWIZZLE_CUH

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

#endif  // KERNELS_CUDA_SWIZZLE_CUH
