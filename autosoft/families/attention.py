"""Flash-attention forward, FlashAttention-2 style on tensor cores: fp16 and bf16 in, fp32 arithmetic.

q is (B, H, N, D), k and v are (B, Hkv, Nkv, D) with H a multiple of Hkv (grouped-query
attention; Hkv = 1 is multi-query) and Nkv any length; the problem's shape is q's, and the
options kv_heads and kv_len say Hkv and Nkv where they differ from H and N. Each array's last
dimension is contiguous; its other strides are run-time kernel arguments (`strided_inputs`), so
views such as the (B, N, H, D) halves of a fused QKV projection, transposed, are taken without a
copy. The outputs are o (B, H, N, D, the input dtype, contiguous) and lse (B, H, N, float32): the
natural log of the sum of exp(s) over the keys each query sees, s = scale * q.k (or, with
softcap c, c * tanh(scale * q.k / c)).

Which keys query i sees: all of them, or with `causal` those at or before its position, and
with a window those within window_left before and window_right after it. The position of query
i is key i + Nkv - N: aligned bottom-right as FlashAttention >= 2.1 does (what prefill with a
cache and decoding need; torch's is_causal aligns top-left). A query that sees no key gets
o = 0 and lse = -inf. The scale (default 1/sqrt(D)) is a kernel argument, bound at run time from
the buffer named "scale" (a numpy float32); it must be positive, since the kernel tracks the
running max of the unscaled scores q.k.

Variants differ in tiles, warps, pipeline and layout, and in two axes for few queries per head
(decoding): `pack`, the query heads of one KV head sharing the rows of one block so K and V are
read once per group, and `splits`, the keys of one query tile shared among blocks whose partial
outputs the last of them merges (flash-decoding).
"""
from __future__ import annotations

import math
import numbers
import operator
import re
from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from ..dtypes import ITEMSIZE, to_float64, to_storage
from ..errors import UserError
from ..operators import Backward, OperatorCall, TorchOperator
from . import register
from ._attention_mma import MmaEngine
from ._attention_wgmma import WgmmaEngine, fast_divisor
from .base import Family, OptionValue, Problem, ProblemOption, Target, option_flag

_SHAPE = re.compile(r"^\s*(\d+)\s*[,xX]\s*(\d+)\s*[,xX]\s*(\d+)\s*[,xX]\s*(\d+)\s*$")
_SHORT = {"float16": "f16", "bfloat16": "bf16"}
_MMA_TYPE = {"float16": "f16", "bfloat16": "bf16"}
HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
INT32_MAX = 2**31 - 1
GRID_YZ_MAX = 65535
# ||o - ref|| / ||ref|| over the whole output; a single row may be off by ROW_FACTOR times more.
# The error comes from rounding P to the input dtype before P.V and rounding O on output.
TOLERANCE = {"float16": 5e-3, "bfloat16": 1e-2}
ROW_FACTOR = 4.0
LSE_ATOL, LSE_RTOL = 1e-3, 1e-4
_REF_BYTES = 256 << 20  # float64 score block of the reference, per chunk


