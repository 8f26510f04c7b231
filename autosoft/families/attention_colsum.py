"""Attention and the attention each key before a split position receives from the queries after it.

For q, k, v of shape (B, H, N, D) (fp16, bf16) and 0 < split < N:

    P = softmax(scale * q k^T [causal])     o = P v     lse = log of each row's sum (as attention's)
    colsum[b, h, j] = sum over queries i >= split of P[b, h, i, j],  for keys j < split  (float32)

what KV-cache compression (H2O, SnapKV) and attention analysis need beside o. The kernel is the
attention family's (templates/attention/), extended by templates/attention_colsum/ with one of two
ways to form the sums, a parameter of the search space:

- fused: a second pass inside the attention kernel, for query tiles that hold queries >= split,
  recomputes the scores of the keys before split and adds each column's sum with atomics; the
  order of those additions varies from run to run, so the last bits of colsum do too;
- key_major: after the attention kernel, one block per tile of keys before split walks the query
  tiles from split on and sums exp(scale q.k - lse) in registers: deterministic.

The problem option `deterministic` restricts the tuner (and the default) to the key-major pass.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ..autograd import refuse_gradients
from ..dtypes import to_float64
from ..errors import UserError
from ..operators import OperatorCall, TorchOperator
from ..space import ParamValue
from . import register
from ._attention_mma import MmaEngine
from ._attention_wgmma import WgmmaEngine
from .attention import AttentionFamily, check_scale
from .base import Call, Engine, Family, Launch, OptionValue, Problem, ProblemOption, Target

# |colsum - ref| <= RTOL * |ref| + ATOL per element; the full rows' column sums must add up to the
# number of queries >= split within TOTAL_RTOL
COLSUM_RTOL, COLSUM_ATOL, TOTAL_RTOL = 1e-3, 1e-5, 1e-4
ZERO_THREADS = 256
_REF_BYTES = 256 << 20  # float64 score block of the reference, per chunk


class AttentionColsumFamily(AttentionFamily):
    """o, colsum and lse of attention with the column sums of P over the queries >= split."""
    name = "attention_colsum"
    template = "attention_colsum/attention_colsum.cu.j2"
    template_folders = ("attention",)  # the attention kernel it extends
    outputs = ("o", "colsum", "lse")
    empty_values = {"lse": float("-inf")}  # no key: o = 0 and lse = -inf; no query: column sums 0
    strided_inputs = ()   # contiguous q, k, v: the key-major kernel takes no strides
    head_dims = (32, 64, 128)
    input_kinds = ("normal", "normal_x10", "equal")
    options = (
        ProblemOption("causal", "mask keys after the query (key j > query i)"),
        ProblemOption("split", "sum P over the queries from this position on, for the keys before it "
                      "(0 < split < N)", kind="int", required=True),
        ProblemOption("deterministic", "only variants whose column sums are the same bits on every run"),
    )
    shape_help = "B,H,N,D (or BxHxNxD): batch, heads, sequence length, head dim, e.g. 1,32,4096,128"
    examples = (("1,1,2,32", "float16", {"split": 1}),
                ("1,2,77,64", "bfloat16", {"causal": True, "split": 76}),
                ("3,7,1000,64", "float16", {"split": 500, "deterministic": True}),
                ("1,8,3333,128", "bfloat16", {"causal": True, "split": 3269}),
                ("2,4,1024,128", "float16", {"split": 1}),
                ("1,4,4096,64", "bfloat16", {"causal": True, "split": 2048}))

    def __init__(self) -> None:
        # on sm_90 the wgmma kernel first: with the key-major pass after it, 1.4 to 1.9 times as fast
        # as the mma kernel's pair on the eight benchmark rows (H200)
        self.engines = (ColsumWgmma(self), ColsumMma(self))

    # --- problem ------------------------------------------------------------------------

    def problem(self, shape_text: str, dtype: str | None = None,
                options: Mapping[str, OptionValue] | Any = ()) -> Problem:
        problem = super().problem(shape_text, dtype, options)
        self._check_split(problem.shape, problem.option("split"))
        return problem

    def problem_for(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                    options: Mapping[str, OptionValue]) -> Problem:
        problem = super().problem_for(shapes, dtype, options)
        try:
            self._check_split(problem.shape, problem.option("split"))
        except UserError as exc:
            raise ValueError(f"autosoft.{self.name}: {exc}") from None
        return problem

    @staticmethod
    def _check_split(shape: tuple[int, ...], split: OptionValue | None) -> None:
        n = shape[2]
        if split is None or not 0 < int(split) < n:
            raise UserError(f"split={split} is outside 0 < split < N={n}: the column sums need queries on both "
                            "sides of it" + (" (N must be at least 2)" if n < 2 else ""))

    def caller_outputs(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                       options: Mapping[str, OptionValue]) -> dict[str, tuple[tuple[int, ...], str]]:
        q = self.check_shapes(shapes)[0]
        split = int(options["split"])
        if not 0 < split < q[2]:  # also for empty inputs, which never reach a Problem
            raise ValueError(f"autosoft.{self.name}: split={split} is outside 0 < split < N={q[2]}")
        return {"o": (q, dtype), "colsum": ((*q[:2], split), "float32"), "lse": (q[:3], "float32")}

    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]:
        return {**super().problem_values(problem, target), "split": int(problem.option("split")),
                "deterministic": "deterministic" in problem.flags}

    # --- the Python function -----------------------------------------------------------

    def python_call(self, q: Any, k: Any, v: Any, split: int | None = None, causal: bool = False,
                    scale: float | None = None, return_lse: bool = False, deterministic: bool = False) -> Call:
        """Attention, and how much attention the queries from `split` on pay to each key before it.

        q, k, v: (B, H, N, D) arrays of one shape, CUDA torch tensors (float16, bfloat16) or CuPy
        float16 arrays, D in 32, 64, 128; split (required): an int with 0 < split < N. Returns
        (o, colsum): o like q (as autosoft.attention), colsum (B, H, split) float32 with
        colsum[b, h, j] the sum over queries i >= split of softmax(scale * q kᵀ [causal])[b, h, i, j];
        with return_lse=True, (o, colsum, lse). scale defaults to 1/sqrt(D) and must be positive.
        deterministic=True uses only variants whose colsum is the same bits on every run (the
        key-major pass, no atomics). It has no backward: torch tensors that require gradients
        while autograd records raise RuntimeError (call it under torch.no_grad()).
        """
        who = f"autosoft.{self.name}"
        if split is None:
            raise TypeError(f"{who}: split is required: the column sums are over the queries from split on, "
                            "for the keys before it (0 < split < N)")
        refuse_gradients(self.name, q, k, v)
        if isinstance(split, bool) or not isinstance(split, (int, np.integer)):
            raise TypeError(f"{who}: split must be an int, got {type(split).__name__}")
        head_dim = q.shape[-1] if hasattr(q, "shape") and len(q.shape) else 1
        scale = check_scale(scale, head_dim, who)
        return Call((q, k, v), {"causal": bool(causal), "split": int(split), "deterministic": bool(deterministic)},
                    {"scale": np.float32(scale)}, ("o", "colsum", "lse") if return_lse else ("o", "colsum"))

    # --- what it costs ------------------------------------------------------------------

    def problem_distance(self, a: Problem, b: Problem) -> float:
        """The attention distance of the shapes plus log2 steps between the splits and between
        the numbers of queries after them (each weighing as N does); other flags: never."""
        if a.flags != b.flags:
            return math.inf
        sa, sb = int(a.option("split")), int(b.option("split"))
        tail = abs(math.log2(a.shape[2] - sa) - math.log2(b.shape[2] - sb))
        return self.shape_distance(a.shape, b.shape) + 4 * (abs(math.log2(sa) - math.log2(sb)) + tail)

    def bytes_moved(self, problem: Problem) -> int:
        b, h, _, _ = problem.shape
        return super().bytes_moved(problem) + 4 * b * h * int(problem.option("split"))

    def flops(self, problem: Problem) -> float:
        """Attention's, and one more q.k product for every (query >= split, key < split) pair."""
        b, h, n, d = problem.shape
        split = int(problem.option("split"))
        return super().flops(problem) + 2.0 * b * h * (n - split) * split * d

    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        b, h, n, _ = problem.shape
        return {**super().output_specs(problem), "colsum": ((b, h, int(problem.option("split"))), "float32")}

    # --- verification (runs on the GPU through CuPy; xp is the cupy module) ---------------

    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
        wrong = super().check(problem, inputs, outputs, xp)  # o and lse, as the attention family checks them
        if wrong:
            return wrong
        colsum = outputs["colsum"].astype(np.float64)
        if bool(xp.isnan(colsum).any()):
            return f"colsum has {int(xp.isnan(colsum).sum())} NaN (unwritten or overflowed) elements"
        split = int(problem.option("split"))
        ref = reference_colsum(problem, inputs, xp)  # every key's sum, keys >= split included
        err = xp.abs(colsum - ref[..., :split])
        bad = ~(err <= COLSUM_RTOL * xp.abs(ref[..., :split]) + COLSUM_ATOL)
        if bool(bad.any()):
            flat = int(xp.argmax(xp.where(bad, err, -1.0)))
            b, h, j = np.unravel_index(flat, colsum.shape)
            return (f"{int(bad.sum())} colsum values off; worst colsum[{b}, {h}, {j}]: got {float(colsum[b, h, j])!r}, "
                    f"expected {float(ref[b, h, j])!r}")
        # a wrong normaliser shows here: each query's row adds to 1, so all columns to the query count
        totals = colsum.sum(axis=-1) + ref[..., split:].sum(axis=-1)
        queries = problem.shape[2] - split
        off = xp.abs(totals - queries)
        if not bool((off <= TOTAL_RTOL * queries).all()):
            flat = int(xp.argmax(off))
            b, h = np.unravel_index(flat, totals.shape)
            return f"column sums of head [{b}, {h}] add to {float(totals[b, h])!r}, not the {queries} queries >= split"
        return None


