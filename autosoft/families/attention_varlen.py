"""Attention over a batch of sequences of different lengths packed into one tensor, as
FlashAttention's flash_attn_varlen_func computes it (prefill in a serving engine).

q (total_q, Hq, D), k and v (total_k, Hkv, D) hold the sequences' tokens one after another;
cu_seqlens_q and cu_seqlens_k (B + 1,) int32 are the offsets of each sequence's first token (and
the totals last). Sequence b's queries attend to its keys only, query i standing at key
i + Nkv_b - Nq_b (bottom-right causal, windows and softcap as the attention family's). o is
(total_q, Hq, D) and lse (total_q, Hq) as the kernel writes them (autosoft.attention_varlen hands
lse back as FlashAttention's (Hq, total_q) view).

The lengths are read on the GPU from the offsets, so one variant serves every batch whose longest
sequences fit the problem's bucket: B, the heads, D, max_seqlen_q (the shape's N) and max_seqlen_k
(kv_len); tuning times every sequence that long. Two kernels of the attention family, with both
lengths run-time values of each sequence (`runtime_queries`): on sm_90 the wgmma kernel
(FlashAttention-3's varlen: tensor maps over the packed tokens, the query tiles numbered sequence
after sequence, one block per tile or persistent blocks), elsewhere and as the tuner's other choice
the mma kernel (one block per query tile of the longest sequence in every sequence, the surplus
returning at once).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from ..dtypes import ITEMSIZE, to_storage
from ..errors import UserError
from ..operators import OperatorCall, TorchOperator
from ..space import ParamValue
from . import register
from ._attention_mma import MmaEngine
from ._attention_wgmma import WgmmaEngine, fast_divisor, swizzle_bytes
from ._host_checks import check_arrays
from .attention import ATTENTION, AttentionFamily, call_options, check_scale, operator_window
from .base import Call, Family, Launch, OptionValue, Problem, ProblemOption, Target, TensorMap


class VarlenMma(MmaEngine):
    """The attention mma kernel over packed sequences: the layout's strides and the offsets as
    arguments, one block per query tile (no split keys)."""

    def __init__(self, family: Family) -> None:
        super().__init__(family, "attention_varlen_mma")

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().template_args(problem, values), "strided": True}

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        (attention,), workspace = super().launches(problem, values, target)
        _, h, _, d = problem.shape
        kv_heads, _ = self.family.kv(problem)
        q_strides = (np.int64(0), np.int64(d), np.int64(h * d))  # a token's row holds its heads
        kv_strides = (np.int64(0), np.int64(d), np.int64(kv_heads * d))
        args = (*attention.args[:6], *q_strides, *kv_strides, *kv_strides, "cu_seqlens_q", "cu_seqlens_k",
                *attention.args[6:])
        return (replace(attention, args=args),), workspace


def packed_maps(problem: Problem, kv_heads: int, kv_len: int, block_m: int,
                block_n: int) -> tuple[TensorMap, TensorMap, TensorMap]:
    """The wgmma kernel's tensor maps over packed q (total_q, Hq, D), k and v (total_k, Hkv, D)
    of a problem with kv_heads heads of k and v and at most kv_len keys a sequence: 3-D, a box one
    head's rows of one row chunk (block_m queries or block_n keys), the tokens' extent the call's
    own (the problem's is the most it may be). Contiguous: the call layer packs the arrays."""
    b, h, n, d = problem.shape
    cols = swizzle_bytes(d) // 2
    return (TensorMap("q", (b * n, h, d), (block_m, 1, cols), problem.dtype, always_contiguous=True, runtime_rows=True),
            TensorMap("k", (b * kv_len, kv_heads, d), (block_n, 1, cols), problem.dtype, always_contiguous=True,
                      runtime_rows=True),
            TensorMap("v", (b * kv_len, kv_heads, d), (block_n, 1, cols), problem.dtype, always_contiguous=True,
                      runtime_rows=True))


class VarlenWgmma(WgmmaEngine):
    """The attention wgmma kernel over packed sequences: tensor maps over the packed tokens, the
    tiles numbered sequence after sequence from the offsets (on the GPU); one block per query tile
    of the longest sequence in every sequence (the surplus returns at once) or persistent blocks
    taking their tiles from a queue or not (attention_varlen_wgmma.yaml fixes chain and lpt off)."""

    def __init__(self, family: Family) -> None:
        super().__init__(family, "attention_varlen_wgmma")

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        b, h, n, _ = problem.shape
        block_m, block_n = int(values["block_m"]), int(values["block_n"])
        if values["chain"] or values["lpt"]:
            raise ValueError(f"{self.family.name}: the wgmma kernel over packed sequences takes no chain or lpt")
        m_blocks = -(-n // block_m)
        grid = (min(m_blocks * h * b, target.sm_count * int(values["blocks_per_sm"])), 1, 1) \
            if values["persistent"] else (m_blocks, h, b)
        # a queue's kernel parameters: the head count's divisors (its tiles find their heads
        # without them here, sequence by sequence) and the counter, in the workspace
        queued = (*fast_divisor(h), *fast_divisor(1), "workspace") if values["queue"] else ()
        args = (*packed_maps(problem, *self.family.kv(problem), block_m, block_n), "o", "lse", "scale", np.int32(h),
                np.int32(b), "cu_seqlens_q", "cu_seqlens_k", *queued)
        return (Launch("attention_fwd", grid, (128 * (block_m // 64 + 1), 1, 1), values["smem_bytes"], args),), \
            8 if values["queue"] else 0

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue] | None:
        """The attention family's wgmma default (tiles, consumers, pipeline) under persistent
        blocks, which the sequences' tiles keep busy whatever their lengths (one block per tile
        needs a grid that covers the longest sequence's tiles in every sequence); causal tiles of
        unequal length taken from a queue, as one block per tile would take them in turn."""
        dense = super().default_params(problem, target)
        if dense is None:
            return None
        point = {**dense, "persistent": True, "queue": "causal" in problem.flags}
        return point if self.is_valid(problem, target, point) else dense


class AttentionVarlenFamily(AttentionFamily):
    """o and lse of attention over sequences of different lengths, packed."""
    name = "attention_varlen"
    template = "attention/attention.cu.j2"
    inputs = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "scale")
    input_dtypes = {"cu_seqlens_q": ("int32",), "cu_seqlens_k": ("int32",)}
    strided_inputs = ()  # packed layouts: their strides are the launch's literals
    input_kinds = ("normal", "normal_x10", "equal")
    options = (
        ProblemOption("causal", "mask keys after the query's position (bottom-right: key j > i + Nkv - Nq)"),
        ProblemOption("kv_heads", "heads of k and v, when fewer than H (grouped-query attention)", kind="int"),
        ProblemOption("kv_len", "the most keys a sequence has (max_seqlen_k), when not N", kind="int"),
        ProblemOption("window_left", "keys before the query's position it sees (sliding window)", kind="int"),
        ProblemOption("window_right", "keys after the query's position it sees (sliding window)", kind="int"),
        ProblemOption("softcap", "cap the scores: s becomes softcap * tanh(s / softcap)", kind="float"),
    )
    shape_help = ("B,H,N,D (or BxHxNxD): sequences, query heads, the most queries a sequence has (max_seqlen_q), "
                  "head dim; --kv-len for max_seqlen_k when not N, e.g. 16,32,4096,128 --kv-heads 8 --causal")
    examples = (("3,4,100,64", "float16", {"causal": True}),
                ("5,8,333,128", "bfloat16", {"kv_heads": 2, "kv_len": 700, "causal": True}),
                ("2,2,64,32", "float16", {"kv_len": 90, "window_left": 20, "softcap": 30.0}),
                ("4,16,1000,128", "bfloat16", {"kv_heads": 4, "causal": True}))

    def __init__(self) -> None:
        # the wgmma kernel first: where it offers a default (sm_90, enough rows) it is the faster
        self.engines = (VarlenWgmma(self), VarlenMma(self))

    # --- problem ------------------------------------------------------------------------

    def kernel_args(self, problem: Problem) -> dict[str, Any]:
        return {**super().kernel_args(problem), "runtime_keys": True, "runtime_queries": True}

    def name_prefix(self, problem: Problem) -> str:
        return super().name_prefix(problem).replace("attention_", "attention_varlen_", 1)

    def problem_for(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                    options: Mapping[str, OptionValue]) -> Problem:
        """The bucket of a call: q (total_q, Hq, D), k and v (total_k, Hkv, D), the offsets (B + 1,);
        max_seqlen_q and max_seqlen_k come in the options (the shape's N and kv_len)."""
        who = f"autosoft.{self.name}"
        self.check_call_shapes(who, shapes)
        q, k = tuple(shapes["q"]), tuple(shapes["k"])
        cu_q = tuple(shapes["cu_seqlens_q"])
        opts = dict(options)
        b = cu_q[0] - 1
        # the bounds a call names, else (a problem's own inputs) the tokens shared out evenly
        n = int(opts.pop("max_seqlen_q", 0)) or -(-q[0] // b)
        kv_len = int(opts.pop("max_seqlen_k", 0)) or int(opts.pop("kv_len", 0)) or -(-k[0] // b)
        opts.pop("kv_len", None)
        try:
            return self.problem(f"{b},{q[1]},{n},{q[2]}", dtype, {**opts, "kv_heads": k[1], "kv_len": kv_len})
        except UserError as exc:
            raise ValueError(f"{who}: {exc}") from None

    def check_call_shapes(self, who: str, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """ValueError, naming the argument, unless the arrays' shapes make a call: q (total_q, Hq, D)
        of a head dim the family takes, k and v (total_k, Hkv, D) with Hq a multiple of Hkv, and
        cu_seqlens_q and cu_seqlens_k (B + 1,) for one B >= 1."""
        q, k, v = (tuple(shapes[n]) for n in ("q", "k", "v"))
        cu_q, cu_k = tuple(shapes["cu_seqlens_q"]), tuple(shapes["cu_seqlens_k"])
        if len(q) != 3:
            raise ValueError(f"{who}: q must be (total_q, Hq, D), three dims, got shape {q}")
        if len(k) != 3:
            raise ValueError(f"{who}: k must be (total_k, Hkv, D), three dims, got shape {k}")
        if v != k:
            raise ValueError(f"{who}: v must have k's shape {k}, got {v}")
        if q[2] not in self.head_dims and 0 not in q:  # an empty call gets empty outputs, as attention's does
            raise ValueError(f"{who}: q's head dim {q[2]} is not supported; use one of "
                             f"{', '.join(map(str, self.head_dims))} (pad the heads to the next one)")
        if k[2] != q[2]:
            raise ValueError(f"{who}: k and v must have q's head dim {q[2]} (their last dim), got {k[2]}")
        if k[1] < 1 or q[1] % k[1]:
            raise ValueError(f"{who}: q's {q[1]} heads must be a multiple of k's and v's {k[1]} (grouped-query attention)")
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            if len(cu) != 1 or cu[0] < 2:
                raise ValueError(f"{who}: {name} must be (B + 1,) with B >= 1, the offsets of each sequence's first "
                                 f"token and the total last, got shape {cu}")
        if cu_q != cu_k:
            raise ValueError(f"{who}: cu_seqlens_q and cu_seqlens_k must have one length (B + 1), got {cu_q[0]} and "
                             f"{cu_k[0]}")
        if k[0] == 0 and q[0] > 0:
            raise ValueError(f"{who}: k and v hold no tokens (shape {k}), so no query has a key to attend to")

    def caller_outputs(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                       options: Mapping[str, OptionValue]) -> dict[str, tuple[tuple[int, ...], str]]:
        self.check_call_shapes(f"autosoft.{self.name}", shapes)  # also for empty inputs, which reach no Problem
        q = tuple(shapes["q"])
        return {"o": (q, dtype), "lse": (q[:2], "float32")}

    # --- the Python function -----------------------------------------------------------

    def python_call(self, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                    max_seqlen_k: int, causal: bool = False, scale: float | None = None, window: Any = None,
                    softcap: float | None = None, return_lse: bool = False) -> Call:
        """The arrays and options of a call; autosoft.attention_varlen documents the arguments. Shapes
        and dtypes are checked here, before anything reaches a device, with errors naming the argument;
        the offsets' values are the GPU's, the caller's to keep valid, as with FlashAttention."""
        who = "autosoft.attention_varlen"
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{who}: {name} must be an int >= 1 (a bound every sequence fits), got {value!r}")
            if value < 1:
                raise ValueError(f"{who}: {name} must be an int >= 1 (a bound every sequence fits), got {value!r}")
        check_arrays(who, self, self.inputs[:5], (q, k, v, cu_seqlens_q, cu_seqlens_k))
        head_dim = q.shape[-1] if hasattr(q, "shape") and len(q.shape) else 1
        options = {**call_options(causal, window, softcap, who), "max_seqlen_q": int(max_seqlen_q),
                   "max_seqlen_k": int(max_seqlen_k)}
        scale = check_scale(scale, head_dim, who)
        return Call((q, k, v, cu_seqlens_q, cu_seqlens_k), options, {"scale": np.float32(scale)},
                    ("o", "lse") if return_lse else ("o",))

    # --- inputs and the check (on the GPU through CuPy; xp is the cupy module) ----------

    def input_shapes(self, problem: Problem) -> dict[str, tuple[int, ...]]:
        b, h, n, d = problem.shape
        kv_heads, kv_len = self.kv(problem)
        return {"q": (b * n, h, d), "k": (b * kv_len, kv_heads, d), "v": (b * kv_len, kv_heads, d),
                "cu_seqlens_q": (b + 1,), "cu_seqlens_k": (b + 1,)}

    def lengths(self, problem: Problem, kind: str, rng: Any) -> tuple[np.ndarray, np.ndarray]:
        """Each sequence's (queries, keys). Timing ("normal") gives every sequence the bucket's
        lengths; the other kinds mix one token, the bucket, and random lengths."""
        b, _, n, _ = problem.shape
        kv_len = self.kv(problem)[1]
        if kind == "normal":
            return np.full(b, n, dtype=np.int32), np.full(b, kv_len, dtype=np.int32)
        drawn = rng.integers(1, max(n, kv_len) + 1, size=2 * b)
        drawn = [int(x) for x in (drawn.get() if hasattr(drawn, "get") else drawn)]
        # one query over the longest keys, the most queries over one key, then random lengths
        queries = [(1, n, drawn[i])[min(i, 2)] for i in range(b)]
        keys = [(kv_len, 1, drawn[b + i])[min(i, 2)] for i in range(b)]
        return np.clip(queries, 1, n).astype(np.int32), np.clip(keys, 1, kv_len).astype(np.int32)

    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]:
        _, h, _, d = problem.shape
        kv_heads, _ = self.kv(problem)
        queries, keys = self.lengths(problem, kind, rng)
        q = rng.standard_normal((int(queries.sum()), h, d), dtype=np.float32)
        k = rng.standard_normal((int(keys.sum()), kv_heads, d), dtype=np.float32)
        v = rng.standard_normal((int(keys.sum()), kv_heads, d), dtype=np.float32)
        if kind == "normal_x10":
            q *= 10
        elif kind == "equal":
            k[...] = k[:1]
        elif kind != "normal":
            raise ValueError(f"unknown input kind {kind!r}")
        offsets = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (queries, keys)]
        return {"q": to_storage(q, problem.dtype, xp), "k": to_storage(k, problem.dtype, xp),
                "v": to_storage(v, problem.dtype, xp), "cu_seqlens_q": xp.asarray(offsets[0]),
                "cu_seqlens_k": xp.asarray(offsets[1]), "scale": np.float32(1.0 / math.sqrt(d))}

    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        b, h, n, d = problem.shape
        return {"o": ((b * n, h, d), problem.dtype), "lse": ((b * n, h), "float32")}

    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
        """Each sequence's o and lse against the attention reference over its own keys; the rows
        past the batch's tokens (the buffer holds the bucket's) are never read."""
        _, h, _, d = problem.shape
        cu_q, cu_k = (x.get() if hasattr(x, "get") else np.asarray(x) for x in (inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]))
        opts = {name: value for name, value in problem.options if name not in ("kv_len",)}
        for s in range(len(cu_q) - 1):
            q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            one = ATTENTION.problem(f"1,{h},{q1 - q0},{d}", problem.dtype, {**opts, "kv_len": k1 - k0})
            seq_inputs = {"q": inputs["q"][q0:q1].transpose(1, 0, 2)[None], "k": inputs["k"][k0:k1].transpose(1, 0, 2)[None],
                          "v": inputs["v"][k0:k1].transpose(1, 0, 2)[None], "scale": inputs["scale"]}
            seq_outputs = {"o": outputs["o"][q0:q1].transpose(1, 0, 2)[None], "lse": outputs["lse"][q0:q1].T[None]}
            wrong = super().check(one, seq_inputs, seq_outputs, xp)
            if wrong:
                return f"sequence {s} ({q1 - q0} queries, {k1 - k0} keys): {wrong}"
        return None

    def bytes_moved(self, problem: Problem) -> int:
        b, h, n, d = problem.shape
        kv_heads, kv_len = self.kv(problem)
        return ITEMSIZE[problem.dtype] * d * (2 * b * h * n + 2 * b * kv_heads * kv_len) + 4 * b * h * n


__all__ = ["ATTENTION_VARLEN", "AttentionVarlenFamily"]

AttentionVarlenFamily.public_functions = ("autosoft.functions.attention_varlen:attention_varlen",)
ATTENTION_VARLEN = register(AttentionVarlenFamily())


# --- the torch operator (autosoft.torch_ops registers it) ---------------------------------------

def _operator_call(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                   max_seqlen_k: int, causal: bool, scale: float, window_left: int | None = None,
                   window_right: int | None = None, softcap: float | None = None) -> OperatorCall:
    """What autosoft.attention_varlen runs for the same arguments (window=(window_left, window_right))."""
    call = ATTENTION_VARLEN.python_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                        scale, operator_window(window_left, window_right), softcap)
    return OperatorCall(call.arrays, call.options, call.scalars)


AttentionVarlenFamily.torch_operators = (
    TorchOperator("attention_varlen", "attention_varlen",
                  "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
                  "int max_seqlen_k, bool causal, float scale, int? window_left=None, int? window_right=None, "
                  "float? softcap=None) -> (Tensor o, Tensor lse)", _operator_call,
                  instead="scaled_dot_product_attention, one call per sequence"),
)
