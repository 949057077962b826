"""Split-K matmul in both twins: K cut into SPLIT_K slices, one program per
(tile, slice), fp32 partials in the shared workspace, the last program of a
tile summing them in slice order and applying bias and ReLU once.

The tests pick their configs from each twin's own space (the twins share the
tunable names BLOCK_M, BLOCK_N, BLOCK_K and SPLIT_K, nothing else), and build
K around the config's SPLIT_K * BLOCK_K so that slices come out full, short
and empty. Under Triton's interpreter the programs of a launch run one after
another, so the arrival order is always the same there: what only a GPU can
show (bitwise determinism under racing arrivals, CUDA-graph replay) is
checked again by the `gpu` tests on the H200.
"""
import math

import pytest
import torch

from kernels_core import contract
from kernels_core.reference import exact
from kernels_core.workspace import splitk_workspace
from tests.test_ops import assert_rel, laid_out, poisoned, randn

DTYPES = list(contract.DTYPES)
LAYOUTS = {"nn": (False, False), "tn": (True, False), "nt": (False, True), "tt": (True, True)}
SPLITS = (2, 4, 16, 64)

# Unit roundoff of each output dtype: the one rounding of the fp32 result.
# Triton's interpreter converts fp32 to bf16 by truncation: a full ulp.
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
INTERPRETED_BF16_ROUNDOFF = 2.0**-7


def tolerance(dtype, k, device):
    """||out - ref|| / ||ref|| allowed: the final rounding to the output dtype
    (at most u relative in every element, so in the norm too) plus the fp32
    accumulation over k terms and SPLIT_K partials. Products of fp16/bf16
    inputs are exact in fp32, and with random signs the accumulated rounding
    errors grow like sqrt(k) * 2**-24; 8x that leaves room for unlucky draws
    while a dropped slice or a doubled bias is off by O(1). 3xTF32 configs
    (TF32 = 3) add per product the dropped small*small and the rounding of each
    small part, each about 2**-24 |a||b| with random signs: the same sqrt(k)
    growth at up to 4x the size, inside that margin, where one product taken
    in plain TF32 is off by 2**-11. Below K = 3 the margin is smaller than one
    3xTF32 product's worst case: tf32x3_slack adds it."""
    u = UNIT_ROUNDOFF[dtype]
    if dtype == "bf16" and device == "cpu":
        u = INTERPRETED_BF16_ROUNDOFF
    return u + 8 * math.sqrt(max(k, 1)) * 2.0**-24


def products_over_ref(a, b, ref, trans_a=False, trans_b=False) -> float:
    """|| |A| |B| || / ||ref||: what a per-product error bound of e |a||b| becomes in the norm-wise
    error (at most e times this), at any K, whatever a bias or ReLU does to ref (a bias cancelling a
    product leaves its error; ReLU shrinks none); clamped where ref is all zeros (K = 0)."""
    magnitude = exact.matmul(a.abs(), b.abs(), trans_a=trans_a, trans_b=trans_b)
    return (torch.linalg.vector_norm(magnitude.double().cpu())
            / torch.linalg.vector_norm(ref.double().cpu()).clamp_min(1e-300)).item()


def tf32x3_slack(a, b, ref, trans_a=False, trans_b=False) -> float:
    """What 3xTF32 (TF32 = 3) may add to tolerance(): each product drops a_small * b_small and the
    roundings of the small parts, at most 3 * 2**-22 |a||b| (products_over_ref)."""
    return 3 * 2.0**-22 * products_over_ref(a, b, ref, trans_a, trans_b)


def pick_config(ops, dtype, device, rng, split_k):
    """A config of the twin's space with this SPLIT_K, drawn from its smallest
    tiles (so that small outputs still have several tiles and ragged edges)."""
    sp = ops.space("matmul", dtype)
    arch = contract.device_arch(torch.device(device))
    configs = [c for c in sp.configs(contract.DTYPES[dtype].itemsize, arch)
               if c["SPLIT_K"] == split_k and sp.precision_of(c) is None]  # lower precisions: test_ops
    assert configs, f"{dtype}: no config with SPLIT_K={split_k} in the space"
    smallest = min(c["BLOCK_M"] * c["BLOCK_N"] for c in configs)
    small = [c for c in configs if c["BLOCK_M"] * c["BLOCK_N"] <= max(smallest, 32 * 32)]
    return small[torch.randint(len(small), (1,), generator=rng).item()]


def operands(rng, m, n, k, dtype, device, layout):
    trans_a, trans_b = LAYOUTS[layout]
    a = randn(rng, (k, m) if trans_a else (m, k), dtype, device)
    b = randn(rng, (n, k) if trans_b else (k, n), dtype, device)
    return a, b, trans_a, trans_b


