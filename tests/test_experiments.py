"""The experiment scripts' CPU-side logic: result checks, loss-curve files, the generated README."""
import sys

import pytest
import pandas as pd
import torch

from experiments import bench_kernels, compare, ksweep, paths, report


def test_readme_results_section_matches_the_committed_csvs():
    assert report.main(["--check"]) == 0, "README is stale: run python -m experiments.report"


def test_bench_check_refuses_a_wrong_matmul_and_passes_a_right_one(rng):
    case = bench_kernels.Case("mlp", "matmul", "fp32", (33, 17, 129), "tn", {"bias": True, "activation": "relu"})
    args, kw, nbytes, work = bench_kernels.make_call(case, rng, torch.device("cpu"))
    assert args[0].shape == (129, 33) and work == 2 * 33 * 17 * 129
    right = torch.relu(args[0].t() @ args[1] + kw["bias"])
    error, problem = bench_kernels.check(case, right, args, kw)
    assert problem is None and 0 < error < 1e-6  # the row's rel_err
    wrong = right.clone()
    wrong[-1, -1] += 1.0
    assert "relative error" in bench_kernels.check(case, wrong, args, kw)[1]
    # A TF32 product (10 mantissa bits): wrong at fp32's tolerance, right at TF32's, its error recorded.
    bits = args[0].view(torch.int32) & ~0x1FFF, args[1].view(torch.int32) & ~0x1FFF
    tf32 = torch.relu(bits[0].view(torch.float32).t() @ bits[1].view(torch.float32) + kw["bias"])
    error, problem = bench_kernels.check(case, tf32, args, kw)
    assert "relative error" in problem and 1e-5 < error < 2e-3
    assert bench_kernels.check(case, tf32, args, kw, "tf32") == (error, None)


def test_bench_check_of_elementwise_ops_is_exact(rng):
    case = bench_kernels.Case("elementwise", "relu_backward", "fp32", (7, 129))
    args, kw, nbytes, _ = bench_kernels.make_call(case, rng, torch.device("cpu"))
    assert nbytes == 3 * 7 * 129 * 4
    out = torch.where(args[1] <= 0, 0.0, args[0])
    assert bench_kernels.check(case, out, args, kw) == (None, None)
    out.view(-1)[5] = float("nan")
    assert "differ" in bench_kernels.check(case, out, args, kw)[1]


def test_loss_curve_file_keeps_other_widths(tmp_path):
    path = tmp_path / "losses.csv"
    compare.write_curve(path, 128, [float(i) for i in range(25)])
    compare.write_curve(path, 1024, [1.0, 0.5])
    compare.write_curve(path, 128, [3.0] * 12)  # a rerun replaces its own width only
    rows = compare.existing_rows(path)
    assert [(r["hidden"], r["step"]) for r in rows] == [("1024", "2"), ("128", "10"), ("128", "12")]


@pytest.mark.slow  # tuner processes killed and resumed
def test_stress_sharing_judges_each_round(tmp_path):
    from experiments import stress_sharing
    out = tmp_path / "stress.csv"
    assert stress_sharing.main(["--rounds", "1", "--out", str(out)]) == 0
    rows = pd.read_csv(out)
    assert list(rows["kind"]) == ["kill", "share"] and rows["ok"].all()
    assert (rows["measured"] == stress_sharing.BUDGET).all() and rows["commit"].notna().all()