class AttentionFamily(Family):
    """o = softmax(s) v over the keys each query sees, and its log-sum-exp, for q (B, H, N, D) and
    k, v (B, Hkv, Nkv, D)."""
    name = "attention"
    template = "attention/attention.cu.j2"
    inputs = ("q", "k", "v", "scale")
    outputs = ("o", "lse")
    empty_values = {"lse": float("-inf")}  # no key: o = 0 and lse = -inf, as for a query that sees none
    strided_inputs = ("q", "k", "v")
    head_dims: tuple[int, ...] = HEAD_DIMS
    input_kinds = ("normal", "normal_x10", "equal", "strided")
    dtypes = ("float16", "bfloat16")
    default_dtype = "bfloat16"
    options = (
        ProblemOption("causal", "mask keys after the query's position (key j > i + Nkv - N: bottom-right)"),
        ProblemOption("kv_heads", "heads of k and v, when fewer than H (grouped-query attention; H a multiple "
                      "of it)", kind="int"),
        ProblemOption("kv_len", "keys (and values) per head, when not N; query i stands at key i + kv_len - N",
                      kind="int"),
        ProblemOption("window_left", "keys before the query's position it sees (sliding window)", kind="int"),
        ProblemOption("window_right", "keys after the query's position it sees (sliding window)", kind="int"),
        ProblemOption("softcap", "cap the scores: s becomes softcap * tanh(s / softcap) (Gemma 2)", kind="float"),
    )
    shape_help = ("B,H,N,D (or BxHxNxD): batch, query heads, queries per head, head dim, e.g. 1,32,8192,64; "
                  "--kv-heads and --kv-len for k and v that differ")
    examples = (("1,1,1,32", "float16", {}), ("1,2,77,64", "bfloat16", {"causal": True}),
                ("3,7,1000,64", "float16", {}), ("1,8,3333,128", "bfloat16", {"causal": True}),
                ("4,16,4096,128", "float16", {}), ("1,32,8192,64", "bfloat16", {"causal": True}),
                ("1,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 32768}),
                ("2,8,7,96", "float16", {"kv_heads": 1, "kv_len": 3333, "causal": True}),
                ("1,8,1000,256", "bfloat16", {"kv_heads": 2, "causal": True, "window_left": 100}),
                ("2,4,64,64", "float16", {"kv_len": 1000, "window_left": 64, "window_right": 64,
                                          "softcap": 30.0}))

    def __init__(self) -> None:
        # the wgmma kernel first: where it offers a default (sm_90, enough rows) it is the faster
        self.engines = (WgmmaEngine(self), MmaEngine(self))

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
        if d not in self.head_dims:
            raise UserError(f"shape {text!r}: head dim D={d} is not supported; use one of "
                            f"{', '.join(map(str, self.head_dims))} (pad the heads to the next one)")
        if b > GRID_YZ_MAX or h > GRID_YZ_MAX:
            raise UserError(f"shape {text!r}: B and H must be at most {GRID_YZ_MAX} (fold them into each other)")
        if n * d > INT32_MAX:
            raise UserError(f"shape {text!r}: sequences longer than {INT32_MAX // d} are not supported for D={d}")
        return (b, h, n, d)

    @property
    def _grouped(self) -> bool:
        """Whether this family takes k and v of other head counts and lengths than q (families
        that extend the kernel without those options take one shape)."""
        return any(o.name == "kv_heads" for o in self.options)

    def problem(self, shape_text: str, dtype: str | None = None,
                options: Mapping[str, OptionValue] | Any = ()) -> Problem:
        return self._normalised(super().problem(shape_text, dtype, options))

    def _normalised(self, problem: Problem) -> Problem:
        """The problem with kv_heads and kv_len dropped where they equal H and N (one key per
        problem), checked: H a multiple of kv_heads, lengths in range, windows >= 0, softcap > 0."""
        if not self._grouped:
            return problem
        b, h, n, d = problem.shape
        opts = dict(problem.options)
        kv_heads, kv_len = int(opts.get("kv_heads", h)), int(opts.get("kv_len", n))
        if not 1 <= kv_heads <= h or h % kv_heads:
            raise UserError(f"--kv-heads {kv_heads}: the {h} query heads must be a multiple of the KV heads")
        if not 1 <= kv_len or kv_len * d > INT32_MAX:
            raise UserError(f"--kv-len {kv_len}: expected 1 to {INT32_MAX // d} keys")
        for side in ("window_left", "window_right"):
            if side in opts and not int(opts[side]) >= 0:
                raise UserError(f"{option_flag(side)} {opts[side]}: expected a number of keys >= 0")
        if "softcap" in opts and not softcap_fits(float(opts["softcap"])):
            raise UserError(f"--softcap {opts['softcap']}: expected a positive number that float32 holds "
                            f"({SOFTCAP_MIN:g} to {SOFTCAP_MAX:g})")
        if kv_heads == h:
            opts.pop("kv_heads", None)
        if kv_len == n:
            opts.pop("kv_len", None)
        return replace(problem, options=tuple(sorted(opts.items())))

    def problem_for(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                    options: Mapping[str, OptionValue]) -> Problem:
        q, k, _ = self.check_shapes(shapes)
        given = dict(options)
        if self._grouped:
            given.update(kv_heads=k[1], kv_len=k[2])
        problem = super().problem_for({**shapes, "q": q}, dtype, given)
        try:
            return self._normalised(problem)
        except UserError as exc:
            raise ValueError(f"autosoft.{self.name}: {exc}") from None

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
        """(q, k, v) shapes when they fit together (empty ones too), else ValueError: q (B, H, N, D),
        k and v (B, Hkv, Nkv, D) of one shape, H a multiple of Hkv (one shape for all three in a
        family without kv_heads)."""
        q, k, v = (tuple(shapes[n]) for n in ("q", "k", "v"))
        who = f"autosoft.{self.name}"
        if not self._grouped:
            if len(q) != 4 or k != q or v != q:
                raise ValueError(f"{who}: q, k, v must be (B, H, N, D) arrays of one shape, got {q}, {k}, {v}")
            return q, k, v
        if len(q) != 4 or len(k) != 4 or v != k:
            raise ValueError(f"{who}: q must be (B, H, N, D) and k, v (B, Hkv, Nkv, D) of one shape, got {q}, {k}, {v}")
        if k[0] != q[0] or k[3] != q[3]:
            raise ValueError(f"{who}: q {q} and k, v {k} must share the batch (first) and head dim (last)")
        if k[1] < 1 or q[1] % k[1]:
            raise ValueError(f"{who}: q's {q[1]} heads must be a multiple of k's and v's {k[1]} (grouped-query attention)")
        return q, k, v

    def caller_outputs(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                       options: Mapping[str, OptionValue]) -> dict[str, tuple[tuple[int, ...], str]]:
        q = self.check_shapes(shapes)[0]  # also for empty inputs, which never reach a Problem
        return {"o": (q, dtype), "lse": (q[:3], "float32")}

    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]:
        b, h, n, d = problem.shape
        kv_heads, kv_len = _kv(problem)
        return {"B": b, "H": h, "N": n, "D": d, "NKV": kv_len, "G": h // kv_heads, "itemsize": ITEMSIZE[problem.dtype],
                "causal": "causal" in problem.flags, "smem_limit": target.smem_optin, "sm_count": target.sm_count,
                "sm90": target.arch == "90", "l2_bytes": target.l2_bytes}

    # --- what every engine's kernel shares ---------------------------------------------

    def kv(self, problem: Problem) -> tuple[int, int]:
        """(KV heads, keys per head) of a problem."""
        return _kv(problem)

    def name_prefix(self, problem: Problem) -> str:
        """The start of every engine's variant names: dtype, head dim, mask, cap and group
        (attention_bf16_d128_causal_g4); the engine appends its own parameters."""
        kv_heads, _ = _kv(problem)
        group = problem.shape[1] // kv_heads
        mask = "_causal" if "causal" in problem.flags else ""
        if problem.option("window_left") is not None or problem.option("window_right") is not None:
            mask += "_window"
        return (f"attention_{_SHORT[problem.dtype]}_d{problem.shape[3]}{mask}"
                f"{'_softcap' if problem.option('softcap') is not None else ''}"
                f"{f'_g{group}' if group > 1 else ''}")

    def kernel_args(self, problem: Problem) -> dict[str, Any]:
        """The template arguments every engine's kernel takes from the problem: the element type,
        the lengths, the group, and what the problem changes in the scores (mask and cap)."""
        b, h, n, d = problem.shape
        kv_heads, kv_len = _kv(problem)
        window_left, window_right = problem.option("window_left"), problem.option("window_right")
        softcap = problem.option("softcap")
        return {"dtype": problem.dtype, "mma_type": _MMA_TYPE[problem.dtype], "NQ": n, "NKV": kv_len,
                "group": h // kv_heads, "strided": bool(self.strided_inputs),
                "window_left": -1 if window_left is None else int(window_left),
                "window_right": -1 if window_right is None else int(window_right),
                "softcap": "0.0" if softcap is None else repr(float(softcap)), "capped": softcap is not None,
                "runtime_keys": False, "paged": False, "runtime_queries": False}

    # --- what it costs ------------------------------------------------------------------

    def shape_distance(self, a: tuple[int, ...], b: tuple[int, ...]) -> float:
        """Log2 steps between shapes, N weighing 4x; a different head dim is another kernel."""
        if a[3] != b[3]:
            return math.inf
        return sum(abs(math.log2(x) - math.log2(y)) * w for x, y, w in zip(a[:3], b[:3], (1, 1, 4)))

    def selector_features(self, problem: Problem) -> dict[str, float]:
        """What a selector (autosoft/selector.py) splits attention problems on: the heads of the
        batch, queries, keys, head dim, the mask and cap, and the query heads per KV head."""
        b, h, n, d = problem.shape
        kv_heads, kv_len = _kv(problem)
        return {"bh": float(b * h), "nq": float(n), "nkv": float(kv_len), "d": float(d),
                "causal": float(bool(problem.option("causal", False))),
                "window": float(problem.option("window_left") is not None or problem.option("window_right") is not None),
                "softcap": float(problem.option("softcap") is not None), "gqa": float(h // kv_heads)}

    def problem_distance(self, a: Problem, b: Problem) -> float:
        """The shapes' distance plus log2 steps between keys per query (kv_len / N, weighing as N does), for
        problems of one mask, cap and group size (query heads per KV head); else never."""
        ka, kb = _kv(a), _kv(b)
        same = {n: v for n, v in a.options if n not in ("kv_heads", "kv_len")} == \
            {n: v for n, v in b.options if n not in ("kv_heads", "kv_len")}
        if not same or a.shape[1] // ka[0] != b.shape[1] // kb[0]:
            return math.inf
        # the keys per query: a kv_len equal to N adds nothing to N's own distance
        return self.shape_distance(a.shape, b.shape) + \
            4 * abs(math.log2(ka[1] / a.shape[2]) - math.log2(kb[1] / b.shape[2]))

    def verification_problem(self, problem: Problem) -> Problem:
        """One batch and up to two KV heads' worth of query heads, the same lengths: the same
        compiled kernel (sizes other than the lengths and the group are run-time), much less work."""
        b, h, n, d = problem.shape
        kv_heads, _ = _kv(problem)
        group = h // kv_heads
        small_h = group * min(kv_heads, 2 if group == 1 else 1)
        opts = dict(problem.options)
        if "kv_heads" in opts:
            opts["kv_heads"] = small_h // group
        return replace(problem, shape=(1, small_h, n, d), options=tuple(sorted(opts.items())))

    def verification_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """One batch and two heads of the same N and D (for problems without grouped heads)."""
        return (1, min(shape[1], 2), shape[2], shape[3])

    def bytes_moved(self, problem: Problem) -> int:
        b, h, n, d = problem.shape
        kv_heads, kv_len = _kv(problem)
        return ITEMSIZE[problem.dtype] * d * (2 * b * h * n + 2 * b * kv_heads * kv_len) + 4 * b * h * n

    def flops(self, problem: Problem) -> float:
        """4 D flops (q.k and p.v) for each (query, key) pair a query sees."""
        b, h, n, d = problem.shape
        return 4.0 * b * h * d * visible_pairs(problem)

    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"o": (problem.shape, problem.dtype), "lse": (problem.shape[:3], "float32")}

    def input_shapes(self, problem: Problem) -> dict[str, tuple[int, ...]]:
        b, h, n, d = problem.shape
        kv_heads, kv_len = _kv(problem)
        return {"q": problem.shape, "k": (b, kv_heads, kv_len, d), "v": (b, kv_heads, kv_len, d)}

    # --- verification (runs on the GPU through CuPy; xp is the cupy module) ---------------

    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]:
        b, h, n, d = problem.shape
        kv_heads, kv_len = _kv(problem)
        q = rng.standard_normal((b, h, n, d), dtype=np.float32)
        k = rng.standard_normal((b, kv_heads, kv_len, d), dtype=np.float32)
        v = rng.standard_normal((b, kv_heads, kv_len, d), dtype=np.float32)
        if kind == "normal_x10":      # large logits: a few keys take almost all the weight
            q *= 10
        elif kind == "equal":         # every key the same: uniform weights, o = mean of v
            k[...] = k[:, :, :1, :]
        elif kind not in ("normal", "strided"):
            raise ValueError(f"unknown input kind {kind!r}")
        arrays = {"q": to_storage(q, problem.dtype, xp), "k": to_storage(k, problem.dtype, xp),
                  "v": to_storage(v, problem.dtype, xp)}
        if kind == "strided" and self.strided_inputs:
            # (B, N, H, D) layouts seen as (B, H, N, D), k and v inside a longer cache: the kernel's strides
            for name, a in arrays.items():
                bb, hh, nn, dd = a.shape
                held = xp.empty((bb, nn + 3, hh, dd), dtype=a.dtype)
                held[:, 1:nn + 1] = a.transpose(0, 2, 1, 3)
                arrays[name] = held[:, 1:nn + 1].transpose(0, 2, 1, 3)
        return {**arrays, "scale": np.float32(1.0 / math.sqrt(d))}

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
        empty = xp.isneginf(ref_lse)  # a query that sees no key: lse -inf exactly
        lse_err = xp.where(empty, 0.0, xp.abs(lse - xp.where(empty, 0.0, ref_lse)))
        bad = ~(lse_err <= LSE_ATOL + LSE_RTOL * xp.abs(xp.where(empty, 0.0, ref_lse))) | (empty != xp.isneginf(lse))
        if bool(bad.any()):
            flat = int(xp.argmax(xp.where(bad, xp.where(empty != xp.isneginf(lse), xp.inf, lse_err), -1.0)))
            b, h, i = np.unravel_index(flat, problem.shape[:3])
            return (f"{int(bad.sum())} lse values off; worst lse[{b}, {h}, {i}]: got {float(lse[b, h, i])!r}, "
                    f"expected {float(ref_lse[b, h, i])!r}")
        return None


