"""experiments.code_ab: the same configs timed on this checkout and on an older tree, in turn."""
from types import SimpleNamespace

import pandas as pd

from experiments import code_ab


def test_worker_one_imports_the_old_tree(tmp_path):
    """Worker 1 imports the old tree's packages even though it starts in this checkout (whose
    directory would come first on sys.path without PYTHONSAFEPATH); worker 0 imports this one's."""
    old = tmp_path / "old"
    (old / "kernels_cuda").mkdir(parents=True)
    (old / "kernels_cuda" / "__init__.py").write_text('raise ImportError("this is the old tree")\n')
    pool = code_ab.code_pool("cpu", old, tmp_path / "logs")
    ask = {"cmd": "compile", "backend": "cuda", "op": "relu", "dtype": "fp32", "configs": [], "arch": 90}
    try:
        new, older = (pool.workers[i][0].request(ask, 120.0) for i in range(2))
    finally:
        pool.close()
    assert new == {"ok": True, "reports": []}
    assert not older["ok"] and "this is the old tree" in older["error"]


def test_an_old_tree_that_ignores_the_calls_momentum_is_told_apart(tmp_path):
    """Trees from before the tuner's --momentum build SGD inputs with buffers whatever the call
    says: the seed protocol's A/B then times both codes with buffers."""
    from pathlib import Path

    assert code_ab.takes_momentum(Path(code_ab.__file__).resolve().parent.parent)
    old = tmp_path / "old" / "autotune"
    assert not code_ab.takes_momentum(old.parent)
    old.mkdir(parents=True)
    (old / "worker.py").write_text('call = Call(req["op"], req["dtype"], tuple(req["shape"]))\n')
    assert not code_ab.takes_momentum(old.parent)


def test_old_commit_from_the_stamp_or_the_folder(tmp_path):
    tree = tmp_path / "303047b"
    tree.mkdir()
    assert code_ab.old_commit(tree) == "303047b"
    (tree / "SOURCE_COMMIT").write_text("abc1234\n")
    assert code_ab.old_commit(tree) == "abc1234"


def test_a_run_adds_its_rows_and_leaves_the_files_rows_as_they_were(tmp_path, monkeypatch):
    """A column added since (momentum) is empty in the file's rows; their text is unchanged."""
    old = ["utc,commit,op,median_ms", '2026-12-01T19:37:47Z,12e4567,matmul,0.0049824']
    (tmp_path / "code_ab_x.csv").write_text("\n".join(old) + "\n")
    rows = pd.DataFrame([{"utc": "2026-12-02T08:00:00Z", "commit": "abc", "op": "linear_sgd",
                          "median_ms": 0.00123456789, "momentum": 0.0, "backend": "cuda", "shape": "s",
                          "code": code} for code in ("new", "old")])
    monkeypatch.setattr(code_ab, "measure", lambda args: rows)
    monkeypatch.setattr(code_ab, "parse_args", lambda argv=None: SimpleNamespace(label="x", results=tmp_path))
    assert code_ab.main([]) == 0
    lines = (tmp_path / "code_ab_x.csv").read_text().splitlines()
    assert lines[0] == "utc,commit,op,median_ms,momentum,backend,shape,code"
    assert lines[1] == old[1] + ",,,,"  # a commit that reads as a number stays text
    assert lines[2] == "2026-12-02T08:00:00Z,abc,linear_sgd,0.00123457,0,cuda,s,new" and len(lines) == 4


def test_summary_sums_the_step_and_takes_the_median_ratio():
    rows = pd.DataFrame([
        {"backend": "cuda", "op": op, "shape": shape, "code": code, "median_ms": ms}
        for op, shape, old_ms, new_ms in [("matmul", "32x128x784:nn", 0.004, 0.002),
                                          ("linear_sgd", "784x128x32:tn", 0.006, 0.004),
                                          ("linear_cross_entropy", "32x10x128:nn", 0.003, 0.003)]
        for code, ms in (("old", old_ms), ("new", new_ms))])
    (line,) = code_ab.summary(rows)
    assert line == "cuda: the step's 3 distinct calls, once each, 13.0 us (old) -> 9.0 us (new), +4.0 us; per call old / new: median 1.50x"
