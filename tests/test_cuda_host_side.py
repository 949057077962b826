"""The CUDA twin's host side, on the CPU: the GPU side (CuPy, the driver) is faked.

resource_report must describe the kernel a config's call really launched (its layout,
epilogue and vector width), not a variant rebuilt from the config alone; every bad
argument must be refused, by name, before anything is compiled or launched; a split-K
config must launch the grid, template and workspace it asks for; and the fused paths
(matmul's a_rows and relu_grad_of, linear_cross_entropy, linear_sgd) must pass the
kernels the arguments, flags and scratch memory their kernels read. The `gpu` tests at
the end check on a real GPU what only this twin has.
"""
import re

import pytest
import torch

import kernels_cuda as kc
from kernels_core.contract import DTYPES, cdiv, label_flag
from kernels_cuda import _runtime as rt
from kernels_cuda import reports
from kernels_cuda.matmul import KERNEL_PARAMS, on_simt
from tests.fake_cuda import fake_runtime

# Where the matmul kernels' template arguments sit (kernels_cuda/matmul.py: simt_variant, tc_variant).
A_KC_AT = {"fp32": 10, "fp16": 11, "bf16": 11}
VA_AT = {"fp32": 5, "fp16": 6, "bf16": 6}
SPLIT_AT = 9
TF32_AT = 17  # matmul_tc.cu's TF32 mode


def named(args) -> dict:
    """A matmul kernel launch's arguments by parameter name."""
    assert len(args) == len(KERNEL_PARAMS)
    return dict(zip((name for name, _ in KERNEL_PARAMS), args))


def fused_flags(variant) -> tuple[int, str]:
    """(A_ROWS, the EPI name) of a matmul kernel variant: its last two template arguments."""
    return variant.targs[-2], {code: name for name, code in rt.EPI_CODE.items()}[variant.targs[-1]]


@pytest.fixture
def fake_gpu(monkeypatch):
    loaded = {}

    def function(variant, device, smem, dependent=0):
        def fn(*args, **kwargs):
            fn.runs += 1
        fn.num_regs, fn.shared_size_bytes, fn.local_size_bytes = len(loaded) + 40, 128, 0
        fn.runs = 0
        loaded[variant.name_expr] = fn
        rt._launched[(variant.source, variant.name_expr)] = (smem, fn)
        return fn

    fake_runtime(monkeypatch, function)
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


def test_a_grid_past_cudas_limits_is_refused_before_anything_is_built(fake_gpu):
    """bias_grad's column blocks lie along grid.y: 8.4M fp32 columns need 65,536 of them at its widest
    vector, one past CUDA's 65,535."""
    ncols = 65536 * 32 * 4
    with pytest.raises(ValueError, match=r"^bias_grad: the call needs 65536 blocks along grid axis y, past CUDA's "
                                         "65535; it is too large for this kernel$"):
        kc.bias_grad(torch.ones(1, ncols), config={"VEC": 4})
    assert not fake_gpu, "nothing compiled or loaded"
    kc.bias_grad(torch.ones(1, ncols - 32 * 4), config={"VEC": 4})
    assert len(fake_gpu) == 1


def test_compile_only_loads_each_kernel_of_a_call_and_runs_none(fake_gpu, rng):
    """The tuner's compile pool (kernels_core.compile_only): a split-K matmul's kernel and the
    fused loss's are compiled and loaded, and launched only outside it."""
    from kernels_core.compile_only import compile_only

    a, b = torch.randn(40, 300, generator=rng), torch.randn(300, 24, generator=rng)
    labels = torch.randint(0, 24, (40,), generator=rng)
    config = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "THREAD_M": 4, "THREAD_N": 4,
              "num_stages": 2, "GROUP_M": 8, "SPLIT_K": 4}
    with compile_only():
        kc.matmul(a, b, config=config)
        kc.linear_cross_entropy(a, b, labels)
    assert len(fake_gpu) == 2 and not any(fn.runs for fn in fake_gpu.values())
    kc.matmul(a, b, config=config)
    kc.linear_cross_entropy(a, b, labels)
    assert all(fn.runs for fn in fake_gpu.values())


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


@pytest.mark.parametrize("tf32", [3, 1])
def test_tf32_configs_launch_the_tensor_core_kernel_on_fp32(launches, rng, tf32):
    """fp32 configs with TF32 > 0 run matmul_tc.cu in fp32 with their TF32 mode, copying halves (an
    fp32 element is two: 4-float copies are 8 halves, a misaligned operand's 1-float copies 2),
    on 32 * num_warps threads and the space's shared memory; the fused ops too; TF32 = 0 stays on
    the SIMT kernel."""
    sp = kc.space("matmul", "fp32")
    a = torch.randn(70, 301, generator=rng)[:, :300]  # rows 301 floats apart: 4-byte copies only
    b = torch.randn(300, 12, generator=rng)  # rows 48 bytes apart: 16-byte copies
    config = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 2, "SPLIT_K": 8, "TF32": tf32}
    kc.matmul(a, b, config=config)
    variant, grid, block, _, smem = launches[-1]
    assert variant.source == "matmul_tc.cu" and variant.targs[TF32_AT] == tf32
    assert variant.targs[10] == rt.DT_CODE["fp32"]
    assert variant.targs[6:8] == (2, 8) and variant.targs[SPLIT_AT] == 8
    assert block == (64, 1, 1) and smem == sp.cost(sp.resolve(config, 4, 90), 4, 90)["smem_bytes"]
    labels = torch.randint(0, 12, (70,), generator=rng)
    kc.linear_cross_entropy(a.contiguous(), b, labels, config=config)
    layer = [torch.randn(s, generator=rng) for s in ((70, 300), (70, 12), (300, 12), (12,))]
    kc.linear_sgd(*layer, None, None, lr=0.1, config={**config, "SPLIT_K": 1})
    for (variant, *_), epi in zip(launches[-2:], ("xent", "sgd")):
        assert variant.source == "matmul_tc.cu" and variant.targs[TF32_AT] == tf32 and fused_flags(variant)[1] == epi
    kc.matmul(a, b, config={**config, "TF32": 0, "num_warps": 4, "THREAD_M": 4, "THREAD_N": 4})
    assert launches[-1][0].source == "matmul_simt.cu"


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


# ----------------------------------------------------------------------------- fused paths

