"""bench_kernels' trainer group: the GEMMs both protocols of the trainer run, with tuned configs
where the store has the exact shape (CPU: the cases are data; timing them needs the H200)."""
from kernels_core.store import ConfigStore
from kernels_core.mlp import PROTOCOLS, mlp_calls
from experiments import bench_kernels


def test_trainer_group_holds_every_distinct_gemm_of_both_protocols_once():
    cases = bench_kernels.trainer_cases()
    keys = [(c.dtype, "x".join(map(str, c.shape)) + ":" + c.layout) for c in cases]
    assert len(keys) == len(set(keys))
    want = {(p.dtype, call.key) for p in PROTOCOLS.values() for h in p.widths
            for call in mlp_calls(h, p.layers, p.batch_size, p.dtype) if call.op == "matmul"}
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
    store.put({"op": "matmul", "backend": "cuda", "dtype": "fp16", "shape": "4096x4096x4096:nn", "config": tuned})
    cases = {(c.dtype, c.shape, c.layout): c for c in bench_kernels.trainer_cases(store)}
    exact = cases[("fp32", (128, 1024, 784), "nn")]
    # fp32: each twin whose space has the TF32 tunable is timed in 3xTF32 too.
    assert exact.configs["triton"] == [("default", None), ("tf32x3", {"TF32": 3}), ("tuned", tuned)]
    # The CUDA twin's default is the SIMT kernel's, BLOCK_K 8: its tensor cores need 16.
    assert exact.configs["cuda"] == [("default", None), ("tf32x3", {"BLOCK_K": 16, "TF32": 3})]
    near = cases[("fp32", (128, 1024, 1024), "nn")]  # the store's lookup would offer a nearest shape: not timed
    assert near.configs["triton"] == [("default", None), ("tf32x3", {"TF32": 3})]
    square = {(c.dtype, c.shape): c for c in bench_kernels.gemm_cases([("fp16", 4096), ("fp16", 4095)], store)}
    assert square[("fp16", (4096,) * 3)].configs == {"cuda": [("default", None), ("tuned", tuned)],
                                                     "triton": [("default", None)]}
    assert square[("fp16", (4095,) * 3)].configs["cuda"] == [("default", None)]
    # fp32 squares: 3xTF32 on operands split ahead too, each twin's nearest such config to its default,
    # where one runs: the CUDA twin's (the wgmma kernel) on sm_90 alone, Triton's from sm_80 (TF32), none
    # without a GPU (arch 0).
    for arch, triton_ahead, cuda_ahead in ((90, True, True), (80, True, False), (75, False, False), (0, False, False)):
        (fp32,) = bench_kernels.gemm_cases([("fp32", 4096)], arch=arch)
        labels = {backend: [label for label, _ in configs] for backend, configs in fp32.configs.items()}
        assert labels["triton"] == ["default", "tf32x3"] + (["tf32x3 split ahead"] if triton_ahead else [])
        assert labels["cuda"] == ["default", "tf32x3"] + (["tf32x3 wgmma"] if cuda_ahead else [])
        if not triton_ahead:
            continue
        ahead = dict(fp32.configs["triton"])["tf32x3 split ahead"]
        assert ahead["TF32"] == 3 and ahead["SPLIT_AHEAD"] == 1
        if cuda_ahead:
            assert dict(fp32.configs["cuda"])["tf32x3 wgmma"]["WGMMA"] == 1


def test_fp32_products_time_torch_with_tf32_on_beside_ieee_cublas():
    fp32, fp16 = (bench_kernels.Case("gemm", "matmul", dt, (64,) * 3) for dt in ("fp32", "fp16"))
    assert bench_kernels._torch_variants(fp32) == [("cuBLAS/aten", None), ("cuBLAS TF32", None)]
    assert bench_kernels._torch_variants(fp16) == [("cuBLAS/aten", None)]
    import torch

    seen = []
    call = bench_kernels._with_tf32(lambda: seen.append(torch.backends.cuda.matmul.allow_tf32))
    call()
    assert seen == [True] and torch.backends.cuda.matmul.allow_tf32 is False


def test_trainer_group_at_chosen_widths_holds_those_widths_gemms_only():
    cases = bench_kernels.trainer_cases(widths={"default": (128,), "seed": ()})
    assert {c.dtype for c in cases} == {"fp32"}
    assert {c.shape for c in cases} >= {(128, 128, 784), (128, 10, 128), (784, 128, 128)}
    assert all(128 in c.shape for c in cases)  # no other width's GEMM
