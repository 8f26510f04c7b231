"""The cross_entropy family on the CPU tier: problems and options, the search space (defaults for
every benchmark vocabulary, every strategy reachable), rendering and NVRTC compilation of every
strategy for sm_90 and sm_80, register spills of the defaults under nvcc, the float64 reference
against torch's F.cross_entropy and autograd, and `check` (NumPy standing in for CuPy) accepting an
exact and an fp32-rounded result while rejecting wrong ones. The public functions are in
test_functions_cross_entropy.py."""
from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest

from autosoft.compile import COMPILE_OPTIONS, compile_source
from autosoft.dtypes import to_storage
from autosoft.errors import UserError
from autosoft.families import get_family
from autosoft.families.base import Target, build_variant, space_of
from autosoft.families.cross_entropy import reference

from helpers import nvcc_path

FAMILY = get_family("cross_entropy")
VOCABS = (32000, 50257, 128256, 151936, 256000)
DTYPES = ("bfloat16", "float16", "float32")


def _valid(problem, arch: str = "90") -> list[dict]:
    return space_of(FAMILY).valid_points(FAMILY.problem_values(problem, Target.for_arch(arch)))


# --- problems ------------------------------------------------------------------------------------

def test_problems_options_and_shapes():
    problem = FAMILY.problem("4096x128256", "bfloat16", {"int32_target": True, "inplace": True})
    assert problem.shape == (4096, 128256) and problem.shape_text == "4096x128256+inplace+int32_target"
    assert FAMILY.parse_problem(problem.shape_text, "bfloat16") == problem
    assert FAMILY.problem_for({"logits": (2, 3, 50257), "target": (2, 3), "scale": (1,)}, "float32", {}) == \
        FAMILY.problem("6x50257", "float32")
    with pytest.raises(ValueError, match="shape of logits"):
        FAMILY.problem_for({"logits": (4, 10), "target": (5,)}, "float32", {})
    with pytest.raises(ValueError, match="scalar"):
        FAMILY.problem_for({"logits": (), "target": ()}, "float32", {})
    with pytest.raises(UserError):
        FAMILY.problem("4x8", "float32", {"log": True})
    for bad in ("4096x", "0x5", "2x3x4"):
        with pytest.raises(UserError):
            FAMILY.problem(bad, "float32")
    outs = FAMILY.caller_outputs({"logits": (2, 3, 7), "target": (2, 3)}, "float16", {})
    assert outs == {"loss": ((2, 3), "float32"), "lse": ((2, 3), "float32"), "grad": ((2, 3, 7), "float16")}
    outs = FAMILY.caller_outputs({"logits": (2, 3, 7), "target": (2, 3)}, "float16", {"loss_only": True})
    assert outs["grad"] == ((2, 3, 0), "float16")
    assert FAMILY.output_specs(FAMILY.problem("6x7", "float16", {"loss_only": True}))["grad"] == ((6, 0), "float16")
    assert FAMILY.bytes_moved(FAMILY.problem("4096x32000", "bfloat16")) == 2 * 4096 * 32000 * 2


def test_a_tuned_variant_serves_the_other_options_and_row_counts():
    """The options change loads and the target type only: an entry tuned without them is borrowed
    for them (one step each), as for another row count (log2 steps)."""
    plain = FAMILY.problem("2048x128256", "bfloat16")
    both = FAMILY.problem("2048x128256", "bfloat16", {"inplace": True, "int32_target": True})
    assert FAMILY.problem_distance(plain, both) == FAMILY.problem_distance(both, plain) == 2
    assert FAMILY.problem_distance(plain, FAMILY.problem("8192x128256", "bfloat16")) == 2
    assert FAMILY.problem_distance(plain, FAMILY.problem("2048x151936", "bfloat16")) > 0.9
    target = Target.for_arch("90")
    params = FAMILY.default_params(plain, target)
    assert FAMILY.is_valid(both, target, params)
    assert build_variant(FAMILY, both, params, target).name == build_variant(FAMILY, plain, params, target).name + \
        "_i32_inplace"