def _signature(source: str, kernel: str) -> list[tuple[str, str]]:
    """(kind, name) of each parameter of `kernel` in kernels_cuda/`source` with fused.cuh's
    FUSED_PARAMS expanded; kind is "ptr" for a pointer, else the scalar type."""
    text = rt.source(source)
    body = re.search(r"#define FUSED_PARAMS\(T\)((?:.*\\\n)*.*)", text).group(1).replace("\\\n", " ")
    params, dtype = re.search(rf"^{kernel}\((.*?)FUSED_PARAMS\(([\w<>]+)\)\)", text, re.MULTILINE | re.DOTALL).groups()
    decls = [d.strip() for d in (params + body.replace("T ", dtype + " ")).split(",") if d.strip()]
    out = []
    for d in decls:
        name = re.search(r"(\w+)$", d).group(1)
        out.append(("ptr" if "*" in d else d[: -len(name)].split()[-1], name))
    return out


@pytest.mark.parametrize("source,kernel", [("matmul_simt.cu", "matmul_simt_kernel"), ("matmul_tc.cu", "matmul_tc_kernel")])
def test_kernel_params_are_the_kernels(source, kernel):
    """A launch passes KERNEL_PARAMS by position: the kernels must declare the same names in the
    same order with the same kinds, or one argument would be read as another on the GPU."""
    kinds = {rt.ptr: "ptr", rt.i32: "int", rt.i64: "i64", rt.f32: "float"}
    assert _signature(source, kernel) == [(kinds[conv], name) for name, conv in KERNEL_PARAMS]


def test_kernel_args_refuse_unknown_names():
    from kernels_cuda.matmul import kernel_args, operands

    x = torch.ones(3, 4)
    with pytest.raises(TypeError, match="labelz"):
        kernel_args(operands(x, x.t(), False, False), labelz=x)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("trans_a", (False, True))
def test_matmul_a_rows_launch(launches, rng, dtype, trans_a):
    """a_rows: the kernel reads the stored rows of a (not a gathered copy) at a's row stride,
    k contiguous when the batch is gathered along M, m contiguous when gathered along K, with
    the index vector and the stored row count (indices outside it read zeros); vector loads
    narrow to what the rows' offset allows. A view whose rows are not unit-stride is copied."""
    dt = DTYPES[dtype]
    data = torch.randn(50, 40, generator=rng).to(dt)
    stored = data[:, 3:27]  # rows of 24 at a stride of 40, 3 elements into the allocation
    rows = torch.tensor([3, 49, 0, -1, 50, 7, 7])
    m, k = (24, 7) if trans_a else (7, 24)
    kc.matmul(stored, torch.randn(k, 9, generator=rng).to(dt), trans_a=trans_a, a_rows=rows)
    variant, grid, _, args, _ = launches[-1]
    args = named(args)
    assert fused_flags(variant) == (1, "plain") and variant.targs[A_KC_AT[dtype]] == int(not trans_a)
    assert (args["A"], args["lda"], args["a_rows"], args["rows_of_a"]) == (stored.data_ptr(), 40, rows.data_ptr(), 50)
    assert (args["M"], args["N"], args["K"]) == (m, 9, k) and args["relu_y"] == 0
    assert variant.targs[VA_AT[dtype]] == 1  # 12 (fp32) or 6 (fp16/bf16) bytes into the allocation
    cfg = kc.space("matmul", dtype).default_for(90)
    assert grid == (cdiv(m, cfg["BLOCK_M"]) * cdiv(9, cfg["BLOCK_N"]), 1, 1)

    strided = data[:, ::2]  # rows of 20 at a column stride of 2: copied once
    k = 7 if trans_a else 20
    kc.matmul(strided, torch.randn(k, 9, generator=rng).to(dt), trans_a=trans_a, a_rows=rows)
    variant, _, _, args, _ = launches[-1]
    args = named(args)
    assert args["A"] != data.data_ptr() and (args["lda"], args["rows_of_a"]) == (20, 50)
    assert variant.targs[VA_AT[dtype]] == 4  # 20-element rows of a fresh allocation: 4 elements divide them


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matmul_relu_grad_of_launch(launches, rng, dtype):
    """relu_grad_of: the relu_grad epilogue, without bias or ReLU flags, reading y with ld = N (a
    column-major y is copied once); a K of 0 writes zeros and launches nothing."""
    dt = DTYPES[dtype]
    dy = torch.randn(13, 20, generator=rng).to(dt)
    w = torch.randn(9, 20, generator=rng).to(dt)  # dy @ w^T: b k-contiguous
    y = torch.randn(9, 13, generator=rng).to(dt).t()
    kc.matmul(dy, w, trans_b=True, relu_grad_of=y)
    variant, _, _, args, _ = launches[-1]
    at = A_KC_AT[dtype]
    assert fused_flags(variant) == (0, "relu_grad") and variant.targs[at + 1: at + 4] == (1, 0, 0)
    assert named(args)["relu_y"] not in (0, y.data_ptr())
    y = y.contiguous()
    kc.matmul(dy, w, trans_b=True, relu_grad_of=y)
    assert named(launches[-1][3])["relu_y"] == y.data_ptr() and len(launches) == 2
    out = kc.matmul(dy[:, :0], w[:, :0], trans_b=True, relu_grad_of=y)
    assert len(launches) == 2 and out.shape == (13, 9) and not out.any()


def _small(dtype: str, cfg: dict) -> dict:
    return {**cfg, **({"THREAD_M": 4, "THREAD_N": 4} if dtype == "fp32" else {})}


# (dtype, config, m, n, k, slices with work, bias, label_rows): K = 300 in 8 slices of 48 is 7
# with work; K = 64 in 4 of 32 is 2; K = 50 in 16 of 64 is 1, the plain kernel.
XENT_LAUNCHES = [
    ("fp32", {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 8}, 70, 10, 300, 7, True, True),
    ("fp16", {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1}, 33, 16, 100, 1, False, False),
    ("bf16", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "SPLIT_K": 4}, 129, 50, 64, 2, True, False),
    ("fp16", {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 1, "SPLIT_K": 16}, 40, 10, 50, 1, True, True),
]


@pytest.mark.parametrize("dtype,config,m,n,k,slices,with_bias,with_rows", XENT_LAUNCHES,
                         ids=[f"{c[0]}-split{c[1].get('SPLIT_K', 1)}-{c[5]}" for c in XENT_LAUNCHES])
