// Elementwise kernels: relu, relu_backward, bias_add (+relu).
// Build alone, no GPU needed (registers, shared memory and spills of the default configs):
//   nvcc -cubin -arch=sm_90 -std=c++17 -DSTANDALONE --resource-usage -o /dev/null kernels_cuda/elementwise.cu
//
// All three are pure bandwidth: relu moves 2 * elt bytes per element for zero
// useful FLOPs (256M fp32 elements: 2.15 GB, at least 0.506 ms at the H200's
// measured 4.25 TB/s copy rate), relu_backward 3 * elt, bias_add 2 * elt, so
// the only things that matter are wide, coalesced accesses and enough bytes
// in flight. Each thread therefore loads ITEMS vectors of VEC elements
// (up to 16 bytes per instruction) before it computes or stores any of them;
// the two phases also make in-place calls (out is the input) safe.
//
// Work split: flat.cuh's vector_index / tail_index. The host picks VEC so
// that every pointer is aligned to min(VEC * elt, 16) bytes.
#include "dtypes.cuh"
#include "flat.cuh"

// y = relu(x); NaN stays NaN.
template <int DT, int VEC, int ITEMS, int THREADS>
__global__ void __launch_bounds__(THREADS)
relu_kernel(const typename Elt<DT>::T* x, typename Elt<DT>::T* y, i64 n) {
    typedef Elt<DT> E;
    typedef Pack<typename E::T, VEC> P;
    const i64 nvec = n / VEC;
    P in[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        i64 v = vector_index<ITEMS, THREADS>(i);
        if (v < nvec) in[i] = reinterpret_cast<const P*>(x)[v];
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        i64 v = vector_index<ITEMS, THREADS>(i);
        if (v < nvec) {
            P out;
#pragma unroll
            for (int j = 0; j < VEC; ++j) out.v[j] = E::store(relu_f(E::load(in[i].v[j])));
            reinterpret_cast<P*>(y)[v] = out;
        }
    }
    i64 t = tail_index<VEC>(n);
    if (t < n) y[t] = E::store(relu_f(E::load(x[t])));
}

// dx = 0 where y <= 0, else grad: torch's threshold_backward, so a NaN y (from
// relu(NaN)) passes grad on, and a NaN grad passes where y > 0.
template <int DT, int VEC, int ITEMS, int THREADS>
__global__ void __launch_bounds__(THREADS)
relu_backward_kernel(const typename Elt<DT>::T* grad, const typename Elt<DT>::T* y,
                     typename Elt<DT>::T* dx, i64 n) {
    typedef Elt<DT> E;
    typedef Pack<typename E::T, VEC> P;
    const i64 nvec = n / VEC;
    const typename E::T zero = E::store(0.f);
    P g[ITEMS], yy[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        i64 v = vector_index<ITEMS, THREADS>(i);
        if (v < nvec) {
            g[i] = reinterpret_cast<const P*>(grad)[v];
            yy[i] = reinterpret_cast<const P*>(y)[v];
        }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        i64 v = vector_index<ITEMS, THREADS>(i);
        if (v < nvec) {
            P out;
#pragma unroll
            for (int j = 0; j < VEC; ++j) out.v[j] = E::load(yy[i].v[j]) <= 0.f ? zero : g[i].v[j];
            reinterpret_cast<P*>(dx)[v] = out;
        }
    }
    i64 t = tail_index<VEC>(n);
    if (t < n) dx[t] = E::load(y[t]) <= 0.f ? zero : grad[t];
}

// y[m, c] = act(x[m, c] + bias[c]) over a contiguous [M, ncols] x, n = M * ncols.
// The host picks VEC dividing ncols, so a vector never straddles two rows and
// its bias slice is one aligned vector load (bias is tiny and stays in L1/L2).
template <int DT, int VEC, int ITEMS, int THREADS, int RELU>
__global__ void __launch_bounds__(THREADS)
bias_add_kernel(const typename Elt<DT>::T* x, const typename Elt<DT>::T* bias,
                typename Elt<DT>::T* y, i64 n, i64 ncols) {
    typedef Elt<DT> E;
    typedef Pack<typename E::T, VEC> P;
    const i64 nvec = n / VEC;
    P in[ITEMS], b[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        i64 v = vector_index<ITEMS, THREADS>(i);
        if (v < nvec) {
            in[i] = reinterpret_cast<const P*>(x)[v];
            b[i] = *reinterpret_cast<const P*>(bias + (v * VEC) % ncols);
        }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        i64 v = vector_index<ITEMS, THREADS>(i);
        if (v < nvec) {
            P out;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float r = E::load(in[i].v[j]) + E::load(b[i].v[j]);
                out.v[j] = E::store(RELU ? relu_f(r) : r);
            }
            reinterpret_cast<P*>(y)[v] = out;
        }
    }
    // VEC divides ncols, hence n: there is no tail.
}

#ifdef STANDALONE
// The default configs (kernels_cuda/elementwise.py: SPACE), instantiated for the build line at the top.
void* const standalone_kernels[] = {
    (void*)&relu_kernel<DT_FP32, 4, 4, 128>,
    (void*)&relu_backward_kernel<DT_FP32, 4, 4, 128>,
    (void*)&bias_add_kernel<DT_FP32, 4, 4, 128, 1>
};
#endif
