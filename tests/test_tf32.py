"""fp32 matmuls on TF32 tensor cores: the TF32 tunable of both twins' fp32 spaces.

TF32 = 3 (3xTF32) must stay within the bounds the exact fp32 kernels are held to; TF32 = 1
(plain TF32) is a lower precision, declared as such, and within its own bound. Under Triton's
interpreter the split and its roundings run as written (kernels_triton/matmul.py: _to_tf32),
and tl.dot multiplies in fp32, so the CPU checks the arithmetic the GPU does, bar the tensor
cores' accumulation; the CUDA twin's (matmul_tc.cu) runs in the `gpu` tests, its builds in
tests/test_cuda_compile.py. Inputs are fresh random draws with ragged shapes; references in
float64.
"""
import dataclasses
import itertools
import math
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from autotune.samplers import view_space
from kernels_core import contract
from kernels_core.reference import exact
from kernels_core.space import Space
from kernels_core.targets import TARGETS
from kernels_triton.matmul import _to_tf32
from tests.test_fused import pick
from tests.test_ops import assert_rel, check_linear_ce, check_linear_sgd, randn, sgd_layer
from tests.test_splitk import products_over_ref, tf32x3_slack, tolerance
from tests.test_wgmma import _cuobjdump, replayed_matmul, sm90

EXACT, SPLIT3, PLAIN = 0, 3, 1  # the TF32 tunable's values


# ----------------------------------------------------------------------------- the rounding

@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, _to_tf32(x), mask=offs < n)


def tf32_reference(x: float) -> float:
    """x rounded to 11 significant bits, ties to even, by value: fp32's subnormals keep their grid
    of 2^-136 (13 bits dropped), and a value past the largest TF32 number becomes infinite."""
    if not math.isfinite(x) or x == 0:
        return x
    _, e = math.frexp(abs(x))  # abs(x) = m * 2^e, 0.5 <= m < 1
    q = 2.0 ** max(e - 11, -136)
    return math.copysign(round(abs(x) / q) * q, x)  # exact quotient; round() ties to even


def test_to_tf32_rounds_to_nearest_even(device, rng):
    bits = torch.randint(-2**31, 2**31, (3000,), generator=rng, dtype=torch.int64)
    ties = (bits[:400] & ~0x1FFF) | 0x1000  # exactly half way, with bit 13 (the kept lsb) odd or even
    specials = torch.tensor([0x7F800000, 0xFF800000, 0x7FC00000, 0x80000000, 0x7F7FFFFF, 0x00000001,
                             0x00001000, 0x00003000, 0x007FF000, 0x3F800FFF, 0x3F801000, 0x3F803000])
    raw = torch.cat([bits, ties, specials]).to(torch.int64)
    x = torch.where(raw >= 2**31, raw - 2**32, raw).to(torch.int32).view(torch.float32)
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(device), y_out := y.to(device), x.numel(), BLOCK=1024)
    got = y_out.cpu()
    want = torch.tensor([tf32_reference(v) for v in x.double().tolist()], dtype=torch.float64).to(torch.float32)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert same.all(), (f"{int((~same).sum())} values rounded wrong, e.g. {x[~same][:4].tolist()} -> "
                        f"{got[~same][:4].tolist()}, expected {want[~same][:4].tolist()}")


# ----------------------------------------------------------------------------- matmul

@pytest.mark.parametrize("layout", ["nn", "tn", "nt", "tt"])
@pytest.mark.parametrize("split_k", [1, 4])
def test_matmul_3xtf32_within_the_fp32_bound(ops, device, rng, layout, split_k):
    """3xTF32 with bias and ReLU, every layout, split or not: within the bound of the exact fp32
    kernels (test_splitk.tolerance: the split's dropped terms included), where one TF32 product
    alone would be off by about 2^-12."""
    m, n, k = 37, 50, 129
    a, b = randn(rng, (m, k), "fp32", device), randn(rng, (k, n), "fp32", device)
    bias = randn(rng, (n,), "fp32", device)
    trans_a, trans_b = layout[0] == "t", layout[1] == "t"
    config = pick(ops, "matmul", "fp32", device, rng, tf32=SPLIT3, split_k=split_k)
    stored_a = a.t().contiguous() if trans_a else a  # op(stored) is a
    stored_b = b.t().contiguous() if trans_b else b
    out = ops.matmul(stored_a, stored_b, bias=bias, activation="relu", trans_a=trans_a, trans_b=trans_b,
                      config=config)
    assert_rel(out, exact.matmul(a, b, bias=bias, activation="relu"), tolerance("fp32", k, device), f"config={config}")


LONG_K = (40, 33, 2**16 + 13)  # m, n, k: a K long enough for a bias that grows like K to pass the bound