# --- the search space ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["90", "80"])
def test_defaults_are_valid_for_every_benchmark_vocabulary(arch):
    target = Target.for_arch(arch)
    for vocab in VOCABS:
        for dtype in ("bfloat16", "float32"):
            for tokens in (1, 7, 4096, 32768):
                problem = FAMILY.problem(f"{tokens}x{vocab}", dtype)
                params = FAMILY.default_params(problem, target)
                assert FAMILY.is_valid(problem, target, params), (problem, params)
                if arch == "80":
                    assert params["combine"] != "cluster"  # clusters need sm_90


def test_every_strategy_is_reachable_for_long_vocabularies():
    """32000 bf16 fits one block's registers or shared memory; 128256 bf16 (250 KiB) fits neither,
    and is held over a cluster or a grid of blocks, split between one block's registers and shared
    memory, or streamed twice."""
    kinds = {(p["storage"], p["combine"]) for p in _valid(FAMILY.problem("8x32000", "bfloat16"))}
    assert {("registers", "none"), ("smem", "none"), ("hybrid", "none"), ("reread", "none")} <= kinds
    long = FAMILY.problem("8x128256", "bfloat16")
    kinds = {(p["storage"], p["combine"]) for p in _valid(long)}
    assert ("registers", "none") not in kinds and ("smem", "none") not in kinds
    assert {("reread", "none"), ("hybrid", "none"), ("registers", "cluster"), ("smem", "cluster"),
            ("hybrid", "cluster"), ("registers", "grid"), ("smem", "grid")} <= kinds
    assert all(p["combine"] != "cluster" for p in _valid(long, "80"))


def test_constraints_reject_what_cannot_work():
    target = Target.for_arch("90")
    problem = FAMILY.problem("4096x128256", "bfloat16")
    base = FAMILY.default_params(problem, target)
    for bad in ({"split": 1, "combine": "none", "storage": "registers"},  # 16 KB per thread
                {"split": 2, "combine": "none"}, {"storage": "smem", "vec": 1},
                {"combine": "grid", "split": 2},  # 8192 blocks cannot all be resident
                {"storage": "registers", "unroll": 2},
                {"storage": "hybrid", "held": 0}, {"storage": "registers", "held": 4},  # held: hybrid's alone
                {"storage": "hybrid", "held": 16, "threads": 1024},  # 128 bytes a thread at most at 1024
                {"storage": "hybrid", "held": 2, "vec": 1}):  # cp.async copies 4, 8 or 16 bytes
        assert not FAMILY.is_valid(problem, target, {**base, **bad}), bad
    short = FAMILY.problem("8x32000", "bfloat16")  # 4000 vectors: 512 threads x 8 would hold them all
    whole = {**FAMILY.default_params(short, target), "storage": "hybrid", "vec": 8, "threads": 512}
    assert FAMILY.is_valid(short, target, {**whole, "held": 4})
    assert not FAMILY.is_valid(short, target, {**whole, "held": 8})
    with pytest.raises(UserError, match="variant invalid"):
        build_variant(FAMILY, problem, {**base, "split": 2, "combine": "none"}, target)


# --- rendering and compilation -------------------------------------------------------------------

def _one_per_strategy(arch: str) -> list[tuple]:
    """(problem, params): one valid point of each (storage, combine), streaming or not, for each
    dtype and option, on shapes with unaligned rows (odd vocabularies)."""
    picks = []
    for shape, dtype, options in (("8x50257", "bfloat16", {}), ("4x128257", "float16", {"int32_target": True}),
                                  ("6x32001", "float32", {"inplace": True}), ("3x33", "bfloat16", {}),
                                  ("5x50257", "bfloat16", {"loss_only": True})):
        problem = FAMILY.problem(shape, dtype, options)
        seen = set()
        for params in _valid(problem, arch):
            kind = (params["storage"], params["combine"], params["streaming"])
            if kind not in seen:
                seen.add(kind)
                picks.append((problem, params))
    return picks


