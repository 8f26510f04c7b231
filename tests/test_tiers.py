"""The test tiers as a contributor runs them: timing tests stay out of parallel workers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
TIMING_TESTS = ("tests/test_gpu_softmax.py", "tests/test_gpu_softmax_backward.py", "tests/test_gpu_attention.py")


def _run(*args: str, worker: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    if worker:
        env["PYTEST_XDIST_WORKER"] = worker
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


def test_the_timing_marker_is_declared():
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("timing:") for m in markers)


def test_timing_tests_are_skipped_in_a_parallel_worker_and_collected_alone():
    collected = _run("--collect-only", "-m", "timing", *TIMING_TESTS, worker=None)
    assert "5 tests collected" in collected or "5/" in collected, collected[-500:]
    in_worker = _run("-m", "timing", *TIMING_TESTS, worker="gw3")
    assert in_worker.count("a timing test: run it alone") >= 1 and "5 skipped" in in_worker, in_worker[-800:]
