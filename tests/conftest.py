"""Shared pytest set-up: the interpreter switch, the device/dtype fixtures, the gpu marker,
and the ``--impl`` option that points graded tests at ``exercises/`` or ``solutions/``."""
from __future__ import annotations

import os

import pytest
import torch

from minillm.testing import default_device, fresh_seed, kernel_dtypes

# Under pytest-xdist (`make test`: one worker per core) each worker computes on one thread:
# torch's default pool (one thread per core in every worker) oversubscribes the cores, and
# the small ops of these tests then spend their time waiting on each other.
# Subprocesses (the grader, notebook kernels) inherit the setting through the environment.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--impl", default="both", choices=["both", "exercises", "solutions"],
        help="which implementation graded tests run on. 'both' (the default, used by `make test`) "
             "requires every graded test to pass on solutions and to fail with NotImplementedError "
             "on the untouched exercise stubs; the grader passes one of the other two.",
    )


def pytest_collection_modifyitems(config, items):
    # Longest first: the slow tests (each notebook runs for minutes, the docs build, the
    # grader) start before the many short ones, so that under pytest-xdist (`make test`)
    # the short tests fill the other workers meanwhile instead of one worker finishing
    # alone with a notebook at the end. The sort is stable: files keep their order.
    items.sort(key=lambda item: 0 if "slow" in item.keywords else 1 if "test_grader" in item.nodeid else 2)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_generate_tests(metafunc):
    # Kernel tests take a `dtype` argument: fp32 and fp16 on CPU (the interpreter has no
    # bf16), plus bf16 on a GPU.
    if "dtype" in metafunc.fixturenames and not _is_parametrized(metafunc, "dtype"):
        metafunc.parametrize("dtype", kernel_dtypes(), ids=lambda d: str(d).removeprefix("torch."))


def _is_parametrized(metafunc, name: str) -> bool:
    return any(name in m.args[0] for m in metafunc.definition.iter_markers("parametrize"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's tests with one torch thread: on tiny models threads only add
    synchronisation (each SDPA call took ~100x longer with 2 threads on a shared 2-core CI box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def device() -> torch.device:
    return default_device()


@pytest.fixture
def seed() -> int:
    return fresh_seed()


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
