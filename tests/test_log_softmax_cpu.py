"""CPU tier: the log-softmax, the softmax family's `log` problem option (families/softmax.py,
templates/softmax/), and the public functions' `dim` and `out` where no GPU is needed."""
from __future__ import annotations

import concurrent.futures as cf
import functools
import random
import re
import subprocess
import sys

import numpy as np
import pytest

import autosoft
from autosoft.compile import compile_source
from autosoft.dtypes import to_storage
from autosoft.families import get_family
from autosoft.families.base import Target, build_variant, space_of

SOFTMAX = get_family("softmax")
H200 = Target(arch="90", name="NVIDIA H200", sm_count=132)


def _compile(job: tuple[str, str]) -> tuple[bool, str]:
    result = compile_source(*job)
    return result.ok, result.log


@functools.lru_cache(maxsize=None)
def _valid(values: tuple) -> list[dict]:
    """The valid points of a problem's values (float16 and bfloat16 rows share theirs)."""
    return space_of(SOFTMAX).valid_points(dict(values))


def _points(problem, target, count: int, seed: str) -> list[dict]:
    valid = _valid(tuple(sorted(SOFTMAX.problem_values(problem, target).items())))
    return random.Random(seed).sample(valid, min(count, len(valid)))


def test_the_log_option_is_a_problem_option_in_keys_names_and_the_cli():
    problem = SOFTMAX.problem("4096x8192", "bfloat16", {"log": True})
    assert problem.shape_text == "4096x8192+log"
    assert SOFTMAX.parse_problem("4096x8192+log", "bfloat16") == problem
    assert SOFTMAX.problem("4096x8192", "bfloat16") != problem
    name = SOFTMAX.variant_name(problem, SOFTMAX.default_params(problem, H200))
    assert name.startswith("log_softmax_bf16_")
    plain = SOFTMAX.problem("4096x8192", "bfloat16")
    assert SOFTMAX.variant_name(plain, SOFTMAX.default_params(plain, H200)).startswith("softmax_bf16_")
    done = subprocess.run([sys.executable, "-m", "autosoft", "render", "softmax", "--shape", "7x1025", "--log"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "log_softmax" in done.stdout and "__logf" in done.stdout


def test_log_variants_write_x_minus_max_minus_log_sum_and_never_an_exponential_quotient():
    for shape in ("7x1025", "4096x8192", "32x131072", "1x1048576"):
        problem = SOFTMAX.problem(shape, "float16", {"log": True})
        for params in _points(problem, H200, 40, shape):
            source = build_variant(SOFTMAX, problem, params, H200).source
            assert "__logf(s)" in source
            assert "f[e] = f[e] - ms - inv;" in source
            assert not re.search(r"ex\([^;]*\) \* inv\)", source), "a scalar write still forms e^(x - m) / sum"


def test_the_log_softmax_never_keeps_exponentials_and_says_why():
    problem = SOFTMAX.problem("4096x1024", "float32", {"log": True})
    values = SOFTMAX.problem_values(problem, H200)
    points = space_of(SOFTMAX).valid_points(values)
    assert points and not any(p["keep_exp"] for p in points)
    kept = {**SOFTMAX.default_params(problem, H200), "keep_exp": True}
    assert any("x - max - log(sum)" in why for why in space_of(SOFTMAX).violations(kept, values))
    plain = SOFTMAX.problem("4096x1024", "float32")
    assert any(p["keep_exp"] for p in space_of(SOFTMAX).valid_points(SOFTMAX.problem_values(plain, H200)))


def test_long_16_bit_log_rows_measure_eight_staged_chunks_within_the_tables_trials():
    # the issue-19 table tunes with 24 trials: the default and the first 23 seeds
    wanted = {"storage": "smem", "threads": 512, "normalise": "online", "chunks": 8, "reduce": "smem", "stagger": 1000}
    for dtype in ("float16", "bfloat16"):
        problem = SOFTMAX.problem("1024x32768", dtype, {"log": True})
        seeds = SOFTMAX.seed_params(problem, H200)[:23]
        assert any(all(s[k] == v for k, v in wanted.items()) for s in seeds), dtype
        assert all(SOFTMAX.is_valid(problem, H200, s) for s in seeds)


@pytest.mark.long
def test_log_variants_compile_for_sm90_and_sm80():
    jobs = set()
    for shape, dtype in (("7x1025", "float32"), ("4096x8192", "bfloat16"), ("32x131072", "float16"),
                         ("3x33", "float16"), ("1x1048576", "float32")):
        problem = SOFTMAX.problem(shape, dtype, {"log": True})
        drawn = _points(problem, Target.for_arch("90"), 6, shape)  # on sm_80, those valid there
        for arch in ("90", "80"):
            target = Target.for_arch(arch)
            kept = [p for p in drawn if SOFTMAX.is_valid(problem, target, p)]
            points = [SOFTMAX.default_params(problem, target), *kept]
            jobs |= {(build_variant(SOFTMAX, problem, p, target).source, arch) for p in points}
    with cf.ProcessPoolExecutor(max_workers=2) as pool:
        failures = [log[:300] for ok, log in pool.map(_compile, sorted(jobs)) if not ok]
    assert len(jobs) >= 40 and not failures, failures[:3]


def _fp32_log_softmax(x: np.ndarray) -> np.ndarray:
    x32 = x.astype(np.float32)
    shifted = x32 - x32.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True, dtype=np.float32))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_check_takes_an_fp32_log_softmax_and_refuses_a_wrong_one(dtype):
    from autosoft.dtypes import to_float64

    problem = SOFTMAX.problem("9x1000", dtype, {"log": True})
    rng = np.random.default_rng(1)
    for kind in SOFTMAX.input_kinds:
        inputs = SOFTMAX.make_inputs(problem, kind, np, rng)
        x = to_float64(inputs["x"], dtype, np)
        good = _fp32_log_softmax(x)
        assert SOFTMAX.check(problem, inputs, {"y": to_storage(good, dtype, np)}, np) is None, kind
        finite = np.argwhere(np.isfinite(good))
        r, c = finite[len(finite) // 2]
        for wrong in (good[r, c] + 0.05 * max(1.0, abs(good[r, c])), np.nan, -np.inf):
            bad = good.copy()
            bad[r, c] = wrong
            assert SOFTMAX.check(problem, inputs, {"y": to_storage(bad, dtype, np)}, np) is not None, (kind, wrong)
        # the softmax itself is not the log-softmax
        assert SOFTMAX.check(problem, inputs, {"y": to_storage(np.exp(good), dtype, np)}, np) is not None


def test_dim_and_out_are_checked_before_any_gpu_work():
    x = np.zeros((3, 4), np.float32)
    with pytest.raises(TypeError, match="dim must be an int"):
        autosoft.softmax(x, dim=1.0)
    with pytest.raises(IndexError, match="dim 2 is out of range for a 2-dimensional input"):
        autosoft.log_softmax(x, dim=2)
    with pytest.raises(IndexError, match="dim -3"):
        autosoft.softmax(x, dim=-3)
    with pytest.raises(TypeError, match="host"):  # a valid dim: then what x is
        autosoft.softmax(x, dim=0)


class _HostArrays:
    """The array layer's output check (arrays._Framework.check_out) over NumPy arrays: the same
    decisions a CUDA framework's arrays get, without a GPU."""

    @staticmethod
    def make():
        from autosoft.arrays import _Framework

        class Host(_Framework):
            def dtype(self, a):
                return str(a.dtype)

            def device(self, a):
                return 0

            def ptr(self, a):
                return a.ctypes.data

            def contiguous(self, a):
                return a.flags.c_contiguous

        return Host()


def test_an_out_of_the_wrong_shape_or_dtype_is_refused_and_a_fitting_one_is_written_directly():
    fw = _HostArrays.make()
    spec = ((4, 8), "float32")
    x = np.zeros((4, 8), np.float32)
    for bad, what in ((np.zeros((4, 9), np.float32), r"\(4, 9\)"), (np.zeros((4, 8), np.float16), "float16")):
        with pytest.raises(ValueError, match=what):
            fw.check_out(bad, spec, 0, x.ctypes.data)
    fresh = np.empty((4, 8), np.float32)
    address = fresh.ctypes.data
    assert fw.check_out(fresh, spec, 0, address + 64) is True     # the input's address mod 16
    assert fw.check_out(fresh, spec, 0, address + 4) is False     # another mod 16: copied in
    assert fw.check_out(fresh, spec, 0, address) is False         # the input itself: copied in
    assert fw.check_out(np.empty((8, 4), np.float32).T, spec, 0, address + 64) is False  # not contiguous
