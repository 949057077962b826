"""The CUDA twin's host side, on the CPU: the GPU side (CuPy, the driver) is faked.

resource_report must describe the kernel a config's call really launched (its layout,
epilogue and vector width), not a variant rebuilt from the config alone; every bad
argument must be refused, by name, before anything is compiled or launched; and a
split-K config must launch the grid, template and workspace it asks for. The `gpu`
tests at the end check on a real GPU what only this twin's split-K has.
"""
import contextlib
from types import SimpleNamespace

import pytest
import torch

import kernels_cuda as kc
from kernels_core.contract import DTYPES
from kernels_cuda import _runtime as rt
from kernels_cuda import reports
from kernels_cuda.matmul import KERNEL_PARAMS

SPLIT_AT = 9  # SPLIT_K's place among both kernels' template arguments


def named(args) -> dict:
    """A matmul kernel launch's arguments by parameter name."""
    assert len(args) == len(KERNEL_PARAMS)
    return dict(zip((name for name, _ in KERNEL_PARAMS), args))


@pytest.fixture
def fake_gpu(monkeypatch):
    loaded = {}

    def function(variant, device, smem):
        def fn(*args, **kwargs):
            pass
        fn.num_regs, fn.shared_size_bytes, fn.local_size_bytes = len(loaded) + 40, 128, 0
        loaded[variant.name_expr] = fn
        rt._launched[(variant.source, variant.name_expr)] = (smem, fn)
        return fn

    fake_cupy = SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: contextlib.nullcontext()))
    monkeypatch.setattr(rt, "function", function)
    monkeypatch.setattr(rt, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(rt, "_stream", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(rt, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(rt, "device_props", lambda i: (90, 232448))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(rt, "_variant_of", {})
    monkeypatch.setattr(rt, "_launched", {})
    return loaded


def test_resource_report_names_the_launched_variant(fake_gpu, rng):
    a = torch.randn(70, 130, generator=rng)  # passed as a.t(): an m-contiguous 130 x 70 operand
    b = torch.randn(70, 33, generator=rng)
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "THREAD_M": 4, "THREAD_N": 4,
              "num_stages": 2, "GROUP_M": 1, "SPLIT_K": 1}
    assert kc.resource_report("matmul", "fp32", config) is None, "nothing launched yet"
    kc.matmul(a.t(), b, bias=torch.randn(33, generator=rng), activation="relu", config=config)
    (launched,) = fake_gpu
    report = kc.resource_report("matmul", "fp32", config)
    assert report["registers"] == fake_gpu[launched].num_regs
    main, _ = reports._report_variant("matmul", "fp32", config, 90)
    assert main.name_expr != launched, "the launch differs from the row-major main variant"
    assert kc.resource_report("matmul", "fp32", {**config, "GROUP_M": 8}) is None


def test_elementwise_and_reductions_are_tagged_by_op_and_dtype(fake_gpu, rng):
    x = torch.randn(7, 129, generator=rng).half()
    kc.relu(x, config={"VEC": 2})
    kc.bias_grad(x)
    assert kc.resource_report("relu", "fp16", {"VEC": 2}) is not None
    assert kc.resource_report("relu", "fp32", {"VEC": 2}) is None
    assert kc.resource_report("bias_grad", "fp16") is not None
    assert kc.resource_report("relu_backward", "fp16", {"VEC": 2}) is None


def test_cuda_twin_names_the_bad_argument(fake_gpu):
    """The argument checks run on the host, so the CPU suite covers the CUDA twin's too."""
    from tests.test_ops import misnamed_errors
    failures = misnamed_errors(kc, "cpu")
    assert not failures, "\n".join(failures)


@pytest.fixture
def launches(fake_gpu, monkeypatch):
    """Every launch of the faked GPU: (variant, grid, block, args, smem)."""
    from kernels_core import workspace

    monkeypatch.setattr(workspace, "_live", {})  # a fresh workspace, so that growth is seen
    seen = []
    real = rt.launch

    def launch(variant, device, grid, block, args, smem=0, *, for_):
        seen.append((variant, tuple(grid), tuple(block), tuple(a.item() for a in args), smem))
        return real(variant, device, grid, block, args, smem, for_=for_)

    monkeypatch.setattr(rt, "launch", launch)
    return seen


# (dtype, config, m, n, k, layout, threads, slices with work): K is cut into SPLIT_K slices of
# ceil(K / (SPLIT_K * BLOCK_K)) * BLOCK_K, e.g. K = 300 into 8 of 48: six full, one of 12 and
# one empty, which is not launched; K = 50 into 4 of 64: one.
SPLITK_LAUNCHES = [
    ("fp32", {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "THREAD_M": 4, "THREAD_N": 4, "SPLIT_K": 8},
     70, 10, 300, "tn", 32, 7),
    ("fp32", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 8, "THREAD_M": 8, "THREAD_N": 4, "SPLIT_K": 2},
     129, 65, 17, "nt", 128, 2),
    ("fp16", {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1, "num_stages": 3, "SPLIT_K": 16},
     33, 10, 1000, "nn", 32, 16),
    ("bf16", {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "SPLIT_K": 4},
     300, 130, 50, "tt", 256, 1),
]


@pytest.mark.parametrize("dtype,config,m,n,k,layout,threads,slices", SPLITK_LAUNCHES,
                         ids=[f"{c[0]}-split{c[1]['SPLIT_K']}" for c in SPLITK_LAUNCHES])
def test_splitk_launch(launches, rng, dtype, config, m, n, k, layout, threads, slices):
    """A SPLIT_K config instantiates the kernel with its SPLIT_K, launches tiles x (slices with
    work) blocks of the config's threads with the slice length, and passes the shared workspace,
    grown to one fp32 tile per (tile, launched slice) and one counter per tile; SPLIT_K = 1, or
    a K that only one slice holds, launches the plain kernel on all K and passes no workspace
    (nor makes one)."""
    from kernels_core.workspace import splitk_workspace

    dt = DTYPES[dtype]
    trans_a, trans_b = layout[0] == "t", layout[1] == "t"
    a = torch.randn((k, m) if trans_a else (m, k), generator=rng).to(dt)
    b = torch.randn((n, k) if trans_b else (k, n), generator=rng).to(dt)
    tiles = -(-m // config["BLOCK_M"]) * -(-n // config["BLOCK_N"])
    for split, launched in ((1, 1), (config["SPLIT_K"], slices)):
        kc.matmul(a, b, trans_a=trans_a, trans_b=trans_b, bias=torch.randn(n, generator=rng).to(dt),
                  activation="relu", config={**config, "SPLIT_K": split})
        variant, grid, block, args, _ = launches[-1]
        args = named(args)
        plain = launched == 1
        assert variant.targs[SPLIT_AT] == (1 if plain else split)
        assert grid == (tiles, launched, 1) and block == (threads, 1, 1)
        k_slice = args["k_slice"]
        assert k_slice % config["BLOCK_K"] == 0 and (launched - 1) * k_slice < k <= launched * k_slice
        partials, counters = splitk_workspace(a.device, 0, 0)  # as the call left it
        if plain:
            assert (args["partials"], args["counters"]) == (0, 0) and partials.numel() == 0 and counters.numel() == 0
        else:
            assert k_slice == -(-k // (split * config["BLOCK_K"])) * config["BLOCK_K"]
            assert (args["partials"], args["counters"]) == (partials.data_ptr(), counters.data_ptr())
            assert partials.dtype == torch.float32 and counters.dtype == torch.int32
            assert partials.numel() == tiles * launched * config["BLOCK_M"] * config["BLOCK_N"]
            assert counters.numel() == tiles and not counters.any()


def test_tc_warp_grid_reaches_the_kernel(launches, rng):
    """The tensor-core kernel gets the warp grid warp_grid derives: 8 warps on a 128 x 64 tile
    are 4 x 2 (32 x 32 warp tiles), 2 warps on 32 x 64 are 1 x 2."""
    a = torch.randn(40, 64, generator=rng).half()
    b = torch.randn(64, 70, generator=rng).half()
    for cfg, grid in (({"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}, (4, 2)),
                      ({"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 2}, (1, 2))):
        kc.matmul(a, b, config=cfg)
        variant, _, block, _, _ = launches[-1]
        assert variant.targs[3:5] == grid and block == (32 * cfg["num_warps"], 1, 1)


# ----------------------------------------------------------------------------- on the GPU
# What only this twin has, out of the shared tests' reach (tests/test_splitk.py draws its
# configs from the smallest tiles, and fp16 accumulation is CUDA's alone).

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_splitk_configs_across_the_space(rng, dtype):
    """A fixed sample of the space's SPLIT_K > 1 configs (tiles up to 128 x 128, 1 to 8 warps,
    BLOCK_K up to 64), each on a K no slice divides, in all four layouts, against float64."""
    import random

    from tests.test_ops import check_matmul, local_arch, matmul_operands, randn

    configs = [c for c in kc.space("matmul", dtype).configs(DTYPES[dtype].itemsize, local_arch("cuda"))
               if c["SPLIT_K"] > 1]
    for i, cfg in enumerate(random.Random(f"splitk-{dtype}").sample(configs, 12)):
        trans_a, trans_b = bool(i % 2), bool(i // 2 % 2)
        m, n, k = 150, 90, 1013 + 64 * i
        a, b = matmul_operands(rng, m, n, k, dtype, "cuda", trans_a, trans_b)
        check_matmul(kc, a, b, trans_a=trans_a, trans_b=trans_b, bias=randn(rng, (n,), dtype, "cuda"),
                     activation="relu", config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", (2, 16))
def test_splitk_with_fp16_accumulation(rng, split_k):
    """Each slice accumulates in fp16 registers; the slices add up in fp32 and the sum is rounded
    once into the fp16 accumulator the epilogue reads: within fp16 accumulation's bound, and the
    same bits on every call."""
    from tests.test_ops import check_matmul, matmul_operands, randn

    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 1, "SPLIT_K": split_k}
    a, b = matmul_operands(rng, 70, 40, 900, "fp16", "cuda", False, False)
    bias = randn(rng, (40,), "fp16", "cuda")
    check_matmul(kc, a, b, bias=bias, activation="relu", config=cfg, accumulate="fp16")
    first = kc.matmul(a, b, bias=bias, activation="relu", config=cfg, accumulate="fp16")
    assert all(torch.equal(kc.matmul(a, b, bias=bias, activation="relu", config=cfg, accumulate="fp16"), first)
               for _ in range(10))
