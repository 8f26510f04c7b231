"""CPU tier: benchmarks/attention.py's ablation (--ablate): which variants it times beside a tuned
one. The timing needs a GPU; what it compares must be right before any of it is run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from autosoft.families.base import build_variant
from autosoft.runtime import Target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention as bench  # noqa: E402

H200 = Target(arch="90", name="NVIDIA H200", sm_count=132, smem_optin=227 * 1024, l2_bytes=60 * 1024 * 1024)
FAMILY = bench.FAMILY


def _names(problem, points):
    return [build_variant(FAMILY, problem, p, H200).name for _, p in points]


def test_each_ablation_removes_exactly_one_technique_the_tuned_variant_uses():
    problem = FAMILY.problem("4,16,1024,64", "bfloat16", ("causal",))
    tuned = {**FAMILY.default_params(problem, H200), "lpt": True}
    assert tuned["engine"] == "wgmma" and tuned["queue"] and tuned["blocks_per_sm"] == 2
    points = bench.ablation_points(problem, tuned, H200)
    labels = [label for label, _ in points]
    assert labels[0] == "tuned" and points[0][1] == tuned
    # the queue, longest first, persistent blocks, overlap and two blocks per SM are in use: each
    # removed alone; ping-pong and chain are not in use: nothing to remove
    assert set(labels) == {"tuned", "no overlap", "not persistent", "no queue", "not longest first",
                           "one block per SM", "mma kernel (default)"}
    for label, point in points[1:-1]:
        changed = {k for k in tuned if point[k] != tuned[k]}
        assert changed, label
        assert FAMILY.is_valid(problem, H200, point), label
    by_label = dict(points)
    assert {k for k in tuned if by_label["not persistent"][k] != tuned[k]} == {"persistent", "queue"}
    assert {k for k in tuned if by_label["no queue"][k] != tuned[k]} == {"queue"}
    assert by_label["mma kernel (default)"]["engine"] == "mma"
    assert len(set(_names(problem, points))) == len(points)  # no variant timed twice


def test_an_mma_variant_has_nothing_to_ablate():
    problem = FAMILY.problem("4,16,1024,64", "bfloat16", ())
    mma = FAMILY.default_params(problem, Target.for_arch("80"))
    assert bench.ablation_points(problem, mma, H200) == [("tuned", mma)]


def test_the_tuned_rows_are_read_back_filtered_and_unverified_ones_left_out(tmp_path):
    problem = FAMILY.problem("16,16,512,64", "float16", ("causal",))
    params = FAMILY.default_params(problem, H200)
    rows = [{"shape": "16x16x512x64", "dtype": "float16", "causal": True, "params": params, "verified": True},
            {"shape": "16x16x512x64", "dtype": "float16", "causal": False, "params": params, "verified": False},
            {"shape": "4x16x1024x64", "dtype": "bfloat16", "causal": False, "params": params, "verified": True},
            {"shape": "4x16x1024x64", "dtype": "float16", "causal": False, "error": "tuning failed"}]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"rows": rows}))
    taken = bench.tuned_rows(str(path), "", "float16,bfloat16", "both")
    assert [(p.shape, p.dtype, p.flags) for p, _ in taken] == [
        ((16, 16, 512, 64), "float16", ("causal",)), ((4, 16, 1024, 64), "bfloat16", ())]
    assert taken[0][1] == params
    assert bench.tuned_rows(str(path), "4,16,1024,64", "float16,bfloat16", "both")[0][0].shape == (4, 16, 1024, 64)
    assert bench.tuned_rows(str(path), "", "float16", "no") == []
