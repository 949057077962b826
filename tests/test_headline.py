"""experiments.headline's plan and the README section experiments.report draws from one headline run
(CPU: the run's CSVs are written here with planted figures; measuring them needs the H200)."""
import time

import pandas as pd
import pytest

from experiments import compare, headline, report
from kernels_core.mlp import PROTOCOLS

PROV = dict(device="NVIDIA H200", utc="2026-12-04T00:00:00Z", torch="2.11", triton="3.6", cupy="14.2", cuda="13.0",
            commit="abc1234")


def _write(folder, name, rows):
    pd.DataFrame([{**PROV, **r} for r in rows]).to_csv(folder / name, index=False)


def fake_run(folder, cublas_ms=2.0, twin_ms=(1.0, 4.0), steps=None):
    """A headline folder as a default-mode run leaves it: two rounds of each kernel case."""
    folder.mkdir(parents=True, exist_ok=True)
    kernels = []
    for rep, wobble in ((0, 1.0), (1, 1.1)):
        # The copy ceiling, measured once a round: the section takes their median, 4000.
        kernels.append(dict(group="ceiling", op="copy", backend="torch", status="ok", gbps=3800.0 + 400 * rep, rep=rep))
        kernels.append(dict(group="elementwise", op="relu", backend="cuda", dtype="fp32", shape="65536x4096",
                            config_label="default", status="ok", gbps=3600.0 * wobble, rep=rep))
        for backend, label, ms in (("torch", "cuBLAS/aten", cublas_ms), ("cuda", "default", twin_ms[0]),
                                   ("cuda", "tuned", twin_ms[1])):
            kernels.append(dict(group="gemm", op="matmul", backend=backend, dtype="fp16", shape="4096x4096x4096:nn",
                                config_label=label, status="ok", time_ms=ms * wobble, vs_torch=cublas_ms / ms, rep=rep,
                                rel_err={"torch": 2.0e-4, "cuda": 3.0e-4}[backend] * wobble * (2 if label == "tuned" else 1)))
    _write(folder, "kernels.csv", kernels)
    gemms = [dict(group="ceiling", op="copy", backend="torch", status="ok", gbps=4000.0)] + [dict(group="trainer", backend=b, dtype="fp32", shape="128x1024x784:nn", config_label=label, status="ok",
                  graph_ms=ms / 1e3 * wobble, rep=rep)
             for rep, wobble in ((0, 1.0), (1, 3.0))
             for b, label, ms in (("torch", "cuBLAS/aten", 24.0), ("cuda", "tuned", 12.0), ("triton", "tuned", 8.0))]
    _write(folder, "trainer_gemms.csv", gemms)
    for protocol in ("default", "seed"):
        p = PROTOCOLS[protocol]
        rows = steps or [dict(variant=v, backend=v.split("-")[0], hidden=h, median_step_us=us, p20_step_us=us - 1,
                              p80_step_us=us + 2, run_length="500 steps")
                         for h in (128, 256) for v, us in (("torch-eager", 400.0), ("torch-compile-graph", 90.0),
                                                           ("cuda-tuned", 45.0), ("triton-tuned", 60.0))]
        _write(folder, compare.csv_name(protocol),
               [dict(r, protocol=protocol, dtype=p.dtype, layers=p.layers) for r in rows])
    _write(folder, "tuning.csv", [dict(command="python -m autotune.search ... --out DIR", studies=20, trials=80,
                                       ok_trials=70, wall_s=50.0, trials_per_s=1.6, workers=14, cores=16)])
    _write(folder, "stages.csv", [dict(stage="kernels", seconds=60.0, status="ok", config_store="store.json"),
                                  dict(stage="steps", seconds=240.0, status="ok", config_store="store.json")])


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "results_dir", lambda gpu: tmp_path / gpu)
    return tmp_path / "gpu" / "headline"


def plant_record(folder, moves, pair=("0123abc", "0123abc")):
    """A record of one earlier pair of runs: a figure per kind, moved by the given fraction."""
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([dict(kind=kind, figure=f"figure {i}", moved=m, commit=pair[0], commit_second=pair[1])
                  for i, (kind, m) in enumerate(moves.items())]).to_csv(folder / report.RERUNS, index=False)