def test_compare_resumes_per_settings_and_store_and_measures_against_its_own_width(tmp_path, monkeypatch):
    """Training faked: a rerun trains nothing; a new tuned store redoes only the tuned rows;
    each width's speedups are against that width's torch-eager step time."""
    import types

    trained = []

    def fake_train(cfg):
        trained.append((cfg.backend, cfg.hidden, cfg.tuned_configs))
        runs = tmp_path / "runs"
        runs.mkdir(exist_ok=True)
        run_csv = runs / f"run{len(trained)}.csv"
        run_csv.write_text("step,loss,step_time_us\n1,2.0,10\n2,1.5,10\n3,1.0,10\n")
        step_us = {"torch": 1000.0, "cuda": 250.0}[cfg.backend] * cfg.hidden / 128
        return types.SimpleNamespace(steps=3, median_step_us=step_us, train_seconds=1.0, setup_seconds=0.5,
                                     final_loss=1.0, test_accuracy=0.9, seconds_to_98=None, config_source="x",
                                     fused=cfg.fuse if cfg.backend != "torch" else None, ops_per_step=None,
                                     csv=str(run_csv), provenance={"commit": "abc"})

    store = tmp_path / "best.json"
    store.write_text("{}")
    monkeypatch.setattr(compare, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(paths, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(compare, "train", fake_train)
    monkeypatch.setattr(compare.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compare, "provenance", lambda: {"commit": "abc"})
    args = ["--protocol", "default", "--hidden", "128,1024", "--variants", "torch-eager,cuda-tuned",
            "--max-autotune-hidden=", "--tuned-configs", str(store)]
    assert compare.main(args) == 0 and len(trained) == 4
    assert compare.main(args) == 0 and len(trained) == 4  # nothing redone
    store.write_text('{"entries": []}')  # re-tuned: only the tuned rows are redone
    assert compare.main(args) == 0 and trained[4:] == [("cuda", 128, str(store)), ("cuda", 1024, str(store))]
    rows = pd.read_csv(next((tmp_path / "results").glob("*/trainer_fp32.csv")))
    assert (rows.loc[rows.variant == "cuda-tuned", "speedup_vs_torch_eager"] == 4.0).all()
    assert (rows.loc[rows.variant == "cuda-tuned", "max_loss_diff_vs_torch_eager"] == 0.0).all()
    assert rows.tuned_configs_sha.nunique(dropna=True) == 2 and rows.run_length.eq("10 epochs").all()


def test_compare_measures_each_row_against_the_fastest_torch_variant_of_its_own_run(tmp_path, monkeypatch):
    """The fastest torch variant is per width and per run key: a step-time-only run (--steps) is measured
    against its own torch rows only. Max-autotune variants run only at the widths asked for; a loss curve
    that leaves eager's is flagged; the README names the fastest torch variant."""
    import types

    trained = []
    step_us = {  # (variant's torch_graph, compile) -> µs at H=128, H=1024
        (False, None): (1000.0, 1100.0), (True, None): (200.0, 90.0),
        (True, "max-autotune-no-cudagraphs"): (100.0, None)}

    def fake_train(cfg):
        trained.append((cfg.backend, cfg.compile, cfg.torch_graph, cfg.hidden, cfg.steps))
        us = 150.0 if cfg.backend == "cuda" else 50.0 if cfg.tf32 else step_us[cfg.torch_graph, cfg.compile][cfg.hidden == 1024]
        losses = [2.0, 1.5, 1.2, 1.0, 0.9][:3 if cfg.steps else 5]
        if cfg.backend == "cuda":
            losses[1] *= 1 + 1e-3  # beyond 1e-4 over the first steps
        runs = tmp_path / "runs"
        runs.mkdir(exist_ok=True)
        run_csv = runs / f"run{len(trained)}.csv"
        run_csv.write_text("step,loss,step_time_us\n" + "".join(f"{i},{v},{us}\n" for i, v in enumerate(losses)))
        return types.SimpleNamespace(steps=len(losses), median_step_us=us, train_seconds=1.0, setup_seconds=0.5,
                                     final_loss=losses[-1], test_accuracy=0.9, seconds_to_98=None, config_source="x",
                                     fused=None, ops_per_step=None, csv=str(run_csv), provenance={"commit": "abc"})

    results = tmp_path / "results"
    monkeypatch.setattr(compare, "RESULTS", results)
    monkeypatch.setattr(paths, "RESULTS", results)
    monkeypatch.setattr(compare, "train", fake_train)
    monkeypatch.setattr(compare.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compare, "provenance", lambda: {"commit": "abc"})
    common = ["--protocol", "default", "--tuned-configs", str(tmp_path / "no_store.json")]
    assert compare.main([*common, "--hidden", "128,1024", "--max-autotune-hidden", "128",
                         "--variants", "torch-graph,torch-compile-max-graph,cuda-default,torch-compile-graph-tf32"]) == 0
    assert [t[1] for t in trained].count("max-autotune-no-cudagraphs") == 1  # at H=128 only
    assert compare.main([*common, "--hidden", "128", "--steps", "300", "--variants", "torch-eager,cuda-default"]) == 0
    assert len(trained) == 11 and trained[-1][-1] == 300

    csv_path = next(results.glob("*/trainer_fp32.csv"))
    rows = pd.read_csv(csv_path).set_index(["variant", "hidden", "run_length"])
    full, timing = "10 epochs", "300 steps"
    # The TF32 variant (the fastest here) is a lower precision: never the best torch a row is held to.
    assert rows.loc[("cuda-default", 128, full), "best_torch_variant"] == "torch-compile-max-graph"
    assert rows.loc[("cuda-default", 128, full), "speedup_vs_best_torch"] == 100.0 / 150.0
    assert rows.loc[("torch-compile-graph-tf32", 128, full), "speedup_vs_best_torch"] == 100.0 / 50.0
    assert rows.loc[("cuda-default", 128, full), "speedup_vs_torch_eager"] == 1000.0 / 150.0
    assert rows.loc[("cuda-default", 1024, full), "best_torch_variant"] == "torch-graph"
    assert rows.loc[("cuda-default", 1024, full), "speedup_vs_best_torch"] == 90.0 / 150.0
    assert rows.loc[("cuda-default", 128, timing), "best_torch_variant"] == "torch-eager"
    assert rows.loc[("torch-graph", 128, full), "tracks_torch_eager"] == "yes"
    assert rows.loc[("cuda-default", 128, full), "tracks_torch_eager"].startswith("step 2: relative difference")
    # The step-time-only run left the protocol's loss curves alone.
    curve = pd.read_csv(next(results.glob("*/loss_curves/losses_*_torch-eager.csv")))
    assert curve.step.tolist() == [5, 5] and sorted(curve.hidden) == [128, 1024]



def test_tracking_failure_names_the_first_step_out_of_tolerance():
    ref = [2.0 + 0.01 * i for i in range(100)]
    assert compare.tracking_failure(ref, ref) is None
    assert compare.tracking_failure([v * (1 + 9e-5) for v in ref], ref) is None
    early = [v * (1 + 2e-4) if i == 3 else v for i, v in enumerate(ref)]
    assert compare.tracking_failure(early, ref).startswith("step 4:")
    late = [v * (1 + 6e-2) if i == 80 else v for i, v in enumerate(ref)]
    assert compare.tracking_failure(late, ref).startswith("step 81:")
    assert compare.tracking_failure(late[:80], ref) is None  # past the run, nothing to hold it to
    assert compare.tracking_failure([float("nan")] + ref[1:], ref).startswith("step 1:")


def test_two_comparisons_writing_one_csv_keep_each_others_rows(tmp_path):
    """Two compare processes (one per GPU lane) append to one CSV: each write merges into what is
    on disk, so neither loses the other's rows, and a rerun of a key replaces its row."""
    def row(variant, us):
        return dict(variant=variant, backend="torch" if variant.startswith("torch") else "cuda", hidden="128",
                    dtype="fp32", protocol="default", run_length="500 steps", tuned_configs_sha="", commit="abc",
                    median_step_us=us)

    path = tmp_path / "trainer_gpu_fp32.csv"
    compare.write_csv(path, [row("torch-eager", 1000.0)])  # lane 1
    compare.write_csv(path, [row("cuda-tuned", 100.0)])  # lane 2, which read the file before lane 1 wrote
    merged = compare.write_csv(path, [row("cuda-tuned", 90.0)])  # lane 2 again: same key, replaced
    by_variant = {r["variant"]: r for r in compare.existing_rows(path)}
    assert set(by_variant) == {"torch-eager", "cuda-tuned"} and float(by_variant["cuda-tuned"]["median_step_us"]) == 90.0
    assert len(merged) == 2 and float(by_variant["cuda-tuned"]["speedup_vs_torch_eager"]) == 1000.0 / 90.0


def test_bench_wgmma_needs_a_gpu(monkeypatch, capsys):
    from experiments import bench_wgmma

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_wgmma.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("commit", ["abc1234", "359785e11863"])  # the second is a float (inf) to pandas
def test_accuracy_spread_runs_each_seed_once_and_summarizes_the_runs_of_its_settings(tmp_path, capsys, monkeypatch,
                                                                                     request, commit):
    from experiments import accuracy_spread
    from kernels_core import provenance

    monkeypatch.setenv("SOURCE_COMMIT", commit)
    provenance._static.cache_clear()  # it holds the commit
    request.addfinalizer(provenance._static.cache_clear)

    results = tmp_path / "spread.csv"
    args = ["--hidden", "8", "--epochs", "1", "--train-subset", "256", "--results", str(results),
            "--out", str(tmp_path / "out")]
    assert accuracy_spread.main([*args, "--seeds", "0-1"]) == 0
    assert accuracy_spread.main([*args, "--seeds", "0,1,4"]) == 0  # seeds 0 and 1 are not run again
    rows = pd.read_csv(results)
    assert sorted(rows["seed"]) == [0, 1, 4] and rows["test_accuracy"].between(0, 1).all()
    assert len(set(rows["test_accuracy"])) > 1  # the seed moves the outcome: each run is its own
    out = capsys.readouterr().out
    assert "0 of 3 seeds reached 98%" in out and "runs >= 98%" in out
    table = accuracy_spread.summary(rows.assign(test_accuracy=[0.97, 0.985, 0.99]))
    assert table.iloc[0]["runs >= 98%"] == 2 and table.iloc[0]["min"] == 0.97


def test_graph_profile_keeps_the_steps_ops_and_leaves_out_what_ran_between_replays(rng):
    from experiments.graph_profile import align

    step = ["gather", "matmul", "matmul", "loss", "matmul"]  # a name may recur within a step
    n = int(torch.randint(3, 9, (1,), generator=rng))
    # An epoch's shuffle before some of the replays, never all: ops run in fewer than n replays.
    shuffled = set(torch.randperm(n, generator=rng)[:int(torch.randint(1, n, (1,), generator=rng))].tolist())
    events, t = [], 0.0
    for s in range(n):
        for name in (("randperm", "sort") if s in shuffled else ()) + tuple(step):
            events.append((name, t, t + 1.0))
            t += 2.0
    rows = align(events, n, first_step=10)
    assert [r["name"] for r in rows] == step * n
    assert [(r["step"], r["pos"]) for r in rows] == [(10 + s, p) for s in range(n) for p in range(len(step))]
    assert len(events) - len(rows) == 2 * len(shuffled)


def test_graph_profile_summary_of_ops_and_replays():
    from experiments.graph_profile import CHUNK, summarize

    # Two ops a step, 2 and 3 µs long with 0.5 µs between them; replays 10 µs apart, and 1000 µs
    # between the two profiler sessions.
    rows, t = [], 0.0
    for step in range(2 * CHUNK):
        if step == CHUNK:
            t += 1000.0
        rows += [dict(step=step, pos=0, name="a", start=t, end=t + 2.0),
                 dict(step=step, pos=1, name="b", start=t + 2.5, end=t + 5.5)]
        t += 10.0
    s = summarize(pd.DataFrame(rows)).set_index("pos")
    assert s.dur_us_median.tolist() == [2.0, 3.0] and s.dur_us_block_drift.tolist() == [0.0, 0.0]
    assert pd.isna(s.gap_before_us_median[0]) and s.gap_before_us_median[1] == 0.5
    assert (s.step_span_us_median == 5.5).all() and (s.kernel_sum_us_median == 5.0).all()
    assert (s.replay_period_us_median == 10.0).all() and (s.gap_between_replays_us_median == 4.5).all()


def test_ksweep_splits_each_line_into_its_fixed_and_per_step_parts(rng):
    """Noisy rounds about two known lines (one per twin, same config and K) come back as those
    lines, each from the median of its own rounds and apart from the other twin's."""
    lines = {("nn", "cuda", "16x16x64 w2 s4"): (2.7, 0.09), ("nn", "triton", "16x16x64 w2 s4"): (2.1, 0.07)}
    rows = []
    for (layout, backend, config), (fixed, step) in lines.items():
        for k in (64, 192, 448, 1000):
            steps = -(-k // 64)
            for noise in (0.0, 0.3, -0.3):  # one round far off each way: the median is the line
                rows.append(dict(layout=layout, backend=backend, config=config, K=k, steps=steps,
                                 us=fixed + step * steps + noise * float(torch.rand(1, generator=rng))))
    got = ksweep.fit(pd.DataFrame(rows)).set_index(["layout", "backend", "config"])
    for key, (fixed, step) in lines.items():
        assert abs(got.loc[key, "fixed_us"] - fixed) < 1e-9 and abs(got.loc[key, "step_us"] - step) < 1e-9
        assert got.loc[key, "points"] == 4 and got.loc[key, "worst_resid_us"] < 1e-9


@pytest.mark.slow  # the tuner in a subprocess
def test_the_tuners_summary_reads_back_and_tuning_speed_finds_each_studys_own_winner(tmp_path, monkeypatch):
    """tuning_speed's figures are the tuner's own: its summary of a real run (the fake backend on the
    cpu target, through a compile pool of two) and its trials' fastest config per study."""
    import os
    import subprocess
    import sys

    from autotune.evaluate import host_cores
    from autotune.search import summary_figures
    from experiments import tuning_speed

    env = dict(os.environ, AUTOTUNE_BACKENDS="fake=tests.fake_backend", TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "autotune.search", "--out", str(tmp_path), "--target", "cpu",
                           "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--shapes", "8x16x8,16x8x24",
                           "--sampler", "random", "--trials", "3", "--workers", "2"],
                          cwd=paths.RESULTS.parent.parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = summary_figures(done.stdout)
    assert figures["trials"] == 6 and figures["workers"] == 2 and figures["timing_processes"] == 1
    assert figures["cores"] == host_cores() and figures["trials_per_s"] == pytest.approx(6 / figures["tuning_s"],
                                                                                         rel=0.05, abs=0.01)
    # The timing process's time a measurement: each of 6 trials and 4 baselines a process round trip or two.
    assert figures["load_ms"] >= 0 and figures["measure_ms"] >= 0 and figures["load_ms"] + figures["measure_ms"] >= 1
    assert figures["load_ms"] + figures["measure_ms"] <= 1e3 * figures["tuning_s"] / 6
    rows = pd.read_csv(tmp_path / "cpu" / "trials.csv")
    won = tuning_speed.study_winners(tmp_path / "cpu" / "trials.csv")
    assert list(won.index) == sorted(rows.study.unique())
    for study, best in won.iterrows():
        mine = rows[(rows.study == study) & (rows.status == "ok")]
        fastest = mine.loc[mine.time_ms.idxmin()]
        assert best.time_ms == fastest.time_ms
        assert best.config == '{"BLOCK_M": %d, "BLOCK_N": %d, "SPLIT": %d}' % (
            fastest.BLOCK_M, fastest.BLOCK_N, fastest.SPLIT)
    with pytest.raises(ValueError, match="no tuner summary"):
        summary_figures(done.stdout.replace("Tuning took", "Tuned in"))

    # The same studies searched serially, then each study's two winners re-timed side by side.
    tuning = ["--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--shapes",
              "8x16x8,16x8x24", "--sampler", "random", "--trials", "3"]
    for name, workers in zip(tuning_speed.WINNERS, ("2", "0")):
        done = subprocess.run([sys.executable, "-m", "autotune.search", *tuning, "--workers", workers, "--seed",
                               workers, "--out", str(tmp_path / name / "experiments")],
                              cwd=paths.RESULTS.parent.parent, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    monkeypatch.setenv("AUTOTUNE_BACKENDS", "fake=tests.fake_backend")
    found = tuning_speed.winners(tmp_path, 2, tuning).set_index("study")
    assert sorted(found.index) == sorted(rows.study.unique())
    for study, row in found.iterrows():
        assert row["op"] == "matmul" and row["backend"] == "fake" and row["shape"] == study.rsplit(":", 2)[1] + ":nn"
        differ = row["parallel_config"] != row["serial_config"]
        assert (row["parallel_retimed_ms"] > 0 and row["serial_retimed_ms"] > 0) if differ else row["ratio"] == 1.0
        assert row["within_3pct"] == (row["ratio"] <= 1.03) and row["serial_within_3pct"] == (row["ratio"] >= 1 / 1.03)


def test_the_winners_summary_counts_each_direction_apart():
    """A parallel winner 10% slower counts against the parallel run only, one 10% or 20% faster against
    the serial run only; equal configs, and 2% apart, count for both."""
    from experiments import tuning_speed

    said = tuning_speed.winners_summary(pd.DataFrame({"ratio": [1.0, 1.1, 1 / 1.1, 1 / 1.2, 1.02]}))
    assert "within 3% of the serial run's in 4 of 5 studies" in said
    assert "the serial run's within 3% of the parallel run's in 3;" in said
    assert "median 1.000 (range 0.833-1.100)" in said


def test_a_failed_tuning_speed_run_says_why_in_its_one_line(tmp_path, monkeypatch):
    """A run that fails stops tuning_speed with the command's last line, not only the path of its log:
    on a machine whose files do not come back, the line is all one sees."""
    from experiments import tuning_speed

    monkeypatch.setitem(tuning_speed.RUNS, "failing-cold",
                        (["-c", "print('step 1'); print('autotune: error: no study here'); raise SystemExit(2)"],
                         "failing", "cold"))
    with pytest.raises(SystemExit) as stop:
        tuning_speed.run("failing-cold", tmp_path)
    assert "failing-cold exited 2: autotune: error: no study here" in str(stop.value)


def test_tuning_speed_names_a_run_it_does_not_know_and_needs_a_gpu(capsys):
    from experiments import tuning_speed

    with pytest.raises(SystemExit) as exc:
        tuning_speed.main(["--runs", "make-run-cold,make-run-lukewarm"])
    assert exc.value.code == 2 and "make-run-lukewarm" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert tuning_speed.main(["--runs", "make-run-cold"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.slow  # make run's 34 studies opened and run (one trial each) by the search's own code
def test_tuner_bookkeeping_runs_make_runs_studies_through_the_searchs_own_code(tmp_path, monkeypatch):
    from experiments import tuner_bookkeeping

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the pool's never-started workers need a GPU id here
    row = tuner_bookkeeping.one_round(1, 0, tmp_path)
    assert row["studies"] == 34 and row["trials"] == 34 and row["sampler"] == "tpe-valid"
    assert row["ask_ms"] > 0 and row["tell_ms"] > 0 and row["per_trial_ms"] == pytest.approx(
        row["ask_ms"] + row["tell_ms"], abs=0.11)
    rows = pd.read_csv(tmp_path / "sm_90" / "trials.csv")
    assert len(rows) == 34 and rows.study.nunique() == 34 and set(rows.status) == {"ok"}


@pytest.mark.parametrize("budgets, words", [("12,x", "expected whole numbers"), ("0", "at least 1 config")])
def test_tuner_bookkeeping_refuses_budgets_it_cannot_run_in_one_line(capsys, budgets, words):
    from experiments import tuner_bookkeeping

    with pytest.raises(SystemExit) as info:
        tuner_bookkeeping.main(["--trials", budgets])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and words in err[-1] and f"--trials {budgets}" in err[-1]


@pytest.mark.slow  # make run's 34 studies through the whole pipeline, one trial each
def test_tuner_bookkeeping_runs_make_runs_studies_through_the_search_pipeline_with_waits_for_processes(
        tmp_path, monkeypatch):
    from experiments import tuner_bookkeeping

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    row = tuner_bookkeeping.pipeline_round(1, 0, tmp_path, measure_ms=5.0, compile_ms=5.0, workers=3)
    assert row["studies"] == 34 and row["trials"] == 34 and row["compile_processes"] == 3
    # Every trial and every baseline (default configs, incumbents, torch once per call) waited once.
    timed = 34 + sum(1 for _ in pd.read_csv(tmp_path / "sm_90" / "trials.csv").itertuples())
    assert 0 < row["lane_busy"] <= 1 and row["lane_busy"] * row["tuning_s"] >= timed * 0.005 * 0.9
    assert row["trials_per_s"] == pytest.approx(34 / row["tuning_s"], rel=0.05)
    rows = pd.read_csv(tmp_path / "sm_90" / "trials.csv")
    assert len(rows) == 34 and rows.study.nunique() == 34 and set(rows.status) == {"ok"}


def test_tuning_speed_replaces_a_runs_row_only_at_its_own_commit_and_device(tmp_path):
    """A run repeated at one commit on one device replaces its row; the rows of earlier commits, or of
    another GPU, stay (the findings cite them)."""
    from experiments import tuning_speed

    table = tmp_path / "tuning_speed.csv"
    row = dict(run="make-run-cold", device="NVIDIA H200", commit="0abc123", wall_s=81.0)
    tuning_speed.put_row(table, row)
    tuning_speed.put_row(table, {**row, "commit": "84b2eaa", "wall_s": 91.2})
    tuning_speed.put_row(table, {**row, "device": "NVIDIA H100 80GB HBM3", "wall_s": 86.1})
    tuning_speed.put_row(table, {**row, "run": "make-run-warm", "wall_s": 73.0})
    tuning_speed.put_row(table, {**row, "wall_s": 80.0})  # the first run repeated: replaced
    df = pd.read_csv(table, dtype={"commit": str})
    assert sorted(zip(df.run, df.device, df.commit, df.wall_s)) == [
        ("make-run-cold", "NVIDIA H100 80GB HBM3", "0abc123", 86.1), ("make-run-cold", "NVIDIA H200", "0abc123", 80.0),
        ("make-run-cold", "NVIDIA H200", "84b2eaa", 91.2), ("make-run-warm", "NVIDIA H200", "0abc123", 73.0)]


@pytest.mark.slow  # compiles in a subprocess (the test process interprets)
def test_compile_stages_times_each_stage_of_a_compile_from_scratch(tmp_path):
    """experiments.compile_stages: a compile's stages as Triton's own timer reports them, with line
    info and without, each a compile from scratch (not a cache hit: the ptxas stage takes time)."""
    import subprocess

    out = tmp_path / "stages.csv"
    done = subprocess.run([sys.executable, "-m", "experiments.compile_stages", "--dtypes", "fp16", "--configs", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    df = pd.read_csv(out)
    assert sorted(df.line_info) == [False, True] and set(df.dtype) == {"fp16"}
    stages = ["make_ir", "ttir", "ttgir", "llir", "ptx", "cubin", "store"]
    assert (df[stages[:-1]] > 0).all().all() and (df.cubin > 0.005).all()
    assert ((df[stages].sum(axis=1) - df.total).abs() < 1e-3).all()


def test_the_persistent_plot_draws_the_newest_run_with_every_variant_over_widths():
    """A later run of the persistent variants at one width, or of some of them over widths, draws
    no curve against the fused step's: the plot keeps the newest run that has them all over widths,
    and a later row of its commit at another run length (a protocol-length run) is not one of its points."""
    from experiments.plots import PERSISTENT_VARIANTS, persistent_run

    def run(commit, variants, widths, length="500 steps"):
        return [dict(commit=commit, variant=v, hidden=h, run_length=length, median_step_us=1.0)
                for v in variants for h in widths]

    rows = (run("a1", PERSISTENT_VARIANTS, (64, 128)) + run("b2", PERSISTENT_VARIANTS, (64, 128, 256))
            + run("c3", PERSISTENT_VARIANTS[:3], (64, 128)) + run("d4", PERSISTENT_VARIANTS, (128,))
            + run("b2", PERSISTENT_VARIANTS[1:2], (128,), "10 epochs"))
    picked, commit = persistent_run(pd.DataFrame(rows))
    assert commit == "b2" and len(picked) == 12 and set(picked.commit) == {"b2"}
    assert set(picked.run_length) == {"500 steps"}
    assert persistent_run(pd.DataFrame(run("d4", PERSISTENT_VARIANTS, (128,)))) is None
    assert persistent_run(pd.DataFrame()) is None


@pytest.mark.parametrize("dtype,lr,planted", [("fp32", 0.005, 100), ("fp16", 0.01, 10)])
def test_persistent_flips_judges_a_training_as_the_full_grid_check_does(tmp_path, monkeypatch, rng, dtype, lr,
                                                                         planted):
    """experiments.persistent_flips on the CPU (torch's fp32 training as the stand-in twin, in fp16
    rounded where the kernels store): a row per twin and config; training from the full-grid tests'
    open-half draw at their lr passes the check, and the same training with one 16 x 16 tile of W1
    left at its start fails it by far (fp16's check allows about 700 times fp32's)."""
    from experiments import persistent_flips as flips

    if torch.cuda.is_available():
        pytest.skip("the CPU's stand-in; the twins' rows are the GPU's")
    monkeypatch.setattr(paths, "RESULTS", tmp_path / "results")
    flips.main(["--twins", "torch-fp32", "--dtype", dtype, "--lr", str(lr), "--draws", "2", "--steps", "1",
                "--first-seed", "5"])
    rows = pd.read_csv(next((tmp_path / "results").glob("*/persistent_flips.csv")))
    assert len(rows) == 1 and rows.draws[0] == 2 and rows.failed[0] == 0 and 0 < rows.worst_of_allowed[0] < 1
    assert rows.dtype[0] == dtype
    with pytest.raises(SystemExit):
        flips.main(["--twins", "cuda"])  # no GPU here: refused, in argparse's one line
    sgd = dict(lr=lr, momentum=0.9, weight_decay=0.0)
    x, y, batches, p0 = flips.draw(int(torch.randint(0, 2**31, (), generator=rng)), dtype, 2, "open-half", "cpu")
    ref_losses, ref, paths_ = flips.reference(x, y, batches, p0, flips.LAYOUT, 2, **sgd)
    params, losses = flips.trained("torch-fp32", {}, x, y, batches, p0, 2, sgd)
    assert flips.judged(params, losses, ref_losses, ref, paths_, dtype, 2) < 1
    flips.LAYOUT.views(params)[2][:16, :16] = flips.LAYOUT.views(p0)[2][:16, :16]
    assert flips.judged(params, losses, ref_losses, ref, paths_, dtype, 2) > planted


def test_ncu_stalls_sums_each_reason_over_the_instructions(tmp_path, monkeypatch, capsys):
    """experiments.ncu_stalls on a source page as ncu writes it: each reason's samples summed over
    the instructions (the "Not Issued" columns apart), shares of the launch's whole; a page with no
    stall columns or of two kernels is refused in one line."""
    from experiments import ncu_stalls

    monkeypatch.setattr(paths, "RESULTS", tmp_path / "results")
    header = ["Address", "Source", "stall_barrier", "stall_long_sb", "stall_barrier (Not Issued)", "stall_math"]
    counts = torch.randint(0, 50, (7, 3)).tolist()
    lines = [["Kernel Name", "void train_steps<(int)0>(float *)"], header]
    lines += [[f"0x{i:04x}", "FFMA R1, R2, R3, R4", b, l, 99, m] for i, (b, l, m) in enumerate(counts)]
    page = tmp_path / "page.csv"
    page.write_text("\n".join(",".join(f'"{v}"' for v in line) for line in lines) + "\n")
    assert ncu_stalls.main([str(page), "--label", "planted"]) == 0
    rows = pd.read_csv(next((tmp_path / "results").glob("*/ncu_stalls.csv"))).set_index("reason")
    want = dict(zip(("barrier", "long_sb", "math"), (sum(c[j] for c in counts) for j in range(3))))
    total = sum(want.values())
    for reason, samples in want.items():
        if samples:
            assert rows.samples[reason] == samples and rows.share[reason] == pytest.approx(samples / total)
    assert set(rows.kernel) == {"void train_steps<(int)0>"} and set(rows.label) == {"planted"}
    page.write_text('"Kernel Name","k"\n"Address","Source"\n"0x0","NOP"\n')
    with pytest.raises(SystemExit):
        ncu_stalls.main([str(page), "--label", "x"])
    page.write_text('"Kernel Name","k"\n"Address","stall_math"\n"Kernel Name","k2"\n"Address","stall_math"\n')
    with pytest.raises(SystemExit):
        ncu_stalls.main([str(page), "--label", "x"])
    assert "no stall columns" in capsys.readouterr().err