@pytest.mark.long
@pytest.mark.parametrize("arch", ["90", "80"])
def test_every_strategy_renders_and_compiles(arch):
    target = Target.for_arch(arch)
    picks = _one_per_strategy(arch)
    kinds = {(p["storage"], p["combine"]) for _, p in picks}
    assert {("registers", "none"), ("smem", "none"), ("hybrid", "none"), ("reread", "none"),
            ("registers", "grid")} <= kinds
    if arch == "90":
        assert {("registers", "cluster"), ("smem", "cluster"), ("hybrid", "cluster")} <= kinds
    for problem, params in picks:
        variant = build_variant(FAMILY, problem, params, target)
        assert "{{" not in variant.source and "{%" not in variant.source
        assert ("__restrict__ x" in variant.source) != bool(problem.option("inplace"))
        assert (".nc" in variant.source) != bool(problem.option("inplace"))  # coherent loads in place
        assert ("typedef int target_t" in variant.source) == bool(problem.option("int32_target"))
        assert ("write_gradient(xs" in variant.source) != bool(problem.option("loss_only"))
        (launch,) = variant.launches
        assert launch.grid[0] == problem.shape[0] * params["split"]
        assert launch.cooperative == (params["combine"] == "grid")
        assert launch.cluster_blocks == (params["split"] if params["combine"] == "cluster" else 1)
        result = compile_source(variant.source, arch)
        assert result.ok, f"{variant.name}: {result.log[:2000]}"


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.long
def test_defaults_of_the_benchmark_vocabularies_do_not_spill():
    target = Target.for_arch("90")
    for vocab in VOCABS:
        for dtype in ("bfloat16", "float32"):
            problem = FAMILY.problem(f"4096x{vocab}", dtype)
            variant = build_variant(FAMILY, problem, FAMILY.default_params(problem, target), target)
            out = subprocess.run([nvcc_path(), "-x", "cu", "-arch=sm_90", "-c", "-o", "/dev/null", *COMPILE_OPTIONS,
                                  "-Xptxas", "-v", "-"], input=variant.source, capture_output=True, text=True)
            assert out.returncode == 0, out.stderr[:2000]
            spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stderr)]
            assert spills and max(spills) == 0, f"{variant.name}: {out.stderr[-600:]}"


# --- the reference -------------------------------------------------------------------------------

