"""The backward of softmax and of log-softmax over the last dimension of an (M, N) array.

softmax:      dx = y * (dy - sum_row(dy * y))
log-softmax:  dx = dy - exp(y) * sum_row(dy)     (problem option `log`; y is the log-softmax output)

y, dy and dx share one dtype (fp32, fp16, bf16); arithmetic is fp32. A memory-bound family: every
kernel reads y and dy once from memory and writes dx once, so it is compared with a copy of
3 * M * N elements.
"""
from __future__ import annotations

import itertools
from typing import Any, Mapping

import numpy as np

from ..dtypes import ITEMSIZE, SHORT as _SHORT, to_float64, to_storage
from ..errors import UserError
from ..operators import OperatorCall, TorchOperator
from ..space import ParamValue
from . import register
from ._rows import INT32_MAX, VEC_BITS_TYPE, RowsFamily, pow2_ceil, pow2_floor, worst_mismatch
from .base import Launch, Problem, ProblemOption, Target, valid_neighbours


# Tolerance per dtype, as |dx - ref| <= rtol*|ref| + coef*scale_i + abs_atol, where scale_i bounds
# what an fp32 kernel's rounding can do to element i besides the final rounding (see `check`):
# rtol covers the rounding of dx to its dtype (half an ulp: 2^-24, 2^-11, 2^-8), coef the fp32
# row sum (a thread adds up to a few hundred terms in order, then a tree: ~(terms + log2) * 2^-24
# of the sum of the terms' magnitudes) and ex2.approx; abs_atol the flushed fp32 subnormals
# (--use_fast_math) and one fp16 subnormal step.
TOLERANCE = {
    "float32": (2e-6, 2e-5, 1e-37),
    "float16": (1e-3, 2e-5, 6e-8),
    "bfloat16": (4e-3, 2e-5, 1e-37),
}


