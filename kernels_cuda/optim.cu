// sgd_update: torch.optim.SGD's step as one elementwise pass.
// Build alone, no GPU needed (registers, shared memory and spills of the default configs):
//   nvcc -cubin -arch=sm_90 -std=c++17 -DSTANDALONE --resource-usage -o /dev/null kernels_cuda/optim.cu
//
// With momentum it moves 4 (param) * 2 + 4 (buffer) * 2 + elt (grad) bytes for
// 4 FLOPs per element (20 bytes with fp32 grads: 1.9M params of the default MLP
// are 37 MB, at least 8.8 µs at 4.25 TB/s): bandwidth bound, like the kernels of elementwise.cu,
// whose work split (flat.cuh's vector_index / tail_index) it shares.
#include "dtypes.cuh"
#include "flat.cuh"

// torch.optim.SGD step (dampening 0, no Nesterov), in place, fp32 master
// params and momentum buffers, gradients in any of the three dtypes:
//   d = g + wd * p;  buf = momentum * buf + d (if MOMENTUM);  p -= lr * d'.
template <int DT, int VEC, int ITEMS, int THREADS, int MOMENTUM>
__global__ void __launch_bounds__(THREADS)
sgd_kernel(float* p, const typename Elt<DT>::T* g, float* buf, float lr, float momentum,
           float weight_decay, i64 n) {
    typedef Elt<DT> E;
    typedef Pack<float, VEC> PF;
    typedef Pack<typename E::T, VEC> PG;
    const i64 nvec = n / VEC;
    PF pp[ITEMS], bb[ITEMS];
    PG gg[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        i64 v = vector_index<ITEMS, THREADS>(i);
        if (v < nvec) {
            pp[i] = reinterpret_cast<const PF*>(p)[v];
            gg[i] = reinterpret_cast<const PG*>(g)[v];
            if (MOMENTUM) bb[i] = reinterpret_cast<const PF*>(buf)[v];
        }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        i64 v = vector_index<ITEMS, THREADS>(i);
        if (v < nvec) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float d = E::load(gg[i].v[j]);
                // Skipped, not multiplied by 0, when off: 0 * inf would turn an inf param into NaN.
                if (weight_decay != 0.f) d += weight_decay * pp[i].v[j];
                if (MOMENTUM) {
                    d = momentum * bb[i].v[j] + d;
                    bb[i].v[j] = d;
                }
                pp[i].v[j] = pp[i].v[j] - lr * d;
            }
            reinterpret_cast<PF*>(p)[v] = pp[i];
            if (MOMENTUM) reinterpret_cast<PF*>(buf)[v] = bb[i];
        }
    }
    i64 t = tail_index<VEC>(n);
    if (t < n) {
        float d = E::load(g[t]);
        if (weight_decay != 0.f) d += weight_decay * p[t];
        if (MOMENTUM) {
            d = momentum * buf[t] + d;
            buf[t] = d;
        }
        p[t] = p[t] - lr * d;
    }
}

#ifdef STANDALONE
// The default configs (kernels_cuda/elementwise.py: SPACE), instantiated for the build line at the top.
void* const standalone_kernels[] = {
    (void*)&sgd_kernel<DT_FP32, 4, 4, 128, 1>
};
#endif
