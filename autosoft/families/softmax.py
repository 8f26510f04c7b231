"""Softmax over the last dimension of an (M, N) array: fp32, fp16 and bf16 in, fp32 arithmetic.
With the problem option `log`, the log-softmax: the same kernels, whose write pass emits
x - max - log(sum) instead of e^(x - max) / sum."""
from __future__ import annotations

from functools import partial
from typing import Any, Mapping

import numpy as np

from ..dtypes import ITEMSIZE, SHORT as _SHORT, to_float64, to_storage
from ..errors import UserError
from ..operators import Backward, OperatorCall, TorchOperator
from ..space import ParamValue
from . import register
from ._rows import INT32_MAX, VEC_BITS_TYPE, RowsFamily, pow2_ceil, pow2_floor, worst_mismatch
from .base import Launch, Problem, ProblemOption, Target, valid_neighbours

_SPLIT_NAMES = {"launches": "split", "cluster": "cluster", "grid": "grid"}  # in variant names: _split64

# Tolerance per output dtype: |y - ref| <= rtol*|ref| + row_atol*max(ref in row) + abs_atol.
# fp16/bf16 are dominated by the rounding of the output (half an ulp: 2^-11, 2^-8).
TOLERANCE = {
    "float32": (1e-4, 1e-6, 1e-37),
    "float16": (1.5e-3, 1e-4, 6e-8),   # 6e-8: one fp16 subnormal step
    "bfloat16": (8e-3, 1e-4, 1e-37),
}

# The log-softmax's tolerance: |y - ref| <= LOG_RTOL*|ref| (the output's rounding) + LOG_ATOL*(the
# row's largest finite |x - max| + 1) (fp32 arithmetic on x - max and log(sum)).
LOG_RTOL = {"float32": 2e-6, "float16": 1.5e-3, "bfloat16": 8e-3}
LOG_ATOL = {"float32": 1e-6, "float16": 1e-4, "bfloat16": 1e-4}


