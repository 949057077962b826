"""The persistent training kernel (kernels_triton/persistent.py): steps against float64 training
under Triton's interpreter (one program: the interpreter runs programs one after another),
offline compiles for sm_80 and sm_90, the refusals, and on a GPU the full grid at the default
protocol's H = 128 against float64 and against itself (bitwise).

The float64 reference is the same training written in torch (kernels_core.reference.mlp_steps):
nn.Linear's arithmetic, cross entropy, torch.optim.SGD (momentum, weight decay), on the same
initial weights and batches.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from kernels_core.persistent import (DEFAULT, Layout, barriers_per_step, check_barrier_count, check_coresident,
                                     check_stamps, resolve_config)
from kernels_core.reference import mlp_steps
from kernels_triton import persistent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference(x, y, batches, params, layout, steps, lr, momentum, weight_decay):
    """(losses, params, paths) of `steps` steps of float64 training from `params` (the tuner's
    reference too: kernels_core.reference.mlp_steps, which rounds where the kernel stores, so only
    the kernel's fp32 accumulation stays between the two), from zeroed momentum buffers as the
    trainer starts. paths: each tensor's updates' norms summed over the steps (W0, b0, W1, ...)."""
    p = params.double().cpu()
    bufs = torch.zeros_like(p) if momentum else None
    losses, pos = torch.zeros(batches.shape[0], dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    paths = [0.0] * 2 * (layout.layers + 1)
    for _ in range(steps):
        before = p.clone()
        mlp_steps(x.cpu(), y.cpu(), batches.cpu(), pos, p, bufs, losses, layout, lr=lr, momentum=momentum,
                  weight_decay=weight_decay, steps=1, compute=torch.float64)
        paths = [path + (after - was).norm().item()
                 for path, after, was in zip(paths, layout.views(p), layout.views(before))]
    return losses[:steps], p, paths


def tolerance(dtype, layout):
    """How far a tensor may end from the reference's, relative to the path its updates took (their
    norms summed over the steps: the net update can be far shorter, where steps undo each other,
    and would hold the kernel to its rounding relative to almost nothing). Between the two only the
    kernel's fp32 accumulation differs: each sum of at most max(inputs, hidden, batch) terms off by
    a few u of fp32 with random signs, passed on through 2 GEMMs a layer each step (measured: under
    15 u at 2 hidden layers; 16 u a layer leaves 3x). In fp16 a sum that lands the other side of a
    rounding boundary from float64's stores a value one fp16 ulp away (u16 relative) and the steps
    after carry it on (STEPS says how far; 4 u16 leaves 12x over the worst of 750 draws). A bias
    left alone, a momentum term dropped or a relu mask missed moves a tensor by tens of percent of
    its path."""
    u32 = 16 * (layout.layers + 1) * 2.0**-24
    return u32 if dtype == "fp32" else 4 * 2.0**-11


def stored_rounding(steps: int, want: torch.Tensor) -> float:
    """How far the kernel's fp32 master weights may sit from float64's, which the reference keeps
    unrounded, whatever the arithmetic: each step stores each weight rounded to fp32, at most 2^-24
    of it off, so `steps` steps part them by at most steps * 2^-24 |w| (in norm). At a small lr
    that is many times what `tolerance` allows of an update's path, so it is allowed besides."""
    return steps * 2.0**-24 * want.norm().item()


def float64_errors(params, losses, ref_losses, ref, paths, layout, dtype, steps) -> dict[str, tuple[float, float]]:
    """What the float64 check judges, each as (error, what is allowed): the losses' largest relative
    error (tolerance's), then each tensor's distance from float64's (tolerance of its updates' path
    and the fp32 weights' rounding); ref_losses, ref, paths: reference's."""
    tol = tolerance(dtype, layout)
    got_losses = losses[:steps].double().cpu()
    errors = {"losses": (((got_losses - ref_losses).abs() / ref_losses).max().item(), tol)}
    names = [f"{kind}{i}" for i in range(layout.layers + 1) for kind in ("W", "b")]
    for name, got, want, path in zip(names, layout.views(params.double().cpu()), layout.views(ref), paths):
        errors[name] = ((got - want).norm().item(), tol * path + stored_rounding(steps, want))
    return errors