@pytest.mark.gpu  # the interpreter's sums round to nearest: only tensor cores can show the bias
@pytest.mark.parametrize("tf32", [EXACT, SPLIT3])
def test_matmul_over_a_long_k_stays_within_the_fp32_bound(ops, device, rng, tf32):
    """Over a long K the fp32 bound grows like sqrt(K) (random signs), while a sum that always rounds
    the same way errs like K. Tensor cores add into their accumulator rounding toward zero: 3xTF32
    carried in the accumulator over all of K erred 2.9e-5 at 4096^3, about 4 times the bound at this
    K scaled up; each k step's products summed apart and added in fp32 stay within it (the model
    below). The exact kernel, here too, shows the bound is not too tight."""
    m, n, k = LONG_K
    a, b = randn(rng, (m, k), "fp32", device), randn(rng, (k, n), "fp32", device)
    config = pick(ops, "matmul", "fp32", device, rng, tf32=tf32)
    assert_rel(ops.matmul(a, b, config=config), exact.matmul(a, b), tolerance("fp32", k, device), f"config={config}")


def test_the_long_k_bound_tells_a_sum_rounded_toward_zero_from_one_rounded_to_nearest(rng):
    """The GPU test above, on a model of the two ways to accumulate: each k8 step's products summed
    exactly (an mma's TF32 products are exact), then added to an fp32 accumulator rounding toward
    zero (the tensor cores carrying it) or to nearest (an fp32 add). At LONG_K the first must fail
    the bound, the second pass it well inside, or the GPU test could not tell the kernels apart."""
    m, n, k = LONG_K
    a = torch.randn((m, k), generator=rng, dtype=torch.float64).numpy()
    b = torch.randn((k, n), generator=rng, dtype=torch.float64).numpy()
    ref = a @ b
    toward_zero, nearest = np.zeros((m, n), np.float32), np.zeros((m, n), np.float32)
    for k0 in range(0, k, 8):
        step = a[:, k0:k0 + 8] @ b[k0:k0 + 8]
        exact_sum = toward_zero + step
        rounded = exact_sum.astype(np.float32)
        away = np.abs(rounded) > np.abs(exact_sum)
        toward_zero = np.where(away, np.nextafter(rounded, np.float32(0)), rounded)
        nearest = (nearest + step).astype(np.float32)
    error = {name: np.linalg.norm(c - ref) / np.linalg.norm(ref) for name, c in
             (("toward zero", toward_zero), ("nearest", nearest))}
    bound = tolerance("fp32", k, "cuda")
    assert error["toward zero"] > bound and error["nearest"] < bound / 4, (error, bound)


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")  # inf * 0, on purpose
def test_3xtf32_keeps_ieee_infinities_nans_and_the_largest_finite_values(ops, device, rng):
    check_ieee_specials(ops, device, rng, pick(ops, "matmul", "fp32", device, rng, tf32=SPLIT3))


def check_ieee_specials(ops, device, rng, config):
    """As test_ops.test_matmul_nan_inf, in 3xTF32: a NaN in A gives its row NaN; an infinity meets B's
    entries that are exact TF32 numbers (their small parts 0, where inf * 0 in a cross product would
    be NaN), another infinity (inf * inf) and a 0 (inf * 0: NaN, as IEEE has it); a finite A entry
    that rounds to TF32's infinity (0x7F7FF000, within half a TF32 step of fp32's largest) stays
    finite."""
    m, n, k = 20, 24, 16
    a = randn(rng, (m, k), "fp32", device)
    b = randn(rng, (k, n), "fp32", device).abs() * 1e-3
    b[2, :6] = torch.tensor([1.0, 0.5, 2.0, 0.25, 1.5, 0.75])
    a[3, 5] = float("nan")
    a[7] = a[7].abs()
    a[7, 2] = float("inf")  # row 7 of C: +inf everywhere (all terms >= 0) but column 9
    b[2, 7] = float("inf")  # C[7, 7] = inf * inf + ...: +inf
    b[2, 9] = 0.0  # C[7, 9] = inf * 0 + ...: NaN
    a[9, 0] = torch.tensor(0x7F7FF000, dtype=torch.int32).view(torch.float32).item()  # times b[0] <= ~4e-3: finite
    out = ops.matmul(a, b, config=config)
    ref = exact.matmul(a, b)
    assert torch.equal(out.isnan().cpu(), ref.isnan().cpu()) and out[3].isnan().all(), f"config={config}"
    assert torch.equal(out.isinf().cpu(), ref.isinf().cpu()) and out[7, 7].isposinf(), f"config={config}"
    assert ref[7, 9].isnan() and (ref[7].isposinf().sum() == n - 1) and ref[7, 7].isposinf()
    finite = ref.isfinite()
    assert_rel(out[finite], ref[finite], tolerance("fp32", k, device), f"config={config}")


