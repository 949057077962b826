"""Shared test setup: the `gpu` marker, the interpreter switch, fresh seeds.

Without a CUDA device the Triton kernels run in Triton's interpreter on CPU
tensors; TRITON_INTERPRET must be set before anything imports triton, so it
is set here, at collection time.

Every test gets fresh random inputs: a base seed is drawn per test run (or
taken from KERNEL_TEST_SEED to replay a failure) and mixed with the test's
node id. The base seed is printed in the header and with every failure.

Two tiers. `--fast` (`make test`) leaves out the tests marked `slow` and runs a seeded sample of
each `matrix`-marked test's cases (MATRIX_SAMPLE of them; the seed picks which, so runs cover the
matrix between them); it fails the run when a test it keeps takes more than FAST_CPU_S seconds of
CPU (its own process's and its children's: compilers, tuner workers), which the machine's load
does not inflate as it does wall time. Without `--fast` (`make test-full`, CI) everything runs.
"""
import os
import random
import resource
import signal
import sys
import zlib

import pytest
import torch

# The packages live at the repository root; plain `pytest` does not put it on sys.path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.postgres import postgres_server, storage_url  # noqa: E402,F401 - fixtures: a storage of each kind

HAS_CUDA = torch.cuda.is_available()
# pytest-xdist's workers share the cores: each keeps its share of torch's CPU threads. Left at one
# per core each, they oversubscribe the machine, and OpenMP's spinning threads burn CPU seconds
# (the fast tier's budget) waiting for the cores the other workers hold.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Put in the environment, so that pytest-xdist's workers, started after this, draw the same inputs
# and sample the same tiers as the header says.
BASE_SEED = int(os.environ.setdefault("KERNEL_TEST_SEED", str(random.randrange(2**31))))


FAST_CPU_S = 8.0
MATRIX_SAMPLE = 3


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast tier: no `slow` tests, a sample of each `matrix` test's cases, and a "
                          f"failure for a kept test that takes more than {FAST_CPU_S:g} CPU seconds")


def pytest_configure(config):
    global _config
    _config = config  # for pytest_runtest_logreport, which is given the report alone
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.fast_over = []  # (nodeid, CPU seconds) of fast-tier tests over FAST_CPU_S


def pytest_report_header(config):
    return f"KERNEL_TEST_SEED={BASE_SEED} (set it to replay these inputs); device: {'cuda' if HAS_CUDA else 'cpu'}"


def pytest_collection_modifyitems(config, items):
    if config.getoption("--fast"):
        _keep_the_fast_tier(config, items)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _keep_the_fast_tier(config, items):
    cases = {}
    for item in items:
        if "matrix" in item.keywords:
            cases.setdefault(item.module.__name__ + "::" + item.originalname, []).append(item)
    sampled = set()
    for name, group in cases.items():
        sampled.update(random.Random(BASE_SEED ^ zlib.crc32(name.encode())).sample(group, min(MATRIX_SAMPLE, len(group))))
    kept = [i for i in items if "slow" not in i.keywords and ("matrix" not in i.keywords or i in sampled)]
    chosen = set(kept)
    left = [i for i in items if i not in chosen]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.cpu_start = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and hasattr(item, "test_seed"):
        report.sections.append(("seed", f"KERNEL_TEST_SEED={BASE_SEED} (this test's seed: {item.test_seed})"))
    if call.when == "teardown" and hasattr(item, "cpu_start"):
        report.user_properties.append(("cpu_s", _cpu_seconds() - item.cpu_start))


def pytest_runtest_logreport(report):
    """Runs where the reports arrive: in pytest-xdist's controller too, whose tests run elsewhere."""
    cpu = dict(report.user_properties).get("cpu_s")
    if cpu is not None and _config.getoption("--fast") and cpu > FAST_CPU_S:
        _config.fast_over.append((report.nodeid, cpu))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.fast_over:
        terminalreporter.section(f"fast-tier tests over {FAST_CPU_S:g} CPU seconds: mark them slow or make them cheaper")
        for nodeid, cpu in sorted(config.fast_over, key=lambda t: -t[1]):
            terminalreporter.line(f"{cpu:7.1f} s  {nodeid}")


def pytest_sessionfinish(session, exitstatus):
    if session.config.fast_over and exitstatus == 0 and not hasattr(session.config, "workerinput"):
        session.exitstatus = 1


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def rng(request) -> torch.Generator:
    """A CPU generator seeded from the test run's base seed and the test's id."""
    seed = (BASE_SEED ^ zlib.crc32(request.node.nodeid.encode())) % 2**63
    request.node.test_seed = seed
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=["triton", pytest.param("cuda", marks=pytest.mark.gpu)])
def ops(request):
    """The twin under test, imported only when its test runs."""
    if request.param == "triton":
        import kernels_triton as module
    else:
        import kernels_cuda as module
    return module


@pytest.fixture
def interruptible():
    """preexec_fn for a child a test interrupts with SIGINT: the disposition a terminal gives it.
    A harness that runs the suite as a background job hands its children SIGINT ignored (bash does
    so for `cmd &` without job control), and Python then never raises KeyboardInterrupt."""
    return lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
