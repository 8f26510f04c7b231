from __future__ import annotations

import shutil
import signal
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


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
