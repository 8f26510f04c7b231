"""The backward of flash attention: dq, dk, dv from q, k, v, the forward's o and lse, and do.

For the attention family's problem (q (B, H, N, D), k and v (B, Hkv, Nkv, D), fp16 or bf16, the
same masks, window, softcap and scale), with P = softmax(s) the forward's weights (recomputed
from lse, never stored) and s = scale * q.k (capped: c * tanh(scale * q.k / c)):

    dv = P^T do            dP = do v^T            Delta_i = sum_d do_id o_id - dlse_i
    dS = P * (dP - Delta)  (times ds/d(q.k): scale, and 1 - tanh^2 with a softcap)
    dq = dS k              dk = dS^T q

dk and dv of grouped-query attention are summed over the query heads of their KV head. dlse, the
gradient of the forward's lse output (problem option `lse_grad`), is optional: a forward whose
lse feeds the loss (return_lse=True) passes it, and then dS = P * (dP - Delta + dlse).

The outputs are dq (B, H, N, D) and dk, dv (B, Hkv, Nkv, D), in the input dtype, contiguous; q, k
and v are taken with their strides, as the forward takes them. A key that no query sees gets
dk = dv = 0, and a query that sees no key dq = 0, exactly. dq is accumulated in float32 by the
blocks of every key tile a query sees; `deterministic` admits only variants that add in a fixed
order, so that dq is the same bits on every run (dk and dv always are: one block owns each).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ..dtypes import ITEMSIZE, to_float64, to_storage
from ..operators import OperatorCall, TorchOperator
from . import register
from ._attention_backward_mma import MmaBackwardEngine
from ._attention_backward_wgmma import WgmmaBackwardEngine
from .attention import AttentionFamily, _kv, call_options, check_scale, key_bounds, operator_window, reference
from .base import Call, Problem, ProblemOption, Target

# ||g - ref|| / ||ref|| for each gradient; a single row may be off by ROW_FACTOR times more (with
# ROW_FLOOR of the gradient's whole norm per row as slack for rows near zero). The error comes from
# rounding P and dS to the input dtype before the products, and the forward's o to it.
TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2}
ROW_FACTOR = 4.0
ROW_FLOOR = 1e-3
# where dS cancels, errors are measured against this fraction of the terms' absolute sizes at least
SIZE_FRACTION = 0.25
_REF_BYTES = 128 << 20  # float64 score block of the reference, per chunk


class AttentionBackwardFamily(AttentionFamily):
    """dq, dk, dv of attention for q (B, H, N, D) and k, v (B, Hkv, Nkv, D), from o, lse and do."""
    name = "attention_backward"
    template = "attention_backward/attention_backward.cu.j2"
    template_folders = ("attention",)  # the variant (masks, softcap) the forward applies
    inputs = ("q", "k", "v", "o", "do", "lse", "dlse", "scale")
    input_dtypes = {"lse": ("float32",), "dlse": ("float32",)}
    optional_inputs = ("dlse",)  # given or not, the problem's option lse_grad says (problem_for sets it)
    outputs = ("dq", "dk", "dv")
    strided_inputs = ("q", "k", "v")
    head_dims = (32, 64, 96, 128, 256)
    input_kinds = ("normal", "normal_x10", "equal", "strided")
    options = AttentionFamily.options + (
        ProblemOption("deterministic", "only variants whose dq is the same bits on every run (dk and dv always are)"),
        ProblemOption("lse_grad", "a gradient of the forward's lse is given (dlse): the loss read lse too; "
                      "a call sets it where it gives dlse"),
    )
    shape_help = ("B,H,N,D (or BxHxNxD) of q: batch, query heads, queries per head, head dim, e.g. 4,16,4096,128; "
                  "--kv-heads and --kv-len for k and v that differ")
    examples = (("1,1,1,32", "float16", {}), ("1,2,77,64", "bfloat16", {"causal": True}),
                ("2,3,333,64", "float16", {"deterministic": True}),
                ("1,4,1000,128", "bfloat16", {"causal": True, "kv_heads": 1}),
                ("1,8,300,96", "float16", {"kv_heads": 2, "kv_len": 1000, "causal": True}),
                ("1,2,257,256", "bfloat16", {"causal": True, "window_left": 100, "lse_grad": True}),
                ("2,4,200,64", "float16", {"kv_len": 500, "window_left": 64, "window_right": 32, "softcap": 20.0}))

    def __init__(self) -> None:
        # the wgmma kernel first: where it offers a default (sm_90, D 64 or 128) it is the faster
        self.engines = (WgmmaBackwardEngine(self), MmaBackwardEngine(self))

    # --- problem ------------------------------------------------------------------------

    def problem_for(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                    options: Mapping[str, Any]) -> Problem:
        q = tuple(shapes["q"])
        who = f"autosoft.{self.name}"
        for name in ("o", "do"):
            if tuple(shapes[name]) != q:
                raise ValueError(f"{who}: {name} must have q's shape {q}, got {tuple(shapes[name])}")
        for name in ("lse", "dlse"):
            if name in shapes and tuple(shapes[name]) != q[:3]:
                raise ValueError(f"{who}: {name} must be (B, H, N) = {q[:3]} float32, got shape {tuple(shapes[name])}")
        return super().problem_for(shapes, dtype, {**options, "lse_grad": "dlse" in shapes})

    def caller_outputs(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                       options: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
        q, k, _ = self.check_shapes(shapes)
        return {"dq": (q, dtype), "dk": (k, dtype), "dv": (k, dtype)}

    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]:
        return {**super().problem_values(problem, target), "deterministic": "deterministic" in problem.flags}

    def kernel_args(self, problem: Problem) -> dict[str, Any]:
        return {**super().kernel_args(problem), "lse_grad": "lse_grad" in problem.flags}

    def name_prefix(self, problem: Problem) -> str:
        return "attention_bwd" + super().name_prefix(problem)[len("attention"):] + \
            ("_dlse" if "lse_grad" in problem.flags else "")

    # --- the Python function -----------------------------------------------------------

    def python_call(self, q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, causal: bool = False,
                    scale: float | None = None, window: Any = None, softcap: float | None = None,
                    dlse: Any = None, deterministic: bool = False) -> Call:
        """The gradients (dq, dk, dv) of o = autosoft.attention(q, k, v, causal, scale,
        window=window, softcap=softcap) for the gradient `do` of o, from the forward's o and lse
        (its return_lse=True outputs); dlse, where the loss also read lse, is its gradient
        ((B, H, N) float32). q (B, H, N, D), k and v (B, Hkv, Nkv, D) as the forward takes them
        (strided views too); o and do like q, lse (B, H, N) float32. Returns dq like q and dk, dv
        like k, in the input dtype. deterministic=True uses only variants whose dq is the same bits
        on every run. A torch training step never calls this: autosoft.attention on tensors that
        require gradients records it as its backward."""
        head_dim = q.shape[-1] if hasattr(q, "shape") and len(q.shape) else 1
        options, scale = _checked(causal, scale, head_dim, window, softcap, deterministic)
        return Call((q, k, v, o, do, lse, dlse), options, {"scale": scale}, ("dq", "dk", "dv"))

    # --- what it costs ------------------------------------------------------------------

    def bytes_moved(self, problem: Problem) -> int:
        """q, k, v, o and do read, dq, dk, dv written once, lse read (and dlse where given)."""
        b, h, n, d = problem.shape
        kv_heads, kv_len = _kv(problem)
        item = ITEMSIZE[problem.dtype]
        lse_rows = 4 * b * h * n * (2 if "lse_grad" in problem.flags else 1)
        return item * d * (4 * b * h * n + 4 * b * kv_heads * kv_len) + lse_rows

    def flops(self, problem: Problem) -> float:
        """2.5 times the forward's: five products of 2 D flops per (query, key) pair it sees (q.k,
        do.v, P^T do, dS^T q, dS k), as FlashAttention's benchmarks count the backward."""
        return 2.5 * super().flops(problem)

    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        b, h, n, d = problem.shape
        kv_heads, kv_len = _kv(problem)
        return {"dq": (problem.shape, problem.dtype), "dk": ((b, kv_heads, kv_len, d), problem.dtype),
                "dv": ((b, kv_heads, kv_len, d), problem.dtype)}

    def input_shapes(self, problem: Problem) -> dict[str, tuple[int, ...]]:
        shapes = super().input_shapes(problem)
        rows = problem.shape[:3]
        shapes.update(o=problem.shape, do=problem.shape, lse=rows)
        if "lse_grad" in problem.flags:
            shapes["dlse"] = rows
        return shapes

    # --- verification (runs on the GPU through CuPy; xp is the cupy module) ---------------

    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]:
        """q, k, v as the forward's inputs of that kind, o and lse the forward's outputs computed
        in float32 (o rounded to the dtype), do standard normal, dlse (with lse_grad) standard
        normal and 0 where a query sees no key. The check's reference takes o and lse as given, so
        float32 suffices, and it keeps the timing sets of large problems quick to make."""
        inputs = super().make_inputs(problem, kind, xp, rng)
        o, lse = reference(problem, inputs, xp, precision=np.float32)
        do = rng.standard_normal(problem.shape, dtype=np.float32)
        inputs.update(o=to_storage(o.astype(np.float32), problem.dtype, xp), do=to_storage(xp.asarray(do), problem.dtype, xp),
                      lse=lse.astype(np.float32), dlse=None)
        if "lse_grad" in problem.flags:
            dlse = xp.asarray(rng.standard_normal(problem.shape[:3], dtype=np.float32))
            inputs["dlse"] = xp.where(xp.isneginf(inputs["lse"]), 0.0, dlse).astype(np.float32)
        return inputs

    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
        """Each gradient against the float64 reference from the same inputs. dS = P (dP - Delta)
        cancels: where the true gradient is near 0 (equal keys, one key taking all the weight), the
        kernel's rounding of P and dS is measured against the size of the terms that cancel (the
        reference's `scale`), not against the near-zero result. A query that sees no key, and a key
        that no query sees, must get exactly 0."""
        refs, sizes = reference_gradients(problem, inputs, xp)
        unseen_queries, unseen_keys = _unseen(problem, xp)
        tol = TOLERANCE[problem.dtype]
        for name in ("dq", "dk", "dv"):
            got = to_float64(outputs[name], problem.dtype, xp)
            ref, size = refs[name], sizes[name]
            if bool(xp.isnan(got).any()):
                return f"{name} has {int(xp.isnan(got).sum())} NaN (unwritten or overflowed) elements"
            unseen = unseen_queries if name == "dq" else unseen_keys  # by row index, every batch and head
            nonzero = xp.any(got != 0, axis=-1) & unseen
            if bool(nonzero.any()):
                at = np.unravel_index(int(xp.argmax(nonzero)), got.shape[:3])
                return f"{name}[{', '.join(map(str, at))}] should be exactly 0 (no (query, key) pair reaches it)"
            norm = max(float(xp.linalg.norm(ref)), SIZE_FRACTION * float(xp.linalg.norm(size)), 1e-30)
            err = float(xp.linalg.norm(got - ref)) / norm
            if not err <= tol:
                return f"{name}: relative error ||{name} - ref|| / ||ref|| = {err:.3g} > {tol:g}"
            row_err = xp.linalg.norm(got - ref, axis=-1)
            row_ref = xp.maximum(xp.linalg.norm(ref, axis=-1), SIZE_FRACTION * xp.linalg.norm(size, axis=-1))
            slack = ROW_FLOOR * norm / math.sqrt(max(1, row_ref.size))
            bad = ~(row_err <= ROW_FACTOR * tol * row_ref + slack)
            if bool(bad.any()):
                flat = int(xp.argmax(xp.where(bad, row_err / (row_ref + slack), -1.0)))
                at = np.unravel_index(flat, got.shape[:3])
                return (f"{int(bad.sum())} rows of {name} off; worst {name}[{', '.join(map(str, at))}]: relative "
                        f"error {float(row_err[at] / max(float(row_ref[at]), 1e-30)):.3g} > {ROW_FACTOR * tol:g}")
        return None


