"""bench_kernels' trainer group: the GEMMs both protocols of the trainer run, with tuned configs
where the store has the exact shape (CPU: the cases are data; timing them needs the H200)."""
from autotune.store import ConfigStore
from autotune.workload import mnist_mlp_calls
from experiments import bench_kernels


def test_trainer_group_holds_every_distinct_gemm_of_both_protocols_once():
    cases = bench_kernels.trainer_cases()
    keys = [(c.dtype, "x".join(map(str, c.shape)) + ":" + c.layout) for c in cases]
    assert len(keys) == len(set(keys))
    want = {(dt, call.key) for dt, batch, layers, widths in bench_kernels.TRAINER_PROTOCOLS for h in widths
            for call in mnist_mlp_calls(h, layers, batch, dt) if call.op == "matmul"}
    assert set(keys) == want
    assert ("fp32", "128x10x4096:nn") in want and ("fp16", "32x8192x8192:nt") in want
    logits = next(c for c in cases if c.shape == (128, 10, 1024) and c.layout == "nn")
    assert logits.kwargs == {"bias": True, "activation": None}
    hidden = next(c for c in cases if c.shape == (128, 1024, 784) and c.layout == "nn")
    assert hidden.kwargs == {"bias": True, "activation": "relu"}


def test_trainer_group_times_a_tuned_config_only_for_its_exact_shape():
    store = ConfigStore("sm_90")
    tuned = {"BLOCK_M": 32, "BLOCK_N": 64}
    store.put({"op": "matmul", "backend": "triton", "dtype": "fp32", "shape": "128x1024x784:nn", "config": tuned})
    cases = {(c.dtype, c.shape, c.layout): c for c in bench_kernels.trainer_cases(store)}
    exact = cases[("fp32", (128, 1024, 784), "nn")]
    assert exact.configs["triton"] == [("default", None), ("tuned", tuned)]
    assert exact.configs["cuda"] == [("default", None)]
    near = cases[("fp32", (128, 1024, 1024), "nn")]  # the store's lookup would offer a nearest shape: not timed
    assert near.configs["triton"] == [("default", None)]