def test_plain_tf32_is_a_lower_precision_within_its_bound(ops, device, rng):
    """TF32 = 1 rounds both operands to TF32: each product off by at most 2^-10 of its size, so
    about 2^-11 norm-wise with random signs; bounded by twice that, and visibly rounded (an exact
    fp32 product is 2^-24-close)."""
    m, n, k = 45, 38, 300
    a, b = randn(rng, (m, k), "fp32", device), randn(rng, (k, n), "fp32", device)
    config = pick(ops, "matmul", "fp32", device, rng, tf32=PLAIN)
    out = ops.matmul(a, b, config=config)
    ref = exact.matmul(a, b)
    err = (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()
    assert 2.0**-14 < err <= 2 * 2.0**-11 + tolerance("fp32", k, device), f"config={config}: error {err:.3g}"


# ----------------------------------------------------------------------------- wgmma on split operands (sm_90)
# The CUDA twin's fp32 WGMMA = 1 (kernels_cuda/matmul_wgmma_tf32x3.cu): a split pass writes A's and
# B^T's TF32 parts k-contiguous, whatever the layout, and the wgmma GEMM multiplies them.

def wgmma_tf32_configs(arch: int = 90) -> list[dict]:
    from kernels_cuda.matmul import FP32_SPACE

    return [c for c in FP32_SPACE.configs(4, arch) if c["WGMMA"]]


def wgmma_tf32_bound(tf32: int, k: int, a, b, ref, trans_a=False, trans_b=False, device="cuda") -> float:
    """3xTF32: the exact kernels' bound with the split's own (tf32x3_slack). TF32: each operand
    rounded to 11 bits, so each product off by a factor d = da + db (+ da db), each of da, db at most
    u = 2^-11: per output at most (2 u + u^2) sum |a||b| (products_over_ref: a bias cancelling the
    products, at small K, leaves their error where ref is small), and with da, db spread evenly over
    [-u, u], d's spread u sqrt(2/3) times sqrt(sum (ab)^2); the smaller of the first and 3 spreads of
    the second, which is the smaller from a few terms on."""
    if tf32 == SPLIT3:
        return tolerance("fp32", k, device) + tf32x3_slack(a, b, ref, trans_a, trans_b)
    u = 2.0**-11
    spread = exact.matmul(a.double() ** 2, b.double() ** 2, trans_a=trans_a, trans_b=trans_b).sqrt()
    random_signs = 3 * u * math.sqrt(2 / 3) * (torch.linalg.vector_norm(spread.cpu())
                                               / torch.linalg.vector_norm(ref.double().cpu()).clamp_min(1e-300)).item()
    worst = (2 * u + u * u) * products_over_ref(a, b, ref, trans_a, trans_b)
    return tolerance("fp32", k, device) + min(worst, random_signs)


@pytest.mark.parametrize("arch", (75, 80, 86, 89, 100))
def test_only_sm90_is_offered_the_fp32_wgmma_kernel(arch):
    import kernels_cuda as kc

    assert not wgmma_tf32_configs(arch)
    assert kc.space("matmul", "fp32").default_for(arch)["WGMMA"] == 0


def test_fp32_wgmma_configs_fit_the_kernel():
    """Every config multiplies on TF32 tensor cores (3xTF32 or plain TF32), a consumer warpgroup owns 64
    rows, one wgmma spans the tile's columns, its ring fits the H200's 227 KB, and the fused ops never
    get the kernel."""
    import kernels_cuda as kc
    from kernels_cuda.matmul import FP32_SPACE

    configs = wgmma_tf32_configs()
    assert {c["TF32"] for c in configs} == {SPLIT3, PLAIN} and len(configs) >= 40
    for c in configs:
        assert c["BLOCK_M"] == 64 * (c["num_warps"] // 4) and c["BLOCK_N"] in (64, 128), c
        assert c["BLOCK_K"] == 32 and c["SPLIT_K"] == 1 and c["num_stages"] >= 2, c
        cost = FP32_SPACE.cost(c, 4, 90)
        assert cost["threads"] == 32 * c["num_warps"] + 128 and cost["smem_bytes"] <= 227 * 1024, c
    for op in contract.FUSED_OPS:
        assert kc.space(op, "fp32").params["WGMMA"] == (0,)


@pytest.mark.skipif(shutil.which("nvcc") is None or _cuobjdump() is None, reason="needs nvcc and cuobjdump")
def test_the_fp32_wgmma_configs_build_to_tf32_hgmma_without_spills_or_serialization(tmp_path):
    """Each tile the space offers (its deepest ring), in 3xTF32 and TF32, with and without bias and
    ReLU, built for sm_90a as the twin launches it: 12 HGMMA ... TF32 a 32-wide k slice in 3xTF32, 4 in
    TF32, TMA loads, no spills, no wgmma ptxas had to serialize (C751x); and the split pass in its four
    forms (3xTF32 or TF32 parts, read along k or across it), no spills."""
    from kernels_cuda.matmul import wgmma_tf32_variant

    deepest = {}
    for c in wgmma_tf32_configs():
        key = (c["BLOCK_M"], c["BLOCK_N"], c["TF32"])
        deepest[key] = max(deepest.get(key, c), c, key=lambda x: x["num_stages"])
    kernels = {}  # name expression -> (BN, TF32 HGMMAs)
    for i, c in enumerate(sorted(deepest.values(), key=lambda x: (x["BLOCK_M"], x["BLOCK_N"], x["TF32"]))):
        v = wgmma_tf32_variant(c, has_bias=i % 2, relu=i % 2, c_pairs=1)
        kernels[v.name_expr] = (c["BLOCK_N"], 12 if c["TF32"] == SPLIT3 else 4)
    splits = [f"tf32_split_kernel<{parts},{k_contig}>" for parts in (1, 2) for k_contig in (0, 1)]
    per_kernel = build_sm90a(tmp_path, [*kernels, *splits])
    assert set(per_kernel) == {*kernels, *splits}
    for name, (bn, hgmmas) in kernels.items():
        assert per_kernel[name].count(f"HGMMA.64x{bn}x8.F32.TF32") == hgmmas, per_kernel[name][:200]
        assert "UTMALDG.2D" in per_kernel[name] and "HMMA" not in per_kernel[name].replace("HGMMA", "")


# Ragged shapes: M and N not multiples of any tile, K with a tail after its 32-wide slices and not a
# multiple of 4 (the parts' rows padded), one row, one column, K = 1, and more tiles than blocks.
WGMMA_TF32_SHAPES = [(150, 70, 129), (1, 200, 37), (257, 1, 64), (64, 64, 1), (333, 190, 1000), (1100, 1300, 300)]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("m,n,k", WGMMA_TF32_SHAPES)
def test_fp32_wgmma_matmul_against_float64(rng, m, n, k, trans_a, trans_b):
    """Every layout (the split pass transposes what is not k-contiguous), bias and ReLU, 3xTF32 within
    the exact kernels' bound and TF32 within its own, on a config drawn per case."""
    import random

    import kernels_cuda as kc

    config = random.Random(f"{m}-{n}-{k}-{trans_a}-{trans_b}").choice(wgmma_tf32_configs())
    a = randn(rng, (k, m) if trans_a else (m, k), "fp32", "cuda")
    b = randn(rng, (n, k) if trans_b else (k, n), "fp32", "cuda")
    bias = randn(rng, (n,), "fp32", "cuda")
    out = torch.full((m, n), float("nan"), device="cuda")
    kc.matmul(a, b, bias=bias, activation="relu", trans_a=trans_a, trans_b=trans_b, out=out, config=config)
    ref = exact.matmul(a, b, bias=bias, activation="relu", trans_a=trans_a, trans_b=trans_b)
    assert_rel(out, ref, wgmma_tf32_bound(config["TF32"], k, a, b, ref, trans_a, trans_b), f"config={config}")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("config", wgmma_tf32_configs(),
                         ids=lambda c: "{BLOCK_M}x{BLOCK_N}w{num_warps}s{num_stages}g{GROUP_M}t{TF32}".format(**c))
def test_every_fp32_wgmma_config(rng, config):
    """Each config the tuner may draw, once: operands as strided views (rows 521 floats apart, an
    unaligned start), so the split pass reads what the TMA could not."""
    import kernels_cuda as kc

    m, n, k = 300, 270, 520
    a = randn(rng, (m, k + 1), "fp32", "cuda")[:, 1:]
    b = randn(rng, (k, n + 1), "fp32", "cuda")[:, 1:]
    ref = exact.matmul(a, b)
    assert_rel(kc.matmul(a, b, config=config), ref, wgmma_tf32_bound(config["TF32"], k, a, b, ref), f"config={config}")


@pytest.mark.gpu
@sm90
def test_fp32_wgmma_keeps_ieee_specials_and_its_long_k_bound(rng):
    """The specials of 3xTF32 as the mma.sync kernel keeps them (the split pass splits an infinity or
    NaN as it does), and over a long K the step accumulator's fp32 adds keep the bias of the tensor
    cores' rounding toward zero out of the result."""
    import kernels_cuda as kc

    configs = [c for c in wgmma_tf32_configs() if c["TF32"] == SPLIT3]
    check_ieee_specials(kc, "cuda", rng, configs[0])
    m, n, k = LONG_K
    a, b = randn(rng, (m, k), "fp32", "cuda"), randn(rng, (k, n), "fp32", "cuda")
    assert_rel(kc.matmul(a, b, config=configs[-1]), exact.matmul(a, b), tolerance("fp32", k, "cuda"), f"{configs[-1]}")


@pytest.mark.gpu
@sm90
def test_fp32_wgmma_call_replays_in_a_cuda_graph(rng):
    """The parts' workspace comes from the graph's pool and the tensor maps are baked into the
    capture: a replay on new inputs gives their product."""
    config = next(c for c in wgmma_tf32_configs() if c["TF32"] == SPLIT3 and c["BLOCK_M"] == 128)
    a, b, out = replayed_matmul(rng, "fp32", config)
    ref = exact.matmul(a, b)
    assert_rel(out, ref, wgmma_tf32_bound(SPLIT3, 784, a, b, ref))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("what", ["a_rows", "relu_grad_of"])
def test_fp32_calls_the_wgmma_kernel_cannot_take_are_config_errors(rng, what):
    import kernels_cuda as kc

    a, b = randn(rng, (64, 96), "fp32", "cuda"), randn(rng, (96, 64), "fp32", "cuda")
    kwargs = {"a_rows": torch.arange(64, device="cuda")} if what == "a_rows" else \
        {"relu_grad_of": randn(rng, (64, 64), "fp32", "cuda")}
    with pytest.raises(ValueError, match="^config: .*WGMMA=0"):
        kc.matmul(a, b, config=wgmma_tf32_configs()[0], **kwargs)


# ----------------------------------------------------------------------------- Triton: split ahead
# SPLIT_AHEAD = 1 (kernels_triton/matmul.py): op(A)'s and op(B)^T's parts written k-contiguous by a
# pass, then the GEMM on them: the same parts as the split per tile, so under the interpreter the
# same bits.

TRITON_AHEAD_TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=2, num_stages=3)


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("tf32", [SPLIT3, PLAIN])
@pytest.mark.parametrize("m,n,k", [(37, 50, 129), (5, 3, 1), (40, 17, 70), (70, 130, 129)])
def test_triton_split_ahead_gives_the_products_of_the_split_per_tile(device, rng, m, n, k, tf32, trans_a, trans_b):
    """Every layout (the pass transposes B and a transposed A), K with a tail and K not a multiple of 4
    (the parts' rows padded), bias and ReLU: the bits of SPLIT_AHEAD = 0 where the interpreter
    multiplies, and on a GPU within the bound of the precision."""
    import kernels_triton as kt

    a = randn(rng, (k, m) if trans_a else (m, k), "fp32", device)
    b = randn(rng, (n, k) if trans_b else (k, n), "fp32", device)
    bias = randn(rng, (n,), "fp32", device)
    outs = [kt.matmul(a, b, bias=bias, activation="relu", trans_a=trans_a, trans_b=trans_b,
                      config={**TRITON_AHEAD_TILE, "TF32": tf32, "SPLIT_AHEAD": ahead}) for ahead in (0, 1)]
    ref = exact.matmul(a, b, bias=bias, activation="relu", trans_a=trans_a, trans_b=trans_b)
    if device == "cpu":
        assert torch.equal(outs[0], outs[1])
    assert_rel(outs[1], ref, wgmma_tf32_bound(tf32, k, a, b, ref, trans_a, trans_b, device), "split ahead")


def test_triton_split_ahead_keeps_ieee_specials(device, rng):
    import kernels_triton as kt

    check_ieee_specials(kt, device, rng, {**TRITON_AHEAD_TILE, "TF32": SPLIT3, "SPLIT_AHEAD": 1})


def test_triton_split_ahead_is_matmuls_alone_and_refuses_gathered_rows(device, rng):
    """The fused ops keep their split per tile; SPLIT_AHEAD needs TF32 parts; a_rows is a config error."""
    import kernels_triton as kt

    sp = kt.space("matmul", "fp32")
    assert sp.params["SPLIT_AHEAD"] == (0, 1) and sp.default["SPLIT_AHEAD"] == 0
    assert all(c["TF32"] for c in sp.configs(4, 90) if c["SPLIT_AHEAD"])
    assert not any(c["SPLIT_AHEAD"] for c in sp.configs(4, 75))
    for op in contract.FUSED_OPS:
        assert kt.space(op, "fp32").params["SPLIT_AHEAD"] == (0,)
    ahead = {**TRITON_AHEAD_TILE, "TF32": SPLIT3, "SPLIT_AHEAD": 1}
    assert sp.cost(ahead, 4, 90)["smem_bytes"] == 2 * sp.cost({**ahead, "SPLIT_AHEAD": 0}, 4, 90)["smem_bytes"]
    a, b = randn(rng, (30, 20), "fp32", device), randn(rng, (20, 8), "fp32", device)
    with pytest.raises(ValueError, match="^config: SPLIT_AHEAD=1 .*a_rows"):
        kt.matmul(a, b, a_rows=torch.arange(4, device=device), config=ahead)


@pytest.mark.parametrize("trans_b", [False, True])
def test_triton_split_aheads_pass_launches_a_k_of_millions(trans_b):
    """The pass's grid is one axis of row and k blocks: over K = 5M a second axis would need 78,125
    blocks, past CUDA's 65,535 (planned here, not run: the interpreter would take minutes)."""
    import kernels_triton as kt
    from kernels_triton.matmul import SPLIT_BLOCK, plan

    K = 5_000_000
    a = torch.ones((1, K))
    b = torch.ones((1, K)) if trans_b else torch.ones((K, 1))
    _, p = plan(a, b, trans_b=trans_b, config={**TRITON_AHEAD_TILE, "TF32": SPLIT3, "SPLIT_AHEAD": 1})
    assert [q.op for q in p.before] == ["tf32_split", "tf32_split"]
    for q in (*p.before, p):
        contract.check_grid(q.op, q.grid)
    assert all(len(q.grid) == 1 for q in p.before) and p.before[0].grid == (contract.cdiv(K, SPLIT_BLOCK),)
    with pytest.raises(ValueError, match=r"^tf32_split: the call needs 78125 blocks along grid axis y, past CUDA's "
                                         "65535; it is too large for this kernel$"):
        kt._runtime.launch(dataclasses.replace(p.before[0], grid=(1, contract.cdiv(K, SPLIT_BLOCK))))


@pytest.mark.gpu
@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product([False, True], repeat=2)))
def test_triton_split_ahead_on_the_gpu(rng, trans_a, trans_b):
    """At ragged sizes of many tiles (1100 x 1300 x 300) on the Hopper tile it was measured at, and over
    a K of 65,549, where only the per-k-block fp32 add keeps the tensor cores' rounding toward zero out."""
    import kernels_triton as kt

    tile = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3)
    for (m, n, k), tf32 in (((1100, 1300, 300), SPLIT3), ((1100, 1300, 300), PLAIN), (LONG_K, SPLIT3)):
        a = randn(rng, (k, m) if trans_a else (m, k), "fp32", "cuda")
        b = randn(rng, (n, k) if trans_b else (k, n), "fp32", "cuda")
        out = kt.matmul(a, b, trans_a=trans_a, trans_b=trans_b, config={**tile, "TF32": tf32, "SPLIT_AHEAD": 1})
        ref = exact.matmul(a, b, trans_a=trans_a, trans_b=trans_b)
        assert_rel(out, ref, wgmma_tf32_bound(tf32, k, a, b, ref, trans_a, trans_b), f"{m}x{n}x{k} TF32={tf32}")


