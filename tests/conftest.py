"""Shared fixtures."""

import os

# The suite runs offline as `python -m pytest -q`, with nothing to export first: Flower never installs the
# app's dependencies at run time or checks for updates, and Hugging Face never reaches for its hub.
for _name in ("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "FLWR_DISABLE_UPDATE_CHECK", "HF_HUB_OFFLINE"):
    os.environ.setdefault(_name, "1")

import pytest  # noqa: E402 (after the environment above, which imports read)
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402


def pytest_configure(config):
    """Under pytest-xdist (pyproject's `-n 2`) each worker is one of two processes sharing the machine's
    cores: one torch thread each (two threads per op on each contend badly on 2 cores), and the processes
    a test starts (Ray actors, Flower's) inherit one OpenMP thread."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def _env_folder(name: str, folder):
    """Point the environment variable `name` at `folder` for the fixture's life, then restore it."""
    old = os.environ.get(name)
    os.environ[name] = str(folder)
    yield os.environ[name]
    if old is None:
        os.environ.pop(name)
    else:
        os.environ[name] = old


@pytest.fixture(scope="module")
def one_thread():
    """torch at one thread for a module: on a shared 2-core machine two OpenMP threads per op contend badly
    (10-50x slower backward)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True, scope="session")
def reader_cache(tmp_path_factory):
    """Evaluation readers (fedapp.readers) cache into this session's folder, never the user's cache."""
    from fedapp.readers import CACHE_ENV

    yield from _env_folder(CACHE_ENV, tmp_path_factory.mktemp("readers"))


@pytest.fixture(autouse=True, scope="session")
def shard_cache(tmp_path_factory):
    """Clients keep their shards (fedapp.shard_cache) in this session's folder, never the user's cache."""
    from fedapp.shard_cache import CACHE_ENV

    yield from _env_folder(CACHE_ENV, tmp_path_factory.mktemp("shards"))


@pytest.fixture
def inside_a_run():
    """Flower stamps new messages with the running task's identity; unit tests have none."""
    old = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = old


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module: on a shared 2-core machine two OpenMP threads per op contend
    badly (10-50x slower backward passes)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fedapp_log(caplog):
    """caplog on the "fedapp" logger, which stops propagating to the root (caplog's) once a server or a
    client set it up (fedapp.progress.setup_logging); records are caught here once either way."""
    import logging

    logger = logging.getLogger("fedapp")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)
    logger.propagate = propagate


@pytest.fixture
def one_actor(monkeypatch):
    """fedapp.simulate's backend for one Ray actor (one torch import) on this 2-core machine, with one torch
    thread: Ray would set the actor's OMP_NUM_THREADS to its num_cpus, 2, which thrash beside the driver
    (FedDifRC's end-to-end run: 190 s against 35 s on a busy machine). A Ray instance started by this process
    passes OMP_NUM_THREADS on to its workers; this process keeps the threads it already has."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return {"client_resources": {"num_cpus": 2, "num_gpus": 0.0}}


@pytest.fixture
def fed(tmp_path):
    """A federation of real Flower processes (tests/deploy_util.Federation), every one stopped after the test."""
    from deploy_util import Federation

    f = Federation(tmp_path)
    try:
        yield f
    finally:
        f.stop()