def call_options(causal: Any, window: Any, softcap: Any, who: str = "autosoft.attention") -> dict[str, OptionValue]:
    """The attention family's problem options of a call with these arguments: {"causal": bool}, plus
    "window_left", "window_right" and "softcap" only where given (not None), so that a call without
    them keys the same problem, cache entry and plan as a plain causal or full attention. The family
    derives kv_heads and kv_len from k's shape itself (problem_for); they are never passed.

    Checked here, before any array or device is touched (also torch.ops.autosoft.attention's
    arguments, as window=(window_left, window_right)), with one-line errors naming the argument:
    window None or a pair (tuple or list) whose sides are None or ints >= 0 (anything with
    __index__ but bool: True is no key count), else TypeError, or ValueError for a negative side;
    softcap None or a real number (not bool), else TypeError, and positive and finite, else
    ValueError (c * tanh(s / c) is undefined at 0 and the identity at infinity)."""
    options: dict[str, OptionValue] = {"causal": bool(causal)}
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            got = f"{len(window)} values" if isinstance(window, (tuple, list)) else type(window).__name__
            raise TypeError(f"{who}: window must be None or a pair (left, right) of key counts, got {got}")
        for side, value in zip(("left", "right"), window):
            if value is None:
                continue
            if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                raise TypeError(f"{who}: window's {side} side must be an int >= 0 or None, "
                                f"got {type(value).__name__}")
            count = operator.index(value)  # a plain int: the option's value is part of the cache key
            if count < 0:
                raise ValueError(f"{who}: window's {side} side must be >= 0 (a number of keys), got {count}")
            options[f"window_{side}"] = count
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"{who}: softcap must be None or a positive finite number, got {type(softcap).__name__}")
        cap = float(softcap)
        if not softcap_fits(cap):
            raise ValueError(f"{who}: softcap must be None or a positive finite number that float32 holds "
                             f"({SOFTCAP_MIN:g} to {SOFTCAP_MAX:g}), got {cap}")
        options["softcap"] = cap
    return options