# ----------------------------------------------------------------------------- the fused step's ops

def test_linear_cross_entropy_in_3xtf32(ops, device, rng):
    m, n, k = 29, 10, 70
    x, w = randn(rng, (m, k), "fp32", device), randn(rng, (k, n), "fp32", device, scale=0.3)
    labels = torch.randint(0, n, (m,), generator=rng).to(device)
    config = pick(ops, "linear_cross_entropy", "fp32", device, rng, tf32=SPLIT3)
    check_linear_ce(ops, x, w, labels, bias=randn(rng, (n,), "fp32", device), config=config)


def test_linear_sgd_in_3xtf32(ops, device, rng):
    layer = sgd_layer(rng, device, "fp32", 70, 37, 19, momentum=0.9, rows=90, low=True)
    config = pick(ops, "linear_sgd", "fp32", device, rng, tf32=SPLIT3)
    check_linear_sgd(ops, layer, lr=0.1, momentum=0.9, weight_decay=1e-4, config=config)


# ----------------------------------------------------------------------------- the space

@pytest.mark.parametrize("name", ["triton", "cuda"])  # the spaces only: no GPU needed
def test_the_tf32_tunable_is_declared_with_its_precisions(name):
    import importlib

    ops = importlib.import_module(f"kernels_{name}")
    for op in ("matmul", "linear_cross_entropy", "linear_sgd"):
        sp = ops.space(op, "fp32")
        assert sp.params["TF32"] == (EXACT, SPLIT3, PLAIN) and sp.default["TF32"] == EXACT
        assert sp.precision_of({**sp.default, "TF32": PLAIN}) == "tf32" and sp.precision_of(sp.default) is None
        assert sp.is_emulated({**sp.default, "TF32": SPLIT3}) and not sp.is_emulated(sp.default)
        assert not any(c["TF32"] for c in sp.configs(4, 75)), "sm_75 has no TF32 tensor cores"
        for dtype in ("fp16", "bf16"):
            assert "TF32" not in ops.space(op, dtype).params
        # A search leaves plain TF32 out unless asked.
        assert view_space(sp, TARGETS["sm_90"], 4).values["TF32"] == [EXACT, SPLIT3]
        assert view_space(sp, TARGETS["sm_90"], 4, lower_precision=True).values["TF32"] == [EXACT, SPLIT3, PLAIN]