def check(ops, a, b, trans_a, trans_b, config, *, bias=None, activation=None):
    m, n, k = contract.matmul_args(a, b, None, None, trans_a, trans_b, "fp32")
    dtype = contract.dtype_name(a.dtype)
    out = poisoned((m, n), dtype, a.device)
    got = ops.matmul(a, b, bias=bias, activation=activation, trans_a=trans_a, trans_b=trans_b, out=out,
                     config=config)
    assert got is out
    ref = exact.matmul(a, b, bias=bias, activation=activation, trans_a=trans_a, trans_b=trans_b)
    tol = tolerance(dtype, k, a.device.type)
    if config.get("TF32") == 3:
        tol += tf32x3_slack(a, b, ref, trans_a, trans_b)
    assert_rel(out, ref, tol, f"{m}x{n}x{k} config={config}")
    return out


def counters_are_zero(device: torch.device):
    counters = splitk_workspace(device, 0, 0)[1]  # the workspace as it is: asks for nothing more
    return bool((counters == 0).all())


# K as a function of (SPLIT_K, BLOCK_K): every way a slice can come out.
K_CASES = {
    "k0": lambda s, bk: 0,  # every slice empty: zeros (plus the bias)
    "k1": lambda s, bk: 1,  # one element in slice 0, the rest empty
    "k7": lambda s, bk: 7,
    "short": lambda s, bk: bk + 5,  # K < SPLIT_K * BLOCK_K: slice 1 short, the rest empty
    # Slices as short as each case allows (the interpreter's time is its programs' k steps): ragged's
    # hold two blocks, so the k-loop inside a slice runs more than once, and about half are launched.
    "ragged": lambda s, bk: s * bk + 13,  # not divisible: the last non-empty slice short
    "exact": lambda s, bk: s * bk,  # every slice full, one block each
}
MN_CASES = [(33, 10), (32, 10), (1, 45), (37, 1), (50, 33)]
# The interpreter runs a launch's programs one after another, up to tens of ms a k step each
# (3xTF32's split is the dearest): a grid above this many programs is left to the GPU run.
INTERPRETED_PROGRAMS = 256