def test_linear_cross_entropy_launch(launches, rng, dtype, config, m, n, k, slices, with_bias, with_rows):
    """One launch of row tiles x slices with work, the xent epilogue, and the scratch layout both
    twins use from one splitk_workspace call: split-K's partial tiles (only when K is split),
    then one fp32 loss slot per row tile; the tiles' counters, then the loss's counter, all zero."""
    from kernels_core.workspace import splitk_workspace

    dt = DTYPES[dtype]
    cfg = kc.space("linear_cross_entropy", dtype).resolve(_small(dtype, config), dt.itemsize)
    x, w = torch.randn(m, k, generator=rng).to(dt), torch.randn(k, n, generator=rng).to(dt)
    bias = torch.randn(n, generator=rng).to(dt) if with_bias else None
    labels = torch.randint(0, n, (m + 5,) if with_rows else (m,), generator=rng)
    label_rows = torch.randint(-2, m + 7, (m,), generator=rng) if with_rows else None
    out_grad = torch.empty(m, n, dtype=dt)
    loss, grad = kc.linear_cross_entropy(x, w, labels, bias=bias, label_rows=label_rows, out_grad=out_grad,
                                         config=cfg)
    assert grad is out_grad and loss.shape == () and loss.dtype == torch.float32
    (variant, grid, block, args, smem), = launches
    args = named(args)
    tiles = cdiv(m, cfg["BLOCK_M"])
    assert grid == (tiles, slices, 1) and block == (kc.space("matmul", dtype).cost(cfg, dt.itemsize)["threads"], 1, 1)
    assert fused_flags(variant) == (0, "xent") and variant.targs[SPLIT_AT] == (cfg["SPLIT_K"] if slices > 1 else 1)
    assert variant.targs[A_KC_AT[dtype] + 2: A_KC_AT[dtype] + 4] == (int(with_bias), 0)
    partials, counters = splitk_workspace(x.device, 0, 0)  # as the call left it
    partial_elems = tiles * slices * cfg["BLOCK_M"] * cfg["BLOCK_N"] if slices > 1 else 0
    assert partials.numel() == partial_elems + tiles and counters.numel() == tiles + 1 and not counters.any()
    assert args["loss_slots"] == partials.data_ptr() + 4 * partial_elems
    assert args["loss_counter"] == counters.data_ptr() + 4 * tiles
    split = (partials.data_ptr(), counters.data_ptr()) if slices > 1 else (0, 0)
    assert (args["partials"], args["counters"]) == split
    assert (args["A"], args["B"], args["bias"], args["C"]) == (
        x.data_ptr(), w.data_ptr(), bias.data_ptr() if with_bias else 0, out_grad.data_ptr())
    assert (args["M"], args["N"], args["K"]) == (m, n, k)
    assert (args["labels"], args["label_rows"], args["n_labels"]) == (
        labels.data_ptr(), label_rows.data_ptr() if with_rows else 0, labels.shape[0])
    assert (args["loss"], args["flag"]) == (loss.data_ptr(), label_flag(x.device).data_ptr())
    assert smem == kc.space("matmul", dtype).cost(cfg, dt.itemsize)["smem_bytes"]
    assert kc.resource_report("linear_cross_entropy", dtype, cfg) is not None


def test_linear_cross_entropy_refusals_and_empty_batch(launches, rng):
    """A tile narrower than the row is refused, naming config, before anything is launched; so is
    split-K's config rule; M = 0 is torch's mean over nothing (NaN) with nothing launched; a
    strided out_grad gets the kernel's contiguous rows by one copy."""
    x, w, labels = torch.randn(5, 8, generator=rng), torch.randn(8, 17, generator=rng), torch.zeros(5, dtype=torch.int64)
    small = {"BLOCK_M": 32, "BLOCK_N": 16, "THREAD_M": 4, "THREAD_N": 4}
    with pytest.raises(ValueError, match=r"config: .*BLOCK_N >= N = 17"):
        kc.linear_cross_entropy(x, w, labels, config=small)
    with pytest.raises(ValueError, match="config: restriction.*split-K"):
        kc.linear_cross_entropy(x, w, labels, config={"SPLIT_K": 2, "GROUP_M": 1})
    loss, grad = kc.linear_cross_entropy(x[:0], w, labels[:0])
    assert loss.isnan() and grad.shape == (0, 17) and not launches
    out_grad = torch.empty(17, 5).t()
    _, grad = kc.linear_cross_entropy(x, w, labels, out_grad=out_grad)
    assert grad is out_grad and named(launches[-1][3])["C"] != out_grad.data_ptr()


# (dtype, config, batch, K_in, N_out, x_rows, momentum): an empty batch still launches (gw = 0,
# the rule still applies); a layer with no inputs still gets one tile row, for its bias.
SGD_LAUNCHES = [
    ("fp32", {"BLOCK_M": 32, "BLOCK_N": 16}, 7, 70, 33, True, 0.9),
    ("fp16", {}, 128, 200, 10, False, 0.0),
    ("bf16", {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}, 0, 65, 130, True, 0.9),
    ("fp32", {}, 5, 0, 9, False, 0.5),
]


@pytest.mark.parametrize("dtype,config,batch,k_in,n_out,with_rows,momentum", SGD_LAUNCHES,
                         ids=[f"{c[0]}-B{c[2]}-K{c[3]}-N{c[4]}" for c in SGD_LAUNCHES])
def test_linear_sgd_launch(launches, rng, dtype, config, batch, k_in, n_out, with_rows, momentum):
    """The "tn" GEMM x^T @ dy (x m-contiguous, dy n-contiguous) in one launch of the sgd epilogue,
    never split, M = K_in, N = N_out, K = the batch; the parameters, their low copies, and the
    buffers only with momentum (the kernel branches on them, as sgd_update's MOMENTUM flag)."""
    dt = DTYPES[dtype]
    cfg = kc.space("linear_sgd", dtype).resolve(_small(dtype, config) if config else None, dt.itemsize)
    x = torch.randn(60 if with_rows else batch, k_in, generator=rng).to(dt)
    x_rows = torch.randint(-3, 63, (batch,), generator=rng) if with_rows else None
    dy = torch.randn(batch, n_out, generator=rng).to(dt)
    w, w_buf = torch.randn(k_in, n_out, generator=rng), torch.randn(k_in, n_out, generator=rng)
    bias, b_buf = torch.randn(n_out, generator=rng), torch.randn(n_out, generator=rng)
    w_low, b_low = torch.empty(k_in, n_out, dtype=dt), torch.empty(n_out, dtype=dt)
    for m in (momentum, 0.0):
        assert kc.linear_sgd(x, dy, w, bias, w_buf, b_buf, lr=0.1, momentum=m, weight_decay=1e-2, x_rows=x_rows,
                             w_low=w_low, b_low=b_low, config=cfg) is None
        variant, grid, block, args, _ = launches[-1]
        args = named(args)
        assert grid == (cdiv(max(k_in, 1), cfg["BLOCK_M"]) * cdiv(n_out, cfg["BLOCK_N"]), 1, 1)
        at = A_KC_AT[dtype]
        assert variant.targs[SPLIT_AT] == 1 and variant.targs[at + 1: at + 4] == (0, 0, 0)
        assert fused_flags(variant) == (int(with_rows), "sgd")
        assert (args["A"], args["B"], args["M"], args["N"], args["K"]) == (
            x.data_ptr(), dy.data_ptr(), k_in, n_out, batch)
        if k_in:  # (an x of no columns has no layout to speak of: no element of it is read)
            assert variant.targs[at] == 0 and (args["lda"], args["ldb"]) == (k_in, n_out)
        assert (args["a_rows"], args["rows_of_a"]) == ((x_rows.data_ptr(), 60) if with_rows else (0, 0))
        assert (args["w"], args["w_low"], args["b"], args["b_low"]) == (
            w.data_ptr(), w_low.data_ptr(), bias.data_ptr(), b_low.data_ptr())
        bufs = (w_buf.data_ptr(), b_buf.data_ptr()) if m else (0, 0)
        assert (args["w_buf"], args["b_buf"]) == bufs
        assert (args["lr"], args["momentum"], args["weight_decay"]) == pytest.approx((0.1, m, 1e-2), rel=1e-7)
        assert args["C"] == args["bias"] == args["partials"] == args["loss"] == 0
    assert kc.resource_report("linear_sgd", dtype, cfg) is not None