def test_a_space_refuses_a_default_below_its_precision():
    params = {"BLOCK": (16, 32), "TF32": (0, 1)}
    with pytest.raises(ValueError, match="own precision"):
        Space(params=params, default={"BLOCK": 16, "TF32": 1}, lower_precision={"TF32": {1: "tf32"}})
    with pytest.raises(ValueError, match="outside the space"):
        Space(params=params, default={"BLOCK": 16, "TF32": 0}, emulated={"TF32": (3,)})


def test_the_split_ahead_experiment_splits_and_multiplies_within_the_fp32_bound(device, rng):
    """experiments.tf32x3_split_ahead's kernels, which time 3xTF32 with its operands split once
    before the GEMM: the pass gives a TF32 big part and a TF32 small part within 3xTF32's rounding
    of x, and the GEMM on the parts of an irregular shape (edge tiles in M, N and K) stays within the
    exact kernels' fp32 bound against float64, whichever number of k slices its tensor cores sum
    before each fp32 add, and with B's parts stored k-major (B^T's), read through pointers or tensor
    descriptors (one program a tile, or persistent), and with B's parts alone split ahead and A split in
    the kernel; so does Triton's own tf32x3
    beside it, and its one plain TF32 product (B row-major or k-major) stays within TF32's bound
    (the interpreter multiplies it in fp32)."""
    from experiments.tf32x3_split_ahead import (b_ahead_matmul, split, split_ahead_matmul, tma_split_ahead_matmul,
                                                triton_dot_matmul)

    m, n, k = 37, 45, 70
    a, b = randn(rng, (m, k), "fp32", device), randn(rng, (k, n), "fp32", device)
    big, small = split(a)
    for part in (big, small):
        assert not (part.view(torch.int32) & 0x1FFF).any()  # 10 mantissa bits: exact TF32 numbers
    assert ((big.double() + small.double() - a.double()).abs() <= 2.0**-22 * a.double().abs()).all()
    parts = (split(a), split(b))
    for every in (1, 2, 4, 0):  # K = 70 is 5 slices of 16: the sums of 2 and 4 end in a ragged group
        out = split_ahead_matmul(*parts, (16, 32, 16, 4, 2), every)
        assert_rel(out, exact.matmul(a, b), tolerance("fp32", k, device), f"split ahead, a sum every {every}")
    bt = b.t().contiguous()  # B stored k-major
    out = split_ahead_matmul(parts[0], split(bt), (16, 32, 16, 4, 2), b_kmajor=True)
    assert_rel(out, exact.matmul(a, b), tolerance("fp32", k, device), "split ahead, B k-major")
    out = b_ahead_matmul(a, b, (16, 32, 16, 4, 2))  # B's parts ahead, A split in the kernel
    assert_rel(out, exact.matmul(a, b), tolerance("fp32", k, device), "B's parts ahead, A split in registers")
    for persistent in (False, True):  # the parts through tensor descriptors, whose rows are 16-byte multiples
        k4 = 68
        a4, b4 = a[:, :k4].contiguous(), b[:k4].contiguous()
        out = tma_split_ahead_matmul(split(a4), split(b4.t().contiguous()), (16, 32, 16, 4, 2), persistent)
        assert_rel(out, exact.matmul(a4, b4), tolerance("fp32", k4, device), f"descriptors, persistent {persistent}")
    out = triton_dot_matmul(a, b, (16, 32, 16, 4, 2), "tf32x3")
    assert_rel(out, exact.matmul(a, b), tolerance("fp32", k, device), "Triton's own tf32x3")
    for given, kmajor in ((b, False), (bt, True)):
        out = triton_dot_matmul(a, given, (16, 32, 16, 4, 2), "tf32", b_kmajor=kmajor)
        assert_rel(out, exact.matmul(a, b), 2 * 2.0**-11 + tolerance("fp32", k, device),
                   f"one plain TF32 product, B k-major {kmajor}")


