"""Cross-entropy over the rows of (M, N) logits (N the vocabulary), with its gradient in the same
read of the logits: the loss and the backward of a language model's last layer.

Per row r with target t (int64 or int32, the option `int32_target`), label smoothing eps and
z-loss weight z (run-time scalars, as is ignore_index):

    lse[r]     = log(sum_i e^x_i)
    loss[r]    = (1 - eps) (lse - x_t) + eps (lse - mean_i x_i) + z lse^2      (0 where t == ignore_index)
    grad[r, i] = scale * (softmax_i (1 + 2 z lse) - eps / N - (1 - eps) [i == t])  (0 where ignored)

with `scale` a one-element float32 array (1 / the rows kept for a mean, else 1): the gradient of
the reduced loss for an incoming gradient of 1, which the backward only rescales by the incoming
gradient where that is not 1. torch's F.cross_entropy(label_smoothing=eps) plus z lse^2 (PaLM's
z-loss). The option `inplace` compiles kernels that may write grad over the logits themselves;
`loss_only` kernels write no gradient (grad is then an empty (M, 0) array): a call that needs none.

The public functions `autosoft.cross_entropy` and `autosoft.linear_cross_entropy` (torch tensors,
with autograd) are in autosoft/functions/cross_entropy.py.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ..dtypes import ITEMSIZE, SHORT as _SHORT, to_float64, to_storage
from ..errors import UserError
from ..space import ParamValue
from . import register
from ._rows import INT32_MAX, VEC_BITS_TYPE, RowsFamily, pow2_ceil, pow2_floor, worst_mismatch
from ..operators import Backward, OperatorCall, TorchOperator
from .base import Launch, OptionValue, Problem, ProblemOption, Target, valid_neighbours

__all__ = ["CrossEntropyFamily", "CROSS_ENTROPY", "reference"]

SCALARS = ("ignore_index", "label_smoothing", "z_loss")  # run-time kernel arguments, not problem options
_KERNEL_BUFFERS = ("logits", "target", "scale", "grad", "loss", "lse")

# The gradient's tolerance per logits dtype: rtol for its rounding to the dtype (half an ulp:
# 2^-24, 2^-11, 2^-8, with margin), abs_atol for flushed fp32 subnormals and one fp16 subnormal step.
GRAD_TOLERANCE = {"float32": (2e-6, 1e-37), "float16": (1e-3, 6e-8), "bfloat16": (4e-3, 1e-37)}
# fp32 arithmetic on a row: the sum of e^(x - max) over up to 2^18 terms in order and a tree,
# ex2.approx's relative error and x - max's rounding: FP32_COEF times the magnitudes involved.
FP32_COEF = 2e-5
CHECK_ROWS = 1024  # rows `check` compares at a time


class CrossEntropyFamily(RowsFamily):
    """The loss, the log-sum-exp and the gradient of cross-entropy, row by row, from one read of
    (M, N) logits and M targets."""
    name = "cross_entropy"
    template = "cross_entropy/cross_entropy.cu.j2"
    inputs = ("logits", "target", "scale", *SCALARS)
    input_dtypes = {"target": ("int64", "int32"), "scale": ("float32",)}  # the option int32_target says which
    outputs = ("loss", "lse", "grad")
    options = (ProblemOption("int32_target", "targets are int32 (default: int64, as torch's)"),
               ProblemOption("inplace", "kernels that may write the gradient over the logits (coherent loads)"),
               ProblemOption("loss_only", "the loss and lse alone, no gradient written (grad is empty)"))
    input_kinds = ("normal", "smoothed", "neg_inf", "large")
    # grad shares the logits' address modulo 16, so one scalar head and tail per row serves both
    input_alignment = 16
    shape_help = "MxN: tokens x vocabulary, e.g. 8192x128256"
    examples = (("1x1", "float32", {}), ("7x33", "bfloat16", {}), ("5x1025", "float16", {"int32_target": True}),
                ("64x50257", "bfloat16", {}), ("33x32000", "float32", {"inplace": True}),
                ("4096x32000", "bfloat16", {}), ("16x128256", "bfloat16", {}), ("8x151936", "float32", {}),
                ("4x256000", "bfloat16", {"inplace": True}), ("3x256000", "float32", {"int32_target": True}),
                ("9x50257", "bfloat16", {"loss_only": True}))

    # --- problems ------------------------------------------------------------------------------
    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]:
        m, n = problem.shape
        return {"M": m, "N": n, "itemsize": ITEMSIZE[problem.dtype], "smem_limit": target.smem_optin - 4096,
                "arch": int(target.arch), "sm_count": target.sm_count}

    def problem_for(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                    options: Mapping[str, OptionValue]) -> Problem:
        """logits (..., N) and target (...): the leading dimensions are the rows."""
        logits, target = tuple(shapes["logits"]), tuple(shapes["target"])
        if len(logits) == 0:
            raise ValueError("autosoft.cross_entropy: logits is a scalar; it needs a vocabulary dimension")
        if target != logits[:-1]:
            raise ValueError(f"autosoft.cross_entropy: target {target} must have the shape of logits {logits} "
                             "without its last (vocabulary) dimension")
        if "scale" in shapes and tuple(shapes["scale"]) != (1,):
            raise ValueError(f"autosoft.cross_entropy: scale must hold one float32, got shape {tuple(shapes['scale'])}")
        return super(RowsFamily, self).problem_for({"logits": (math.prod(logits[:-1]), logits[-1])}, dtype, options)

    def caller_outputs(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                       options: Mapping[str, OptionValue]) -> dict[str, tuple[tuple[int, ...], str]]:
        """loss and lse shaped like target (float32), grad like the logits (with loss_only, its
        last dimension 0: empty)."""
        rows = tuple(shapes["target"])
        grad = rows + (0,) if options.get("loss_only") else tuple(shapes["logits"])
        return {"loss": (rows, "float32"), "lse": (rows, "float32"), "grad": (grad, dtype)}

    def problem_distance(self, a: Problem, b: Problem) -> float:
        """shape_distance, plus one step per option that differs: the options change only the
        kernels' loads and target type, so a variant tuned for int64 targets and a separate
        gradient serves int32 targets or an in-place gradient too (verified there, as any
        borrowed variant is)."""
        differ = len(set(a.options) ^ set(b.options))
        return self.shape_distance(a.shape, b.shape) + differ

    # --- variants ------------------------------------------------------------------------------
    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        p = params
        name = f"cross_entropy_{_SHORT[problem.dtype]}_t{p['threads']}_v{p['vec']}_u{p['unroll']}_{p['storage']}"
        if p["storage"] == "hybrid":
            name += str(p["held"])
        if p["split"] != 1:
            name += f"_{p['combine']}{p['split']}"
        if p["streaming"]:
            name += "_cs"
        if problem.option("int32_target"):
            name += "_i32"
        if problem.option("inplace"):
            name += "_inplace"
        if problem.option("loss_only"):
            name += "_loss_only"
        return name

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        return {**values, "dtype": problem.dtype, "vec_bits_type": VEC_BITS_TYPE[values["vec_bytes"]],
                "pairs": ITEMSIZE[problem.dtype] == 2 and values["vec"] >= 2,  # 16-bit vectors as packed pairs
                "target_type": "int" if problem.option("int32_target") else "long long",
                "inplace": bool(problem.option("inplace", False)),
                "write_grad": not problem.option("loss_only", False)}

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        m = problem.shape[0]
        split = values["split"]
        blocks = m * split
        if blocks > INT32_MAX:
            raise UserError(f"{problem.shape_text}: too many rows for one launch; split the call")
        args = _KERNEL_BUFFERS + SCALARS
        kernel = "cross_entropy_rows"
        if values["combine"] == "grid":
            # workspace: a float4 of statistics per segment, then an arrival counter per row
            return (Launch(kernel, (blocks, 1, 1), (values["threads"], 1, 1), values["smem_bytes"],
                           (*args, "workspace", np.int64(m)), cooperative=True),), m * split * 16 + m * 4
        cluster = split if values["combine"] == "cluster" else 1
        return (Launch(kernel, (blocks, 1, 1), (values["threads"], 1, 1), values["smem_bytes"],
                       (*args, np.int64(m)), cluster),), 0

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue]:
        """A sensible variant without tuning: 16-byte vectors, the row held in the registers of one
        block (about eight vectors a thread, else four); longer rows held over a cluster of 2..8
        blocks (sm_90), else staged over one, else held over 16; else staged in the shared memory
        of one block, else streamed twice. Blocks of 512 threads
        come first: at 1024 threads (64 registers each) ptxas spills some held rows of 16-bit data
        (nvcc -Xptxas -v: 4096x32000 bfloat16, 4 vectors a thread, 56 bytes). loss_only: one
        streamed pass (reread without its second pass), several loads in flight."""
        m, n = problem.shape
        vec = min(16 // ITEMSIZE[problem.dtype], pow2_floor(n))
        vectors = -(-n // vec)
        p: dict[str, ParamValue] = {"threads": 128, "vec": vec, "unroll": 1, "storage": "registers",
                                    "held": 0, "split": 1, "combine": "none", "streaming": False}
        candidates = [{**p, "threads": min(1024, max(128, pow2_ceil(-(-vectors // per))))} for per in (8, 4)]
        if problem.option("loss_only"):  # nothing to hold for a gradient: one streamed pass
            candidates = [{**p, "storage": "reread", "threads": t, "unroll": u} for t in (512, 256, 128)
                          for u in (4, 2)] + candidates
        if int(target.arch) >= 90:
            # portable clusters (at most 8 blocks) first, held in registers, then staged in shared
            # memory; 16 blocks last: a cluster of 16 needs 16 SMs of one GPC free at once
            cluster = {**p, "combine": "cluster"}
            candidates += [{**cluster, "threads": t, "split": s} for t in (512, 1024) for s in (2, 4, 8)]
            candidates += [{**cluster, "storage": "smem", "threads": t, "split": s} for s in (2, 4, 8)
                           for t in (512, 1024)]
            candidates += [{**cluster, "threads": t, "split": 16} for t in (512, 1024)]
        candidates += [{**p, "storage": "smem", "threads": t} for t in (1024, 512)]
        candidates += [{**p, "storage": "reread", "threads": 1024, "unroll": u} for u in (4, 2, 1)]
        for candidate in candidates:
            if self.is_valid(problem, target, candidate):
                return candidate
        return self.first_valid(problem, target, p, ({"storage": "reread", "threads": 128},
                                                     {"vec": 1}))

    def seed_params(self, problem: Problem, target: Target) -> list[dict[str, ParamValue]]:
        """Starting points the tuner measures first: the row held in registers by blocks of every
        size (also with evict-first accesses), staged in shared memory, streamed twice with more
        loads in flight, held or staged over clusters (sm_90), and split over a cooperative grid
        for few rows. Where the default itself splits the row over a cluster (long vocabularies),
        the cluster seeds come first, small blocks and, for 16-bit logits, 8-byte vectors among
        them: those won on 151936 and 256000 words (BENCHMARKS.md, issue 43), and a tune of a few
        dozen trials measures little beyond its seeds."""
        base = self.default_params(problem, target)
        whole = {"split": 1, "combine": "none", "unroll": 1}
        rows: list[dict[str, ParamValue]] = []
        for threads in (128, 256, 512, 1024):
            rows.append({**whole, "storage": "registers", "threads": threads})
            rows.append({**whole, "storage": "registers", "threads": threads, "streaming": True})
            rows.append({**whole, "storage": "smem", "threads": threads})
        for threads in (256, 512, 1024):
            for unroll in (2, 4, 8):
                rows.append({**whole, "storage": "reread", "threads": threads, "unroll": unroll})
                rows.append({**whole, "storage": "reread", "threads": threads, "unroll": unroll, "streaming": True})
        clusters: list[dict[str, ParamValue]] = []
        for split in (2, 4, 8, 16):
            for threads in (256, 512, 1024):
                for storage in ("registers", "smem"):
                    clusters.append({"split": split, "combine": "cluster", "threads": threads, "storage": storage,
                                     "unroll": 1})
        long_row = base["combine"] == "cluster"
        if long_row:  # staged over 8 or 16 blocks of few threads, first, then partly held in registers
            vecs = (base["vec"], int(base["vec"]) // 2) if ITEMSIZE[problem.dtype] == 2 else (base["vec"],)
            staged = [{"split": split, "combine": "cluster", "threads": threads, "storage": "smem", "unroll": 1,
                       "vec": vec} for vec in vecs for split in (8, 16) for threads in (128, 256)]
            hybrid = [{"split": split, "combine": "cluster", "threads": threads, "storage": "hybrid", "held": held,
                       "unroll": 1} for split in (16, 8) for threads in (256, 512) for held in (4, 8)]
            clusters = staged + hybrid + clusters
        grids: list[dict[str, ParamValue]] = []
        for split in (2, 4, 8, 16, 32, 64):  # the space keeps those whose grid is resident at once
            for threads in (512, 1024):
                grids.append({"split": split, "combine": "grid", "threads": threads, "storage": "registers",
                              "unroll": 1})
        first, then = (clusters, rows) if long_row else (rows, clusters)
        return valid_neighbours(self, problem, target, base, [{"streaming": True}, *first, *then, *grids])

    # --- costs ---------------------------------------------------------------------------------
    def bytes_moved(self, problem: Problem) -> int:
        """The logits read once and their gradient written once (the targets and the per-row
        outputs are a rounding error beside them)."""
        m, n = problem.shape
        return 2 * m * n * ITEMSIZE[problem.dtype]

    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        m, _ = problem.shape
        grad = (m, 0) if problem.option("loss_only") else problem.shape
        return {"loss": ((m,), "float32"), "lse": ((m,), "float32"), "grad": (grad, problem.dtype)}

    # --- verification (on the GPU through CuPy; NumPy works too: xp is the array module) ---------
    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]:
        """Random logits (x50 for `large`; 20% -inf for `neg_inf`, every row keeping a finite
        entry and some targets on -inf: an infinite loss), random targets with about one row in
        eight ignored, the scale of a mean over the rows kept; `smoothed` and `neg_inf` set label
        smoothing and a z-loss, and `smoothed` a non-default ignore_index. rng: xp's Generator."""
        m, n = problem.shape
        x = rng.standard_normal((m, n), dtype=np.float32) * 2
        t = rng.integers(0, n, size=m)
        ignore_index, eps, z = -100, 0.0, 0.0
        if kind == "large":
            x *= 50
        elif kind == "smoothed":
            ignore_index, eps, z = n // 2, 0.1, 1e-3
        elif kind == "neg_inf":
            x[rng.random((m, n)) < 0.2] = -np.inf
            rows = xp.arange(m)
            x[rows, (rows * 7 + 3) % n] = 1.0  # every row keeps a finite entry
            eps, z = 0.05, 1e-4
        t[rng.random(m) < 0.125] = ignore_index
        kept = int((t != ignore_index).sum())
        target = t.astype(np.int32 if problem.option("int32_target") else np.int64)
        return {"logits": to_storage(x, problem.dtype, xp), "target": target,
                "scale": xp.asarray(np.array([1.0 / max(kept, 1)], dtype=np.float32)),
                "ignore_index": np.int64(ignore_index), "label_smoothing": np.float32(eps), "z_loss": np.float32(z)}

    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
        """loss, lse and grad against `reference` in float64 from the stored logits, CHECK_ROWS
        rows at a time (float64 copies of the whole logits would not fit beside them)."""
        m = problem.shape[0]
        for start in range(0, m, CHECK_ROWS):
            rows = slice(start, min(m, start + CHECK_ROWS))
            wrong = self._check_rows(problem, inputs, outputs, rows, xp)
            if wrong:
                return wrong if start == 0 else f"rows from {start}: {wrong}"
        return None

    def _check_rows(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], rows: slice,
                    xp: Any) -> str | None:
        """lse within FP32_COEF (|lse| + 1); the loss within FP32_COEF times the magnitudes of its
        terms; the gradient within its rounding to the dtype plus FP32_COEF scale p (1 + 2z|lse|)
        (1 + |x - lse|), an exponential's error from its argument's. Equal infinities match."""
        x = to_float64(inputs["logits"][rows], problem.dtype, xp)
        t = inputs["target"][rows].astype(np.int64)
        ignore, eps, z = int(inputs["ignore_index"]), float(inputs["label_smoothing"]), float(inputs["z_loss"])
        scale = float(inputs["scale"][0])
        loss_ref, lse_ref, grad_ref = reference(x, t, ignore, eps, z, scale, xp)
        lse = outputs["lse"][rows].astype(np.float64)
        loss = outputs["loss"][rows].astype(np.float64)
        kept = t != ignore
        wrong = _worst_row("lse", lse, lse_ref, FP32_COEF * (xp.abs(lse_ref) + 1), xp)
        if wrong:
            return wrong
        # the terms' finite magnitudes (an infinite loss must be matched exactly)
        finite = xp.where(xp.isfinite(x), xp.abs(x), 0.0)
        xt = xp.where(kept, finite[xp.arange(x.shape[0]), xp.where(kept, t, 0)], 0.0)
        terms = xp.abs(lse_ref) + xt + eps * finite.mean(axis=1) + z * lse_ref ** 2 + 1
        wrong = _worst_row("loss", loss, loss_ref, FP32_COEF * terms, xp)
        if wrong or problem.option("loss_only"):
            return wrong
        rtol, abs_atol = GRAD_TOLERANCE[problem.dtype]
        grad = to_float64(outputs["grad"][rows], problem.dtype, xp)
        with np.errstate(invalid="ignore"):
            p = xp.exp(x - lse_ref[:, None])
            spread = xp.where(p > 0, 1 + xp.abs(x - lse_ref[:, None]), 0.0)
        tol = rtol * xp.abs(grad_ref) + FP32_COEF * scale * p * (1 + 2 * z * xp.abs(lse_ref[:, None])) * spread \
            + FP32_COEF * scale * (eps / x.shape[1] + 2 ** -20) + abs_atol
        return worst_mismatch(grad, grad_ref, xp.abs(grad - grad_ref), tol, xp)