def test_linear_sgd_refusals(launches, rng):
    """Split-K is outside linear_sgd's space (refused naming config); a layer of no outputs has
    nothing to update and launches nothing."""
    x, dy = torch.randn(4, 6, generator=rng), torch.randn(4, 5, generator=rng)
    w, bias = torch.zeros(6, 5), torch.zeros(5)
    with pytest.raises(ValueError, match="config: SPLIT_K=2 is outside"):
        kc.linear_sgd(x, dy, w, bias, None, None, lr=0.1, config={"SPLIT_K": 2})
    kc.linear_sgd(x, dy[:, :0], w[:, :0], bias[:0], None, None, lr=0.1)
    assert not launches


def test_fused_ops_refuse_bf16_before_sm80(fake_gpu, monkeypatch, rng):
    monkeypatch.setattr(rt, "device_props", lambda i: (75, 65536))
    x = torch.randn(4, 6, generator=rng).bfloat16()
    with pytest.raises(ValueError, match="x: bf16 .*sm_80"):
        kc.linear_cross_entropy(x, torch.randn(6, 3).bfloat16(), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="x: bf16 .*sm_80"):
        kc.linear_sgd(x, x[:, :3], torch.zeros(6, 3), torch.zeros(3), None, None, lr=0.1)
    with pytest.raises(ValueError, match="a: bf16 .*sm_80"):
        kc.matmul(x, x.t(), a_rows=torch.zeros(2, dtype=torch.int64))


# ----------------------------------------------------------------------------- on the GPU
# What only this twin has, out of the shared tests' reach (tests/test_splitk.py draws its
# configs from the smallest tiles, and fp16 accumulation is CUDA's alone).

def mine(items, part: int, parts: int):
    """(index, item) of the items a test's `part` of `parts` checks. A test that compiles dozens of
    variants runs as several parts, so that pytest-xdist spreads its compiles over the workers of
    a fresh machine: whole, the longest took 4 minutes of a 4-minute suite."""
    return [(i, item) for i, item in enumerate(items) if i % parts == part]