@pytest.mark.parametrize("eps,z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3), (0.2, 1e-2)])
def test_reference_matches_torch_in_float64(eps, z):
    """torch's F.cross_entropy (ignore_index, label_smoothing) plus z lse^2 per kept row, its
    gradient by autograd, with -inf logits (the loss is infinite where smoothing meets them, as
    in torch) and a vocabulary that is no multiple of any vector width."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    m, n = 37, 1025
    x = torch.randn(m, n, dtype=torch.float64, generator=gen) * 3
    x[torch.rand(m, n, generator=gen) < 0.2] = -float("inf")
    x[torch.arange(m), (torch.arange(m) * 7 + 3) % n] = 1.0
    t = torch.randint(0, n, (m,), generator=gen)
    t[::5] = 11
    xr = x.clone().requires_grad_()
    per_row = torch.nn.functional.cross_entropy(xr, t, ignore_index=11, label_smoothing=eps, reduction="none")
    per_row = per_row + z * torch.where(t != 11, torch.logsumexp(xr, -1) ** 2, 0)
    kept = int((t != 11).sum())
    (per_row.sum() / kept).backward()
    loss, lse, grad = reference(x.numpy(), t.numpy(), 11, eps, z, 1 / kept)
    expected = per_row.detach().numpy()
    assert np.array_equal(np.isfinite(loss), np.isfinite(expected))
    assert np.array_equal(loss[~np.isfinite(loss)], expected[~np.isfinite(expected)])
    np.testing.assert_allclose(loss[np.isfinite(loss)], expected[np.isfinite(expected)], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, torch.logsumexp(x, -1).numpy(), rtol=1e-12)
    np.testing.assert_allclose(grad, xr.grad.numpy(), rtol=1e-10, atol=1e-14)
    assert (grad[::5] == 0).all() and (loss[::5] == 0).all()


def test_reference_gives_nan_for_a_target_out_of_range():
    x = np.random.default_rng(0).standard_normal((3, 10))
    loss, _, grad = reference(x, np.array([0, 10, -100]), -100)
    assert np.isfinite(loss[0]) and np.isnan(loss[1]) and loss[2] == 0
    assert np.isfinite(grad).all() and (grad[2] == 0).all()


# --- check ---------------------------------------------------------------------------------------

def _outputs_of(problem, inputs, dtype_round: bool):
    """What a correct kernel writes: the float64 reference, its grad rounded to the dtype (through
    fp32 first with dtype_round)."""
    from autosoft.dtypes import to_float64

    x = to_float64(inputs["logits"], problem.dtype, np)
    t = inputs["target"].astype(np.int64)
    loss, lse, grad = reference(x, t, int(inputs["ignore_index"]), float(inputs["label_smoothing"]),
                                float(inputs["z_loss"]), float(inputs["scale"][0]))
    if dtype_round:
        grad = grad.astype(np.float32).astype(np.float64)
    return {"loss": loss.astype(np.float32), "lse": lse.astype(np.float32),
            "grad": to_storage(grad.astype(np.float32), problem.dtype, np)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_check_accepts_right_results_and_rejects_wrong_ones(dtype):
    problem = FAMILY.problem("40x1025", dtype, {"int32_target": dtype == "float16"})
    for kind in FAMILY.input_kinds:
        inputs = FAMILY.make_inputs(problem, kind, np, np.random.default_rng(1))
        assert inputs["target"].dtype == (np.int32 if dtype == "float16" else np.int64)
        assert (inputs["target"] == int(inputs["ignore_index"])).any(), "some rows are ignored"
        good = _outputs_of(problem, inputs, True)
        assert FAMILY.check(problem, inputs, good, np) is None, kind
        t = inputs["target"].astype(np.int64)
        row = int(np.flatnonzero(t != int(inputs["ignore_index"]))[0])
        wrong_grad = {**good, "grad": good["grad"].copy()}
        # the target's -(1 - eps) term dropped: what a kernel that misses the target writes
        dropped = float(good["grad"][row, t[row]].astype(np.float64) if dtype != "bfloat16" else 0.0) \
            + (1 - float(inputs["label_smoothing"])) * float(inputs["scale"][0])
        wrong_grad["grad"][row, t[row]] = to_storage(np.array([dropped], np.float32), dtype, np)[0]
        assert FAMILY.check(problem, inputs, wrong_grad, np) is not None, kind
        for name in ("loss", "lse"):
            off = {**good, name: good[name].copy()}
            value = off[name][row]  # infinite where smoothing meets -inf logits: a finite one is wrong
            off[name][row] = value + 0.01 * (abs(value) + 1) if np.isfinite(value) else 5.0
            assert name in (FAMILY.check(problem, inputs, off, np) or ""), (kind, name)
        unwritten = {**good, "grad": good["grad"].copy()}
        unwritten["grad"][-1, -1] = to_storage(np.array([np.nan], np.float32), dtype, np)[0]
        assert FAMILY.check(problem, inputs, unwritten, np) is not None


def test_check_works_in_row_chunks(monkeypatch):
    import autosoft.families.cross_entropy as module

    monkeypatch.setattr(module, "CHECK_ROWS", 7)
    problem = FAMILY.problem("40x65", "float32")
    inputs = FAMILY.make_inputs(problem, "smoothed", np, np.random.default_rng(2))
    good = _outputs_of(problem, inputs, True)
    assert FAMILY.check(problem, inputs, good, np) is None
    good["loss"][30] += 1.0
    assert FAMILY.check(problem, inputs, good, np).startswith("rows from 28: loss")


# --- the public functions' arguments -------------------------------------------------------------


def test_long_vocabularies_seed_the_staged_clusters_first():
    """Where the default splits the row over a cluster, the seeds open with rows staged in the
    shared memory of 8 or 16 small blocks (the winners measured on 151936 and 256000 words, also
    with 8-byte vectors for 16-bit logits); a short row keeps its whole-row seeds first."""
    target = Target.for_arch("90")
    for vocab, dtype, winner in ((151936, "bfloat16", "cross_entropy_bf16_t256_v4_u1_smem_cluster8"),
                                 (256000, "bfloat16", "cross_entropy_bf16_t128_v8_u1_smem_cluster16"),
                                 (151936, "float32", "cross_entropy_f32_t128_v4_u1_smem_cluster8")):
        problem = FAMILY.problem(f"2048x{vocab}", dtype)
        seeds = FAMILY.seed_params(problem, target)
        names = [FAMILY.variant_name(problem, p) for p in seeds]
        assert len(set(names)) == len(names) and all(FAMILY.is_valid(problem, target, p) for p in seeds)
        assert winner in names[:8], names[:8]
        assert all(p["combine"] == "cluster" and p["storage"] == "smem" for p in seeds[1:5])
    short = FAMILY.problem("2048x32000", "bfloat16")
    assert FAMILY.default_params(short, target)["combine"] == "none"
    assert FAMILY.seed_params(short, target)[1]["split"] == 1
