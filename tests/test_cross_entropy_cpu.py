"""The cross_entropy family on the CPU tier: problems and options, the search space (defaults for
every benchmark vocabulary, every strategy reachable), rendering and NVRTC compilation of every
strategy for sm_90 and sm_80, register spills of the defaults under nvcc, the float64 reference
against torch's F.cross_entropy and autograd, `check` (NumPy standing in for CuPy) accepting an
exact and an fp32-rounded result while rejecting wrong ones, and the public functions' argument
errors (which all show before any GPU is touched)."""
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
from autosoft.families.cross_entropy import default_chunk, reference

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
    and is held over a cluster or a grid of blocks, or streamed twice."""
    kinds = {(p["storage"], p["combine"]) for p in _valid(FAMILY.problem("8x32000", "bfloat16"))}
    assert {("registers", "none"), ("smem", "none"), ("reread", "none")} <= kinds
    long = FAMILY.problem("8x128256", "bfloat16")
    kinds = {(p["storage"], p["combine"]) for p in _valid(long)}
    assert ("registers", "none") not in kinds and ("smem", "none") not in kinds
    assert {("reread", "none"), ("registers", "cluster"), ("smem", "cluster"), ("registers", "grid"),
            ("smem", "grid")} <= kinds
    assert all(p["combine"] != "cluster" for p in _valid(long, "80"))


def test_constraints_reject_what_cannot_work():
    target = Target.for_arch("90")
    problem = FAMILY.problem("4096x128256", "bfloat16")
    base = FAMILY.default_params(problem, target)
    for bad in ({"split": 1, "combine": "none", "storage": "registers"},  # 16 KB per thread
                {"split": 2, "combine": "none"}, {"storage": "smem", "vec": 1},
                {"combine": "grid", "split": 2},  # 8192 blocks cannot all be resident
                {"storage": "registers", "unroll": 2}):
        assert not FAMILY.is_valid(problem, target, {**base, **bad}), bad
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


@pytest.mark.parametrize("arch", ["90", "80"])
def test_every_strategy_renders_and_compiles(arch):
    target = Target.for_arch(arch)
    picks = _one_per_strategy(arch)
    kinds = {(p["storage"], p["combine"]) for _, p in picks}
    assert {("registers", "none"), ("smem", "none"), ("reread", "none"), ("registers", "grid")} <= kinds
    if arch == "90":
        assert {("registers", "cluster"), ("smem", "cluster")} <= kinds
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

def test_cross_entropy_argument_errors_are_one_line():
    torch = pytest.importorskip("torch")
    import autosoft

    x = torch.randn(4, 10)
    t = torch.zeros(4, dtype=torch.int64)
    cases = [
        ((np.zeros((4, 10)), t), {}, TypeError, "logits must be a CUDA torch tensor"),
        ((x, [0, 1, 2, 3]), {}, TypeError, "target must be a torch tensor"),
        ((x.to(torch.int32), t), {}, TypeError, "unsupported logits dtype"),
        ((x, t.float()), {}, TypeError, "int64 or int32"),
        ((x, t), {"ignore_index": 1.5}, TypeError, "ignore_index must be an int"),
        ((x, t), {"label_smoothing": 1.5}, ValueError, r"label_smoothing must be in \[0, 1\]"),
        ((x, t), {"z_loss": -1.0}, ValueError, "z_loss must be finite"),
        ((x, t), {"reduction": "avg"}, ValueError, "reduction must be one of"),
        ((x, t[:3]), {}, ValueError, "must have the shape of logits"),
        ((x, t), {"inplace_backward": 1}, TypeError, "inplace_backward must be True or False"),
        ((x[:0], t[:0]), {}, ValueError, "is empty"),
        ((x, t), {}, TypeError, r"logits is a CPU tensor; move it to the GPU first \(logits.cuda\(\)\)"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message) as info:
            autosoft.cross_entropy(*args, **kwargs)
        assert "\n" not in str(info.value)


def test_linear_cross_entropy_argument_errors_are_one_line():
    torch = pytest.importorskip("torch")
    import autosoft

    h = torch.randn(6, 8)
    w = torch.randn(20, 8)
    t = torch.zeros(6, dtype=torch.int64)
    cases = [
        ((h.numpy(), w, t), {}, TypeError, "hidden and weight must be CUDA torch tensors"),
        ((h, w[:, :7], t), {}, ValueError, "do not fit"),
        ((h, w.half(), t), {}, TypeError, "must share one dtype"),
        ((h, w, t), {"bias": torch.zeros(19)}, ValueError, r"bias must be a tensor of shape \(20,\)"),
        ((h, w, t[:5]), {}, ValueError, r"target must be a tensor of shape \(6,\)"),
        ((h, w, t), {"reduction": "none"}, ValueError, "reduction must be one of 'mean', 'sum'"),
        ((h, w, t), {"chunk_size": 0}, ValueError, "chunk_size must be a positive int"),
        ((h, w, t), {"label_smoothing": -0.1}, ValueError, "label_smoothing"),
        ((h, w, t), {}, TypeError, "hidden is a CPU tensor"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message) as info:
            autosoft.linear_cross_entropy(*args, **kwargs)
        assert "\n" not in str(info.value)


def test_default_chunk_is_ligers_and_bounds_a_chunks_logits():
    """Liger's choice for the issue's rows: 8192 and 32768 tokens, hidden 4096, vocab 128256
    (ceil(V/H) = 32) and 151936 (38)."""
    assert default_chunk(8192, 128256, 4096) == 256 and default_chunk(32768, 128256, 4096) == 1024
    assert default_chunk(8192, 151936, 4096) == 256 and default_chunk(32768, 151936, 4096) == 1024
    assert default_chunk(100, 128256, 4096) == 4 and default_chunk(3, 10, 4096) == 3
    for tokens, vocab, hidden in ((32768, 151936, 4096), (8192, 50257, 2048), (65536, 32000, 8192)):
        chunk = default_chunk(tokens, vocab, hidden)
        assert chunk & (chunk - 1) == 0 and chunk * vocab < 2 * tokens * hidden  # logits < 2x the hidden states


# --- the public functions' Python, on the CPU ----------------------------------------------------

@pytest.fixture
def kernel_on_the_cpu(monkeypatch):
    """autosoft.cross_entropy's Python around a stand-in for the kernel launch: `reference` in
    float64 on CPU tensors, writing over the logits where asked (devices left unchecked)."""
    torch = pytest.importorskip("torch")
    import autosoft.families.cross_entropy as module

    launches = []

    def forward(logits2d, target1d, scale, ignore_index, eps, z, inplace, loss_only=False):
        assert logits2d.is_contiguous() and logits2d.dim() == 2 and target1d.dim() == 1
        loss, lse, grad = reference(logits2d.double().numpy(), target1d.long().numpy(), ignore_index, eps, z,
                                    float(scale))
        grad = None if loss_only else torch.from_numpy(grad).to(logits2d.dtype)
        if inplace and not loss_only:
            logits2d.data.copy_(grad)  # as the kernel writes: no autograd version bump
            grad = logits2d
        launches.append((tuple(logits2d.shape), "loss_only" if loss_only else inplace))
        return torch.from_numpy(loss).float(), torch.from_numpy(lse).float(), grad

    monkeypatch.setattr(module, "_forward", forward)
    monkeypatch.setattr(module, "_check_devices", lambda who, named: None)
    return launches


def _composition(torch, logits, target, ignore_index, eps, z, reduction):
    x = logits.detach().double().requires_grad_()
    per_row = torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]), target.reshape(-1).long(),
                                                ignore_index=ignore_index, label_smoothing=eps, reduction="none")
    kept = target.reshape(-1) != ignore_index
    per_row = per_row + z * torch.where(kept, torch.logsumexp(x.reshape(-1, x.shape[-1]), -1) ** 2, 0)
    loss = {"mean": per_row.sum() / kept.sum(), "sum": per_row.sum(), "none": per_row.reshape(target.shape)}[reduction]
    return loss, x


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_python_reduces_and_backpropagates(kernel_on_the_cpu, reduction):
    torch = pytest.importorskip("torch")
    import autosoft

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 33, generator=gen).requires_grad_()
    target = torch.randint(0, 33, (2, 5), generator=gen, dtype=torch.int32)
    target[0, 1] = 4
    weight = torch.rand(2, 5, generator=gen) if reduction == "none" else torch.tensor(2.5)
    loss = autosoft.cross_entropy(logits, target, ignore_index=4, label_smoothing=0.1, z_loss=1e-3,
                                  reduction=reduction)
    (loss * weight).sum().backward()
    expected, x = _composition(torch, logits, target, 4, 0.1, 1e-3, reduction)
    (expected * weight.double()).sum().backward()
    assert loss.shape == expected.shape and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        again, lse = autosoft.cross_entropy(logits, target, ignore_index=4, label_smoothing=0.1, z_loss=1e-3,
                                            reduction=reduction, return_lse=True)
    assert kernel_on_the_cpu[-1] == ((10, 33), "loss_only")  # no gradient written without autograd
    torch.testing.assert_close(again, loss.detach())
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.detach().double(), -1))


def test_cross_entropy_python_in_place_and_copies(kernel_on_the_cpu):
    torch = pytest.importorskip("torch")
    import autosoft

    logits = torch.randn(6, 40).requires_grad_()
    kept = logits.detach().clone()
    target = torch.randint(0, 40, (6,))
    autosoft.cross_entropy(logits, target, inplace_backward=True).backward()
    assert kernel_on_the_cpu[-1] == ((6, 40), True)
    assert not torch.equal(logits.detach(), kept)  # the logits' memory took the gradient
    loss64, x = _composition(torch, kept, target, -100, 0.0, 0.0, "mean")
    loss64.backward()
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=1e-6, atol=1e-7)
    wide = torch.randn(6, 50)[:, 5:45].requires_grad_()  # not contiguous: copied, the copy takes the gradient
    before = wide.detach().clone()
    autosoft.cross_entropy(wide, target).backward()
    assert kernel_on_the_cpu[-1] == ((6, 40), True) and torch.equal(wide.detach(), before)
    assert wide.grad.shape == (6, 40)


@pytest.mark.parametrize("bias,chunk", [(False, None), (True, 7), (True, 1)])
def test_linear_cross_entropy_python_chunks_and_gradients(kernel_on_the_cpu, bias, chunk):
    torch = pytest.importorskip("torch")
    import autosoft

    gen = torch.Generator().manual_seed(5)
    h = torch.randn(3, 10, 8, generator=gen).requires_grad_()
    w = torch.randn(21, 8, generator=gen).requires_grad_()
    b = torch.randn(21, generator=gen).requires_grad_() if bias else None
    target = torch.randint(0, 21, (3, 10), generator=gen)
    target[1, ::3] = -100
    loss = autosoft.linear_cross_entropy(h, w, target, bias=b, label_smoothing=0.05, z_loss=1e-3,
                                         chunk_size=chunk)
    (loss * 3).backward()
    sizes = [shape[0] for shape, inplace in kernel_on_the_cpu]
    assert all(inplace for _, inplace in kernel_on_the_cpu)
    step = default_chunk(30, 21, 8) if chunk is None else chunk  # 16: ceil(21 / 8) = 3, 30 / 3 -> 16
    assert sizes == [min(step, 30 - s) for s in range(0, 30, step)]
    h2, w2 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b2 = b.detach().double().requires_grad_() if bias else None
    logits = h2 @ w2.t() + (b2 if bias else 0)
    per_row = torch.nn.functional.cross_entropy(logits.reshape(-1, 21), target.reshape(-1), label_smoothing=0.05,
                                                reduction="none")
    kept = target.reshape(-1) != -100
    per_row = per_row + 1e-3 * torch.where(kept, torch.logsumexp(logits.reshape(-1, 21), -1) ** 2, 0)
    expected = per_row.sum() / kept.sum()
    (expected * 3).backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    for got, want in ((h.grad, h2.grad), (w.grad, w2.grad)) + (((b.grad, b2.grad),) if bias else ()):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(autosoft.linear_cross_entropy(h, w, target, bias=b, label_smoothing=0.05,
                                                                 z_loss=1e-3, chunk_size=chunk), loss.detach())
    assert kernel_on_the_cpu[-1][1] == "loss_only"


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph_traces_one_operator_with_its_backward(monkeypatch, reduction):
    """Under torch.compile (fullgraph: no graph break) autosoft.cross_entropy is the operator
    torch.ops.autosoft.cross_entropy, whose declared backward AOTAutograd traces (meta tensors:
    the fake implementation gives the shapes and dtypes; no kernel runs)."""
    torch = pytest.importorskip("torch")
    import autosoft
    import autosoft.torch_ops as torch_ops

    def refuse(*args, **kwargs):
        raise AssertionError("a real implementation ran while tracing")
    monkeypatch.setattr(torch_ops, "call_family", refuse)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    logits = torch.empty(2, 6, 50, device="meta", dtype=torch.bfloat16).requires_grad_()
    target = torch.empty(2, 6, device="meta", dtype=torch.int32)
    compiled = torch.compile(lambda x, t: autosoft.cross_entropy(x, t, label_smoothing=0.1, reduction=reduction),
                             backend=backend, fullgraph=True)
    loss = compiled(logits, target)
    assert (loss.shape, loss.dtype) == ((2, 6) if reduction == "none" else (), torch.float32)
    loss.sum().backward()
    assert (logits.grad.shape, logits.grad.dtype) == ((2, 6, 50), torch.bfloat16)
    targets = [str(n.target) for n in graphs[0].graph.nodes if "autosoft" in str(n.target)]
    assert targets == ["autosoft.cross_entropy"]  # the operator Dynamo saw called
    torch._dynamo.reset()


def test_the_operators_declared_backward_weights_each_rows_gradient(monkeypatch):
    """torch.ops.autosoft.cross_entropy's autograd: the kernel's gradient (scale times each row's)
    times the incoming gradient of each row's loss over the scale; lse carries none. The kernel is
    `reference` in float64 behind the array layer (CPU tensors)."""
    torch = pytest.importorskip("torch")
    import autosoft.torch_ops as torch_ops

    def kernel(name, arrays, options=None, scalars=None, who=None):
        assert name == "cross_entropy" and options == {"int32_target": True}
        x, t, scale = arrays
        loss, lse, grad = reference(x.detach().double().reshape(-1, x.shape[-1]).numpy(), t.reshape(-1).long().numpy(),
                                    int(scalars["ignore_index"]), float(scalars["label_smoothing"]),
                                    float(scalars["z_loss"]), float(scale[0]))
        return (torch.from_numpy(loss).float().reshape(t.shape), torch.from_numpy(lse).float().reshape(t.shape),
                torch.from_numpy(grad).to(x.dtype).reshape(x.shape))
    monkeypatch.setattr(torch_ops, "call_family", kernel)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 17, generator=gen, dtype=torch.float64).requires_grad_()
    target = torch.randint(0, 17, (3, 4), generator=gen, dtype=torch.int32)
    target[0, 1] = -100
    weight = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    loss, lse, grad = torch.ops.autosoft.cross_entropy(logits, target, torch.tensor([0.25]), -100, 0.1, 1e-3)
    assert loss.grad_fn is not None and "cross_entropy" in type(loss.grad_fn).__name__
    (loss * weight).sum().backward()
    expected, x = _composition(torch, logits, target, -100, 0.1, 1e-3, "none")
    (expected * weight).sum().backward()
    torch.testing.assert_close(logits.grad, x.grad, rtol=1e-6, atol=1e-9)


def test_a_target_of_another_dtype_is_a_one_line_type_error_naming_it():
    torch = pytest.importorskip("torch")
    import autosoft
    import autosoft.torch_ops  # noqa: F401 - registers the operators

    logits, scale = torch.empty(4, 10, device="meta"), torch.empty(1, device="meta")
    for target in (torch.empty(4, device="meta"), torch.empty(4, device="meta", dtype=torch.int16)):
        with pytest.raises(TypeError, match=rf"^autosoft\.cross_entropy: target must be int64 or int32, got "
                                            rf"{re.escape(str(target.dtype))}$"):
            torch.ops.autosoft.cross_entropy(logits, target, scale, -100, 0.0, 0.0)
        with pytest.raises(TypeError, match=r"^autosoft\.cross_entropy: target must hold int64 or int32"):
            autosoft.cross_entropy(logits, target)
    with pytest.raises(TypeError, match=r"^autosoft\.cross_entropy: scale must be float32, got torch\.float64$"):
        torch.ops.autosoft.cross_entropy(logits, torch.empty(4, device="meta", dtype=torch.int64),
                                         scale.double(), -100, 0.0, 0.0)


def test_every_row_ignored_gives_a_nan_mean_and_zero_gradients(kernel_on_the_cpu):
    torch = pytest.importorskip("torch")
    import autosoft

    logits = torch.randn(5, 30).requires_grad_()
    target = torch.full((5,), -100)
    loss = autosoft.cross_entropy(logits, target)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(torch.nn.functional.cross_entropy(logits, target))
    assert (logits.grad == 0).all()
    assert autosoft.cross_entropy(logits, target, reduction="sum") == 0
