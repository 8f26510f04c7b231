"""Flash-attention forward, FlashAttention-2 style on tensor cores: fp16 and bf16 in, fp32 arithmetic.

q, k, v are contiguous (B, H, N, D) arrays; the outputs are o (B, H, N, D, the input dtype) and
lse (B, H, N, float32): the natural log of the sum of exp(scale * q.k) over each query's keys.
Problem.flags == ("causal",) masks keys after the query. The scale (default 1/sqrt(D)) is a
kernel argument, bound at run time from the buffer named "scale" (a numpy float32); it must be
positive, since the kernel tracks the running max of the unscaled scores q.k.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

import numpy as np

from ..dtypes import ITEMSIZE, to_float64, to_storage
from ..errors import UserError
from ..space import ParamValue
from . import register
from .base import Family, Launch, OptionValue, Problem, ProblemOption, Target, valid_neighbours

_SHAPE = re.compile(r"^\s*(\d+)\s*[,xX]\s*(\d+)\s*[,xX]\s*(\d+)\s*[,xX]\s*(\d+)\s*$")
_SHORT = {"float16": "f16", "bfloat16": "bf16"}
_MMA_TYPE = {"float16": "f16", "bfloat16": "bf16"}
HEAD_DIMS = (32, 64, 128)
INT32_MAX = 2**31 - 1
GRID_YZ_MAX = 65535

# ||o - ref|| / ||ref|| over the whole output; a single row may be off by ROW_FACTOR times more.
# The error comes from rounding P to the input dtype before P.V and rounding O on output.
TOLERANCE = {"float16": 5e-3, "bfloat16": 1e-2}
ROW_FACTOR = 4.0
LSE_ATOL, LSE_RTOL = 1e-3, 1e-4
_REF_BYTES = 256 << 20  # float64 score block of the reference, per chunk


class AttentionFamily(Family):
    """o = softmax(scale * q k^T [causal]) v and its log-sum-exp, for (B, H, N, D) q, k, v."""
    name = "attention"
    template = "attention/attention.cu.j2"
    inputs = ("q", "k", "v", "scale")
    outputs = ("o", "lse")
    input_kinds = ("normal", "normal_x10", "equal")
    dtypes = ("float16", "bfloat16")
    default_dtype = "bfloat16"
    options = (ProblemOption("causal", "mask keys after the query (key j > query i)"),)
    shape_help = "B,H,N,D (or BxHxNxD): batch, heads, sequence length, head dim, e.g. 1,32,8192,64"
    examples = (("1,1,1,32", "float16", {}), ("1,2,77,64", "bfloat16", {"causal": True}),
                ("3,7,1000,64", "float16", {}), ("1,8,3333,128", "bfloat16", {"causal": True}),
                ("4,16,4096,128", "float16", {}), ("1,32,8192,64", "bfloat16", {"causal": True}))

    # --- problem ------------------------------------------------------------------------

    def parse_shape(self, text: str) -> tuple[int, int, int, int]:
        match = _SHAPE.match(str(text))
        if not match:
            raise UserError(f"malformed --shape {text!r}: attention wants B,H,N,D (or BxHxNxD) with positive "
                            "integers, e.g. 1,32,8192,64")
        return self.check_shape(tuple(int(g) for g in match.groups()), text)

    def check_shape(self, shape: tuple[int, ...], text: Any = None) -> tuple[int, int, int, int]:
        text = text if text is not None else "x".join(map(str, shape))
        if len(shape) != 4 or min(shape) < 1:
            raise UserError(f"malformed --shape {text!r}: B, H, N and D must be at least 1, e.g. 1,32,8192,64")
        b, h, n, d = (int(s) for s in shape)
        if d not in HEAD_DIMS:
            raise UserError(f"shape {text!r}: head dim D={d} is not supported; use one of "
                            f"{', '.join(map(str, HEAD_DIMS))} (pad the heads to the next one)")
        if b > GRID_YZ_MAX or h > GRID_YZ_MAX:
            raise UserError(f"shape {text!r}: B and H must be at most {GRID_YZ_MAX} (fold them into each other)")
        if n * d > INT32_MAX:
            raise UserError(f"shape {text!r}: sequences longer than {INT32_MAX // d} are not supported for D={d}")
        return (b, h, n, d)

    def problem_for(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                    options: Mapping[str, OptionValue]) -> Problem:
        self.check_shapes(shapes)
        return super().problem_for(shapes, dtype, options)

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
        """q's shape when q, k and v are (B, H, N, D) arrays of one shape (empty ones too), else ValueError."""
        q, k, v = (tuple(shapes[n]) for n in ("q", "k", "v"))
        if len(q) != 4 or k != q or v != q:
            raise ValueError(f"autosoft.{self.name}: q, k, v must be (B, H, N, D) arrays of one shape, got {q}, {k}, {v}")
        return q

    def caller_outputs(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                       options: Mapping[str, OptionValue]) -> dict[str, tuple[tuple[int, ...], str]]:
        q = self.check_shapes(shapes)  # also for empty inputs, which never reach a Problem
        return {"o": (q, dtype), "lse": (q[:3], "float32")}

    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]:
        b, h, n, d = problem.shape
        return {"B": b, "H": h, "N": n, "D": d, "itemsize": ITEMSIZE[problem.dtype],
                "causal": "causal" in problem.flags, "smem_limit": target.smem_optin}

    # --- a variant ----------------------------------------------------------------------

    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        p = params
        name = (f"attention_{_SHORT[problem.dtype]}_d{problem.shape[3]}"
                f"{'_causal' if 'causal' in problem.flags else ''}"
                f"_m{p['block_m']}_n{p['block_n']}_w{p['warps']}_s{p['stages']}"
                f"_{'swz' if p['layout'] == 'swizzle' else 'pad'}")
        if p["q_in"] == "registers":
            name += "_qreg"
        return name

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        return {**values, "dtype": problem.dtype, "mma_type": _MMA_TYPE[problem.dtype]}

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        b, h, n, _ = problem.shape
        grid = (-(-n // values["block_m"]), h, b)
        block = (32 * values["warps"], 1, 1)
        return (Launch("attention_fwd", grid, block, values["smem_bytes"], ("q", "k", "v", "o", "lse", "scale")),), 0

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue]:
        """4 warps of 32 query rows each (two mma tiles share every K/V fragment read from shared
        memory), 64 keys per tile, a two-stage pipeline, swizzled rows; Q fragments in registers
        for D <= 64 (re-read from shared memory for D = 128, where registers are short). The best
        of all 102 / 82 variants at 1x32x8192x64 / 4x16x4096x128 bf16 on an H200 (352 and 364
        TFLOP/s). Smaller query tiles when 128-row tiles cannot fill the GPU."""
        b, h, n, d = problem.shape
        p: dict[str, ParamValue] = {"block_m": 128, "block_n": 64, "warps": 4, "stages": 2, "layout": "swizzle",
                                    "q_in": "registers" if d <= 64 else "smem"}
        if -(-n // 128) * b * h < target.sm_count:
            p.update(block_m=64)
        return self._first_valid(problem, target, p)

    def seed_params(self, problem: Problem, target: Target) -> list[dict[str, ParamValue]]:
        """Neighbours of the default that are often better: the tuner tries these first."""
        base = self.default_params(problem, target)
        other_q = "smem" if base["q_in"] == "registers" else "registers"
        changes = (
            {"stages": 3},
            {"q_in": other_q},
            {"layout": "pad"},
            {"block_n": 128, "q_in": "smem"},
            {"block_m": 64, "block_n": 128, "q_in": "registers"},
            {"block_m": 128, "warps": 8, "block_n": 128, "stages": 3, "q_in": "registers"},  # 16 rows per warp
            {"block_n": 32, "stages": 3},
        )
        return valid_neighbours(self, problem, target, base, changes)

    def _first_valid(self, problem: Problem, target: Target, p: dict[str, ParamValue]) -> dict[str, ParamValue]:
        # smaller key tiles, shallower pipeline, smaller query tile: the last step is valid for any N >= 1
        for block_m, warps in ((p["block_m"], p["warps"]), (64, 4)):
            for block_n in (p["block_n"], 64, 32):
                for stages in (p["stages"], 2, 1):
                    candidate = {**p, "block_m": block_m, "warps": warps, "block_n": block_n, "stages": stages}
                    if int(block_n) <= int(p["block_n"]) and int(stages) <= int(p["stages"]) \
                            and self.is_valid(problem, target, candidate):
                        return candidate
        raise AssertionError(f"no valid default attention variant for {problem}")

    # --- what it costs ------------------------------------------------------------------

    def shape_distance(self, a: tuple[int, ...], b: tuple[int, ...]) -> float:
        """Log2 steps between shapes, N weighing 4x; a different head dim is another kernel."""
        if a[3] != b[3]:
            return math.inf
        return sum(abs(math.log2(x) - math.log2(y)) * w for x, y, w in zip(a[:3], b[:3], (1, 1, 4)))

    def verification_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """One batch and two heads of the same N and D: the same compiled kernel, much less work."""
        return (1, min(shape[1], 2), shape[2], shape[3])

    def bytes_moved(self, problem: Problem) -> int:
        b, h, n, d = problem.shape
        return 4 * b * h * n * d * ITEMSIZE[problem.dtype] + 4 * b * h * n

    def flops(self, problem: Problem) -> float:
        b, h, n, d = problem.shape
        f = 4.0 * b * h * n * n * d
        return f / 2 if "causal" in problem.flags else f

    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"o": (problem.shape, problem.dtype), "lse": (problem.shape[:3], "float32")}

    # --- verification (runs on the GPU through CuPy; xp is the cupy module) ---------------

    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]:
        shape = problem.shape
        q = rng.standard_normal(shape, dtype=np.float32)
        k = rng.standard_normal(shape, dtype=np.float32)
        v = rng.standard_normal(shape, dtype=np.float32)
        if kind == "normal_x10":      # large logits: a few keys take almost all the weight
            q *= 10
        elif kind == "equal":         # every key the same: uniform weights, o = mean of v
            k[...] = k[:, :, :1, :]
        elif kind != "normal":
            raise ValueError(f"unknown input kind {kind!r}")
        return {"q": to_storage(q, problem.dtype, xp), "k": to_storage(k, problem.dtype, xp),
                "v": to_storage(v, problem.dtype, xp), "scale": np.float32(1.0 / math.sqrt(shape[3]))}

    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
        o = to_float64(outputs["o"], problem.dtype, xp)
        lse = outputs["lse"].astype(np.float64)
        if bool(xp.isnan(o).any()) or bool(xp.isnan(lse).any()):
            where = "o" if bool(xp.isnan(o).any()) else "lse"
            return f"{where} has {int(xp.isnan(o if where == 'o' else lse).sum())} NaN (unwritten or overflowed) elements"
        ref_o, ref_lse = reference(problem, inputs, xp)
        tol = TOLERANCE[problem.dtype]
        err = float(xp.linalg.norm(o - ref_o)) / max(float(xp.linalg.norm(ref_o)), 1e-30)
        if not err <= tol:
            return f"relative error ||o - ref|| / ||ref|| = {err:.3g} > {tol:g}"
        row_err = xp.linalg.norm(o - ref_o, axis=-1)
        row_ref = xp.linalg.norm(ref_o, axis=-1)
        bad_rows = ~(row_err <= ROW_FACTOR * tol * row_ref + 1e-6)
        if bool(bad_rows.any()):
            flat = int(xp.argmax(xp.where(bad_rows, row_err / (row_ref + 1e-30), -1.0)))
            b, h, i = np.unravel_index(flat, problem.shape[:3])
            return (f"{int(bad_rows.sum())} rows off; worst o[{b}, {h}, {i}]: relative error "
                    f"{float(row_err[b, h, i] / row_ref[b, h, i]):.3g} > {ROW_FACTOR * tol:g}")
        lse_err = xp.abs(lse - ref_lse)
        bad = ~(lse_err <= LSE_ATOL + LSE_RTOL * xp.abs(ref_lse))
        if bool(bad.any()):
            flat = int(xp.argmax(xp.where(bad, lse_err, -1.0)))
            b, h, i = np.unravel_index(flat, problem.shape[:3])
            return (f"{int(bad.sum())} lse values off; worst lse[{b}, {h}, {i}]: got {float(lse[b, h, i])!r}, "
                    f"expected {float(ref_lse[b, h, i])!r}")
        return None