@pytest.mark.skipif(shutil.which("nvcc") is None or _cuobjdump() is None, reason="needs nvcc and cuobjdump")
def test_the_wgmma_3xtf32_probe_builds_to_tf32_hgmma_without_spills_or_serialization(tmp_path):
    """experiments.tf32x3_split_ahead's CUDA kernel (kernels_cuda/matmul_wgmma_tf32x3.cu), at every
    tile and sum it times, built for sm_90a: three HGMMA ... TF32 a k8 step (12 a 32-wide k slice,
    the slices of a step unrolled; one, 4, for its plain TF32 form), fed by TMA loads, no spills, and no wgmma that ptxas had to
    serialize or wait on (C751x: an accumulator read while its wgmma may be in flight, say)."""
    from experiments.tf32x3_split_ahead import WGMMA_SUMS, WGMMA_TILES

    kernels = {}  # name -> (BN, TF32 HGMMAs a 32-wide slice, times the slices a step unrolls)
    for (bm, bn, stages, consumers), every, pairs in itertools.product(WGMMA_TILES, (*WGMMA_SUMS, 0), (0, 1)):
        kernels[f"matmul_wgmma_tf32x3_kernel<{bm},{bn},{stages},{consumers},8,{every},{pairs},2,0,0>"] = (bn, 12 * max(every, 1))
        # plain TF32 through the same pipeline: one wgmma a k8 step
        kernels[f"matmul_wgmma_tf32x3_kernel<{bm},{bn},{stages},{consumers},8,0,{pairs},1,0,0>"] = (bn, 4)
    per_kernel = build_sm90a(tmp_path, list(kernels))
    assert set(per_kernel) == set(kernels)
    for name, (bn, hgmmas) in kernels.items():
        assert per_kernel[name].count(f"HGMMA.64x{bn}x8.F32.TF32") == hgmmas, per_kernel[name][:200]
        assert "UTMALDG.2D" in per_kernel[name] and "HMMA" not in per_kernel[name].replace("HGMMA", "")


