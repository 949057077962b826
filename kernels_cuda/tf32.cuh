// Rounding fp32 to TF32 and 3xTF32's split, shared by the mma.sync kernel (matmul_tc.cu, which
// splits fragment registers as they leave shared memory) and the wgmma kernel's split pass
// (matmul_wgmma_tf32x3.cu, which splits the operands once, ahead of the GEMM).
#ifndef KERNELS_CUDA_TF32_CUH
#define KERNELS_CUDA_TF32_CUH

#include "dtypes.cuh"

// fp32 bits rounded to TF32 (10 mantissa bits), to nearest, ties away from zero.
__device__ __forceinline__ u32 to_tf32(u32 x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(__uint_as_float(x)));
    return r;
}

__device__ __forceinline__ bool finite_bits(u32 x) { return (x & 0x7f800000u) != 0x7f800000u; }

// 3xTF32's split: x = big + rest with big = tf32(x), so |rest| <= 2^-11 |x|, exact in fp32;
// small = tf32(rest). A finite x that rounds past TF32's largest is rounded down instead, and a
// non-finite x splits into big = +-1, small = x, so that the products of an infinity or NaN are
// IEEE's (kernels_triton/matmul.py's docstring says why).
__device__ __forceinline__ void split_tf32(u32 x, u32& big, u32& small) {
    if (finite_bits(x)) {
        u32 b = to_tf32(x);
        if (!finite_bits(b)) b = x & 0xffffe000u;
        big = b;
        small = to_tf32(__float_as_uint(__uint_as_float(x) - __uint_as_float(b)));
    } else {
        big = (x & 0x80000000u) | 0x3f800000u;
        small = x;
    }
}

#endif
