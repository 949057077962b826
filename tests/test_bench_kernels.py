"""bench_kernels' trainer group: the GEMMs both protocols of the trainer run, with tuned configs
where the store has the exact shape (CPU: the cases are data; timing them needs the H200)."""
from kernels_core.store import ConfigStore
from kernels_core.mlp import PROTOCOLS, mlp_calls
from experiments import bench_kernels, paths


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
    cases = {(c.dtype, c.shape, c.layout): c for c in bench_kernels.trainer_cases(store)}
    exact = cases[("fp32", (128, 1024, 784), "nn")]
    assert exact.configs["triton"] == [("default", None), ("tuned", tuned)]
    assert exact.configs["cuda"] == [("default", None)]
    near = cases[("fp32", (128, 1024, 1024), "nn")]  # the store's lookup would offer a nearest shape: not timed
    assert near.configs["triton"] == [("default", None)]


def test_report_states_each_twins_median_speed_against_cublas_of_the_same_run(tmp_path, monkeypatch):
    """The README's trainer-GEMM table: cuBLAS time / twin time per shape, medians per twin and config,
    and apart the shapes where one program per tile leaves the GPU idle (K >= 784, M*N <= 131072)."""
    import pandas as pd

    from experiments import report

    prov = dict(device="GPU", utc="2026-12-01T00:00:00Z", torch="t", triton="tr", cupy="c", cuda="13", commit="abc")
    rows = []
    for shape, cublas, cuda, triton in [("128x1024x784:nn", 24.0, 12.0, 8.0), ("128x10x128:nn", 5.0, 10.0, 5.0),
                                        ("1024x1024x128:tn", 10.0, 5.0, 20.0)]:
        rows.append(dict(group="trainer", backend="torch", dtype="fp32", shape=shape, config_label="cuBLAS/aten",
                         status="ok", graph_ms=cublas / 1e3, **prov))
        for backend, us in (("cuda", cuda), ("triton", triton)):
            rows.append(dict(group="trainer", backend=backend, dtype="fp32", shape=shape, config_label="tuned",
                             status="ok", graph_ms=us / 1e3, **prov))
    # --repeat 3: every case three times, the middle time the median (two more reps at 0.5x and 3x)
    reps = [dict(r, rep=0) for r in rows] + [dict(r, rep=1, graph_ms=r["graph_ms"] * 0.5) for r in rows] + \
        [dict(r, rep=2, graph_ms=r["graph_ms"] * 3) for r in rows]
    (tmp_path / "gpu").mkdir()
    pd.DataFrame(reps).to_csv(tmp_path / "gpu" / "trainer_gemms.csv", index=False)
    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    text = "\n".join(report.gemms_section("gpu"))
    assert "| fp32 | cuda | tuned | 3 | 2.00× | 2.00× (1) |" in text  # speedups 2, 0.5, 2
    assert "| fp32 | triton | tuned | 3 | 1.00× | 3.00× (1) |" in text  # speedups 3, 1, 0.5
    assert "| fp32 | 128x1024x784:nn | 24.0 | 12.0 (2.00×) | 8.0 (3.00×) |" in text


def test_the_4096_table_gives_one_row_per_dtype_and_backend_of_a_repeat_run():
    """bench_kernels --repeat N times every case N times; the README's table shows each dtype and
    backend once, at the median of its rounds."""
    import pandas as pd
    from experiments import report

    rows = [dict(group="gemm", dtype=dt, backend=b, time_ms=t, tflops=137.4 / t, vs_torch=v)
            for dt in ("fp32", "fp16") for b, base in (("cuda", 1.0), ("torch", 0.8))
            for t, v in ((base, 0.8), (base * 1.1, 0.7), (base * 3, 0.1))]
    table = report._gemm_table(pd.DataFrame(rows))
    assert list(zip(table.dtype, table.backend)) == [("fp32", "cuda"), ("fp32", "torch"), ("fp16", "cuda"),
                                                     ("fp16", "torch")]
    assert table["ms"].tolist() == ["1.100", "0.880"] * 2 and table["vs cuBLAS"].tolist() == ["0.70"] * 4