def draw_mn(rng, config, split_k, device):
    """One of MN_CASES; on the CPU only those whose grid stays within INTERPRETED_PROGRAMS."""
    cases = [(m, n) for m, n in MN_CASES
             if device != "cpu" or math.ceil(m / config["BLOCK_M"]) * math.ceil(n / config["BLOCK_N"]) * split_k
             <= INTERPRETED_PROGRAMS]
    return cases[torch.randint(len(cases), (1,), generator=rng).item()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", SPLITS)
@pytest.mark.parametrize("k_case", list(K_CASES))
def test_splitk_odd_k(ops, device, rng, k_case, split_k, dtype):
    config = pick_config(ops, dtype, device, rng, split_k)
    k = K_CASES[k_case](split_k, config["BLOCK_K"])
    m, n = draw_mn(rng, config, split_k, device)
    layout = list(LAYOUTS)[torch.randint(len(LAYOUTS), (1,), generator=rng).item()]
    a, b, trans_a, trans_b = operands(rng, m, n, k, dtype, device, layout)
    bias = randn(rng, (n,), dtype, device)
    check(ops, a, b, trans_a, trans_b, config, bias=bias, activation="relu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("m,n", MN_CASES)
def test_splitk_layouts(ops, device, rng, m, n, layout, dtype):
    config = pick_config(ops, dtype, device, rng, 4)
    k = K_CASES["ragged"](4, config["BLOCK_K"])
    a, b, trans_a, trans_b = operands(rng, m, n, k, dtype, device, layout)
    check(ops, a, b, trans_a, trans_b, config)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("bias_kind", [None, "contiguous", "strided"])
def test_splitk_bias_relu_once(ops, device, rng, bias_kind, activation, dtype):
    """A bias of scale 3 added once per slice, or ReLU applied to each partial
    before the sum, would be far outside the tolerance."""
    config = pick_config(ops, dtype, device, rng, 8)
    m, n, k = 37, 45, K_CASES["ragged"](8, config["BLOCK_K"])
    a, b, trans_a, trans_b = operands(rng, m, n, k, dtype, device, "nn")
    bias = None if bias_kind is None else laid_out(randn(rng, (n,), dtype, device, scale=3.0), bias_kind)
    check(ops, a, b, trans_a, trans_b, config, bias=bias, activation=activation)


@pytest.mark.parametrize("dtype", DTYPES)
def test_splitk_out_view(ops, device, rng, dtype):
    """The last program stores only inside a strided `out`; the rest stays NaN."""
    config = pick_config(ops, dtype, device, rng, 4)
    m, n, k = 33, 20, K_CASES["ragged"](4, config["BLOCK_K"])
    a, b, trans_a, trans_b = operands(rng, m, n, k, dtype, device, "nt")
    big = poisoned((m, 2 * n + 3), dtype, device)
    out = big[:, 1:1 + 2 * n:2]
    assert ops.matmul(a, b, trans_b=True, out=out, config=config) is out
    assert_rel(out, exact.matmul(a, b, trans_b=True), tolerance(dtype, k, device), f"config={config}")
    rest = torch.ones_like(big, dtype=torch.bool)
    rest[:, 1:1 + 2 * n:2] = False
    assert big[rest].isnan().all(), f"wrote outside out (config={config})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_splitk_bitwise_deterministic(ops, device, rng, dtype):
    """The same inputs give the same bits on every call: the sum runs in slice
    order whoever arrives last, and each call starts from counters at zero
    (a counter left at SPLIT_K would make no program of the next call last)."""
    config = pick_config(ops, dtype, device, rng, 16)
    m, n, k = 33, 20, K_CASES["ragged"](16, config["BLOCK_K"])
    a, b, trans_a, trans_b = operands(rng, m, n, k, dtype, device, "nn")
    bias = randn(rng, (n,), dtype, device)
    first = check(ops, a, b, trans_a, trans_b, config, bias=bias, activation="relu")
    for _ in range(1 if device == "cpu" else 20):
        again = check(ops, a, b, trans_a, trans_b, config, bias=bias, activation="relu")
        assert torch.equal(again, first), f"two calls differ (config={config})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", (4, 16, 64))
def test_splitk_sums_slices_in_order(ops, device, rng, split_k, dtype):
    """The bits of the contract's reduction: partials summed in fp32 in slice
    order 0..SPLIT_K-1, slices of ceil(K / (SPLIT_K * BLOCK_K)) * BLOCK_K.

    Each column of B holds three non-zeros, in three different slices: big,
    tiny = big * 2**-24 and -big (in some order), so every partial is one
    exact product and only the order of the fp32 sums decides the result:
    big + tiny rounds to big (a tie, to even) while -big + tiny is exact. A
    sum in another order (reversed, or the last arrival's own partial added
    last) gives a different column on some draw; float64 gives tiny everywhere.
    """
    config = pick_config(ops, dtype, device, rng, split_k)
    bk = config["BLOCK_K"]
    k = 2 * split_k * bk + 13
    k_slice = -(-k // (split_k * bk)) * bk
    slices = -(-k // k_slice)  # the non-empty ones
    m, n = 9, 24
    big = 2.0**14  # exact, with twice and half of it, in every input dtype
    # One factor per row of A, so that every result is 0 or +-tiny times it:
    # exact in every output dtype, whatever rounding the final cast does.
    a = torch.tensor([1.0, -1.0, 2.0, 0.5])[torch.randint(4, (m, 1), generator=rng)].double().expand(m, k)
    b = torch.zeros(k, n, dtype=torch.float64)
    for col in range(n):
        chosen = torch.randperm(slices, generator=rng)[:3]
        for s, value in zip(chosen.tolist(), (big, big * 2.0**-24, -big)):
            row = s * k_slice + torch.randint(min(k_slice, k - s * k_slice), (1,), generator=rng).item()
            b[row, col] = value
    products = a[:, :, None] * b[None, :, :]  # m x k x n, each exact in fp32
    partials = torch.stack([products[:, s * k_slice:(s + 1) * k_slice].sum(1) for s in range(split_k)]).float()
    want = partials[0]
    for s in range(1, split_k):
        want = want + partials[s]  # fp32, in slice order
    a, b = a.contiguous().to(device, contract.DTYPES[dtype]), b.to(device, contract.DTYPES[dtype])
    for _ in range(1 if device == "cpu" else 20):
        out = poisoned((m, n), dtype, device)
        ops.matmul(a, b, out=out, config=config)
        assert torch.equal(out.cpu(), want.to(out.dtype)), f"not the slice-order sum (config={config})"


def test_splitk_workspace_shared_by_shapes(ops, device, rng):
    """Calls of different shapes, dtypes and SPLIT_K one after another share
    one workspace, growing and reusing it; after each its counters are 0."""
    calls = [("fp32", 4, (70, 90, 300)), ("fp16", 16, (20, 10, 200)), ("fp32", 2, (5, 7, 1)),
             ("bf16", 8, (90, 70, 260)), ("fp16", 16, (20, 10, 200)), ("fp32", 4, (33, 1, 77))]
    for dtype, split_k, (m, n, k) in calls:
        config = pick_config(ops, dtype, device, rng, split_k)
        a, b, trans_a, trans_b = operands(rng, m, n, k, dtype, device, "tn")
        check(ops, a, b, trans_a, trans_b, config, bias=randn(rng, (n,), dtype, device))
        assert counters_are_zero(a.device), f"counters left non-zero by {m}x{n}x{k} config={config}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_space_offers_splitk_and_small_tiles(ops, dtype):
    """Both twins declare the same SPLIT_K values and 16-wide tiles for the
    trainer's N = 10 and M = 32, with valid configs at sm_90; 32 and 64 slices
    on tiles of at most 512 outputs only."""
    sp = ops.space("matmul", dtype)
    assert tuple(sp.params["SPLIT_K"]) == (1, 2, 4, 8, 16, 32, 64)
    assert sp.default["SPLIT_K"] == 1
    configs = list(sp.configs(contract.DTYPES[dtype].itemsize, 90))
    assert {c["SPLIT_K"] for c in configs} == {1, 2, 4, 8, 16, 32, 64}
    assert any(c["BLOCK_N"] == 16 and c["SPLIT_K"] > 1 for c in configs), "no split tile for N = 10"
    assert any(c["BLOCK_M"] <= 32 and c["SPLIT_K"] > 1 for c in configs), "no split tile for M = 32"
    wide = [c for c in configs if c["SPLIT_K"] > 16]
    assert max(c["BLOCK_M"] * c["BLOCK_N"] for c in wide) == 512
    assert any(c["BLOCK_M"] == c["BLOCK_N"] == 16 for c in wide), "no 16 x 16 tile with 64 slices"


def test_splitk_partials_past_32_bits_refused():
    """The Triton wrapper refuses a split whose partials need offsets past 2**31
    (shape-only tensors: nothing is allocated or launched)."""
    from kernels_triton.matmul import plan

    a = torch.empty(16384, 1024, device="meta")
    b = torch.empty(1024, 16384, device="meta")
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}
    assert plan(a, b, config={**config, "SPLIT_K": 4})[1].grid == (256 * 256, 4)
    with pytest.raises(ValueError, match="config: SPLIT_K=16"):
        plan(a, b, config={**config, "SPLIT_K": 16})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_splitk_cuda_graph_replay(ops, rng, dtype):
    """A captured split-K call replays with new inputs: the workspace it points
    at stays alive and its counters are zero again after every replay."""
    config = pick_config(ops, dtype, "cuda", rng, 8)
    m, n, k = 128, 10, 1000
    a, b, trans_a, trans_b = operands(rng, m, n, k, dtype, "cuda", "nn")
    bias = randn(rng, (n,), dtype, "cuda")
    out = poisoned((m, n), dtype, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: compiles and sizes the workspace
        ops.matmul(a, b, bias=bias, activation="relu", out=out, config=config)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.matmul(a, b, bias=bias, activation="relu", out=out, config=config)
    for _ in range(3):
        a.copy_(randn(rng, (m, k), dtype, "cuda"))
        b.copy_(randn(rng, (k, n), dtype, "cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_rel(out, exact.matmul(a, b, bias=bias, activation="relu"), tolerance(dtype, k, "cuda"),
                   f"replay, config={config}")
        assert counters_are_zero(a.device)


@pytest.mark.parametrize("k,split_k,block_k,want", [
    (784, 4, 32, (224, 4)),     # 784 = 3 * 224 + 112: the last slice is short
    (32, 16, 32, (32, 1)),      # one BLOCK_K of K: 15 of 16 slices would be empty, none is launched
    (100, 16, 32, (32, 4)),     # ceil(100 / 32) = 4 slices hold K, 12 are not launched
    (1, 2, 16, (16, 1)),
    (0, 4, 32, (0, 1)),         # no K: one program writes the bias alone
])
def test_splitk_slices_launch_only_slices_that_hold_k(k, split_k, block_k, want):
    from kernels_core.workspace import splitk_slices

    k_slice, slices = splitk_slices(k, split_k, block_k)
    assert (k_slice, slices) == want
    assert k_slice % block_k == 0 and slices <= split_k
    assert (slices - 1) * k_slice < k <= slices * k_slice or k == 0


def test_splitk_workspace_refuses_to_grow_inside_a_capture(monkeypatch):
    """Counters made inside a CUDA graph capture would have their zeroing recorded, not run, so a
    call before the first replay would count from garbage: growing is refused there, with the fix
    in the message (faked capture: no GPU here; nothing is allocated before the refusal)."""
    from kernels_core import workspace

    monkeypatch.setattr(workspace, "_live", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before capturing a CUDA graph"):
        workspace.splitk_workspace(torch.device("cuda", 0), 1024, 8)
    assert workspace._live == {}
