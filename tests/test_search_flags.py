"""`python -m autotune.search`'s flags and endings, in this process: every refusal is one line on
stderr, `autotune: error: ...`, with exit code 2 for a bad flag, 1 for a run that cannot go on,
130 for Ctrl-C. A search here runs on the fake backend with the worker pool replaced by a function
(no subprocess), so each test takes a second or less.
"""
from __future__ import annotations

import builtins
import io
import os
import random
import runpy
import select
import sys
from pathlib import Path

import pytest

from autotune import compile_sweep, console, search
from autotune.evaluate import Evaluator
from autotune.plan import build_plan
from autotune.storage import shown_url
from tests.test_tuner_inputs import fake_registered, one_error_line, rand  # noqa: F401 - fixtures

ERROR = f"{console.PREFIX}: error: "
FAKE_MATMUL = ("--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--sampler", "random")
pytestmark = [pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning"),
              pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")]


def refused(capsys, argv: list[str], *words: str) -> str:
    with pytest.raises(SystemExit) as info:
        search.parse_args(argv)
    assert info.value.code == 2
    return one_error_line(capsys, *words)


def pool(monkeypatch, answer) -> None:
    """Every evaluation answered by `answer(call, backend, config)`, in this process (so no worker
    process is started ahead either)."""
    monkeypatch.setattr(Evaluator, "evaluate",
                        lambda self, index, call, backend, config, seed: answer(call, backend, config))
    monkeypatch.setattr(Evaluator, "start", lambda self: None)


FAKE_DEFAULT = {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT": 1}  # the fake matmul's default config


def timed(rand: random.Random):
    """Random times, the default config's the slowest: a study's best beats it, so the entry a finished
    study writes is its winner (where the default config wins, the entry is the default config)."""
    return lambda call, backend, config: {"status": "ok", "time_ms": (2.0 if config == FAKE_DEFAULT else 0.5)
                                          + rand.random(), "gpu": None}


def run(tmp_path: Path, *args: str) -> int:
    return search.main(["--out", str(tmp_path / "out"), "--storage", f"sqlite:///{tmp_path / 'tuning.db'}", *args])


# -- every numeric flag at its extremes --------------------------------------------------

EXTREMES = ("0", "-0", "1e-320", "1e39", "1e308", "inf", "nan", str(2**64), "abc")
# The extremes each flag takes, and what they parse to; it refuses the others in one line.
ACCEPTED = {
    "--timeout": {},
    "--momentum": {"0": 0.0, "-0": 0.0, "1e-320": float("1e-320")},  # 0: the seed protocol's, without buffers
    "--seed": {"0": 0, "-0": 0},
    "--trials": {},
    "--workers": {"0": 0, "-0": 0},  # no compile pool: the timing process compiles
    "--layers": {},
    "--batch-size": {},
    "--hidden": {},
    "--max-failures-in-a-row": {str(2**64): 2**64},  # never set a worker aside
}
# Each flag's allowed range, ends included.
BOUNDS = {
    "--timeout": ("1", "1e9", "0.999", "1000000000.5"),
    "--momentum": ("0", "0.999", "-0.001", "1"),
    "--seed": ("0", str(2**32 - 1), "-1", str(2**32)),
    "--trials": ("1", "1000000", "0", "1000001"),
    "--workers": ("0", "256", "-1", "257"),
    "--layers": ("1", "1024", "0", "1025"),
    "--batch-size": ("1", str(2**31 - 1), "0", str(2**31)),
    "--hidden": ("1", str(2**31 - 1), "0", str(2**31)),
    "--max-failures-in-a-row": ("1", str(2**80), "0", "-3"),
}


def test_the_tables_hold_every_numeric_flag():
    numeric = {a.option_strings[0] for a in search.parser()._actions if a.type not in (None, str, Path)}
    assert set(ACCEPTED) == set(BOUNDS) == numeric


def dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def parsed(flag: str, text: str):
    value = getattr(search.parse_args([flag, text]), dest(flag))
    return value[0] if flag == "--hidden" else value


@pytest.mark.parametrize("flag", ACCEPTED)
@pytest.mark.parametrize("text", EXTREMES)
def test_every_numeric_flag_takes_an_extreme_or_refuses_it_in_one_line(flag, text, capsys):
    want = ACCEPTED[flag].get(text)
    if want is None:
        refused(capsys, [flag, text], f"argument {flag}: {text!r}")
        return
    assert parsed(flag, text) == want and not capsys.readouterr().err
    args = search.parse_args([flag, text, *FAKE_MATMUL[:-2]])
    assert build_plan(args).jobs  # and the plan is built on it


@pytest.mark.parametrize("flag", BOUNDS)
def test_each_numeric_flags_range_ends_where_its_message_says(flag, capsys):
    low, high, below, above = BOUNDS[flag]
    assert parsed(flag, low) == pytest.approx(float(low)) and parsed(flag, high) == pytest.approx(float(high))
    for text in (below, above):
        refused(capsys, [flag, text], f"argument {flag}: {text!r} is not")


def test_a_timeout_the_waiting_cannot_take_is_refused_and_the_longest_allowed_it_takes(capsys):
    """A worker's answer is waited for with select(), which raised OverflowError at 1e300 s."""
    refused(capsys, ["--timeout", "1e300"], "--timeout", "'1e300' is not a number of seconds from 1 to 1e+09")
    longest = search.parse_args(["--timeout", "1e9"]).timeout
    ready, out = os.pipe()
    try:
        os.write(out, b"\n")
        assert select.select([ready], [], [], longest)[0] == [ready]
    finally:
        os.close(ready)
        os.close(out)


# -- flags that do not go together ---------------------------------------------------------

@pytest.mark.parametrize("flags", [["--hidden", "64"], ["--layers", "3"], ["--batch-size", "40"],
                                   ["--workload", "mnist-mlp"], ["--hidden", "96,160", "--layers", "5"]])
def test_the_workloads_flags_are_refused_beside_shapes_which_replace_them(flags, capsys):
    err = refused(capsys, ["--shapes", "7x9,33x5x12:tn", *flags], "--shapes", "drop")
    assert all(f in err for f in flags if f.startswith("--"))
    args = search.parse_args(["--shapes", "7x9", "--momentum", "0"])  # the SGD ops' momentum holds for shapes too
    assert args.momentum == 0 and search.parse_args(flags).shapes is None


def test_compile_only_for_the_cpu_target_is_refused_as_the_help_says(capsys):
    target_help = next(a.help for a in search.parser()._actions if "--target" in a.option_strings)
    assert "the CUDA twin is skipped" in target_help and "nothing to --compile-only" in target_help
    refused(capsys, ["--compile-only", "--target", "cpu"], "--compile-only --target cpu", "--target sm_90")
    plan = build_plan(search.parse_args(["--target", "cpu", "--backends", "cuda,fake", "--ops", "relu", "--dtypes",
                                         "fp32", "--shapes", "8x8"]))
    assert "cuda" not in plan.modules and any(line.startswith("cuda:") for line in plan.skipped)
    assert search.parse_args(["--compile-only", "--target", "sm_90"]).compile_only


def test_compile_only_with_no_compile_process_is_refused(capsys):
    refused(capsys, ["--compile-only", "--target", "sm_90", "--workers", "0"], "--workers 0", "no process would compile")
    assert search.parse_args(["--compile-only", "--target", "sm_90", "--workers", "1"]).workers == 1


@pytest.mark.parametrize("url", ["sqlite:///", "sqlite://", "sqlite:///:memory:"])
def test_a_storage_of_no_file_is_refused_with_what_to_pass(url, capsys, tmp_path, monkeypatch):
    refused(capsys, ["--storage", url], f"--storage {url}:", "memory", "sqlite:///PATH/tuning.db")
    monkeypatch.chdir(tmp_path)  # a file named from here, which the compile processes (elsewhere) must find
    assert search.parse_args(["--storage", "sqlite:///runs/tuning.db"]).storage == f"sqlite:///{tmp_path}/runs/tuning.db"


# -- the storage URL is shown without its password -----------------------------------------

@pytest.mark.parametrize("url, shown", [
    ("postgresql+psycopg://tuner:s3cret@dbhost:notaport/tuning",
     "postgresql+psycopg://tuner:***@dbhost:notaport/tuning"),
    ("mysql://tuner:p@ss:w0rd/x@dbhost:9x/db", "mysql://tuner:***@dbhost:9x/db"),
    ("tuner:s3cret@dbhost/tuning", "tuner:***@dbhost/tuning"),
    ("postgresql://tuner:s3cret@dbhost/tuning", "postgresql://tuner:***@dbhost/tuning"),
    ("notaurl", "notaurl"),
])
def test_a_storage_url_is_shown_without_its_password_parseable_or_not(url, shown):
    assert shown_url(url) == shown


def test_an_unparseable_storage_url_is_refused_without_its_password(tmp_path, capsys):
    url = "postgresql+psycopg://tuner:s3cret@127.0.0.1:notaport/tuning"
    assert search.main(["--out", str(tmp_path), "--storage", url, *FAKE_MATMUL, "--shapes", "8x8x8"]) == 2
    err = one_error_line(capsys, "--storage", "tuner:***@127.0.0.1")
    assert "s3cret" not in err


# -- one prefix --------------------------------------------------------------------------

def test_a_bad_flag_and_a_run_that_is_refused_share_one_prefix(tmp_path, capsys):
    refused(capsys, ["--trials", "0"], "--trials")
    refused(capsys, ["--no-such-flag"], "--no-such-flag", "--help")
    (tmp_path / "afile").write_text("")
    assert search.main(["--out", str(tmp_path / "afile"), *FAKE_MATMUL, "--shapes", "8x8x8"]) == 2
    one_error_line(capsys, "--out")
    console.error("first\n\n  second  \n")
    assert capsys.readouterr().err == f"{ERROR}first | second\n"


# -- endings -----------------------------------------------------------------------------

def failing(*statuses: str):
    cycle = iter(statuses * 100)
    return lambda call, backend, config: {"ok": False, "status": next(cycle), "error": "fake", "gpu": None}


@pytest.mark.parametrize("statuses, words", [
    (("timeout",), ["every one of the 3 trials of this run timed out", "--timeout 1 s", "larger --timeout"]),
    (("timeout", "compile_error"), ["none of the 3 trials of this run ran correctly", "compile_error:1, timeout:2",
                                    "trials.csv"]),
])
def test_a_search_that_timed_nothing_exits_1(tmp_path, capsys, monkeypatch, statuses, words):
    pool(monkeypatch, failing(*statuses))
    assert run(tmp_path, *FAKE_MATMUL, "--shapes", "8x16x8", "--trials", "3", "--timeout", "1") == 1
    one_error_line(capsys, *words)
    assert not (tmp_path / "out" / "cpu" / "best.json").exists()


def test_one_config_timed_is_a_search_that_succeeded(tmp_path, capsys, monkeypatch, rand):
    answers = [failing("timeout"), timed(rand)]
    pool(monkeypatch, lambda call, backend, config: answers[config == FAKE_DEFAULT](
        call, backend, config))
    assert run(tmp_path, *FAKE_MATMUL, "--shapes", "8x16x8", "--sampler", "grid", "--trials", "30",
               "--max-failures-in-a-row", "100") == 0
    assert not capsys.readouterr().err and (tmp_path / "out" / "cpu" / "best.json").exists()


def test_a_search_with_no_worker_left_exits_1(tmp_path, capsys, monkeypatch):
    pool(monkeypatch, failing("launch_error"))
    assert run(tmp_path, *FAKE_MATMUL, "--shapes", "8x16x8", "--max-failures-in-a-row", "2") == 1
    err = capsys.readouterr().err
    assert "it gets no more trials" in err and err.splitlines()[-1].startswith(f"{ERROR}no worker left")


@pytest.mark.parametrize("at", [0, 1])
def test_the_summary_after_ctrl_c_says_what_was_done_and_names_only_files_there(tmp_path, capsys, monkeypatch,
                                                                                rand, at):
    shapes = ["16x8x24", "8x40x16"]
    ok = timed(rand)

    def answer(call, backend, config):
        if call.key.startswith(shapes[at]):
            raise KeyboardInterrupt
        return ok(call, backend, config)

    pool(monkeypatch, answer)
    assert run(tmp_path, *FAKE_MATMUL, "--shapes", ",".join(shapes), "--trials", "4") == 130
    out = capsys.readouterr().out
    assert f"{at} of 2 studies finished" in out and f"This run: {4 * at} trials measured" in out, out
    named = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith(("trials:", "best:"))]
    best = tmp_path / "out" / "cpu" / "best.json"
    assert best.exists() == bool(at) and (str(best) in named) == bool(at), out
    assert all(Path(p).exists() for p in named if p.startswith("/")), named


# runpy runs the module's code afresh beside the copy this test file imported, and says so.
@pytest.mark.filterwarnings("ignore:'autotune.search' found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("module", ["sqlalchemy.exc", "autotune.plan", "kernels_core.contract"])
def test_ctrl_c_while_the_tuner_loads_ends_in_one_line_and_130(monkeypatch, capsys, module):
    """As `python -m autotune.search` runs it, with the import of `module` (the first, one in the
    middle, the last) cut by a Ctrl-C."""
    real = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == module:
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    try:
        runpy.run_module("autotune.search", run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped: python prints its traceback")
    assert code == 130 and capsys.readouterr().err == "autotune: interrupted\n"
    with pytest.raises(KeyboardInterrupt):  # a program importing the tuner reports its own Ctrl-C
        runpy.run_module("autotune.search", run_name="autotune.search_imported")


# -- progress bars only on a terminal ----------------------------------------------------------

class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_search_draws_no_bar_into_a_log_and_counts_its_trials_all_the_same(tmp_path, capsys, monkeypatch, rand):
    pool(monkeypatch, timed(rand))
    assert run(tmp_path, *FAKE_MATMUL, "--shapes", "8x16x8", "--trials", "3") == 0
    out, err = capsys.readouterr()
    assert not err and "This run: 3 trials measured" in out


def test_the_cpu_targets_summary_compares_no_interpreted_kernel_with_native_torch(tmp_path, capsys, monkeypatch,
                                                                                   rand):
    pool(monkeypatch, timed(rand))
    assert run(tmp_path, *FAKE_MATMUL, "--shapes", "8x16x8", "--trials", "2") == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "best config" in line)
    assert "vs default" in header and "vs torch" not in header
    assert "no 'vs torch' on the cpu target" in out


def test_compile_only_draws_no_bar_into_a_log(tmp_path, capsys, monkeypatch):
    class Compiler:
        def __init__(self, name, env, log_path):
            pass

        def request(self, message, timeout):
            return {"ok": True, "reports": [{"status": "ok", "registers": 40, "smem_bytes": 0, "spill_bytes": 0,
                                             "compile_s": 0.1} for _ in message["configs"]]}

        def close(self):
            pass

    monkeypatch.setattr(compile_sweep, "WorkerProcess", Compiler)
    assert search.main(["--out", str(tmp_path), "--target", "sm_75", "--compile-only", "--backends", "fake",
                        "--ops", "relu", "--dtypes", "fp32", "--workers", "1"]) == 0
    out, err = capsys.readouterr()
    assert not err and "compiled ok" in out


def test_a_bar_is_drawn_on_a_terminal_only(monkeypatch):
    for stream, drawn in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        bar = console.bar(total=3, unit="trial")
        bar.update(2)
        bar.close()
        assert ("\r" in stream.getvalue() and "2/3" in stream.getvalue()) == drawn, stream.getvalue()


def test_the_gpu_times_its_next_config_while_a_study_is_told_the_last(tmp_path, monkeypatch, rand):
    """A tell is a few storage round trips: the timing process goes on meanwhile with a config
    compiled ahead (Search._tell_loop), and every outcome is still told, each study's budget exactly."""
    import time

    from autotune.evaluate import CompilePool
    from autotune.studies import StudyRunner

    ok, spans = timed(rand), {"timing": [], "tell": []}

    def answer(call, backend, config):
        start = time.monotonic()
        time.sleep(0.02)
        spans["timing"].append((start, time.monotonic()))
        return ok(call, backend, config)

    finish = StudyRunner._finish

    def slow_tell(self, trial, config, result):  # under the storage's lock, as its round trips are
        start = time.monotonic()
        time.sleep(0.1)
        row = finish(self, trial, config, result)
        if result["status"] != "invalid":
            spans["tell"].append((start, time.monotonic()))
        return row

    pool(monkeypatch, answer)
    monkeypatch.setattr(CompilePool, "start", lambda self: None)
    monkeypatch.setattr(CompilePool, "build", lambda self, index, call, backend, config, seed: {"ok": True})
    monkeypatch.setattr(StudyRunner, "_finish", slow_tell)
    assert run(tmp_path, *FAKE_MATMUL, "--shapes", "16x8x24,8x40x16", "--trials", "5", "--workers", "2") == 0
    assert len(spans["tell"]) == 10
    # Of 14 timings (10 trials, 4 baselines), 8 to 10 overlapped a tell on 2 busy cores; none do told in line.
    assert sum(any(t0 < e and s < t1 for t0, t1 in spans["tell"]) for s, e in spans["timing"]) >= 5


@pytest.mark.parametrize("store_fails", [False, True])
def test_a_study_told_in_full_as_the_gpu_is_lost_is_judged_and_the_loss_stays_the_error(tmp_path, monkeypatch,
                                                                                         capsys, store_fails):
    """The third and last trial loses the GPU: the search stops (no worker left), its study has its
    budget told, and is judged in that run; if that judging fails, the lost GPU is still what the
    run ends with."""
    from autotune import tuning

    timed_trials = []

    def answer(call, backend, config):
        if backend == "torch" or config == FAKE_DEFAULT:
            return {"status": "ok", "time_ms": 2.0, "gpu": None}
        timed_trials.append(config)
        if len(timed_trials) == 3:
            return {"ok": False, "status": "launch_error", "error": "gpu gone", "gpu": "0"}
        return {"status": "ok", "time_ms": 0.5 + len(timed_trials) / 10, "gpu": None}

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device", "best.json")

    pool(monkeypatch, answer)
    if store_fails:
        monkeypatch.setattr(tuning, "merge_into_store", no_space)
    assert run(tmp_path, *FAKE_MATMUL, "--shapes", "16x8x24", "--trials", "3", "--workers", "0",
               "--max-failures-in-a-row", "1") == 1
    err = capsys.readouterr().err
    assert "no worker left to run trials" in err and "gpu gone" in err
    assert (tmp_path / "out" / "cpu" / "best.json").exists() != store_fails
    assert ("could not be judged" in err) == store_fails
