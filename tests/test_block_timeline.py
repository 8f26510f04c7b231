"""CPU tier: benchmarks/block_timeline.py's instrumentation (the launches need a GPU).

Its marks find their places by text in the attention kernel's rendered source: a template edit
that moves that text would silently drop a mark, so every mark is counted here."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from autosoft.compile import compile_source
from autosoft.families import get_family
from autosoft.families.base import build_variant
from autosoft.runtime import Target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import block_timeline  # noqa: E402

H200 = Target(arch="90", name="NVIDIA H200", sm_count=132, smem_optin=227 * 1024, l2_bytes=60 * 1024 * 1024)


def _instrumented(family: str, shape: str, dtype: str, options: dict, overrides: dict) -> tuple[str, str]:
    fam = get_family(family)
    problem = fam.problem(shape, dtype, options)
    params = {**fam.default_params(problem, H200), **overrides}
    variant = build_variant(fam, problem, params, H200)
    launch = variant.launches[0]
    return variant.source, block_timeline.instrument(variant.source, launch.kernel, int(np.prod(launch.grid)),
                                                     family == "attention")


def test_a_split_decode_kernel_gets_every_mark_and_compiles():
    # main loop done, partials written, arrived and merged, in that order in the source
    _, source = _instrumented("attention", "1,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 4096}, {"splits": 16})
    for slot in range(8):
        assert f"timeline_mark({slot})" in source, slot
    positions = [source.index(f"timeline_mark({slot})") for slot in (4, 5, 6, 7)]
    assert positions == sorted(positions)
    assert compile_source(source, "90").ok


def test_an_unsplit_kernel_has_no_split_marks():
    _, source = _instrumented("attention", "16,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 4096}, {"splits": 1})
    assert "timeline_mark(4)" in source and "timeline_mark(5)" not in source and "timeline_mark(7)" not in source


def test_a_softmax_kernel_is_wrapped_with_its_launch_bounds():
    original, source = _instrumented("softmax", "1024x32768", "bfloat16", {"log": True},
                                     {"storage": "smem", "threads": 1024, "row_threads": 1024, "chunks": 4})
    assert "__launch_bounds__(THREADS, 2) softmax_rows(" in original
    assert "__device__ __forceinline__ void softmax_rows_body(" in source
    assert "__launch_bounds__(THREADS, 2) softmax_rows(" in source and "softmax_rows_body(x, y, M);" in source
    assert compile_source(source, "90").ok


def test_kernels_taking_tensor_maps_are_refused():
    fam = get_family("attention")
    problem = fam.problem("4,16,4096,128", "bfloat16", {})
    variant = build_variant(fam, problem, fam.default_params(problem, H200), H200)
    assert variant.params["engine"] == "wgmma"
    with pytest.raises(SystemExit, match="tensor maps"):
        block_timeline.instrument(variant.source, variant.launches[0].kernel, 1, False)