@pytest.mark.gpu
@pytest.mark.parametrize("part", range(4))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_splitk_configs_across_the_space(rng, dtype, part):
    """A fixed sample of the space's SPLIT_K > 1 configs (tiles up to 128 x 128, 1 to 8 warps,
    BLOCK_K up to 128), each on a K no slice divides, in all four layouts, against float64."""
    import random

    from tests.test_ops import check_matmul, local_arch, matmul_operands, randn

    sp = kc.space("matmul", dtype)
    configs = [c for c in sp.configs(DTYPES[dtype].itemsize, local_arch("cuda"))
               if c["SPLIT_K"] > 1 and sp.precision_of(c) is None]  # lower precisions: test_tf32
    for i, cfg in mine(random.Random(f"splitk-{dtype}").sample(configs, 12), part, 4):
        trans_a, trans_b = bool(i % 2), bool(i // 2 % 2)
        m, n, k = 150, 90, 1013 + 64 * i
        a, b = matmul_operands(rng, m, n, k, dtype, "cuda", trans_a, trans_b)
        check_matmul(kc, a, b, trans_a=trans_a, trans_b=trans_b, bias=randn(rng, (n,), dtype, "cuda"),
                     activation="relu", config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("part", range(4))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_wide_k_steps_across_the_layouts(rng, dtype, part):
    """The configs of the widest k steps of the spaces (SIMT: BLOCK_K 64 and 128 at
    the register rule's edge; tensor cores: BLOCK_K 128), a fixed sample, plain and split-K, in all
    four layouts with bias and ReLU, against float64; and every one-warp tensor-core tile at BLOCK_K
    128 on K = 10, whose k-contiguous rows are read 4 bytes at a time: 32 x 64 and 64 x 32 wrote
    garbage there (relative error 1) until the copies took load_async (experiments/FINDINGS.md, "Tensor-core kernel: small blocks and the one-warp cost")."""
    import random

    from tests.test_ops import check_matmul, matmul_operands, randn

    wide = 64 if dtype == "fp32" else 128
    configs = _fitting(kc.space("matmul", dtype), DTYPES[dtype].itemsize,
                       lambda c: c["BLOCK_K"] >= wide and not c.get("WGMMA"))
    for i, cfg in mine(random.Random(f"wide-k-{dtype}").sample(configs, 8), part, 4):
        trans_a, trans_b = bool(i % 2), bool(i // 2 % 2)
        # K below one k step, between, past several; rows of K = 10 and 330 (k-contiguous operands)
        # are read 4 bytes at a time, of 100 8 bytes, of 1013 2 (kernels_cuda/_runtime.py: pick_vec).
        m, n, k = 37 + 20 * i, 10 + 13 * i, (10, 100, 330, 1013)[i % 4]
        a, b = matmul_operands(rng, m, n, k, dtype, "cuda", trans_a, trans_b)
        check_matmul(kc, a, b, trans_a=trans_a, trans_b=trans_b, bias=randn(rng, (n,), dtype, "cuda"),
                     activation="relu", config=cfg)
    if dtype == "fp32":
        return
    one_warp = _fitting(kc.space("matmul", dtype), DTYPES[dtype].itemsize,
                        lambda c: c["BLOCK_K"] == 128 and c["num_warps"] == 1 and c["SPLIT_K"] == 1
                        and c["GROUP_M"] == 1 and c["num_stages"] == 2)
    assert {(c["BLOCK_M"], c["BLOCK_N"]) for c in one_warp} >= {(32, 64), (64, 32), (16, 16)}
    for _, cfg in mine(one_warp, part, 4):
        a, b = matmul_operands(rng, 32, 128, 10, dtype, "cuda", False, True)
        check_matmul(kc, a, b, trans_b=True, config=cfg)


# Small work per thread: the SIMT kernel's thread tiles of 2 (rows or columns in
# groups of 2), the tensor-core kernel's blocks of 2-4 warps up to 512 outputs (warp tiles down to
# 16 x 8, one n-tile: ldmatrix x2). Each with the set of shapes it adds, and its 16 x 16 tile.
SMALL_WORK = {
    "fp32": (lambda c: 2 in (c["THREAD_M"], c["THREAD_N"]), lambda c: (c["THREAD_M"], c["THREAD_N"]),
             {(2, 2), (2, 4), (4, 2), (2, 8), (8, 2)}, lambda c: c["THREAD_M"] == c["THREAD_N"] == 2),
    **{dtype: (lambda c: not c["WGMMA"] and c["num_warps"] > 1 and c["BLOCK_M"] * c["BLOCK_N"] <= 512,
               lambda c: (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"]),
               {(16, 16, 2), (16, 32, 2), (32, 16, 2), (16, 32, 4), (32, 16, 4)}, lambda c: c["num_warps"] == 2)
       for dtype in ("fp16", "bf16")},
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_small_work_per_thread(rng, dtype):
    """SMALL_WORK's configs, a fixed sample with the 16 x 16 tile among it, plain and split-K, in all
    four layouts with bias and ReLU and with relu_grad_of, on odd shapes (odd N: the epilogue's
    pairs split at the edge) against float64; then linear_sgd (gathered rows, momentum, weight
    decay, low copies) and linear_cross_entropy (split-K, a K no slice divides) on such tiles."""
    import random

    from kernels_core.reference import exact
    from tests.test_fused import ce_problem
    from tests.test_ops import (assert_rel, check_linear_ce, check_linear_sgd, check_matmul, matmul_operands, randn,
                                sgd_layer)
    from tests.test_splitk import K_CASES, tolerance

    new, shape_of, shapes, tile16 = SMALL_WORK[dtype]
    elt = DTYPES[dtype].itemsize

    def small(op, **fixed):
        return _fitting(kc.space(op, dtype), elt, lambda c: new(c) and all(c[k] == v for k, v in fixed.items()))

    configs = small("matmul")
    assert {shape_of(c) for c in configs} == shapes
    smallest = [c for c in configs if c["BLOCK_M"] == c["BLOCK_N"] == 16 and tile16(c)]
    for i, cfg in enumerate(random.Random(f"small-{dtype}").sample(configs, 7) +
                            random.Random(f"small-{dtype}").sample(smallest, 1)):
        trans_a, trans_b = bool(i % 2), bool(i // 2 % 2)
        m, n, k = 45 + 6 * i, 27 + 10 * i, (1, 37, 130, 1013)[i % 4]
        a, b = matmul_operands(rng, m, n, k, dtype, "cuda", trans_a, trans_b)
        check_matmul(kc, a, b, trans_a=trans_a, trans_b=trans_b, bias=randn(rng, (n,), dtype, "cuda"),
                     activation="relu", config=cfg)
    for cfg in random.Random(f"small-{dtype}-relu-grad").sample(configs, 2):
        g, w, y = (randn(rng, shape, dtype, "cuda") for shape in ((33, 70), (41, 70), (33, 41)))
        out = kc.matmul(g, w, trans_b=True, relu_grad_of=y, config=cfg)
        assert_rel(out, exact.matmul(g, w, trans_b=True, relu_grad_of=y), tolerance(dtype, 70, "cuda"), f"{cfg}")
    for cfg in random.Random(f"small-{dtype}-sgd").sample(small("linear_sgd"), 3):
        layer = sgd_layer(rng, "cuda", dtype, 70, 37, 19, momentum=0.9, rows=90, low=True)
        check_linear_sgd(kc, layer, lr=0.1, momentum=0.9, weight_decay=1e-2, config=cfg)
    for split_k in (1, 4):
        cfg = random.Random(f"small-{dtype}-xent-{split_k}").choice(small("linear_cross_entropy", SPLIT_K=split_k))
        k = 29 if split_k == 1 else K_CASES["ragged"](split_k, cfg["BLOCK_K"])
        x, w, bias, labels = ce_problem(rng, 70, 10, k, dtype, "cuda")
        check_linear_ce(kc, x, w, labels, bias=bias, config=cfg)


# Tiles of the staged epilogue (matmul_tc.cu: STAGED, more than 512 outputs): (BLOCK_M, BLOCK_N,
# num_warps, num_stages), on 1 to 8 warps, which stage a tile of tn operands in 1, 1, 2, 4, 1 and
# 2 passes.
STAGED_TILES = ((32, 32, 1, 4), (64, 64, 4, 4), (128, 128, 4, 2), (256, 128, 8, 2), (64, 128, 8, 4), (256, 32, 8, 2))
# Tiles of at most 512 outputs, whose epilogue reads the mma fragments straight from registers.
FRAGMENT_TILES = ((16, 16, 1, 2), (16, 32, 1, 2), (32, 16, 1, 3), (16, 16, 2, 2), (16, 32, 2, 4), (32, 16, 4, 2))


def summation_order(cfg, accumulate="fp32"):
    """What fixes the order in which the tensor-core kernel sums an output's products: the k step
    (BLOCK_K), the slices of K (SPLIT_K), and whether the warp tile keeps a second set of
    accumulators for every other 16-wide k slice (matmul_tc.cu: TWO_SETS, warp tiles of one or two
    16 x 8 mma tiles with fp32 accumulators, bar 3xTF32's). Configs of the same order promise the
    same bits; others only agree within rounding."""
    from kernels_cuda.matmul import warp_grid

    warps_m, warps_n = warp_grid(cfg)
    mma_tiles = cfg["BLOCK_M"] // warps_m // 16 * (cfg["BLOCK_N"] // warps_n // 8)
    two_sets = accumulate == "fp32" and cfg.get("TF32", 0) != 3 and mma_tiles <= 2
    return cfg["BLOCK_K"], cfg["SPLIT_K"], 2 if two_sets else 1


def test_every_staged_tile_has_a_fragment_tile_of_its_summation_order():
    """The bit-for-bit test below needs, for each staged tile, a fragment tile that sums in the same
    order; and the fragment tiles must cover both orders, so that a rule change that moves one of
    them is seen."""
    def config(bm, bn, warps, stages):
        return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": warps, "num_stages": stages}

    fragment_orders = {summation_order(config(*t)) for t in FRAGMENT_TILES}
    assert {summation_order(config(*t))[2] for t in FRAGMENT_TILES} == {1, 2}
    assert all(summation_order(config(*t)) in fragment_orders for t in STAGED_TILES)
    assert all(config(*t)["BLOCK_M"] * config(*t)["BLOCK_N"] <= 512 for t in FRAGMENT_TILES)
    assert all(config(*t)["BLOCK_M"] * config(*t)["BLOCK_N"] > 512 for t in STAGED_TILES)


@pytest.mark.gpu
@pytest.mark.parametrize("part", range(2))
@pytest.mark.parametrize("dtype", ("fp16", "bf16"))
def test_tiles_of_one_summation_order_give_the_same_bits(rng, dtype, part):
    """The tensor-core kernel promises the same bits for the same inputs and config on every call,
    and across tile shapes wherever the summation order is the same (summation_order): tiles of
    more than 512 outputs go through shared memory to the epilogue, tiles of at most 512 straight
    from their mma fragments, and the two epilogues do the same arithmetic per element. Checked bit
    for bit between each staged tile and a fragment tile of its order, and among fragment tiles of
    one order: plain GEMMs with bias and ReLU in three layouts, on rows of N % 4 != 0 and into a C
    4 bytes past an 8-byte boundary (the epilogue's scalar stores), relu_grad_of, split-K, and
    linear_sgd with gathered rows, momentum, weight decay and low copies. Each is also checked
    against float64, and each config is called twice."""
    from kernels_core.reference import exact
    from tests.test_ops import (assert_rel, check_linear_sgd, check_matmul, matmul_operands, poisoned, randn,
                                sgd_layer)
    from tests.test_splitk import tolerance

    def config(bm, bn, warps, stages, split_k=1):
        return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 32, "num_warps": warps, "num_stages": stages, "GROUP_M": 8,
                "SPLIT_K": split_k, "WGMMA": 0}

    def same_order(cfg, tiles=FRAGMENT_TILES):
        """Another tile of cfg's summation order."""
        return next(config(*t, split_k=cfg["SPLIT_K"]) for t in tiles
                    if t[:3] != (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"])
                    and summation_order(config(*t, split_k=cfg["SPLIT_K"])) == summation_order(cfg))

    m, k = 77, 70
    pairs = [(config(*t), same_order(config(*t))) for t in STAGED_TILES + FRAGMENT_TILES[:2]]
    for i, (cfg, fragments) in mine(pairs, part, 2):
        n = (203, 200)[i % 2]
        trans_a, trans_b = ((False, False), (True, False), (False, True))[i % 3]
        a, b = matmul_operands(rng, m, n, k, dtype, "cuda", trans_a, trans_b)
        kw = dict(trans_a=trans_a, trans_b=trans_b, bias=randn(rng, (n,), dtype, "cuda"), activation="relu")
        check_matmul(kc, a, b, config=cfg, **kw)
        want = kc.matmul(a, b, config=fragments, **kw)
        assert torch.equal(kc.matmul(a, b, config=fragments, **kw), want), fragments
        assert torch.equal(kc.matmul(a, b, config=cfg, **kw), want), (cfg, fragments)
        shifted = poisoned((m * n + 2,), dtype, "cuda")[2:].view(m, n)
        assert torch.equal(kc.matmul(a, b, config=cfg, out=shifted, **kw), want), (cfg, fragments)

        g, w, y = (randn(rng, shape, dtype, "cuda") for shape in ((m, k), (n, k), (m, n)))
        got = kc.matmul(g, w, trans_b=True, relu_grad_of=y, config=cfg)
        assert_rel(got, exact.matmul(g, w, trans_b=True, relu_grad_of=y), tolerance(dtype, k, "cuda"), f"{cfg}")
        assert torch.equal(got, kc.matmul(g, w, trans_b=True, relu_grad_of=y, config=fragments)), (cfg, fragments)

        layer = sgd_layer(rng, "cuda", dtype, 37, m, n, momentum=0.9, rows=90, low=True)
        again = tuple(None if t is None else t.clone() for t in layer)
        hyper = dict(lr=0.1, momentum=0.9, weight_decay=1e-2)
        check_linear_sgd(kc, layer, config=cfg, **hyper)
        x, dy, w0, bias, w_buf, b_buf, x_rows, w_low, b_low = again
        kc.linear_sgd(x, dy, w0, bias, w_buf, b_buf, x_rows=x_rows, w_low=w_low, b_low=b_low, config=fragments, **hyper)
        for name, got, want in zip(("w", "bias", "w_buf", "b_buf", "w_low", "b_low"),
                                   layer[2:6] + layer[7:], again[2:6] + again[7:]):
            assert torch.equal(got, want), f"{name}, {cfg}, {fragments}"

    for _, tile in mine(((64, 64, 4, 4), (128, 128, 4, 2), (16, 16, 1, 2)), part, 2):  # split-K: at most 128 x 128
        cfg = config(*tile, split_k=4)
        fragments = same_order(cfg)
        a, b = matmul_operands(rng, m, 203, 900, dtype, "cuda", False, False)
        kw = dict(bias=randn(rng, (203,), dtype, "cuda"), activation="relu")
        check_matmul(kc, a, b, config=cfg, **kw)
        want = kc.matmul(a, b, config=cfg, **kw)
        assert torch.equal(kc.matmul(a, b, config=cfg, **kw), want), cfg
        assert torch.equal(kc.matmul(a, b, config=fragments, **kw), want), (cfg, fragments)


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


def _fitting(sp, elt, keep):
    """The space's configs for this GPU (arch, shared memory) that `keep` accepts."""
    from tests.test_ops import fits_here, local_arch

    return [c for c in sp.configs(elt, local_arch("cuda")) if keep(c) and fits_here(sp, c, elt, "cuda")]


@pytest.mark.gpu
@pytest.mark.parametrize("part", range(3))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_linear_cross_entropy_epilogue_across_the_space(rng, dtype, part):
    """linear_cross_entropy over a sample of its space (split-K or not, 300 rows in many row
    tiles, a K no slice divides, label_rows with entries outside labels): loss and dlogits
    against float64 softmax cross-entropy of the logits matmul stores with the same config. Its
    accumulation is the fused kernel's (same tiles, slices, order and bias add), so the logits
    are the same bits and what is left is the epilogue's fp32 arithmetic. Per row, with
    u = 2**-24: s = sum exp(z - max) within (N + 3) u (expf within 2 ulp, N - 1 sums), so
    log s within that plus logf's ulp, and the row's three terms |max|, |log s|, |z_label| each
    rounded once more: (N + 8) u (1 + those terms) covers it; the mean adds M roundings of the
    rows' sum. dlogits: softmax within (N + 10) u of itself plus u (an exp of a rounded
    difference, the sum, the reciprocal; p |z - max| <= 1/e), - onehot and / M one rounding
    each, then the dtype's rounding (its unit roundoff of the value, or half its smallest
    subnormal). A wrong row, label or tile sum is off by orders more. The loss is the same
    bits on every call."""
    import random

    from kernels_core.reference import exact
    from tests.test_ops import randn

    elt = DTYPES[dtype].itemsize
    m, n, k, u = 300, 10, 1013, 2.0**-24
    sp = kc.space("linear_cross_entropy", dtype)
    pick = random.Random(f"xent-{dtype}")
    configs = (pick.sample(_fitting(sp, elt, lambda c: c["SPLIT_K"] > 1 and c["BLOCK_N"] >= n), 6)
               + pick.sample(_fitting(sp, elt, lambda c: c["SPLIT_K"] == 1 and c["BLOCK_N"] >= n), 3))
    x, w = randn(rng, (m, k), dtype, "cuda"), randn(rng, (k, n), dtype, "cuda", scale=k ** -0.5 * 3)
    bias = randn(rng, (n,), dtype, "cuda")
    labels = torch.randint(0, n, (m + 50,), generator=rng).cuda()
    label_rows = torch.randint(-3, m + 53, (m,), generator=rng).cuda()
    inside = (label_rows >= 0) & (label_rows < m + 50)
    picked = torch.where(inside, labels[label_rows.clamp(0, m + 49)], torch.zeros_like(label_rows))
    unit = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}[dtype]
    tiny = {"fp32": 2.0**-150, "fp16": 2.0**-25, "bf16": 2.0**-134}[dtype]
    for _, cfg in mine(configs, part, 3):
        loss, grad = kc.linear_cross_entropy(x, w, labels, bias=bias, label_rows=label_rows, config=cfg)
        z = kc.matmul(x, w, bias=bias, config=cfg).double()
        ref_loss, ref_grad = exact.softmax_cross_entropy(z, picked)
        terms = z.max(1).values.abs() + torch.logsumexp(z, 1).abs() + z.gather(1, picked[:, None])[:, 0].abs()
        row_bound = (n + 8) * u * (1 + terms.max().item())
        bound = row_bound + m * u * (ref_loss.abs().item() + row_bound)
        assert abs(loss.item() - ref_loss.item()) <= bound, (cfg, loss.item(), ref_loss.item(), bound)
        grad_bound = unit * ref_grad.abs() + tiny + (n + 10) * u * (torch.softmax(z, 1) + 1) / m
        excess = ((grad.double() - ref_grad).abs() - grad_bound).max().item()
        assert excess <= 0, (cfg, excess)
        for _ in range(3):
            again, again_grad = kc.linear_cross_entropy(x, w, labels, bias=bias, label_rows=label_rows, config=cfg)
            assert torch.equal(again, loss) and torch.equal(again_grad, grad), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("trans_a", (False, True))
def test_a_rows_with_splitk(rng, dtype, trans_a):
    """Gathered rows under split-K: along K each slice starts k_slice entries into the index
    vector (enter_slice), along M every slice gathers the same rows; indices outside the stored
    rows read zeros. Against float64 within matmul's tolerance: a slice that gathered the wrong
    rows is off by O(1)."""
    import random

    from kernels_core.reference import exact
    from tests.test_ops import assert_rel, matmul_tol, randn

    elt = DTYPES[dtype].itemsize
    data = randn(rng, (500, 1000 if not trans_a else 96), dtype, "cuda")
    rows = torch.randint(-5, 505, (96 if not trans_a else 1000,), generator=rng).cuda()
    k = 1000
    b = randn(rng, (k, 40), dtype, "cuda")
    sp = kc.space("matmul", dtype)
    for cfg in random.Random(f"rows-{dtype}-{trans_a}").sample(_fitting(sp, elt, lambda c: c["SPLIT_K"] > 1 and sp.precision_of(c) is None), 4):
        out = kc.matmul(data, b, trans_a=trans_a, a_rows=rows, config=cfg)
        assert_rel(out, exact.matmul(data, b, trans_a=trans_a, a_rows=rows), matmul_tol(dtype, k), str(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_rows_in_whole_k_steps(rng, dtype):
    """Gathered rows along M (the trainer's first layer) in the small tiles' loop of whole k steps,
    where each thread's chunk rows are looked up once (matmul_tc.cu, TcTile::Async): 80 x 48
    outputs, so most tiles lie inside M and N, and K = 784, twelve whole steps of 64 and a ragged
    one; indices outside the stored rows fall inside tiles (rows of zeros in whole steps). Configs
    of at most 64 x 64 outputs without split-K, against float64 within matmul's tolerance."""
    import random

    from kernels_core.reference import exact
    from tests.test_ops import assert_rel, matmul_tol, randn

    elt = DTYPES[dtype].itemsize
    m, n, k, stored = 80, 48, 784, 300
    data, b = randn(rng, (stored, k), dtype, "cuda"), randn(rng, (k, n), dtype, "cuda")
    rows = torch.randint(0, stored, (m,), generator=rng)
    rows[[5, 21, 42]] = torch.tensor([-1, stored, 2**40])
    rows = rows.cuda()
    sp = kc.space("matmul", dtype)
    small = _fitting(sp, elt, lambda c: c["SPLIT_K"] == 1 and c["BLOCK_M"] * c["BLOCK_N"] <= 4096 and not c.get("WGMMA"))
    for cfg in random.Random(f"whole-rows-{dtype}").sample(small, 8):
        out = kc.matmul(data, b, a_rows=rows, config=cfg)
        assert_rel(out, exact.matmul(data, b, a_rows=rows), matmul_tol(dtype, k), str(cfg))


@pytest.mark.gpu
def test_simt_ring_gives_the_two_buffer_loops_bits(rng):
    """The SIMT kernel's cp.async ring (num_stages 3 and 4, matmul_simt.cu) runs the two-buffer
    loop's FMAs in the same order on the same zeros, so each of a sample of its configs must give
    num_stages 2's bits: in all four layouts with bias and ReLU, plain and split-K, ragged in M, N
    and K, operands read 4, 8 and 16 bytes at a time (K = 101, 330, 1000 and odd N: pick_vec);
    with gathered rows along M and K (indices outside the stored rows), with relu_grad_of; and in
    linear_cross_entropy and linear_sgd. Against float64 within matmul's tolerance too, so that
    two loops wrong the same way fail."""
    import random

    from kernels_core.reference import exact
    from tests.test_ops import assert_rel, matmul_operands, matmul_tol, randn

    ring = _fitting(kc.space("matmul", "fp32"), 4, lambda c: on_simt("fp32", c) and c["num_stages"] >= 3)
    pick = random.Random("simt-ring")

    def same(fn, cfg, **kw):
        out = fn(config=cfg, **kw)
        two = fn(config={**cfg, "num_stages": 2}, **kw)
        for x, y in zip(*((out, two) if isinstance(out, tuple) else ((out,), (two,)))):
            assert torch.equal(x, y), cfg
        return out

    for i, cfg in enumerate(pick.sample(ring, 8)):
        trans_a, trans_b = bool(i % 2), bool(i // 2 % 2)
        m, n, k = 37 + 20 * i, 10 + 13 * i, (101, 330, 1000, 784)[i % 4]
        a, b = matmul_operands(rng, m, n, k, "fp32", "cuda", trans_a, trans_b)
        kw = dict(trans_a=trans_a, trans_b=trans_b, bias=randn(rng, (n,), "fp32", "cuda"), activation="relu")
        out = same(lambda **c: kc.matmul(a, b, **kw, **c), cfg)
        assert_rel(out, exact.matmul(a, b, **kw), matmul_tol("fp32", k), str(cfg))

    data = randn(rng, (300, 1000), "fp32", "cuda")
    for trans_a in (False, True):
        rows = torch.randint(-5, 305, (96 if not trans_a else 300,), generator=rng).cuda()
        a = data if not trans_a else data[:, :96]
        b = randn(rng, (1000 if not trans_a else 300, 40), "fp32", "cuda")
        for cfg in pick.sample(ring, 2):
            out = same(lambda **c: kc.matmul(a, b, trans_a=trans_a, a_rows=rows, **c), cfg)
            assert_rel(out, exact.matmul(a, b, trans_a=trans_a, a_rows=rows), matmul_tol("fp32", len(b)), str(cfg))

    dy, w = randn(rng, (77, 70), "fp32", "cuda"), randn(rng, (50, 70), "fp32", "cuda")
    y = randn(rng, (77, 50), "fp32", "cuda")
    for cfg in pick.sample(ring, 2):
        out = same(lambda **c: kc.matmul(dy, w, trans_b=True, relu_grad_of=y, **c), cfg)
        assert_rel(out, exact.matmul(dy, w, trans_b=True, relu_grad_of=y), matmul_tol("fp32", 70), str(cfg))

    x, wl = randn(rng, (130, 784), "fp32", "cuda"), randn(rng, (784, 10), "fp32", "cuda", scale=0.1)
    labels = torch.randint(0, 10, (130,), generator=rng).cuda()
    for cfg in pick.sample([c for c in ring if c["BLOCK_N"] >= 10], 2):
        same(lambda **c: kc.linear_cross_entropy(x, wl, labels, bias=wl[0], **c), cfg)

    xs, g = randn(rng, (200, 150), "fp32", "cuda"), randn(rng, (200, 33), "fp32", "cuda")
    start = [randn(rng, shape, "fp32", "cuda") for shape in ((150, 33), (33,), (150, 33), (33,))]  # w, bias, bufs
    for cfg in pick.sample([c for c in ring if c["SPLIT_K"] == 1], 2):
        def step(config):
            params = [p.clone() for p in start]
            kc.linear_sgd(xs, g, *params, lr=0.05, momentum=0.9, weight_decay=1e-2, config=config)
            return tuple(params)
        same(step, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("n_out", (33, 64))
@pytest.mark.parametrize("layout", ("contiguous", "offset1"))
def test_linear_sgd_weights_are_sgd_updates_bits(rng, n_out, layout):
    """fp32: the weights and their buffer after linear_sgd are bit for bit sgd_update's from the
    gw matmul computes with the same config (the same accumulation; the rule written with the
    same expressions, so the same fused multiply-adds), whether the epilogue moves whole vectors
    (N_out = 64, aligned) or single elements (N_out odd, or the params one element into their
    allocation); w_low is w. The bias (column sums in k order, where bias_grad sums another
    way) is within what its fp32 sum can be off, B u sum |dy|, carried through the rule (times
    lr into the bias, once into its buffer), plus the rule's own 6 u of its terms."""
    from kernels_core.reference import exact
    from tests.test_ops import laid_out, randn

    batch, k_in, lr, momentum, wd, u = 77, 150, 0.05, 0.9, 1e-2, 2.0**-24
    data = randn(rng, (300, k_in), "fp32", "cuda")
    x_rows = torch.randint(-2, 302, (batch,), generator=rng).cuda()
    dy = randn(rng, (batch, n_out), "fp32", "cuda")
    params = [laid_out(randn(rng, shape, "fp32", "cuda"), layout) for shape in [(k_in, n_out)] * 2 + [(n_out,)] * 2]
    w, w_buf, bias, b_buf = params
    start = [p.clone() for p in params]
    w_low, b_low = laid_out(torch.empty(k_in, n_out, device="cuda"), layout), torch.empty(n_out, device="cuda")
    cfg = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 16, "THREAD_M": 4, "THREAD_N": 4, "SPLIT_K": 1}
    kc.linear_sgd(data, dy, w, bias, w_buf, b_buf, lr=lr, momentum=momentum, weight_decay=wd, x_rows=x_rows,
                  w_low=w_low, b_low=b_low, config=cfg)
    ref_w, ref_buf = start[0].clone(), start[1].clone()
    kc.sgd_update([ref_w], [kc.matmul(data, dy, trans_a=True, a_rows=x_rows, config=cfg)], [ref_buf], lr=lr,
                  momentum=momentum, weight_decay=wd)
    assert torch.equal(w, ref_w) and torch.equal(w_buf, ref_buf) and torch.equal(w_low, w)
    gb = dy.double().sum(0)
    (ref_b,), (ref_bb,) = exact.sgd_update([start[2]], [gb], [start[3]], lr=lr, momentum=momentum, weight_decay=wd)
    (mag_b,), (mag_bb,) = exact.sgd_update([start[2].abs()], [gb.abs()], [start[3].abs()], lr=-lr,
                                           momentum=momentum, weight_decay=wd)
    sum_err = batch * u * dy.double().abs().sum(0)
    assert ((bias.double() - ref_b).abs() <= 6 * u * mag_b + lr * sum_err).all()
    assert ((b_buf.double() - ref_bb).abs() <= 6 * u * mag_bb + sum_err).all()
    assert torch.equal(b_low, bias)