def _checked(causal: Any, scale: Any, head_dim: int, window: Any, softcap: Any,
             deterministic: Any) -> tuple[dict[str, Any], np.float32]:
    """A call's problem options and its scale, checked as the forward checks them (its errors
    naming autosoft.attention_backward): the Python function's and the operator's alike."""
    who = "autosoft.attention_backward"
    checked_scale = np.float32(check_scale(scale, head_dim, who))
    return {**call_options(causal, window, softcap, who), "deterministic": bool(deterministic)}, checked_scale


def _unseen(problem: Problem, xp: Any) -> tuple[Any, Any]:
    """(queries that see no key, (N,) bool; keys that no query sees, (Nkv,) bool), on xp's device."""
    n = problem.shape[2]
    kv_len = _kv(problem)[1]
    lo, hi = key_bounds(problem, np.arange(n), np)
    seen_by = np.zeros(kv_len + 1, dtype=np.int64)  # +1 at a query's first key, -1 after its last
    has = hi >= lo
    np.add.at(seen_by, lo[has], 1)
    np.add.at(seen_by, hi[has] + 1, -1)
    return xp.asarray(~has), xp.asarray(np.cumsum(seen_by)[:kv_len] == 0)


def reference_gradients(problem: Problem, inputs: Mapping[str, Any], xp: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """float64 dq, dk, dv on the GPU, with explicit masks, from the inputs (q, k, v, do, the
    forward's o and lse as given, dlse), in chunks of KV heads and query rows as the forward's
    reference: what the kernel computes, in exact arithmetic. (Given the float64 forward's o and lse,
    it is the exact gradient of attention.) Returns (gradients, sizes) by name: the sizes are the
    same products of the terms' absolute values (|dS| taken as P (|dP| + |Delta|)), which bound the
    rounding where dS cancels."""
    b, h, n, d = problem.shape
    kv_heads, kv_len = _kv(problem)
    group = h // kv_heads
    scale = float(inputs["scale"])
    cap = problem.option("softcap")
    q, k, v, do, o = (to_float64(inputs[name], problem.dtype, xp).reshape(b * kv_heads, -1, inputs[name].shape[-2], d)
                      for name in ("q", "k", "v", "do", "o"))
    lse_ref = inputs["lse"].astype(np.float64).reshape(b * kv_heads, group, n)
    delta = (do * o).sum(axis=-1)
    if "lse_grad" in problem.flags:
        delta = delta - inputs["dlse"].astype(np.float64).reshape(b * kv_heads, group, n)
    dq = xp.zeros((b * kv_heads, group, n, d), dtype=np.float64)
    dk = xp.zeros((b * kv_heads, kv_len, d), dtype=np.float64)
    dv = xp.zeros((b * kv_heads, kv_len, d), dtype=np.float64)
    sizes = {name: xp.zeros_like(a) for name, a in (("dq", dq), ("dk", dk), ("dv", dv))}
    rows = max(1, min(n, _REF_BYTES // (8 * kv_len * group)))
    keys = xp.arange(kv_len)[None, :]
    for hh in range(b * kv_heads):
        kh, vh = k[hh, 0], v[hh, 0]
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            qh = q[hh, :, r0:r1]                     # (group, rows, D)
            x = xp.matmul(qh, kh.T) * scale          # (group, rows, kv_len)
            s = float(cap) * xp.tanh(x / float(cap)) if cap is not None else x
            lo, hi = key_bounds(problem, xp.arange(r0, r1), xp)
            hidden = (keys < lo[:, None]) | (keys > hi[:, None])
            lse = lse_ref[hh, :, r0:r1, None]
            seen = xp.isfinite(lse)
            p = xp.where(hidden[None] | ~seen, 0.0, xp.exp(xp.where(hidden[None], 0.0, s) - xp.where(seen, lse, 0.0)))
            dp = xp.matmul(do[hh, :, r0:r1], vh.T)
            ds_dx = scale * (1.0 - (s / float(cap)) ** 2) if cap is not None else scale
            ds = p * (dp - delta[hh, :, r0:r1, None]) * ds_dx
            dv[hh] += xp.einsum("gik,gid->kd", p, do[hh, :, r0:r1])
            dk[hh] += xp.einsum("gik,gid->kd", ds, qh)
            dq[hh, :, r0:r1] = xp.matmul(ds, kh)
            size = p * (xp.abs(dp) + xp.abs(delta[hh, :, r0:r1, None])) * ds_dx
            sizes["dv"][hh] += xp.einsum("gik,gid->kd", p, xp.abs(do[hh, :, r0:r1]))
            sizes["dk"][hh] += xp.einsum("gik,gid->kd", size, xp.abs(qh))
            sizes["dq"][hh, :, r0:r1] = xp.matmul(size, xp.abs(kh))
    shapes = {"dq": (b, h, n, d), "dk": (b, kv_heads, kv_len, d), "dv": (b, kv_heads, kv_len, d)}
    grads = {"dq": dq, "dk": dk, "dv": dv}
    return ({name: a.reshape(shapes[name]) for name, a in grads.items()},
            {name: a.reshape(shapes[name]) for name, a in sizes.items()})


__all__ = ["ATTENTION_BACKWARD", "AttentionBackwardFamily", "reference_gradients"]

ATTENTION_BACKWARD = register(AttentionBackwardFamily())


# --- the torch operator (autosoft.torch_ops registers it) ---------------------------------------

def _operator_call(q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, dlse: Any, causal: bool, scale: float,
                   window_left: int | None = None, window_right: int | None = None, softcap: float | None = None,
                   deterministic: bool = False) -> OperatorCall:
    """What autosoft.attention_backward runs for the same arguments (window=(window_left, window_right))."""
    options, scale_value = _checked(causal, scale, q.shape[-1], operator_window(window_left, window_right), softcap,
                                    deterministic)
    return OperatorCall((q, k, v, o, do, lse, dlse), options, {"scale": scale_value})


AttentionBackwardFamily.torch_operators = (
    TorchOperator("attention_backward", "attention_backward",
                  "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor do, Tensor lse, Tensor? dlse, bool causal, "
                  "float scale, int? window_left=None, int? window_right=None, float? softcap=None, "
                  "bool deterministic=False) -> (Tensor dq, Tensor dk, Tensor dv)",
                  _operator_call, instead="scaled_dot_product_attention"),
)