def check_scale(scale: Any, head_dim: int, who: str) -> float:
    """The scale of a call: 1/sqrt(head_dim) for None, else a positive number that float32 holds
    (the kernel tracks the running max of the unscaled scores): TypeError for what is not a real
    number (a string, a bool), ValueError for one out of range, each naming the argument."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{who}: scale must be None or a positive number, got {type(scale).__name__} {scale!r}")
    value = float(scale)
    if not SOFTCAP_MIN <= value <= SOFTCAP_MAX:
        raise ValueError(f"{who}: scale must be positive and a float32 ({SOFTCAP_MIN:g} to {SOFTCAP_MAX:g}), got {value}")
    return value


# the kernel computes c * tanh(s / c) in float32: c must be a normal float32, neither 0 nor inf there
SOFTCAP_MIN, SOFTCAP_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def softcap_fits(cap: float) -> bool:
    """Whether softcap `cap` is positive and a normal float32 (1e-300 becomes 0 there, 1e308 inf)."""
    return SOFTCAP_MIN <= cap <= SOFTCAP_MAX


def _kv(problem: Problem) -> tuple[int, int]:
    """(KV heads, keys per head) of a problem: its kv_heads and kv_len options, else H and N."""
    return int(problem.option("kv_heads", problem.shape[1])), int(problem.option("kv_len", problem.shape[2]))


def key_bounds(problem: Problem, queries: Any, xp: Any = np) -> tuple[Any, Any]:
    """(first, last) key each query index in `queries` sees, as the kernel's key_lo and key_hi:
    positions aligned bottom-right, then causal and window limits; first > last: none."""
    n = problem.shape[2]
    kv_len = _kv(problem)[1]
    at = queries + (kv_len - n)  # the query's position among the keys
    left, right = problem.option("window_left"), problem.option("window_right")
    lo = at - int(left) if left is not None else xp.zeros_like(at)
    hi = xp.full_like(at, kv_len - 1)
    if "causal" in problem.flags:
        hi = xp.minimum(hi, at)
    if right is not None:
        hi = xp.minimum(hi, at + int(right))
    return xp.maximum(lo, 0), hi


def visible_pairs(problem: Problem) -> float:
    """(query, key) pairs of one head that are not masked, the mask's area: a key at the causal
    edge counts half, so that causal attention of N queries and keys has N^2 / 2 pairs, as
    FlashAttention's and cuDNN's benchmarks count it."""
    lo, hi = key_bounds(problem, np.arange(problem.shape[2], dtype=np.int64))
    seen = np.maximum(hi - lo + 1, 0)
    edge = 0.0
    if "causal" in problem.flags:  # rows whose last key is the one at their own position
        at = np.arange(problem.shape[2], dtype=np.int64) + (_kv(problem)[1] - problem.shape[2])
        edge = 0.5 * int(((hi == at) & (seen > 0)).sum())
    return float(seen.sum()) - edge


def reference(problem: Problem, inputs: Mapping[str, Any], xp: Any, precision: Any = np.float64) -> tuple[Any, Any]:
    """float64 attention on the GPU with explicit masks, in chunks of KV heads and query rows so
    that no (query, key) block of all heads is ever held at once, and k and v are never copied
    per query head. Returns (o, lse) shaped like the kernel's outputs; a query that sees no key
    gets o = 0 and lse = -inf. precision: the float type it computes in (np.float32 where float64's
    speed matters more than its last digits: the backward's inputs)."""
    b, h, n, d = problem.shape
    kv_heads, kv_len = _kv(problem)
    group = h // kv_heads
    scale = float(inputs["scale"])
    cap = problem.option("softcap")
    # query head hkv * group + g reads KV head hkv: q as (B * kv_heads, group, N, D)
    q, k, v = (inputs[name].reshape(b * kv_heads, -1, inputs[name].shape[-2], d) for name in ("q", "k", "v"))
    o = xp.empty((b * kv_heads, group, n, d), dtype=precision)
    lse = xp.empty((b * kv_heads, group, n), dtype=precision)
    rows = max(1, min(n, _REF_BYTES // (8 * kv_len * group)))
    heads = max(1, min(b * kv_heads, _REF_BYTES // (8 * kv_len * group * rows)))
    keys = xp.arange(kv_len)[None, :]
    for h0 in range(0, b * kv_heads, heads):
        hs = slice(h0, min(b * kv_heads, h0 + heads))
        kh = to_float64(k[hs, 0], problem.dtype, xp).astype(precision)[:, None]  # (heads, 1, kv_len, D)
        vh = to_float64(v[hs, 0], problem.dtype, xp).astype(precision)[:, None]
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            qh = to_float64(q[hs, :, r0:r1], problem.dtype, xp).astype(precision)
            s = xp.matmul(qh, kh.transpose(0, 1, 3, 2)) * precision(scale)
            if cap is not None:
                s = float(cap) * xp.tanh(s / float(cap))
            lo, hi = key_bounds(problem, xp.arange(r0, r1), xp)
            s[:, :, (keys < lo[:, None]) | (keys > hi[:, None])] = -np.inf
            m = s.max(axis=-1, keepdims=True)
            seen = xp.isfinite(m)
            p = xp.exp(s - xp.where(seen, m, 0.0))
            total = p.sum(axis=-1, keepdims=True)
            o[hs, :, r0:r1] = xp.matmul(p, vh) / xp.where(seen, total, 1.0)
            lse[hs, :, r0:r1] = xp.where(seen, m + xp.log(xp.where(seen, total, 1.0)), -np.inf)[..., 0]
    return o.reshape(b, h, n, d), lse.reshape(b, h, n)


__all__ = ["ATTENTION", "AttentionFamily", "call_options", "check_scale", "fast_divisor", "key_bounds", "operator_window",
           "reference", "softcap_fits", "visible_pairs"]

ATTENTION = register(AttentionFamily())


# --- the torch operator (autosoft.torch_ops registers it) ---------------------------------------

def operator_window(window_left: int | None, window_right: int | None) -> tuple[Any, Any] | None:
    """The `window` argument of a call from an operator's two (a schema has no tuple of optionals)."""
    return None if window_left is None and window_right is None else (window_left, window_right)


def _operator_call(q: Any, k: Any, v: Any, causal: bool, scale: float, window_left: int | None = None,
                   window_right: int | None = None, softcap: float | None = None) -> OperatorCall:
    """What autosoft.attention runs for the same arguments (window=(window_left, window_right))."""
    scale = check_scale(scale, q.shape[-1], "autosoft.attention")
    return OperatorCall((q, k, v), call_options(causal, operator_window(window_left, window_right), softcap), {"scale": np.float32(scale)})


def _gradient(ops: Any, saved: Mapping[str, Any], grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """dq, dk, dv from the attention_backward family, for the gradients of o and lse (either may
    be None: an output the loss did not read). Without one for o, do is zeros; without one for lse,
    no dlse goes to the family (its problem then has no lse_grad). dq is the deterministic variant's
    where torch.use_deterministic_algorithms(True) is set, the switch torch users already flip for
    reproducible training. The options have no gradient."""
    import torch  # loaded: autograd is calling this

    grad_o, grad_lse = grads
    o = saved["o"]
    dq, dk, dv = ops.attention_backward(
        saved["q"], saved["k"], saved["v"], o, o.new_zeros(o.shape) if grad_o is None else grad_o, saved["lse"],
        grad_lse, saved["causal"], saved["scale"], saved["window_left"], saved["window_right"], saved["softcap"],
        torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, None, None, None, None, None


AttentionFamily.torch_operators = (
    TorchOperator("attention", "attention", "(Tensor q, Tensor k, Tensor v, bool causal, float scale, "
                  "int? window_left=None, int? window_right=None, float? softcap=None) -> (Tensor o, Tensor lse)",
                  _operator_call,
                  backward=Backward(("q", "k", "v", "o", "lse", "causal", "scale", "window_left", "window_right",
                                     "softcap"), _gradient)),
)
