// softmax_cross_entropy: the fused softmax cross-entropy forward + backward.
// Build alone, no GPU needed (registers, shared memory and spills of the default configs):
//   nvcc -cubin -arch=sm_90 -std=c++17 -DSTANDALONE --resource-usage -o /dev/null kernels_cuda/loss.cu
//
// Bandwidth bound: 2 reads + 1 write of M * N * elt bytes and ~3 exps per element
// (the trainer's 128 x 10 logits are 5 KB: there the launch, not the bytes, is the cost).
#include "dtypes.cuh"

// Merges running (max, sum of exp(x - max)) pairs. The equality tests keep
// -inf - -inf (a NaN) out of the sums; a NaN input still poisons the sum.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    float mx = fmaxf(m, m2);
    float a = m == mx ? s : s * expf(m - mx);
    float b = m2 == mx ? s2 : s2 * expf(m2 - mx);
    m = mx;
    s = a + b;
}

// Per row of logits [M, ncols] (contiguous) with int64 labels:
//   loss += (logsumexp(x) - x[label]) / M       (loss zeroed by the host)
//   dlogits = (softmax(x) - onehot(label)) / M  in the logits' dtype.
//
// One block per row. Pass 1 reads the row once, keeping an online
// (max, sum exp(x - max)) per thread (Milakov & Gimelshein), then a warp
// shuffle and a shared-memory step merge them; pass 2 re-reads the row
// (from L2/L1 for any row that fits) and writes the gradient. Traffic is
// 2 reads + 1 write of M * N * elt bytes, about 3 exps per element. A label
// outside [0, ncols) cannot raise from the device: its row's loss is NaN, its
// gradient is the plain softmax / M, and (1, label, ncols) goes to `flag`
// (kernels_core.contract.label_flag), which the host reads at its next sync.
template <int DT, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS)
softmax_xent_kernel(const typename Elt<DT>::T* logits, const i64* labels, float* loss,
                    typename Elt<DT>::T* dlogits, i64* flag, i64 ncols, float inv_rows) {
    typedef Elt<DT> E;
    typedef Pack<typename E::T, VEC> P;
    constexpr int WARPS = THREADS / 32;
    __shared__ float sh_m[WARPS], sh_s[WARPS];
    const i64 row = blockIdx.x;
    const typename E::T* x = logits + row * ncols;
    typename E::T* dx = dlogits + row * ncols;
    const i64 nvec = ncols / VEC;  // the host picks VEC dividing ncols

    float m = neg_inf(), s = 0.f;
    for (i64 v = threadIdx.x; v < nvec; v += THREADS) {
        P p = reinterpret_cast<const P*>(x)[v];
#pragma unroll
        for (int j = 0; j < VEC; ++j) lse_merge(m, s, E::load(p.v[j]), 1.f);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        lse_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        sh_m[warp] = m;
        sh_s[warp] = s;
    }
    __syncthreads();
    m = sh_m[0];
    s = sh_s[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) lse_merge(m, s, sh_m[w], sh_s[w]);

    const i64 label = labels[row];
    const bool valid = label >= 0 && label < ncols;
    const float inv_s = 1.f / s;
    for (i64 v = threadIdx.x; v < nvec; v += THREADS) {
        P p = reinterpret_cast<const P*>(x)[v];
        P out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            float g = expf(E::load(p.v[j]) - m) * inv_s - (v * VEC + j == label ? 1.f : 0.f);
            out.v[j] = E::store(g * inv_rows);
        }
        reinterpret_cast<P*>(dx)[v] = out;
    }
    if (threadIdx.x == 0) {
        float row_loss = valid ? m + logf(s) - E::load(x[label]) : quiet_nan();
        atomicAdd(loss, row_loss * inv_rows);
        if (!valid) {  // racing rows all write a bad label and the same ncols
            flag[0] = 1;
            flag[1] = label;
            flag[2] = ncols;
        }
    }
}

#ifdef STANDALONE
// The default configs (kernels_cuda/loss.py: SPACE), instantiated for the build line at the top.
void* const standalone_kernels[] = {
    (void*)&softmax_xent_kernel<DT_FP32, 4, 128>
};
#endif