def _worst_row(what: str, got: Any, ref: Any, tol: Any, xp: Any) -> str | None:
    """None when every row's value is within tol of ref (equal infinities match), else the worst."""
    same = got == ref  # equal infinities
    with np.errstate(invalid="ignore"):
        err = xp.where(same, 0.0, xp.abs(got - ref))
    bad = ~(err <= tol)
    if not bool(bad.any()):
        return None
    r = int(xp.argmax(xp.where(bad, xp.nan_to_num(err, nan=np.inf), -1.0)))
    return (f"{what}: {int(bad.sum())} of {got.size} rows off; worst row {r}: got {float(got[r])!r}, "
            f"expected {float(ref[r])!r} (tolerance {float(tol[r]):.3g})")


def reference(x: Any, target: Any, ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
              scale: float = 1.0, xp: Any = np) -> tuple[Any, Any, Any]:
    """(loss, lse, grad) of (M, N) float64 logits x and M int targets, as the kernels define them:
    per-row loss (0 where ignored), lse, and grad = scale * d(loss)/dx (0 where ignored). A target
    outside [0, N) that is not ignored gives NaN. NumPy or CuPy (xp)."""
    m, n = x.shape
    rows = xp.arange(m)
    kept = target != ignore_index
    in_range = (target >= 0) & (target < n)
    mx = x.max(axis=1)
    ms = xp.where(xp.isfinite(mx), mx, 0.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lse = ms + xp.log(xp.exp(x - ms[:, None]).sum(axis=1))
        xt = x[rows, xp.where(in_range, target, 0)]
        loss = (1 - label_smoothing) * (lse - xt) + z_loss * lse ** 2
        if label_smoothing:
            loss = loss + label_smoothing * (lse - x.mean(axis=1))
        loss = xp.where(kept, xp.where(in_range, loss, np.nan), 0.0)
        p = xp.exp(x - lse[:, None])
        grad = p * (1 + 2 * z_loss * lse[:, None]) - label_smoothing / n
        grad[rows, xp.where(in_range, target, 0)] -= xp.where(in_range, 1 - label_smoothing, 0.0)
        grad = xp.where(kept[:, None], grad * scale, 0.0)
    return loss, lse, grad


CROSS_ENTROPY = register(CrossEntropyFamily())


# --- the torch operator: torch.ops.autosoft.cross_entropy ----------------------------------------

def _operator_call(logits: Any, target: Any, scale: Any, ignore_index: int, label_smoothing: float,
                   z_loss: float) -> OperatorCall:
    """The operator's arguments as the family's call: the target's dtype sets int32_target."""
    options: dict[str, OptionValue] = {"int32_target": True} if str(target.dtype) == "torch.int32" else {}
    return OperatorCall((logits, target, scale), options,
                        {"ignore_index": np.int64(ignore_index), "label_smoothing": np.float32(label_smoothing),
                         "z_loss": np.float32(z_loss)})


def _logits_gradient(ops: Any, saved: Mapping[str, Any], grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """d/d logits of the per-row losses weighted by their incoming gradient: the kernel's grad is
    scale times each row's own, so the weight is divided by the scale (a row's lse gets none)."""
    grad_loss, grad = grads[0], saved["grad"]
    if grad_loss is None:
        return None, None, None, None, None, None
    weight = grad_loss.unsqueeze(-1) / saved["scale"]
    return grad * weight.to(grad.dtype), None, None, None, None, None


CrossEntropyFamily.torch_operators = (
    TorchOperator("cross_entropy", "cross_entropy",
                  "(Tensor logits, Tensor target, Tensor scale, int ignore_index, float label_smoothing, "
                  "float z_loss) -> (Tensor loss, Tensor lse, Tensor grad)", _operator_call,
                  backward=Backward(("grad", "scale"), _logits_gradient)),
)
CrossEntropyFamily.public_functions = ("autosoft.functions.cross_entropy:cross_entropy",
                                       "autosoft.functions.cross_entropy:linear_cross_entropy")