def test_the_section_shows_one_run_and_names_its_commit_once_per_table(results):
    fake_run(results)
    plant_record(results.parent, {"square matmuls": -0.2, "step, cuda-tuned": 0.1,
                                  "trainer GEMMs over 5 µs (graph replays)": 0.03})
    text = report.render("gpu")
    assert "(5.0 min): NVIDIA H200, 2026-12-04" in text and "config store `store.json`" in text
    titles = [line for line in text.splitlines() if line.startswith("### ")]
    assert len(titles) == 5 and all(t.endswith("(commit abc1234)") for t in titles)
    # Kernels: medians of the rounds and their range; the ratio to the copy and to cuBLAS of each round;
    # the next run's spread, the wider of the rounds' band and the kind's largest move on record.
    assert "| relu | cuda | default | 3780 (3600–3960) | 94.5 | ±4.8% |" in text  # no elementwise pair on record
    # The error against float64: the larger of the rounds'.
    assert "| 4096³ fp16 | cuda | tuned | 4.200 (4.000–4.400) | 33 | 0.50 | 6.6e-04 | ±20.0% |" in text
    assert "| 4096³ fp16 | torch | cuBLAS | 2.100 (2.000–2.200) | 65 | 1.00 | 2.2e-04 | ±20.0% |" in text
    # A run from before the error was recorded: the column is empty.
    pd.read_csv(results / "kernels.csv").drop(columns="rel_err").to_csv(results / "kernels.csv", index=False)
    assert "| 4096³ fp16 | torch | cuBLAS | 2.100 (2.000–2.200) | 65 | 1.00 |  | ±20.0% |" in report.render("gpu")
    # The trainer's GEMMs: the median time over rounds, cuBLAS's over the twin's; rounds of 12 and 36 µs.
    assert "| fp32 | cuda | tuned | 1 | 2.00× | 2.00× | 2.00× |" in text
    assert "| fp32 | 128x1024x784:nn | 48.0 | 24.0 ±50.0% (2.00×) | 16.0 ±50.0% (3.00×) |" in text
    # Steps: median, ± the wider of p20-p80's farther end and the record; max-autotune marked where not measured.
    assert "| cuda-tuned | 45.0 ±10.0% | 45.0 ±10.0% |" in text
    assert "| torch-eager | 400.0 ±0.5% | 400.0 ±0.5% |" in text
    assert "| torch-compile-max-graph | `--full` | `--full` |" in text
    assert "| 128 | 45.0 | 2.00× | 8.89× | 60.0 | 1.50× | 6.67× | torch-compile-graph 90.0 |" in text
    assert "| 256 | 45.0 | 2.00× | 8.89× | 60.0 | 1.50× | 6.67× | torch-compile-graph 90.0 | ~5.2× |" in text
    assert ("--out DIR` (14 compile processes, one timing process per GPU, 16 cores): 80 trials (70 valid) in 20 "
            "studies, 50 s of wall time, 1.60 trials per second") in text


def test_a_section_mixing_commits_or_repeating_a_row_is_refused(results):
    fake_run(results)
    gemms = pd.read_csv(results / "trainer_gemms.csv")
    gemms.loc[0, "commit"] = "def5678"
    gemms.to_csv(results / "trainer_gemms.csv", index=False)
    with pytest.raises(report.NotOneRun, match="mix commits: abc1234, def5678"):
        report.render("gpu")

    fake_run(results)
    steps = pd.read_csv(results / "compare_fp16.csv")
    pd.concat([steps, steps.iloc[[2]]]).to_csv(results / "compare_fp16.csv", index=False)
    with pytest.raises(report.NotOneRun, match="step-time table repeats a row: variant=cuda-tuned, hidden=128"):
        report.render("gpu")

    fake_run(results)
    kernels = pd.read_csv(results / "kernels.csv")
    pd.concat([kernels, kernels.iloc[[3]]]).to_csv(results / "kernels.csv", index=False)
    with pytest.raises(report.NotOneRun, match="a round repeats a row"):
        report.render("gpu")