def reference(problem: Problem, inputs: Mapping[str, Any], xp: Any) -> tuple[Any, Any]:
    """float64 attention on the GPU, in chunks of heads and query rows so that no N x N block
    of all heads is ever held at once. Returns (o, lse) shaped like the kernel's outputs."""
    b, h, n, d = problem.shape
    causal = "causal" in problem.flags
    scale = float(inputs["scale"])
    q = to_float64(inputs["q"], problem.dtype, xp).reshape(b * h, n, d)
    k = to_float64(inputs["k"], problem.dtype, xp).reshape(b * h, n, d)
    v = to_float64(inputs["v"], problem.dtype, xp).reshape(b * h, n, d)
    o = xp.empty((b * h, n, d), dtype=np.float64)
    lse = xp.empty((b * h, n), dtype=np.float64)
    rows = max(1, min(n, _REF_BYTES // (8 * n)))
    heads = max(1, min(b * h, _REF_BYTES // (8 * n * rows)))
    for h0 in range(0, b * h, heads):
        hs = slice(h0, min(b * h, h0 + heads))
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            s = xp.matmul(q[hs, r0:r1], k[hs].transpose(0, 2, 1)) * scale
            if causal:
                later = xp.arange(n)[None, :] > xp.arange(r0, r1)[:, None]
                s[:, later] = -np.inf
            m = s.max(axis=-1, keepdims=True)
            p = xp.exp(s - m)
            total = p.sum(axis=-1, keepdims=True)
            o[hs, r0:r1] = xp.matmul(p, v[hs]) / total
            lse[hs, r0:r1] = (m + xp.log(total))[..., 0]
    return o.reshape(b, h, n, d), lse.reshape(b, h, n)


ATTENTION = register(AttentionFamily())
