"""Probe the GPU machine's stack before relying on it: CuPy/NVRTC templates and headers,
launches on torch's stream and inside a torch CUDA graph, Triton's API, and the two ceilings
(device copy bandwidth, cuBLAS GEMM rates on random data). Prints one line per check.

    python -m experiments.probe_stack
"""
import inspect
import time
import traceback

import numpy as np
import torch

from kernels_core.provenance import provenance
from kernels_core.timing import bench


def check(name, fn):
    try:
        print(f"OK   {name}: {fn()}", flush=True)
    except Exception as exc:
        print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(limit=2)


SRC = r"""
template <int VEC, bool FLAG>
__global__ void scale(const float* __restrict__ x, float* __restrict__ y, long long n, float s) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = FLAG ? x[i] * s * VEC : x[i];
}
"""


def cupy_template():
    import cupy
    t0 = time.time()
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=["scale<4, true>"])
    fn = mod.get_function("scale<4, true>")
    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    with stream:
        fn((4,), (256,), (np.uint64(x.data_ptr()), np.uint64(y.data_ptr()), np.int64(1000), np.float32(0.5)))
    torch.cuda.synchronize()
    assert torch.allclose(y, x * 2), "wrong result"
    # inside a torch CUDA graph
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        pass
    with torch.cuda.graph(g):
        st = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        with st:
            fn((4,), (256,), (np.uint64(x.data_ptr()), np.uint64(y.data_ptr()), np.int64(1000), np.float32(1.0)))
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(y, x * 4), "graph replay wrong"
    return f"compile {time.time() - t0:.2f}s, regs {fn.num_regs}, graph replay ok"


def cupy_headers():
    import cupy
    src = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <mma.h>\n" \
          "extern \"C\" __global__ void k(__half* p){ p[0] = __float2half(1.0f); }"
    cupy.RawModule(code=src, options=("-std=c++17",)).get_function("k")
    return "cuda_fp16.h, cuda_bf16.h, mma.h compile under NVRTC"


def cupy_mma():
    import cupy
    src = r"""
extern "C" __global__ void k(const unsigned* a, const unsigned* b, float* c) {
    float d[4] = {0, 0, 0, 0};
    unsigned A[4] = {a[0], a[1], a[2], a[3]}, B[2] = {b[0], b[1]};
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B[0]), "r"(B[1]));
    c[threadIdx.x] = d[0];
}"""
    cupy.RawModule(code=src, options=("-std=c++17", "--gpu-architecture=sm_90")).get_function("k")
    return "bf16 mma.sync compiles for sm_90 under NVRTC"


def triton_api():
    import triton
    import triton.language as tl
    sig = inspect.signature(tl.dot)
    from triton.compiler import ASTSource
    return f"triton {triton.__version__}; tl.dot params {list(sig.parameters)}; ASTSource {inspect.signature(ASTSource.__init__)}"


def ceilings():
    out = []
    n = 256 * 1024 * 1024
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    out.append(f"copy {2 * n * 4 / t.median_ms / 1e6:.0f} GB/s")
    del src, dst
    for name, dt, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                           ("fp16", torch.float16, False), ("bf16", torch.bfloat16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(4096, 4096, device="cuda").to(dt)
        b = torch.randn(4096, 4096, device="cuda").to(dt)
        t = bench(lambda: a @ b)
        out.append(f"{name} {2 * 4096 ** 3 / t.median_ms / 1e9:.0f} TFLOP/s")
    torch.backends.cuda.matmul.allow_tf32 = False
    return ", ".join(out)


def launch_overhead():
    import triton
    x = torch.randn(1024, device="cuda")
    for _ in range(10):
        torch.relu(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(1000):
        torch.relu(x)
    torch.cuda.synchronize()
    return f"torch relu {((time.perf_counter() - t0) * 1e3):.1f} us/call (triton {triton.__version__})"


if __name__ == "__main__":
    print(provenance())
    for name, fn in [("cupy templates + stream + graph", cupy_template), ("cupy headers", cupy_headers),
                     ("cupy bf16 mma", cupy_mma), ("triton api", triton_api),
                     ("launch overhead", launch_overhead), ("ceilings", ceilings)]:
        check(name, fn)
    try:
        import optuna
        print("OK   optuna", optuna.__version__)
    except Exception as exc:
        print("FAIL optuna", exc)