class SoftmaxBackwardFamily(RowsFamily):
    """The backward of softmax (or of log-softmax, --log): dx from y and dy, row by row.

    y = softmax(x) (log_softmax(x) with `log`) and dy are (M, N) arrays of one dtype; the
    reductions run over the last dimension."""
    name = "softmax_backward"
    template = "softmax_backward/softmax_backward.cu.j2"
    inputs = ("y", "dy")
    outputs = ("dx",)
    input_kinds = ("normal", "normal_x100", "neg_inf", "equal_rows")
    # y, dy and dx 16-byte aligned (dx always shares y's alignment): a row then starts equally far
    # from a vector boundary in all three, and one scalar head and tail per row serves them all.
    input_alignment = 16
    options = (ProblemOption("log", "the backward of log-softmax: y is log_softmax(x), dx = dy - exp(y) * sum(dy)"),)
    examples = (("1x1", "float32", {}), ("7x1025", "float16", {"log": True}), ("3x33", "bfloat16", {}),
                ("4096x8192", "float32", {}), ("4097x8192", "bfloat16", {"log": True}), ("65536x64", "float16", {}),
                ("32x131072", "float32", {}), ("1x1048576", "bfloat16", {}), ("4096x50257", "float16", {"log": True}))

    # --- problems --------------------------------------------------------------------------
    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]:
        m, n = problem.shape
        return {"M": m, "N": n, "itemsize": ITEMSIZE[problem.dtype], "smem_limit": target.smem_optin - 4096,
                "arch": int(target.arch), "sm_count": target.sm_count}

    # --- variants ----------------------------------------------------------------------------
    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        p = params
        name = (f"softmax_backward_{_SHORT[problem.dtype]}_t{p['threads']}_g{p['row_threads']}_v{p['vec']}"
                f"_u{p['unroll']}_{p['storage']}")
        if problem.option("log"):
            name += "_log"
        if p["chunks"] != 1:
            name += f"_c{p['chunks']}"
        if p["split"] != 1:
            name += f"_{p['combine']}{p['split']}"
        if p["persistent"]:
            name += "_persistent"
        if p["streaming"]:
            name += "_cs"
        return name

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        # 16-bit vectors of two or more elements are converted as packed pairs
        pairs = ITEMSIZE[problem.dtype] == 2 and values["vec"] >= 2
        return {**values, "dtype": problem.dtype, "log": bool(problem.option("log", False)),
                "vec_bits_type": VEC_BITS_TYPE[values["vec_bytes"]], "pairs": pairs}

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        m = problem.shape[0]
        threads, split, smem = values["threads"], values["split"], values["smem_bytes"]
        block = (threads, 1, 1)
        if split > 1 and values["combine"] == "cluster":
            return (Launch("softmax_backward_cluster", (m * split, 1, 1), block, smem, ("y", "dy", "dx", np.int64(m)),
                           split),), 0
        if split > 1:
            # workspace: a partial sum per segment, then an arrival counter per row
            return (Launch("softmax_backward_grid", (m * split, 1, 1), block, smem,
                           ("y", "dy", "dx", "workspace", np.int64(m)), cooperative=True),), m * split * 4 + m * 4
        blocks = -(-m // values["rows_per_block"])
        if values["persistent"]:
            blocks = min(blocks, target.sm_count * values["blocks_per_sm"])
        if blocks > INT32_MAX:
            raise UserError(f"{problem.shape_text}: too many rows for one launch; use a persistent variant")
        return (Launch("softmax_backward_rows", (blocks, 1, 1), block, smem, ("y", "dy", "dx", np.int64(m))),), 0

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue]:
        """A sensible variant without tuning: 16-byte vectors, about four vectors per thread held
        in registers, streamed passes for rows too long for that, and few wide rows split over a
        cluster (sm_90) or a cooperative grid."""
        m, n = problem.shape
        vec = min(16 // ITEMSIZE[problem.dtype], pow2_floor(n))
        vectors = -(-n // vec)
        p: dict[str, ParamValue] = {
            "threads": 128, "row_threads": 32, "vec": vec, "unroll": 1, "storage": "registers", "chunks": 1,
            "split": 1, "combine": "none", "persistent": False, "streaming": False,
        }
        if vectors <= 32:
            p["row_threads"] = max(vec, pow2_ceil(vectors))
        else:  # about four vectors per thread: all loads in flight, row held in registers
            p["row_threads"] = min(1024, max(32, pow2_ceil(-(-vectors // 4))))
            p["threads"] = max(128, p["row_threads"])
        if m * 2 < target.sm_count and n >= 16384:
            # few wide rows: enough blocks per row to fill the GPU, ~2-4 vectors per thread each;
            # the largest split that holds its segment in registers: over a cluster on sm_90 (no
            # residency needed), else over a cooperative grid that is resident at once
            # (~2048 elements a block: the split nearest that, larger first, that is valid)
            most = min(pow2_floor(max(1, 2 * target.sm_count // m)), 256)
            aim = min(most, pow2_floor(max(1, -(-n // (vec * 2048)))))
            splits = sorted((1 << k for k in range(1, most.bit_length())),
                            key=lambda s: (abs(s.bit_length() - aim.bit_length()), -s))
            combines = ("cluster", "grid") if int(target.arch) >= 90 else ("grid",)
            # then, for rows whose y and dy outgrow the registers of the blocks that can wait for
            # each other (float32 8x500000), segments streamed twice, the second time from L2
            ways = itertools.product(({"storage": "registers", "unroll": 1}, {"storage": "reread", "unroll": 2}),
                                     splits, combines, (1024, 512))
            for storage, split, combine, threads in ways:
                candidate = {**p, **storage, "threads": threads, "row_threads": threads, "split": split,
                             "combine": combine}
                if self.is_valid(problem, target, candidate):
                    return candidate
        if not self.is_valid(problem, target, p):
            # too long for the registers of one block: staged in shared memory a row per block,
            # else held in registers over a cluster of two, else staged over a cluster (on the
            # H200: 4096x50257 bfloat16 staged 94.6% of copy; 4096x32768 float32 over a cluster
            # held 94.9%, staged 84.5%; 4096x50257 float32 staged over a cluster of 2 90.8%,
            # held over a cluster of 4 75.3%)
            staged = {**p, "storage": "smem", "threads": 512, "row_threads": 512, "chunks": 4}
            held = {**p, "threads": 1024, "row_threads": 1024, "split": 2, "combine": "cluster"}
            clusters = [{**staged, "threads": 256, "row_threads": 256, "chunks": 1, "split": split,
                         "combine": "cluster"} for split in (2, 4, 8, 16)]
            for candidate in (staged, *((held, *clusters) if int(target.arch) >= 90 else ())):
                if self.is_valid(problem, target, candidate):
                    return candidate
            p.update(storage="reread", unroll=2)
        return self._first_valid(problem, target, p)

    def seed_params(self, problem: Problem, target: Target) -> list[dict[str, ParamValue]]:
        """Structured starting points the tuner measures first: rows held in registers by groups
        of every size (also with evict-first accesses, and persistent), rows streamed twice with
        more loads in flight, rows and split rows staged in shared memory, and splits over a
        cluster or a cooperative grid for wide rows, held or streamed twice."""
        base = self.default_params(problem, target)
        held: dict[str, ParamValue] = {"storage": "registers", "unroll": 1, "chunks": 1, "split": 1, "combine": "none",
                                       "persistent": False}
        streamed: dict[str, ParamValue] = {"storage": "reread", "chunks": 1, "split": 1, "combine": "none",
                                           "persistent": False}
        staged: dict[str, ParamValue] = {**held, "storage": "smem"}
        changes: list[dict[str, ParamValue]] = [{"persistent": True}, {"streaming": True}]
        if problem.shape[1] * ITEMSIZE[problem.dtype] > 64 * 1024:
            # rows whose y and dy pass 128 KiB outgrow one block's registers: one of each way to
            # hold them first (the H200 sweep's winners of such rows and their near neighbours),
            # then the rest
            changes += [{**held, "combine": "cluster", "split": 2, "threads": 1024, "row_threads": 1024},
                        {**streamed, "row_threads": 512, "threads": 512, "unroll": 4, "streaming": True},
                        {**staged, "row_threads": 1024, "threads": 1024, "chunks": 2},
                        {**staged, "row_threads": 512, "threads": 512, "chunks": 4},
                        {**staged, "combine": "cluster", "split": 2, "threads": 256, "row_threads": 256},
                        {**staged, "combine": "cluster", "split": 4, "threads": 512, "row_threads": 512, "chunks": 2},
                        {**staged, "combine": "cluster", "split": 2, "threads": 1024, "row_threads": 1024, "chunks": 4},
                        {**held, "combine": "cluster", "split": 4, "threads": 1024, "row_threads": 1024},
                        {**streamed, "row_threads": 1024, "threads": 1024, "unroll": 2}]
        for g in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            changes.append({**held, "row_threads": g, "threads": max(g, 128)})
            changes.append({**held, "row_threads": g, "threads": max(g, 128), "streaming": True})
            changes.append({**held, "row_threads": g, "threads": max(g, 256), "persistent": True})
        for g in (256, 512, 1024):
            for unroll in (2, 4, 8):
                changes.append({**streamed, "row_threads": g, "threads": g, "unroll": unroll})
                changes.append({**streamed, "row_threads": g, "threads": g, "unroll": unroll, "streaming": True})
        for split in (2, 4, 8, 16):
            for threads in (256, 512, 1024):
                changes.append({**held, "combine": "cluster", "split": split, "threads": threads,
                                "row_threads": threads})
        for g in (128, 256, 512, 1024):  # the space keeps the slots that fit
            for chunks in (1, 2, 4):
                changes.append({**staged, "row_threads": g, "threads": g, "chunks": chunks})
        for split in (2, 4, 8, 16):
            for threads in (256, 512, 1024):
                for chunks in (1, 2, 4):
                    changes.append({**staged, "combine": "cluster", "split": split, "threads": threads,
                                    "row_threads": threads, "chunks": chunks})
        for split in (2, 4, 8, 16, 32, 64, 128, 256):  # the space keeps those whose grid fits the GPU
            for threads in (256, 512, 1024):
                changes.append({**held, "combine": "grid", "split": split, "threads": threads,
                                "row_threads": threads})
        for split in (8, 16, 32, 64, 128):  # split and streamed twice: rows past the registers' reach
            for threads in (512, 1024):
                changes.append({**streamed, "combine": "cluster" if split <= 16 else "grid", "split": split,
                                "threads": threads, "row_threads": threads, "unroll": 2})
        return valid_neighbours(self, problem, target, base, changes)

    def _first_valid(self, problem: Problem, target: Target, p: dict[str, ParamValue]) -> dict[str, ParamValue]:
        # Walk towards the plainest variant until every constraint holds; the last step is valid for any N.
        return self.first_valid(problem, target, p, (
            {"unroll": 1}, {"storage": "reread", "unroll": 1, "chunks": 1},
            {"split": 1, "combine": "none", "threads": 128, "row_threads": 32, "persistent": False},
            {"vec": 1, "threads": 32, "row_threads": 1}))

    # --- costs -------------------------------------------------------------------------------
    def bytes_moved(self, problem: Problem) -> int:
        m, n = problem.shape
        return 3 * m * n * ITEMSIZE[problem.dtype]  # read y and dy, write dx

    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"dx": (problem.shape, problem.dtype)}

    # --- verification (on the GPU through CuPy; NumPy works too: xp is the array module) -----
    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]:
        """y: the softmax (log-softmax with `log`) of random x, computed in float64 and rounded
        once to the dtype; dy: random normal. `neg_inf` puts -inf in x (y = 0, or -inf with
        `log`), every row keeping one finite entry."""
        m, n = problem.shape
        x = rng.standard_normal((m, n), dtype=np.float32).astype(np.float64)
        if kind == "normal_x100":
            x *= 100
        elif kind == "neg_inf":
            x[rng.random((m, n)) < 0.2] = -np.inf
            x[xp.arange(m), xp.arange(m) % n] = 1.0
        elif kind == "equal_rows":
            x[::3] = 3.25
        shifted = x - x.max(axis=1, keepdims=True)
        if problem.option("log"):
            y = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        else:
            y = xp.exp(shifted)
            y /= y.sum(axis=1, keepdims=True)
        dy = rng.standard_normal((m, n), dtype=np.float32)
        return {"y": _store(y, problem.dtype), "dy": to_storage(dy, problem.dtype, xp)}

    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
        """dx against a float64 reference from the stored y and dy. Besides dx's own rounding
        (rtol), an fp32 kernel's error in element i is bounded by the error of its row sum s,
        times what multiplies s there, plus the rounding where dy and the s term cancel:
            softmax:  |y_i| * (|dy_i| + sum_j |dy_j * y_j|)
            log:      |dy_i| + e^y_i * (sum_j |dy_j| + |s| * |y_i|)   (|y_i|: ex2's error grows with it)
        each scaled by the dtype's coef. A kernel that drops or misplaces s, or writes nothing
        (poisoned NaN), is far outside this."""
        y = to_float64(inputs["y"], problem.dtype, xp)
        dy = to_float64(inputs["dy"], problem.dtype, xp)
        dx = to_float64(outputs["dx"], problem.dtype, xp)
        if problem.option("log"):
            p = xp.exp(y)  # 0 where y = -inf
            s = dy.sum(axis=1, keepdims=True)
            ref = dy - p * s
            y_mag = xp.where(p > 0, xp.abs(y), 0.0)  # 0 * inf would be NaN
            scale = xp.abs(dy) + p * (xp.abs(dy).sum(axis=1, keepdims=True) + xp.abs(s) * y_mag)
        else:
            s = (dy * y).sum(axis=1, keepdims=True)
            ref = y * (dy - s)
            scale = xp.abs(y) * (xp.abs(dy) + xp.abs(dy * y).sum(axis=1, keepdims=True))
        rtol, coef, abs_atol = TOLERANCE[problem.dtype]
        tol = rtol * xp.abs(ref) + coef * scale + abs_atol
        return worst_mismatch(dx, ref, xp.abs(dx - ref), tol, xp)


def _store(values64: Any, dtype: str) -> Any:
    """float64 values rounded once to the dtype's storage (bf16 as uint16 bits): for fp32 and
    fp16 a direct cast; for bf16 through fp32, whose rounding first can only move a value that
    lies within 2^-29 relative of a bf16 rounding boundary."""
    if dtype == "float32":
        return values64.astype(np.float32)
    if dtype == "float16":
        return values64.astype(np.float16)
    return to_storage(values64.astype(np.float32), dtype, None)


SOFTMAX_BACKWARD = register(SoftmaxBackwardFamily())


# --- the torch operator (autosoft.torch_ops registers it) ---------------------------------------

def _along(y: Any, dy: Any, dim: int, log: bool) -> OperatorCall:
    """dx of the softmax (log: the log-softmax) along dim from its output y and dy."""
    if y.shape != dy.shape:
        raise ValueError(f"autosoft.softmax_backward: y {tuple(y.shape)} and dy {tuple(dy.shape)} differ in shape")
    return OperatorCall((y, dy), {"log": True} if log else {}, dim=dim)


SoftmaxBackwardFamily.torch_operators = (
    TorchOperator("softmax_backward", "softmax_backward", "(Tensor y, Tensor dy, int dim, bool log) -> Tensor", _along,
                  instead="softmax"),
)