def reference_colsum(problem: Problem, inputs: Mapping[str, Any], xp: Any) -> Any:
    """float64 sums over queries >= split of each key's P, for every key (B, H, N), on the GPU in
    chunks of heads and query rows, as the attention reference computes P."""
    b, h, n, d = problem.shape
    split = int(problem.option("split"))
    causal = "causal" in problem.flags
    scale = float(inputs["scale"])
    q = to_float64(inputs["q"], problem.dtype, xp).reshape(b * h, n, d)
    k = to_float64(inputs["k"], problem.dtype, xp).reshape(b * h, n, d)
    sums = xp.zeros((b * h, n), dtype=np.float64)
    rows = max(1, min(n - split, _REF_BYTES // (8 * n)))
    heads = max(1, min(b * h, _REF_BYTES // (8 * n * rows)))
    for h0 in range(0, b * h, heads):
        hs = slice(h0, min(b * h, h0 + heads))
        for r0 in range(split, n, rows):
            r1 = min(n, r0 + rows)
            s = xp.matmul(q[hs, r0:r1], k[hs].transpose(0, 2, 1)) * scale
            if causal:
                s[:, xp.arange(n)[None, :] > xp.arange(r0, r1)[:, None]] = -np.inf
            p = xp.exp(s - s.max(axis=-1, keepdims=True))
            sums[hs] += (p / p.sum(axis=-1, keepdims=True)).sum(axis=1)
    return sums.reshape(b, h, n)


# --- the engines: an attention engine's kernel, then the column-sum pass -----------------

# the column-sum pass's parameters where the attention kernel's own points do not set them
_PASS = {"colsum": "key_major", "km_rows": 16, "km_queries": 64, "km_split": 1}
_WAYS: tuple[dict[str, ParamValue], ...] = ({"colsum": "key_major"}, {"colsum": "fused", **{n: v for n, v in _PASS.items()
                                                                                             if n != "colsum"}})


class _ColsumEngine(Engine):
    """An attention engine's kernel (self.attention, on this engine's space) with the column-sum
    pass: its template extends the attention template; its name, default and seeds are the
    attention engine's with the pass's parameters."""
    template = "attention_colsum/attention_colsum.cu.j2"
    attention: Engine

    def __init__(self, family: Family, attention: Engine) -> None:
        super().__init__(family, attention.space_name)
        self.attention = attention
        self.name = attention.name  # type: ignore[misc]
        self.archs = attention.archs  # type: ignore[misc]

    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        way = "fused" if params["colsum"] == "fused" else \
            f"kmajor{int(params['km_rows']) * int(params.get('warps', 4))}x{params['km_queries']}" + \
            (f"c{params['km_split']}" if int(params["km_split"]) > 1 else "")
        return self.attention.variant_name(problem, params).replace("attention_", f"attention_colsum_{way}_", 1)

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        return {**self.attention.template_args(problem, values), "attention_kernel": "attention_fwd",
                "single_length": True, "zero_kernel": "colsum_zero", "key_major_kernel": "colsum_key_major"}

    def attention_launch(self, problem: Problem, values: Mapping[str, Any], target: Target) -> Launch:
        """The attention kernel's launch."""
        raise NotImplementedError

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        b, h, n, _ = problem.shape
        split = values["split"]
        attention = self.attention_launch(problem, values, target)
        if values["colsum"] == "fused":
            count = b * h * split
            zero = Launch("colsum_zero", (min(-(-count // ZERO_THREADS), 4 * target.sm_count), 1, 1),
                          (ZERO_THREADS, 1, 1), 0, ("colsum", np.int64(count)))
            return (zero, attention), 0
        keys = values["warps"] * values["km_rows"]
        key_tiles, chunks = -(-split // keys), values["km_split"]
        args: tuple[str, ...] = ("q", "k", "lse", "colsum", "scale")
        workspace = 0
        if chunks > 1:  # partial sums per (tile, chunk), then an arrival counter per tile
            args += ("workspace",)
            workspace = 4 * b * h * key_tiles * (chunks * keys + 1)
        key_major = Launch("colsum_key_major", (key_tiles * chunks, h, b), (32 * values["warps"], 1, 1),
                           values["key_major_smem"], args)
        return (attention, key_major), workspace

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue] | None:
        """The attention engine's default kernel and tiles, then the key-major pass with 16 keys
        per warp and 64 queries per tile, its query tiles shared among as many blocks per key tile
        (up to 8) as it takes to give every SM two blocks. On the H200 the key-major pass beat the
        fused one on all eight benchmark rows untuned (by 4-46 %: the fused pass lengthens the
        longest query tiles, which start first and finish last), and it is deterministic."""
        p = self.attention.default_params(problem, target)
        if p is None:
            return None
        b, h, _, _ = problem.shape
        warps = int(p.get("warps", 4))
        blocks = -(-int(problem.option("split")) // (warps * int(p["km_rows"]))) * b * h
        chunks = 1
        while blocks * chunks < 2 * target.sm_count and chunks < 8 and \
                self.is_valid(problem, target, {**p, "km_split": 2 * chunks}):
            chunks *= 2
        return {**p, "km_split": chunks}

    def seed_params(self, problem: Problem, target: Target, default: Mapping[str, ParamValue]) -> list[dict[str, ParamValue]]:
        """As the default engine: other key-major tiles, the fused pass, then the attention
        engine's seeds with each pass; else the attention engine's default and seeds with each pass."""
        kernel = self.attention.default_params(problem, target)
        mine = self.default_params(problem, target)
        if default.get("engine") != self.name or mine is None:
            kernels = ([kernel] if kernel is not None else []) + \
                self.attention.seed_params(problem, target, {"engine": self.name, **(kernel or {})})
            return self.valid_neighbours(problem, target, {}, [{**s, **way} for s in kernels for way in _WAYS])
        kernels = self.attention.seed_params(problem, target, {"engine": self.name, **(kernel or {})})
        if kernel is not None and kernel != mine:
            kernels = [kernel, *kernels]
        changes: list[dict[str, ParamValue]] = [
            {"km_queries": 128}, {"km_rows": 32}, {"km_rows": 32, "km_queries": 128}, {"km_queries": 32},
            {"km_split": 1}, {"km_split": 2}, {"km_split": 4}, {"km_split": 8}, {**_WAYS[1]}]
        changes += [{**s, **way} for s in kernels for way in _WAYS]
        return self.valid_neighbours(problem, target, mine, changes)


class ColsumMma(_ColsumEngine):
    """The mma kernel with the pass: the fused pass inside it (its `colsum` argument), or the
    key-major kernel after it."""

    def __init__(self, family: Family) -> None:
        super().__init__(family, MmaEngine(family, "attention_colsum_mma", adds=_PASS))

    def attention_launch(self, problem: Problem, values: Mapping[str, Any], target: Target) -> Launch:
        b, h, n, _ = problem.shape
        return Launch("attention_fwd", (-(-n // values["block_m"]), h, b), (32 * values["warps"], 1, 1),
                      values["smem_bytes"], ("q", "k", "v", "o", "lse", "scale", "colsum"))


class ColsumWgmma(_ColsumEngine):
    """The wgmma kernel as attention launches it, then the key-major pass built on the mma
    kernel's helpers (in the same source, the Hopper kernel in a namespace of its own)."""

    def __init__(self, family: Family) -> None:
        super().__init__(family, WgmmaEngine(family, "attention_colsum_wgmma", adds=_PASS, decoding=True))

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        # the helpers' tiles: one warp per row group, no packed heads or split keys
        return {**super().template_args(problem, values), "mma_helpers": True, "key_warps": 1, "pack": False,
                "splits": 1, "merge": "last_block"}

    def attention_launch(self, problem: Problem, values: Mapping[str, Any], target: Target) -> Launch:
        (attention,), _ = self.attention.launches(problem, values, target)
        return attention


__all__ = ["ATTENTION_COLSUM", "AttentionColsumFamily", "reference_colsum"]

ATTENTION_COLSUM = register(AttentionColsumFamily())


# --- the torch operator (autosoft.torch_ops registers it) ---------------------------------------

def _operator_call(q: Any, k: Any, v: Any, split: int, causal: bool, scale: float,
                   deterministic: bool) -> OperatorCall:
    """What autosoft.attention_colsum runs for the same arguments."""
    scale = check_scale(scale, q.shape[-1], "autosoft.attention_colsum")
    return OperatorCall((q, k, v), {"causal": bool(causal), "split": int(split), "deterministic": bool(deterministic)},
                        {"scale": np.float32(scale)})


AttentionColsumFamily.torch_operators = (
    TorchOperator("attention_colsum", "attention_colsum", "(Tensor q, Tensor k, Tensor v, int split, bool causal, "
                  "float scale, bool deterministic) -> (Tensor o, Tensor colsum, Tensor lse)", _operator_call,
                  instead="scaled_dot_product_attention"),
)
AttentionColsumFamily.python_returns = "tuple[Array, Array] | tuple[Array, Array, Array]"  # (o, colsum[, lse])
