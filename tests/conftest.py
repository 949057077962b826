"""Shared test setup: the `gpu` marker, the interpreter switch, fresh seeds.

Without a CUDA device the Triton kernels run in Triton's interpreter on CPU
tensors; TRITON_INTERPRET must be set before anything imports triton, so it
is set here, at collection time.

Every test gets fresh random inputs: a base seed is drawn per session (or
taken from KERNEL_TEST_SEED to replay a failure) and mixed with the test's
node id. The base seed is printed in the header and with every failure.
"""
import os
import random
import signal
import sys
import zlib

import pytest
import torch

# The packages live at the repository root; plain `pytest` does not put it on sys.path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.postgres import postgres_server, storage_url  # noqa: E402,F401 - fixtures: a storage of each kind

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

BASE_SEED = int(os.environ.get("KERNEL_TEST_SEED", random.randrange(2**31)))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


def pytest_report_header(config):
    return f"KERNEL_TEST_SEED={BASE_SEED} (set it to replay these inputs); device: {'cuda' if HAS_CUDA else 'cpu'}"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and hasattr(item, "test_seed"):
        report.sections.append(("seed", f"KERNEL_TEST_SEED={BASE_SEED} (this test's seed: {item.test_seed})"))


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def rng(request) -> torch.Generator:
    """A CPU generator seeded from the session's base seed and the test's id."""
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
