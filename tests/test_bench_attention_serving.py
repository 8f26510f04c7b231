"""CPU tier: benchmarks/attention_serving.py's prefill rows (--prefill). The timing needs a GPU; the
batches it builds, the FLOPs it divides by and the problems it tunes must be right before that."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autosoft.families import get_family

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention_serving as bench  # noqa: E402


@pytest.mark.parametrize("row", bench.PREFILL)
def test_prefill_lengths_are_the_issues_batches_and_the_same_every_time(row):
    total, count, shortest, longest = row
    lengths = bench.prefill_lengths(*row)
    assert len(lengths) == count and sum(lengths) == total
    assert min(lengths) == shortest and max(lengths) == longest
    assert bench.prefill_lengths(*row) == lengths
    assert bench.prefill_lengths(*row, seed=bench.PREFILL_SEED + 1) != lengths  # the seed decides them


def test_prefill_lengths_refuse_a_batch_no_lengths_can_make():
    with pytest.raises(ValueError, match="no 3 lengths of 10 to 20 tokens sum to 100"):
        bench.prefill_lengths(100, 3, 10, 20)


def test_prefill_flops_are_the_attention_familys_count_sequence_by_sequence():
    attention = get_family("attention")
    lengths = bench.prefill_lengths(*bench.PREFILL[0])
    per_sequence = sum(attention.flops(attention.problem(f"1,{bench.HQ},{n},{bench.D}", "bfloat16",
                                                         {"kv_heads": bench.HKV, "causal": True}))
                       for n in lengths)
    assert bench.causal_flops(lengths) == pytest.approx(per_sequence, rel=1e-12)


def test_prefill_problems_are_the_longest_sequences_bucket_and_the_dense_batch():
    lengths = bench.prefill_lengths(*bench.PREFILL[1])
    problems = bench.prefill_problems(lengths, "float16")
    varlen, dense = problems["varlen"], problems["dense"]
    assert varlen.family == "attention_varlen" and varlen.shape == (len(lengths), bench.HQ, max(lengths), bench.D)
    assert dense.family == "attention" and dense.shape == (sum(lengths) // 4096, bench.HQ, 4096, bench.D)
    for problem in (varlen, dense):
        assert "causal" in problem.flags and problem.option("kv_heads") == bench.HKV and problem.dtype == "float16"