def check_against_float64(x, y, batches, p0, params, losses, layout, dtype, steps, **sgd):
    ref_losses, ref, paths = reference(x, y, batches, p0, layout, steps, **sgd)
    for name, (err, allowed) in float64_errors(params, losses, ref_losses, ref, paths, layout, dtype, steps).items():
        assert err <= allowed, (f"{name}: {err:.3g} off float64's, allowed {allowed:.3g} (losses: relative; a "
                                "tensor: tolerance of its updates' path and the fp32 weights' rounding)")


def full_grid_inputs(layout, dtype, steps, device="cuda", open_half=True):
    """(x, y, batches, p0) of a full-grid case on the GPU: MNIST-sized random data (2048 images) and
    small random weights. With open_half each hidden bias sits in the widest gap of its unit's float64
    pre-activations over the steps' rows (the tuner gate's inputs, autotune/workload.py's _open_half):
    where a pre-activation lies within a rounding's reach of zero, any fp32 kernel's ReLU may fall
    the other way and pass a gradient float64 blocks, its tensors then far past the tolerance (both
    twins failed the same draws alike, by 13 to 5,800 times it, in 0.4-5% of draws by steps, lr
    and biases: h100/persistent_flips.csv; in fp16 from random biases at lr 0.05, 2.8% of draws:
    cpu/persistent_flips.csv); a small lr keeps the second step's pre-activations in their gaps."""
    from autotune.workload import _open_half

    x = torch.randn(2048, layout.inputs, device=device).to(torch.float16 if dtype == "fp16" else torch.float32)
    y = torch.randint(0, layout.classes, (2048,), device=device)
    batches = torch.stack([torch.randperm(2048, device=device)[:layout.batch] for _ in range(steps)])
    p0 = torch.randn(layout.numel, device=device) * 0.05
    if open_half:
        _open_half(layout, p0, x.index_select(0, batches.flatten()).double())
    return x, y, batches, p0


