from __future__ import annotations

import os
import shutil
import signal
import sys
from functools import lru_cache

import pytest

import postgres

# the fixtures of tests/postgres.py (a PostgreSQL server for the session), for any test
postgres_server = postgres.postgres_server
postgres_url = postgres.postgres_url


@lru_cache(maxsize=1)
def gpu_available() -> bool:
    try:
        from autosoft.runtime import cupy_module

        cupy_module()
        return True
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no device
        return False


def in_parallel_worker() -> bool:
    """Whether this process is one of pytest-xdist's workers (`pytest -n N`)."""
    return "PYTEST_XDIST_WORKER" in os.environ


def pytest_collection_modifyitems(config, items):
    if in_parallel_worker():
        # xdist hands out its groups first, then single tests in this order: the long ones go
        # before the rest, so the run does not end with one worker on a long test and one idle
        items.sort(key=lambda item: "long" not in item.keywords)
        # a speed compared while other workers load the same GPU says nothing about the kernel
        alone = pytest.mark.skip(reason="a timing test: run it alone, `python -m pytest -m timing`")
        for item in items:
            if "timing" in item.keywords:
                item.add_marker(alone)
    if not gpu_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_memory_returned(request):
    """In a parallel worker, a GPU test hands its pooled device memory back when it ends: eight
    workers' CuPy and torch pools holding what their largest test needed fill the card, and a
    small allocation of another worker's test then fails."""
    yield
    if not (in_parallel_worker() and "gpu" in request.keywords and gpu_available()):
        return
    from autosoft.runtime import cupy_module

    cp = cupy_module()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture
def no_kernels(monkeypatch):
    """Any call of a real implementation of autosoft's torch operators fails the test: tracing
    (torch.compile, fake tensors) must not run kernels."""
    pytest.importorskip("torch")
    import autosoft.torch_ops as torch_ops

    def refuse(*args, **kwargs):
        raise AssertionError("a real implementation ran while tracing")
    monkeypatch.setattr(torch_ops, "call_family", refuse)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty AUTOSOFT_CACHE_DIR for the test: nothing touches the user's cache."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def sigint_handled():
    """Ctrl-C raises KeyboardInterrupt in this process and in the processes the test starts, for
    the test's duration, however pytest was started (`cmd &` in a script starts it with SIGINT
    ignored, which every child inherits)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def sigint_ignored():
    """SIGINT ignored in this process, and so in the processes the test starts, as a script's
    background commands (`cmd &`, no job control) have it."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, before)


def has_nvcc() -> bool:
    return shutil.which("nvcc") is not None