class SoftmaxFamily(RowsFamily):
    """y = softmax(x) over the last dimension of an (M, N) array, or y = log_softmax(x) with the
    option `log` (`--log` on the command line); leading dimensions of a caller's array are flattened into M."""
    name = "softmax"
    template = "softmax/softmax.cu.j2"
    inputs = ("x",)
    outputs = ("y",)
    options = (ProblemOption("log", "the log-softmax: y = x - max - log(sum of e^(x - max)) over each row"),)
    input_kinds = ("normal", "normal_x100", "neg_inf", "equal_rows")
    input_alignment = 1  # a row that starts mid-vector gets a scalar prefix
    examples = (("1x1", "float32", {}), ("7x1025", "float16", {}), ("3x33", "bfloat16", {}),
                ("4096x8192", "float32", {}), ("4097x8192", "bfloat16", {}), ("65536x64", "float16", {}),
                ("32x131072", "float32", {}), ("1x1048576", "bfloat16", {}), ("4096x50257", "float16", {}),
                ("7x1025", "float32", {"log": True}), ("4096x8192", "bfloat16", {"log": True}),
                ("32x131072", "float16", {"log": True}))

    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]:
        m, n = problem.shape
        # 4 KiB stays free for the static reduction scratch
        return {"M": m, "N": n, "itemsize": ITEMSIZE[problem.dtype], "smem_limit": target.smem_optin - 4096,
                "arch": int(target.arch), "sm_count": target.sm_count, "log": "log" in problem.flags}

    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        p = params
        name = (f"{'log_' if problem.option('log') else ''}softmax_{_SHORT[problem.dtype]}_t{p['threads']}_g{p['row_threads']}_v{p['vec']}"
                f"_u{p['unroll']}_{p['storage']}_{p['normalise']}_{p['reduce']}")
        if p["split"] != 1:
            name += f"_{_SPLIT_NAMES[p['combine']]}{p['split']}"
        if p["persistent"]:
            name += "_persistent"
        if p["chunks"] != 1:
            name += f"_c{p['chunks']}"
        if p["prefetch"]:
            name += "_prefetch"
        if p["keep_exp"]:
            name += "_keep"
        if p["streaming"]:
            name += "_cs"
        if p["stagger"]:
            name += f"_stagger{p['stagger']}"
        return name

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        # 16-bit vectors of two or more elements are handled as packed pairs
        pairs = ITEMSIZE[problem.dtype] == 2 and values["vec"] >= 2
        return {**values, "dtype": problem.dtype, "vec_bits_type": VEC_BITS_TYPE[values["vec_bytes"]], "pairs": pairs}

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        m = problem.shape[0]
        threads, split = values["threads"], values["split"]
        block = (threads, 1, 1)
        if split > 1 and values["combine"] == "cluster":
            return (Launch("softmax_cluster", (m * split, 1, 1), block, 0, ("x", "y", np.int64(m)), split),), 0
        if split > 1 and values["combine"] == "grid":
            # workspace: a (max, sum) pair per segment, then an arrival counter per row
            return (Launch("softmax_grid", (m * split, 1, 1), block, 0, ("x", "y", "workspace", np.int64(m)),
                           cooperative=True),), m * split * 8 + m * 4
        if split > 1:
            grid = (m * split, 1, 1)
            partial = Launch("softmax_partials", grid, block, 0, ("x", "workspace", np.int64(m)))
            finish = Launch("softmax_finish", grid, block, 0, ("x", "y", "workspace", np.int64(m)))
            return (partial, finish), m * split * 8
        blocks = -(-m // values["rows_per_block"])
        if values["persistent"]:
            blocks = min(blocks, target.sm_count * values["blocks_per_sm"])
        if blocks > INT32_MAX:
            raise UserError(f"{problem.shape_text}: too many rows for one launch; use a persistent variant")
        return (Launch("softmax_rows", (blocks, 1, 1), block, values["smem_bytes"], ("x", "y", np.int64(m))),), 0

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue]:
        """A sensible variant without tuning: 16-byte accesses, enough threads, row kept on chip."""
        m, n = problem.shape
        itemsize = ITEMSIZE[problem.dtype]
        vec = min(16 // itemsize, pow2_floor(n))
        vectors = -(-n // vec)
        p: dict[str, ParamValue] = {
            "threads": 128, "row_threads": 32, "vec": vec, "unroll": 1, "storage": "registers",
            "normalise": "three_pass", "reduce": "shuffle", "split": 1, "combine": "launches", "persistent": False,
            "streaming": False, "prefetch": False, "chunks": 1, "keep_exp": False, "stagger": 0,
        }
        if vectors <= 32:
            p["row_threads"] = max(vec, pow2_ceil(vectors))
        else:  # about four vectors per thread: all loads in flight, row held in registers
            p["row_threads"] = min(1024, max(32, pow2_ceil(-(-vectors // 4))))
            p["threads"] = max(128, p["row_threads"])
        if m * 2 < target.sm_count and n >= 65536:
            # few wide rows: enough blocks per row to fill the GPU, ~2 vectors per thread each
            split = min(pow2_floor(max(1, 2 * target.sm_count // m)), pow2_floor(max(1, n // (vec * 2048))))
            p.update(threads=1024, row_threads=1024, split=split, storage="reread", normalise="online", unroll=2)
        elif -(-vectors // p["row_threads"]) * vec > 32:
            p.update(storage="reread", normalise="online", unroll=2)
        return self._first_valid(problem, target, p)

    def seed_params(self, problem: Problem, target: Target) -> list[dict[str, ParamValue]]:
        """Structured starting points the tuner measures first: the row staged in shared memory
        (whole, or worked on in 4 or 8 chunks as they land), held in registers by groups of every size
        (also with evict-first accesses), big rows with a staggered first wave, splits over a
        cluster or a cooperative grid, and two-launch splits for few wide rows."""
        base = self.default_params(problem, target)
        on_chip = {"storage": "registers", "normalise": "three_pass", "unroll": 1, "split": 1,
                   "combine": "launches", "persistent": False}
        staged = {"storage": "smem", "normalise": "three_pass", "unroll": 1, "split": 1, "combine": "launches"}
        changes: list[dict[str, ParamValue]] = [{"persistent": True}, {"streaming": True}]
        arriving = {**staged, "normalise": "online", "chunks": 4}  # the first pass works on chunks as they land
        for g in (256, 512, 1024):
            changes.append({**staged, "row_threads": g, "threads": g, "keep_exp": True})
            changes.append({**staged, "row_threads": g, "threads": g})
            changes.append({**arriving, "row_threads": g, "threads": g, "keep_exp": True})
            changes.append({**arriving, "row_threads": g, "threads": g})
            changes.append({**arriving, "row_threads": g, "threads": g, "stagger": 2000})
        # Eight chunks of a staged row, reduced through shared memory, every other first-wave block
        # 1 us late: the family's fastest variant for 1024x32768 bfloat16 log rows in each of three
        # runs on the H200 (scans of 61 and 181 variants, a probe of 4; benchmarks/results/log_write_ab/),
        # ahead of every seed above. Twenty-four trials measure it: the default and 23 seeds.
        changes.append({**arriving, "row_threads": 512, "threads": 512, "chunks": 8, "reduce": "smem", "stagger": 1000})
        for g in (8, 16, 32, 64, 128, 256, 512, 1024):
            for keep in (True, False):
                changes.append({**on_chip, "row_threads": g, "threads": max(g, 128), "keep_exp": keep})
            changes.append({**on_chip, "row_threads": g, "threads": max(g, 128), "keep_exp": True, "streaming": True})
        changes.append({**on_chip, "row_threads": 1024, "threads": 1024, "stagger": 2000})
        for split in (2, 4, 8, 16):
            for threads in (256, 512, 1024):
                changes.append({**on_chip, "combine": "cluster", "split": split, "threads": threads,
                                "row_threads": threads})
        for split in (2, 4, 8, 16, 32, 64, 128, 256):  # the space keeps those whose grid fits the GPU
            for threads in (256, 512, 1024):
                changes.append({**on_chip, "combine": "grid", "split": split, "threads": threads,
                                "row_threads": threads})
        if problem.shape[0] * 4 < target.sm_count:
            for split in (32, 64, 128, 256):
                changes.append({"storage": "reread", "normalise": "online", "unroll": 4, "combine": "launches",
                                "split": split, "threads": 512, "row_threads": 512, "persistent": False})
        return valid_neighbours(self, problem, target, base, changes)

    def _first_valid(self, problem: Problem, target: Target, p: dict[str, ParamValue]) -> dict[str, ParamValue]:
        # Walk towards the plainest variant until every constraint holds; the last step is valid for any N.
        return self.first_valid(problem, target, p, (
            {"unroll": 1}, {"storage": "reread", "normalise": "online", "unroll": 1},
            {"split": 1, "combine": "launches", "threads": 128, "row_threads": 32},
            {"vec": 1, "threads": 32, "row_threads": 1}))

    def bytes_moved(self, problem: Problem) -> int:
        m, n = problem.shape
        return 2 * m * n * ITEMSIZE[problem.dtype]

    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"y": (problem.shape, problem.dtype)}

    # --- verification (runs on the GPU through CuPy; xp is the cupy module) ---------------

    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]:
        m, n = problem.shape
        x = rng.standard_normal((m, n), dtype=np.float32)
        if kind == "normal_x100":
            x *= 100
        elif kind == "neg_inf":
            x[rng.random((m, n)) < 0.2] = -np.inf
            x[xp.arange(m), xp.arange(m) % n] = 1.0  # every row keeps one finite entry
        elif kind == "equal_rows":
            x[::3] = 3.25
        return {"x": to_storage(x, problem.dtype, xp)}

    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
        x = to_float64(inputs["x"], problem.dtype, xp)
        y = to_float64(outputs["y"], problem.dtype, xp)
        rtol, row_atol, abs_atol = TOLERANCE[problem.dtype]
        if problem.option("log"):
            shifted = x - x.max(axis=1, keepdims=True)
            ref = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
            # x - max - log(sum) in fp32: the rounding of x - max and of log(sum), up to the row's
            # largest finite |x - max|, then the output's own rounding
            finite = xp.isfinite(shifted)
            scale = xp.where(finite, xp.abs(shifted), 0.0).max(axis=1, keepdims=True) + 1.0
            tol = LOG_RTOL[problem.dtype] * xp.abs(xp.where(finite, ref, 0.0)) + LOG_ATOL[problem.dtype] * scale
            both = xp.isneginf(ref) & xp.isneginf(y)  # x = -inf gives -inf
            err = xp.abs(xp.where(both, 0.0, y) - xp.where(both, 0.0, ref))
        else:
            ref = xp.exp(x - x.max(axis=1, keepdims=True))
            ref /= ref.sum(axis=1, keepdims=True)
            tol = rtol * xp.abs(ref) + row_atol * ref.max(axis=1, keepdims=True) + abs_atol
            err = xp.abs(y - ref)
        return worst_mismatch(y, ref, err, tol, xp)


SOFTMAX = register(SoftmaxFamily())


# --- the torch operators (autosoft.torch_ops registers them) -----------------------------------

def _along(x: Any, dim: int) -> OperatorCall:
    return OperatorCall((x,), dim=dim)


def _log_along(x: Any, dim: int) -> OperatorCall:
    return OperatorCall((x,), {"log": True}, dim=dim)


def _gradient(log: bool, ops: Any, saved: Mapping[str, Any], grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """dx from y alone: the softmax_backward family, dx = y (dy - sum(dy y)), or for the log-softmax
    dx = dy - e^y sum(dy); dim has no gradient."""
    return ops.softmax_backward(saved["y"], grads[0], saved["dim"], log), None


SoftmaxFamily.torch_operators = (
    TorchOperator("softmax", "softmax", "(Tensor x, int dim) -> Tensor", _along,
                  backward=Backward(("y", "dim"), partial(_gradient, False)), plan_options={}),
    TorchOperator("log_softmax", "softmax", "(Tensor x, int dim) -> Tensor", _log_along,
                  backward=Backward(("y", "dim"), partial(_gradient, True)), plan_options={"log": True}),
)