CPU_CASES = [  # irregular sides: none a multiple of a tile
    ("fp32", Layout(hidden=24, layers=2, batch=20, inputs=50), dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    ("fp16", Layout(hidden=40, layers=3, batch=24, inputs=70), dict(lr=0.01, momentum=0.0, weight_decay=0.0)),
    ("fp32", Layout(hidden=17, layers=1, batch=37, inputs=33), dict(lr=0.2, momentum=0.5, weight_decay=0.0)),
]


# Steps the cases train: in fp16 an activation stored one ulp from float64's (its fp32 sum on the
# other side of a rounding boundary) feeds the next steps, its difference grows with them, and where
# it meets a pre-activation that close to zero it flips a ReLU: a tensor then lands tens of u16 off
# (at lr 0.1: 2 of 60 draws over 5 steps, 1 of 150 over 2). At lr 0.01 over 3 steps: at most 0.34 u16
# in 750 draws (over 5 steps, 1 of 400 flipped).
STEPS = {"fp32": 5, "fp16": 3}
# Configs for those cases: the default's tiles (one or two a phase at these sides); tiles of 16, so
# every phase has several, but W_0's of 32 rows, and the first layer's K in 3 slices; K in 2 slices.
CPU_CONFIGS = [{}, dict(BM=16, BN=16, BK=16, BR=16, BR0=32, BC=16, SPLIT_K=3), dict(BR=16, SPLIT_K=2)]


@pytest.mark.timeout(120)  # a barrier that never opens spins: fail, not hang
@pytest.mark.parametrize("dtype,layout,sgd,config", [(*case, config) for case, config in zip(CPU_CASES, CPU_CONFIGS)])
def test_steps_in_two_launches_track_float64_training(dtype, layout, sgd, config):
    if torch.cuda.is_available():
        pytest.skip("the interpreter's run; the GPU's is test_the_full_grid_tracks_float64_and_repeats_its_bits")
    images, steps = 4 * layout.batch, STEPS[dtype]
    x = torch.randn(images, layout.inputs).to(torch.float16 if dtype == "fp16" else torch.float32)
    y = torch.randint(0, layout.classes, (images,))
    batches = torch.stack([torch.randperm(images)[:layout.batch] for _ in range(steps)])
    p0 = torch.randn(layout.numel) * 0.2
    params, bufs, losses = p0.clone(), torch.zeros_like(p0), torch.zeros(steps)
    pos = torch.zeros((), dtype=torch.int64)
    plan = persistent.plan(x, y, batches, pos, params, bufs if sgd["momentum"] else None, losses, layout, **sgd,
                           config=config)
    plan.run(2)
    assert not plan.tile_counts.any(), plan.tile_counts  # each tile's last slice set its count back
    plan.run(steps - 2)  # a second segment goes on from the first's weights, momentum and position
    assert pos.item() == steps and not plan.tile_counts.any()
    check_against_float64(x, y, batches, p0, params, losses, layout, dtype, steps, **sgd)


def test_a_launch_whose_barriers_would_wrap_the_counter_is_refused():
    assert barriers_per_step(2) == 5 and barriers_per_step(3) == 7
    check_barrier_count(2**31 // (5 * 132) - 1, 5, 132)
    with pytest.raises(ValueError, match=r"past the counter's 2\*\*31\); launch fewer steps"):
        check_barrier_count(2**31 // (5 * 132) + 1, 5, 132)
    with pytest.raises(ValueError, match="steps: -1"):
        check_barrier_count(-1, 5, 132)


def test_a_grid_that_cannot_all_be_resident_is_refused():
    check_coresident("k", 264, 2, 132)  # fits exactly
    with pytest.raises(ValueError, match="265 programs cannot all be resident.*2 a multiprocessor, 264"):
        check_coresident("k", 265, 2, 132)
    with pytest.raises(ValueError, match="a grid of 0"):
        check_coresident("k", 0, 2, 132)


def _args(layout=Layout(hidden=16, layers=1, batch=16, inputs=16)):
    x, y = torch.randn(32, layout.inputs), torch.randint(0, 10, (32,))
    return (x, y, torch.zeros(2, layout.batch, dtype=torch.int64), torch.zeros((), dtype=torch.int64),
            torch.zeros(layout.numel), None, torch.zeros(2), layout)


@pytest.mark.parametrize("config,message", [
    (dict(BM=8), "BM=8, a tile side must be a power of two of at least 16"),
    (dict(BC=48), "BC=48"),
    (dict(BR0=24), "BR0=24"),
    (dict(num_warps=3), "num_warps=3"),
    (dict(PROGRAMS=-1), "PROGRAMS=-1"),
    (dict(SPLIT_K=0), "SPLIT_K=0, the first layer's slices: at least 1"),
    (dict(BLOCK_M=32), "unknown tunables"),
])
def test_a_bad_config_is_refused_in_one_line(config, message):
    with pytest.raises(ValueError, match=message):
        persistent.plan(*_args(), lr=0.1, config=config)


def test_w0_updates_in_the_other_weights_tiles_unless_a_config_names_br0(tmp_path):
    """A config without BR0 (a store's entry tuned without it) keeps what it timed: W_0 in its BR x BC
    tiles, given to a twin or read from a store."""
    assert resolve_config(dict(BR=16))["BR0"] == 16 and resolve_config(dict(BR=64))["BR0"] == 64
    assert resolve_config(dict(BR=16, BR0=64))["BR0"] == 64
    from kernels_core.store import load_store

    config = {k: v for k, v in {**DEFAULT, "BR": 16}.items() if k != "BR0"}
    path = tmp_path / "best.json"
    path.write_text(json.dumps({"target": "sm_90", "format": 1, "entries": [
        dict(op="persistent", backend="triton", dtype="fp32", shape="128x2x128:mlp", config=config, time_ms=0.02)]}))
    (entry,) = load_store(path, "sm_90").entries.values()
    assert entry["config"]["BR0"] == 16 and entry["config"]["BR"] == 16


def test_bad_inputs_are_refused_in_one_line():
    x, y, batches, pos, params, bufs, losses, layout = _args()
    with pytest.raises(ValueError, match="params: .* expected"):
        persistent.plan(x, y, batches, pos, params[1:], bufs, losses, layout, lr=0.1)
    with pytest.raises(ValueError, match="bufs: momentum needs"):
        persistent.plan(x, y, batches, pos, params, None, losses, layout, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="batches: .* expected int64"):
        persistent.plan(x, y, batches.int(), pos, params, bufs, losses, layout, lr=0.1)
    with pytest.raises(ValueError, match="x: .* expected a contiguous"):
        persistent.plan(x[:, :8], y, batches, pos, params, bufs, losses, layout, lr=0.1)
    with pytest.raises(ValueError, match="pos: .* expected one int64"):
        persistent.plan(x, y, batches, pos.int(), params, bufs, losses, layout, lr=0.1)


def test_the_interpreter_refuses_more_than_one_program():
    if torch.cuda.is_available():
        pytest.skip("the interpreter's rule")
    with pytest.raises(ValueError, match="PROGRAMS=2.*passes only with 1"):
        persistent.plan(*_args(), lr=0.1, config=dict(PROGRAMS=2))


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels_core.persistent import DEFAULT, Layout
from kernels_triton.persistent import _train_kernel, constants
from kernels_triton.reports import _ptxas_usage
arch, dt, stamps, split = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "stamps", int(sys.argv[4])
ptr = "*" + dt
signature = {"x_ptr": ptr, "y_ptr": "*i64", "batches_ptr": "*i64", "p_ptr": "*fp32", "buf_ptr": "*fp32",
             "acts_ptr": ptr, "grads_ptr": ptr, "part_ptr": "*fp32", "counts_ptr": "*i32", "slots_ptr": "*fp32",
             "losses_ptr": "*fp32",
             "counter_ptr": "*i32", "pos_ptr": "*i64", "stamps_ptr": "*i64", "steps": "i32", "epoch_steps": "i32",
             "lr": "fp32", "momentum": "fp32", "weight_decay": "fp32", "inv_m": "fp32"}
constexprs = constants(Layout(hidden=128, layers=2, batch=128), {**DEFAULT, "SPLIT_K": split}, True, False, stamps,
                       132)
for name in constexprs:
    signature[name] = "constexpr"
k = triton.compile(ASTSource(fn=_train_kernel, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", arch, 32), options=dict(num_warps=DEFAULT["num_warps"]))
regs, spills = _ptxas_usage(k.asm["ptx"])
print(json.dumps(dict(ptx=k.asm["ptx"], cubin=k.asm["cubin"].hex(), regs=regs, spills=spills)))
"""


def _compile(arch: int, dtype: str, stamps: bool, split: int = 1) -> dict:
    import json

    env = {**os.environ, "TRITON_INTERPRET": "0"}  # kernels_triton would turn it on without a GPU
    return json.loads(subprocess.run([sys.executable, "-c", _COMPILE, str(arch), dtype, "stamps" if stamps else "-",
                                      str(split)], check=True, capture_output=True, text=True, env=env,
                                     cwd=ROOT).stdout)


def _sass(tmp_path, out: dict) -> list[str]:
    from tests.test_persistent_cuda import _ops
    from tests.test_wgmma import _cuobjdump

    cubin = tmp_path / "persistent.cubin"
    cubin.write_bytes(bytes.fromhex(out["cubin"]))
    return _ops(subprocess.run([_cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout)


def test_the_phase_clock_is_read_only_when_asked_for():
    """With stamps the kernel reads the GPU's clock at its start and after each barrier (program 0
    alone, under a branch); without, never."""
    with_clock, without = _compile(90, "fp32", stamps=True)["ptx"], _compile(90, "fp32", stamps=False)["ptx"]
    assert with_clock.count("%globaltimer") == 1 + barriers_per_step(2)
    assert "%globaltimer" not in without


def test_stamps_are_refused_under_the_interpreter_and_short_or_of_another_dtype():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="stamps: Triton's interpreter has no GPU clock"):
            persistent.plan(*_args(), lr=0.1, stamps=torch.zeros(100, dtype=torch.int64))
    check_stamps(torch.zeros(11, dtype=torch.int64), 2, 5)
    with pytest.raises(ValueError, match=r"stamps: torch.int64 \(10,\), expected int64 with 11 entries for 2 steps"):
        check_stamps(torch.zeros(10, dtype=torch.int64), 2, 5)
    with pytest.raises(ValueError, match="stamps: torch.int32"):
        check_stamps(torch.zeros(11, dtype=torch.int32), 2, 5)


@pytest.mark.parametrize("arch,dtype,instruction", [(80, "fp32", None), (90, "fp32", None),
                                                     (80, "fp16", "mma.sync"), (90, "fp16", "mma.sync")])
def test_the_kernel_compiles_offline_with_its_barrier_and_its_products(tmp_path, arch, dtype, instruction):
    """The default config at the default protocol's shape (batch 128, H = 128), in a process of its
    own (the interpreter and the compiler cannot share one): ptxas accepts it, nothing spills on
    sm_90 (sm_80 has fewer registers to spare and may), the barrier arrives with a GPU-scope release
    and polls with a GPU-scope acquire, and fp16 products run on tensor cores while fp32 ones stay
    IEEE on the FMA units (on sm_90 too: tiles of 32 rows are under wgmma's 64 a warpgroup)."""
    import json

    env = {**os.environ, "TRITON_INTERPRET": "0"}  # kernels_triton would turn it on without a GPU
    out = _compile(arch, dtype, stamps=False)
    ops = set(re.findall(r"\b(?:red|atom|ld|mma|wgmma)\.[\w.]+", out["ptx"]))
    assert arch != 90 or out["spills"] == 0, f"{out['spills']} bytes of spill stores"
    assert any(op.startswith(("red.", "atom.")) and ".gpu" in op and ".release" in op for op in ops), ops
    assert any(op.startswith("ld.") and ".gpu" in op and ".acquire" in op for op in ops), ops
    # the next step's rows, sent for ahead by the programs that hold one (none past the batch)
    assert re.search(r"@\w+ prefetch\.global\.L2", out["ptx"]), "no predicated prefetch.global.L2"
    products = {op for op in ops if op.startswith(("mma.", "wgmma."))}
    assert bool(products) == (instruction is not None), products
    assert instruction is None or any(op.startswith(instruction + ".") for op in products), products
    # What makes another program's writes visible: the pipeliner turns the dots' `.cg` loads into
    # cp.async copies through L1, so each barrier's acquire poll must invalidate L1 (CCTL.IVALL),
    # as a relaxed poll would not; one barrier a phase.
    from tests.test_wgmma import _cuobjdump

    if _cuobjdump() is None:
        return
    sass = _sass(tmp_path, out)
    arrivals = [i for i, op in enumerate(sass) if re.fullmatch(r"REDG?\.E\.ADD\.STRONG\.GPU", op)]
    assert len(arrivals) == barriers_per_step(2), len(arrivals)
    for at, after in zip(arrivals, arrivals[1:] + [len(sass)]):
        poll = next(i for i in range(at, after) if sass[i] == "LDG.E.STRONG.GPU")
        assert "CCTL.IVALL" in sass[poll:after], at


def test_a_split_first_layer_is_summed_by_each_tiles_last_slice_without_a_phase(tmp_path):
    """SPLIT_K = 4 on sm_90: each tile-slice arrives at its tile's count with one GPU-scope atomic
    that releases its partial and acquires the others' (acq_rel), whose acquire invalidates L1
    (CCTL.IVALL) before the last slice reads the partials; the step keeps its 2L + 1 barriers."""
    from tests.test_wgmma import _cuobjdump

    out = _compile(90, "fp32", stamps=False, split=4)
    assert re.search(r"\batom\.global\.gpu\.acq_rel\.add|\batom\.acq_rel\.gpu\.global\.add", out["ptx"]), \
        sorted(set(re.findall(r"\batom\.[\w.]+", out["ptx"])))
    if _cuobjdump() is None:
        return
    sass = _sass(tmp_path, out)
    counts = [i for i, op in enumerate(sass) if re.fullmatch(r"ATOMG\.E\.ADD\.STRONG\.GPU", op)]
    arrivals = [i for i, op in enumerate(sass) if re.fullmatch(r"REDG?\.E\.ADD\.STRONG\.GPU", op)]
    assert len(counts) == 1 and len(arrivals) == barriers_per_step(2), (counts, arrivals)
    assert "CCTL.IVALL" in sass[counts[0]:arrivals[0]], sass[counts[0]:arrivals[0]]


# The full grid's configs: the default (the first layer whole); tiles of 16 with the first layer in
# 4 slices, 256 tile-slices on 132 programs, so a tile's slices race to be its last.
FULL_GRID_CONFIGS = [{}, dict(BM=16, BN=16, BK=16, SPLIT_K=4, num_warps=4)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", FULL_GRID_CONFIGS)
def test_the_full_grid_tracks_float64_and_repeats_its_bits(config):
    """The default protocol's shape (784-128-128-10, batch 128, fp32, momentum) on MNIST-sized
    random data (full_grid_inputs), one program a multiprocessor: two steps against float64, two runs
    from the same start agree to the bit, and every tile's count is back at zero."""
    layout, steps, sgd = Layout(hidden=128, layers=2, batch=128), 2, dict(lr=0.005, momentum=0.9, weight_decay=0.0)
    x, y, batches, p0 = full_grid_inputs(layout, "fp32", steps)
    runs = []
    for _ in range(2):
        params, bufs, losses = p0.clone(), torch.zeros_like(p0), torch.zeros(steps, device="cuda")
        pos = torch.zeros((), dtype=torch.int64, device="cuda")
        plan = persistent.plan(x, y, batches, pos, params, bufs, losses, layout, **sgd, config=config)
        plan.run(steps)
        assert not plan.tile_counts.any(), plan.tile_counts
        runs.append((params, losses))
    check_against_float64(x, y, batches, p0, *runs[0], layout, "fp32", steps, **sgd)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.gpu
def test_a_grid_past_the_gpus_residency_is_refused_before_it_launches():
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in _args()]
    with pytest.raises(ValueError, match="cannot all be resident"):
        persistent.plan(*args, lr=0.1, config=dict(PROGRAMS=100000))


@pytest.mark.parametrize("kw,message", [
    (dict(backend="torch"), "the cuda and triton backends only"),
    (dict(backend="triton", pdl="exit"), "--pdl and --no-fuse choose among"),
    (dict(backend="triton", fuse=False), "--pdl and --no-fuse choose among"),
])
def test_the_trainer_refuses_persistent_where_it_does_not_apply(kw, message):
    from trainer.config import Config

    with pytest.raises(ValueError, match=message):
        Config(persistent="on", **kw)


def _trained_losses(tmp_path, backend, persistent_kernel, **kw):
    import csv

    from trainer.config import Config
    from trainer.train import train

    summary = train(Config(backend=backend, persistent="on" if persistent_kernel else None, tuned_configs="none",
                           progress=False, out=str(tmp_path / f"{backend}{persistent_kernel}"), **kw))
    with open(summary.csv) as f:
        return [float(row["loss"]) for row in csv.DictReader(f)], summary


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_trainer_with_the_persistent_kernel_trains_as_the_fused_step_does(tmp_path, backend):
    """Segments of steps in one launch each (an evaluation every 3 steps), the position and the loss
    record carried from one to the next: the losses of the twin's fused step, to fp32 accumulation
    order (compare's bar: the first 5 steps within 1e-4), and the same test accuracy to a few images."""
    kw = dict(hidden=16, batch_size=16, steps=7, eval_every=3, train_subset=512, momentum=0.9, lr=0.05)
    if torch.cuda.is_available():
        kw.update(hidden=128, batch_size=128, steps=40, eval_every=15, train_subset=0)
    fused, fused_summary = _trained_losses(tmp_path, backend, False, **kw)
    got, summary = _trained_losses(tmp_path, backend, True, **kw)
    assert summary.persistent and not fused_summary.persistent
    assert len(got) == len(fused) == kw["steps"]
    worst = max(abs(a - b) / b for a, b in zip(got[:5], fused[:5]))
    assert worst <= 1e-4, (got, fused)
    assert abs(summary.test_accuracy - fused_summary.test_accuracy) <= 5e-4, (summary, fused_summary)


def test_persistent_is_refused_where_the_model_does_not_fit_on_chip_and_auto_picks_by_the_same_rule(monkeypatch,
                                                                                                    capsys):
    from kernels_core.persistent import state_bytes
    from trainer import persistent as trainer_persistent
    from trainer.config import Config
    from trainer.train import RunError

    config = Config(backend="triton", hidden=128, persistent="on")
    need = state_bytes(Layout(128, config.layers, config.batch_size), 4, True)
    assert need == 4 * 2 * Layout(128, 2, 128).numel + 4 * (2 * 128 * 128 + 2 * 128 * 128 + 128 * 10)
    gpu = torch.device("cuda")
    for l2, fits in ((need, True), (need - 1, False)):
        props = type("Props", (), {"L2_cache_size": l2})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
        if fits:
            assert trainer_persistent.runs_persistent(config, gpu)
        else:
            with pytest.raises(RunError, match=r"--persistent: .* take \d+\.\d MiB, more than the GPU's"):
                trainer_persistent.runs_persistent(config, gpu)
        assert trainer_persistent.runs_persistent(Config(backend="triton", hidden=128, persistent="auto"), gpu) == fits
        picked = "the persistent kernel" if fits else "the fused step"
        assert f"--persistent auto: {picked}" in capsys.readouterr().err


def test_the_configs_experiment_refuses_an_unknown_config_or_backend_and_a_machine_without_a_gpu(capsys):
    from experiments import persistent_configs

    with pytest.raises(SystemExit) as exit_:
        persistent_configs.main(["--configs", "default,huge"])
    assert exit_.value.code == 2 and "unknown configs ['huge']" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        persistent_configs.main(["--backends", "triton,torch"])
    assert exit_.value.code == 2 and "--backends triton,torch: of triton, cuda" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        persistent_configs.main(["--configs", "default,tuned"])
    assert exit_.value.code == 2 and "--configs tuned: give the store it reads" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        persistent_configs.main(["--configs", "tuned", "--tuned-configs", "no/such/best.json"])
    assert exit_.value.code == 2 and "no/such/best.json: no such file" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exit_:
            persistent_configs.main(["--configs", "default"])
        assert exit_.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_the_configs_experiment_reads_the_tuned_config_of_each_net_from_a_store(tmp_path):
    """A store's persistent entry for the protocol's net is the config 'tuned' runs; a net it has
    no entry for is refused in one line."""
    import json

    from experiments import persistent_configs

    config = {**DEFAULT, "BM": 16, "SPLIT_K": 4}
    store = tmp_path / "best.json"
    store.write_text(json.dumps({"target": "sm_90", "format": 1, "entries": [
        dict(op="persistent", backend="triton", dtype="fp16", shape="128x3x32:mlp", config=config)]}))
    assert persistent_configs.tuned_config(str(store), "triton", "seed", 128) == config
    with pytest.raises(ValueError, match="no persistent entry for triton fp32 128x2x128:mlp"):
        persistent_configs.tuned_config(str(store), "triton", "default", 128)