def build_sm90a(tmp_path, exprs: list[str]) -> dict[str, str]:
    """matmul_wgmma_tf32x3.cu's kernels `exprs` (name expressions) built for sm_90a in one cubin,
    which must build with no spills and no wgmma ptxas had to serialize or wait on (C751x: an
    accumulator read while its wgmma may be in flight, say): each kernel's SASS by its expression."""
    from kernels_cuda import _runtime as rt

    refs = ",\n".join(f"(void*)&{e}" for e in exprs)
    (tmp_path / "v.cu").write_text(f'#include "matmul_wgmma_tf32x3.cu"\nvoid* const kernel_refs[] = {{\n{refs}\n}};\n')
    built = subprocess.run(["nvcc", "-std=c++17", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "--resource-usage",
                            f"-I{rt.HERE}", "-o", str(tmp_path / "v.cubin"), str(tmp_path / "v.cu")],
                           capture_output=True, text=True)
    log = built.stdout + built.stderr
    assert built.returncode == 0, log[-3000:]
    assert "C751" not in log, [line for line in log.splitlines() if "C751" in line][:3]
    assert log.count("0 bytes spill stores") == len(exprs), log[-2000:]
    sass = subprocess.run([_cuobjdump(), "-sass", str(tmp_path / "v.cubin")], check=True, capture_output=True,
                          text=True).stdout
    return {_demangled(text.split("\n")[0]): text for text in sass.split("Function : ")[1:]}


