// Element types of every kernel of kernels_cuda: the integer shorthands, the dtype codes,
// fp16 / bf16 conversions, vectors of N elements and a few float constants.
//
// The same text is compiled by NVRTC at run time (kernels_cuda/_runtime.py pastes each local
// #include in place) and by nvcc offline (resource reports). NVRTC ships no C library headers by
// default and cuda_fp16.h / cuda_bf16.h are not guaranteed to be found, so the headers here
// include nothing of the toolkit's: half and bfloat16 values travel as raw 16-bit patterns and
// are converted with PTX (fp16) or bit arithmetic (bf16).
#ifndef KERNELS_CUDA_DTYPES_CUH
#define KERNELS_CUDA_DTYPES_CUH

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// Element type codes, the first template argument of every kernel; the Python
// side reads them from here (kernels_cuda/_runtime.py: DT_CODE).
#define DT_FP32 0
#define DT_FP16 1
#define DT_BF16 2

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// bf16 is the top half of an fp32, so widening is a shift.
__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round to nearest even by hand: cvt.rn.bf16.f32 needs sm_80 and these
// kernels also build for sm_75. A NaN keeps its sign and gets the quiet bit
// so truncation cannot turn it into an infinity.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}

// Storage type and conversions of one element type.
template <int DT> struct Elt;
template <> struct Elt<DT_FP32> {
    typedef float T;
    static __device__ __forceinline__ float load(T v) { return v; }
    static __device__ __forceinline__ T store(float v) { return v; }
};
template <> struct Elt<DT_FP16> {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) { return f16_to_f32(v); }
    static __device__ __forceinline__ T store(float v) { return f32_to_f16(v); }
};
template <> struct Elt<DT_BF16> {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ T store(float v) { return f32_to_bf16(v); }
};

// The storage type of dtype code DT (float, or the raw 16 bits of a half or bfloat16).
template <int DT> using EltT = typename Elt<DT>::T;

// N elements moved by one (or, past 16 bytes, a few) vector instructions.
// The host only picks N when the pointer is aligned to min(N * sizeof(T), 16).
template <typename T, int N>
struct alignas((sizeof(T) * N) < 16 ? (sizeof(T) * N) : 16) Pack {
    T v[N];
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// torch.relu semantics: negative -> 0, NaN stays NaN (fmaxf would drop it).
__device__ __forceinline__ float relu_f(float v) { return v < 0.f ? 0.f : v; }

#endif  // KERNELS_CUDA_DTYPES_CUH