def test_check_fails_on_a_stale_section_and_on_mixed_commits(results, tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    monkeypatch.setattr(report, "README", readme)
    fake_run(results)
    readme.write_text(f"intro\n{report.BEGIN}\nold\n{report.END}\ntail\n")
    assert report.main(["--gpu", "gpu", "--check"]) == 1
    assert report.main(["--gpu", "gpu"]) == 0 and report.main(["--gpu", "gpu", "--check"]) == 0
    assert readme.read_text().startswith("intro\n") and readme.read_text().endswith("tail\n")
    fake_run(results, cublas_ms=3.0)  # a new run moves a figure: the committed section is stale
    assert report.main(["--gpu", "gpu", "--check"]) == 1
    tuning = pd.read_csv(results / "tuning.csv")
    tuning["commit"] = "def5678"
    tuning.to_csv(results / "tuning.csv", index=False)
    assert report.main(["--gpu", "gpu"]) == 1 and "def5678" not in readme.read_text()


def test_default_plan_measures_every_protocol_width_and_marks_max_autotune(tmp_path):
    p = headline.plan("default", "gpu")
    assert p.widths == {name: proto.widths for name, proto in PROTOCOLS.items()}
    assert p.widths["seed"] == (128, 256, 512, 1024, 2048, 4096, 8192) and p.readme
    assert set(p.variants) == {*headline.TORCH_VARIANTS, *headline.TWIN_VARIANTS}
    full = headline.plan("full", "gpu")
    assert "torch-max-autotune" in full.variants and full.widths == p.widths
    quick = headline.plan("quick", "gpu")
    assert not quick.readme and quick.rounds == 1 and "runs" in quick.folder.parts
    assert all(w == (128, 1024) for w in quick.widths.values())


def test_the_compile_stage_builds_what_the_timed_stages_run_and_nothing_else(tmp_path, monkeypatch):
    import trainer.config

    monkeypatch.setattr(trainer.config, "_has_gpu", lambda: True)  # the graphed variants' configs need one
    p = headline.plan("quick", "gpu")
    from experiments import bench_kernels

    cases = bench_kernels.gemm_cases([("fp32", 256)], arch=90)
    jobs = headline.warm_jobs(p, tmp_path / "store.json", cases)
    gemm_jobs = [j for j in jobs if j[0] is headline._warm_gemm]
    assert [(j[2], j[3]) for j in gemm_jobs] == [("cuda", None), ("cuda", {"BLOCK_K": 16, "TF32": 3}),
                                                 ("cuda", {"BLOCK_M": 64, "BLOCK_K": 32, "TF32": 3, "WGMMA": 1}),
                                                 ("triton", None), ("triton", {"TF32": 3}),
                                                 ("triton", {"TF32": 3, "SPLIT_AHEAD": 1})]
    off_hopper = bench_kernels.gemm_cases([("fp32", 256)], arch=80)[0].configs["cuda"]
    assert [label for label, _ in off_hopper] == ["default", "tf32x3"]  # wgmma is sm_90a's alone
    trains = [j[1] for j in jobs if j[0] is headline._warm_train]
    built = {(c.backend, c.compile, c.hidden, c.dtype) for c in trains}
    for protocol, proto in PROTOCOLS.items():
        for h in (128, 1024):
            for variant in p.variants:
                spec = compare.VARIANTS[variant]
                want = (spec["backend"], spec.get("compile"), h, proto.dtype)
                assert (want in built) == (spec["backend"] != "torch" or "compile" in spec), variant
    assert all(c.tuned_configs == str(tmp_path / "store.json") for c in trains if c.backend != "torch")
    assert len(trains) == len(built)


def test_a_rerun_is_judged_figure_by_figure_against_the_first_runs_spread(tmp_path):
    fake_run(tmp_path / "first")
    fake_run(tmp_path / "second", twin_ms=(1.02, 4.0))  # cuda's default 4096^3 moves 2%: its rounds span 10%
    none = pd.DataFrame(columns=["kind", "moved"])
    table = report.rerun(tmp_path / "first", tmp_path / "second", none).set_index("figure")
    assert table.within_spread.all() and len(table) == 1 + 3 + 3 + 16
    assert table.loc["gemm time_ms matmul fp16 4096x4096x4096:nn cuda default", "moved"] == pytest.approx(0.02)
    fake_run(tmp_path / "second", twin_ms=(1.2, 4.0))
    table = report.rerun(tmp_path / "first", tmp_path / "second", none).set_index("figure")
    assert list(table.index[~table.within_spread]) == ["gemm time_ms matmul fp16 4096x4096x4096:nn cuda default"]
    # A square matmul moved 25% between two earlier runs: 20% is within what that kind does.
    record = pd.DataFrame([dict(kind="square matmuls", moved=-0.25), dict(kind="step, cuda-tuned", moved=0.01)])
    table = report.rerun(tmp_path / "first", tmp_path / "second", record).set_index("figure")
    assert table.within_spread.all()
    assert table.loc["gemm time_ms matmul fp16 4096x4096x4096:nn cuda default", "spread"] == pytest.approx(0.25)


def test_a_reruns_summary_counts_each_kind_of_figure(tmp_path):
    fake_run(tmp_path / "first")
    fake_run(tmp_path / "second", twin_ms=(1.3, 4.0))  # one square matmul 30% slower, outside its 10%
    record = pd.DataFrame([dict(kind="step, cuda-tuned", moved=-0.08)])
    summary = report.rerun_summary(report.rerun(tmp_path / "first", tmp_path / "second", record)).set_index("kind")
    assert list(summary.index) == ["elementwise GB/s", "square matmuls", "trainer GEMMs over 5 µs (graph replays)",
                                   "step, torch-eager", "step, torch-compile-graph", "step, cuda-tuned",
                                   "step, triton-tuned"]
    assert summary.n.tolist() == [1, 3, 3, 4, 4, 4, 4] and summary.within.tolist() == [1, 2, 3, 4, 4, 4, 4]
    squares = summary.loc["square matmuls"]
    assert (squares["median move %"], squares["largest move %"]) == (0.0, 30.0)
    assert squares["median band %"] == round(100 * (1.1 / 1.05 - 1), 1)  # rounds 1.0 and 1.1 about their median
    assert summary.loc["step, cuda-tuned", "median band %"] == pytest.approx(4.4)  # p80 2 µs above 45
    assert summary.loc["step, cuda-tuned", "on record %"] == 8.0 and summary.loc["square matmuls", "on record %"] == 0


def test_a_short_trainer_gemm_is_a_kind_of_its_own():
    assert report.gemm_kind(0.0049) != report.gemm_kind(0.0051)
    assert report.gemm_kind(report.SHORT_GEMM_MS) == report.KINDS["short"]


def test_rerun_judges_a_pair_by_the_pairs_before_it_and_adds_it_to_the_record(results, tmp_path, capsys):
    """The pair's own moves never widen the spreads it is judged by: judged again, it replaces itself."""
    fake_run(results)
    second = tmp_path / "second"
    fake_run(second, twin_ms=(1.3, 4.0))  # 30% off a 10% band
    plant_record(results.parent, {"square matmuls": 0.05})
    assert report.main(["--gpu", "gpu", "--rerun", str(second)]) == 0
    assert "22 of 23 figures" in capsys.readouterr().out
    record = pd.read_csv(results.parent / report.RERUNS, dtype={"commit": str})
    assert len(record) == 1 + 23 and record.within_spread.sum() == 22
    assert report.main(["--gpu", "gpu", "--rerun", str(second)]) == 0
    assert "22 of 23 figures" in capsys.readouterr().out
    assert len(pd.read_csv(results.parent / report.RERUNS)) == 1 + 23


def test_the_spreads_draw_on_every_gpus_pairs_and_a_pair_is_recorded_with_its_own_gpu(results, tmp_path, capsys):
    """Moves measured between two runs on another GPU widen this GPU's spreads: a user's next run is on
    another machine. The pair judged here is written to this GPU's record alone."""
    fake_run(results)
    second = tmp_path / "second"
    fake_run(second, twin_ms=(1.3, 4.0))  # 30% off a 10% band
    plant_record(tmp_path / "other", {"square matmuls": 0.35}, pair=("abc1234", "abc1234"))  # this pair's commits
    assert "| 4096³ fp16 | cuda | tuned | 4.200 (4.000–4.400) | 33 | 0.50 | 6.6e-04 | ±35.0% |" in report.render("gpu")
    assert report.main(["--gpu", "gpu", "--rerun", str(second)]) == 0
    assert "23 of 23 figures" in capsys.readouterr().out
    assert len(pd.read_csv(tmp_path / "other" / report.RERUNS)) == 1
    written = pd.read_csv(results.parent / report.RERUNS)
    assert len(written) == 23 and "gpu" not in written and list(written.columns[:3]) == ["kind", "figure", "median"]
    assert set(report.reruns(tmp_path).gpu) == {"gpu", "other"}


def test_resume_keeps_a_finished_runs_stages_and_refuses_another_commits(tmp_path):
    assert headline.resumable(tmp_path, "abc1234", "store.json") == {}
    pd.DataFrame([dict(stage="compile", seconds=30.0, status="ok", commit="abc1234", config_store="store.json"),
                  dict(stage="kernels", seconds=20.0, status="FAILED: RuntimeError: x", commit="abc1234",
                       config_store="store.json")]).to_csv(tmp_path / "stages.csv", index=False)
    kept = headline.resumable(tmp_path, "abc1234", "store.json")
    assert list(kept) == ["compile"] and kept["compile"]["seconds"] == 30.0  # a failed stage runs again
    with pytest.raises(ValueError, match="holds a run at commit abc1234 on store.json, not def5678 on store.json"):
        headline.resumable(tmp_path, "def5678", "store.json")
    with pytest.raises(ValueError, match="not abc1234 on other.json"):
        headline.resumable(tmp_path, "abc1234", "other.json")


def test_a_stopped_run_resumes_where_it_stopped_and_a_failed_stage_keeps_the_readme(tmp_path, monkeypatch):
    """The run's order on the CPU, every stage a stub: a failing stage is recorded and leaves the folder
    and the README alone; --resume runs again only what did not finish, the training step always (it
    skips the runs its CSVs hold), adds the times, and puts the finished run in place."""
    import kernels_core.contract
    import kernels_core.provenance
    import kernels_core.store
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels_core.store, "local_gpu", lambda: None)  # no GPU to name: no store
    monkeypatch.setattr(kernels_core.provenance, "provenance", lambda: {"commit": "abc1234"})
    monkeypatch.setattr(kernels_core.provenance, "device_slug", lambda: "h200")  # torch here has no CUDA to ask
    monkeypatch.setattr(kernels_core.contract, "device_arch", lambda device: 90)
    monkeypatch.setattr(headline, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(headline, "LOG", tmp_path / "headline.log")
    monkeypatch.setattr(headline, "warm_jobs", lambda *args: [])
    ran, fail = [], {"gemms"}

    def stub(name):
        def stage(*args):
            ran.append(name)
            time.sleep(0.05)
            if name in fail:
                raise RuntimeError(f"{name} broke")
            return 0
        return stage

    for name in ("compile", "kernels", "gemms", "steps", "tuning"):
        monkeypatch.setattr(headline, f"{name}_stage", stub(name))
    reports = []
    monkeypatch.setattr(headline, "report_stage", lambda p, gpu, log: reports.append(p.readme))
    monkeypatch.setattr(headline, "summary", lambda p, done: "")
    folder = tmp_path / "runs" / "headline-quick"
    folder.mkdir(parents=True)
    (folder / "stages.csv").write_text("an earlier run's\n")
    assert headline.main(["--quick"]) == 1
    assert ran == ["compile", "kernels", "gemms", "steps", "tuning"] and reports == []
    assert (folder / "stages.csv").read_text() == "an earlier run's\n"  # left as it was
    stages = pd.read_csv(folder.with_name("headline-quick.partial") / "stages.csv")
    assert stages.status.tolist() == ["ok", "ok", "FAILED: RuntimeError: gemms broke", "ok", "ok"]
    ran.clear()
    fail.clear()
    assert headline.main(["--quick", "--resume"]) == 0
    assert ran == ["gemms", "steps"] and reports == [False]
    assert not folder.with_name("headline-quick.partial").exists()
    again = pd.read_csv(folder / "stages.csv")
    assert again.status.tolist() == ["ok"] * 5 and again.stage.tolist() == stages.stage.tolist()
    before, after = stages.set_index("stage").seconds, again.set_index("stage").seconds
    assert after["steps"] >= before["steps"] + 0.05  # the steps' two runs add up (each sleeps 0.05 s)
    assert after["kernels"] == before["kernels"]  # kept as recorded
    ran.clear()
    assert headline.main(["--quick", "--resume"]) == 0 and ran == ["steps"]  # a finished run: nothing new to measure
    ran.clear()
    assert headline.main(["--quick"]) == 0 and ran == ["compile", "kernels", "gemms", "steps", "tuning"]  # afresh


def _fake_round(cases, copy_elements, out, log_path):
    """A round as bench_kernels.measure writes it (rep 0, every case once), naming the process it ran in."""
    import os

    rows = [dict(group="ceiling", op="copy", gbps=copy_elements, rep="")]
    rows += [dict(group="gemm", op=case, time_ms=os.getpid(), rep=0) for case in cases]
    pd.DataFrame(rows).to_csv(out, index=False)


def test_each_round_of_the_kernel_stages_runs_in_a_process_of_its_own(tmp_path, monkeypatch):
    """What moves between processes must show in a figure's range, so no two rounds share one."""
    monkeypatch.setattr(headline, "LOG", tmp_path / "headline.log")
    out = tmp_path / "kernels.csv"
    logged = []
    headline._bench(["a", "b"], 7, out, 3, "kernels", logged.append, measure_round=_fake_round)
    df = pd.read_csv(out, dtype={"rep": str})
    assert df.groupby("rep").op.apply(list).to_dict() == {r: ["copy", "a", "b"] for r in "012"}
    pids = df[df.group == "gemm"].groupby("rep").time_ms.unique()
    assert all(len(p) == 1 for p in pids) and len({p[0] for p in pids}) == 3
    assert (df.gbps[df.group == "ceiling"] == 7).all() and sorted(p.name for p in tmp_path.iterdir()) == [
        "kernels.csv"]  # the rounds' own files are gone
    assert logged == [f"kernels: round {r} of 3 done" for r in (1, 2, 3)]