def _demangled(name: str) -> str:
    """kernel<...> from its mangled name, _Z<length><kernel>I...: template arguments are ints (Li128E)."""
    length = re.match(r"\s*_Z(\d+)", name)
    start = length.end()
    return name[start:start + int(length.group(1))] + "<" + ",".join(re.findall(r"Li(\d+)E", name)) + ">"


def test_the_split_ahead_experiment_keeps_each_row_as_it_is_measured(tmp_path):
    """Its CSV holds every row measured so far, each against the first (cuBLAS fp32), so a run a
    hung kernel or a time limit stops keeps what it measured."""
    import pandas as pd

    from experiments.tf32x3_split_ahead import keep_row

    rows, out = [], tmp_path / "rows.csv"
    keep_row(rows, {"kernel": "cublas_fp32", "ms": 2.0, "tflops": 60.0}, out)
    assert pd.read_csv(out).vs_cublas_fp32.tolist() == [1.0]
    keep_row(rows, {"kernel": "slower", "ms": 4.0, "tflops": 30.0}, out)
    keep_row(rows, {"kernel": "split_pass", "ms": 0.1, "tflops": None}, out)  # no product: no ratio
    keep_row(rows, {"kernel": "refused", "status": "refused"}, out)
    df = pd.read_csv(out)
    assert df.kernel.tolist() == ["cublas_fp32", "slower", "split_pass", "refused"]
    assert df.vs_cublas_fp32.tolist()[:2] == [1.0, 0.5] and df.vs_cublas_fp32.isna().tolist()[2:] == [True, True]
