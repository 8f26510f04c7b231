"""The router of a mixture-of-experts layer: for each token (a row of E logits) the K best experts,
their weights (float32) and their indices (int32), best first.

plain (topk_softmax, as vLLM's `topk_softmax`): the K largest logits; weight = softmax(x)[e], or
  renormalised over the K chosen (`renormalize`).
grouped (DeepSeek-V3's `grouped_topk`, options n_group, topk_group, sigmoid, bias): scores
  s = softmax(x) (sigmoid(x) with `sigmoid`), selection keys s + bias[e] (the
  e_score_correction_bias, float32, with `bias`); the experts form n_group contiguous groups; a
  group scores the sum of its two best keys (with a bias, DeepSeek-V3) or its best key (without,
  DeepSeek-V2); the topk_group best groups are kept, then the K best keys among their experts;
  weight = s[e], the unbiased score, renormalised over the K if asked.
Every weight is then multiplied by the run-time scale (routed_scaling_factor, default 1).

Ties: equal keys go to the lower expert index (equal group scores to the lower group), in every
round, in every variant: the kernels compare (value, -index) pairs. The plain form compares the
logits themselves (softmax keeps their order), so its choice is exactly torch.topk(logits, k) with
ties to the lower index: the same experts as torch.topk(softmax(x)) where the probabilities are
distinct. The grouped form compares fp32 scores, so experts whose keys differ by fp32 rounding may
tie there. NaN logits give an unspecified choice.

No backward: the router's weights are not differentiated here (a training router that needs them
would gather softmax(x) at the indices in torch).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ..dtypes import ITEMSIZE, SHORT as _SHORT, to_float64, to_storage
from ..errors import UserError
from ..space import ParamValue
from . import register
from ._rows import INT32_MAX, VEC_BITS_TYPE, RowsFamily, pow2_ceil
from ..operators import OperatorCall, TorchOperator
from .base import Call, Launch, OptionValue, Problem, ProblemOption, Target, valid_neighbours

MAX_EXPERTS = 2048  # 32 threads x 64 experts held in registers
MAX_GROUPS = 32     # the kept groups are a 32-bit mask
SCALE_DEFAULT = 1.0

# Tolerances of `check`. Selection keys of the grouped form: fp32 scores (ex2.approx, one add of
# the bias) against float64, |key error| <= KEY_RTOL * (1 + |key|). Weights: the fp32 exponentials
# err by ~2^-23 of |x - max| (of |x| for sigmoid), the sums by ~2^-24 per term.
KEY_RTOL = 1e-5
WEIGHT_RTOL, WEIGHT_SPREAD_RTOL, WEIGHT_ATOL = 1e-5, 4e-7, 1e-37


class TopkSoftmaxFamily(RowsFamily):
    """weights, indices = the K best experts of each token's logits (M, E), plain or grouped."""
    name = "topk_softmax"
    template = "topk_softmax/topk_softmax.cu.j2"
    inputs = ("logits", "bias", "scale")  # bias: (E,) float32 or None; scale: routed_scaling_factor
    input_dtypes = {"bias": ("float32",)}
    optional_inputs = ("bias",)  # given or not, the problem's option `bias` says (problem_for sets it)
    outputs = ("weights", "indices")
    input_kinds = ("normal", "normal_x10", "ties", "neg_inf")
    input_alignment = 16  # rows start on vector boundaries (E % vec == 0)
    shape_help = "MxE: tokens x experts, e.g. 4096x256"
    options = (
        ProblemOption("k", "experts chosen per token (1 <= k <= E)", kind="int", required=True),
        ProblemOption("renormalize", "weights divided by their sum over the k chosen"),
        ProblemOption("n_group", "groups of experts (grouped form; E a multiple of it)", kind="int", default=1),
        ProblemOption("topk_group", "groups kept before the top k (grouped form)", kind="int", default=1),
        ProblemOption("sigmoid", "scores are sigmoid(x) rather than softmax(x)"),
        ProblemOption("bias", "a float32 bias of E added to the scores for selection (e_score_correction_bias); "
                              "a call sets it where it gives the bias input"),
    )
    examples = (("1x8", "float32", {"k": 1}),
                ("1x8", "float32", {"k": 8, "renormalize": True}),
                ("7x60", "bfloat16", {"k": 4, "renormalize": True}),
                ("33x160", "float16", {"k": 6}),
                ("4096x256", "bfloat16", {"k": 8, "renormalize": True, "n_group": 8, "topk_group": 4,
                                          "sigmoid": True, "bias": True}),
                ("100x384", "float32", {"k": 16, "renormalize": True}),
                ("65536x128", "bfloat16", {"k": 8, "renormalize": True}),
                ("5x512", "float16", {"k": 512}),
                ("3x160", "float32", {"k": 6, "n_group": 8, "topk_group": 3}))

    # --- problems ------------------------------------------------------------------------------
    def check_shape(self, shape: tuple[int, ...], text: Any = None) -> tuple[int, int]:
        shape = super().check_shape(shape, text)
        if shape[1] > MAX_EXPERTS:
            raise UserError(f"shape {text or 'x'.join(map(str, shape))!r}: at most {MAX_EXPERTS} experts "
                            "(a token's logits are held in one warp's registers)")
        return shape

    def problem(self, shape_text: str, dtype: str | None = None,
                options: Mapping[str, OptionValue] | Any = ()) -> Problem:
        problem = super().problem(shape_text, dtype, options)
        self._check_routing(problem)
        return problem

    def problem_for(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                    options: Mapping[str, OptionValue]) -> Problem:
        """Tokens are everything but the last dimension of the logits: (B, T, E) is (B*T)xE. The
        option `bias` is whether the bias input is given (shapes holds it): (E,)."""
        shape = tuple(shapes["logits"])
        if len(shape) == 0:
            raise ValueError(f"autosoft.{self.name}: router_logits is a scalar; it needs a dimension of experts")
        bias = shapes.get("bias")
        if bias is not None and tuple(bias) != (shape[-1],):
            raise ValueError(f"autosoft.{self.name}: bias must be a vector of the {shape[-1]} experts, got shape "
                             f"{tuple(bias)}")
        try:
            problem = Problem(self.name, dtype, self.check_shape((math.prod(shape[:-1]), shape[-1])),
                              self.check_options({**options, "bias": bias is not None}))
            self._check_routing(problem)
        except UserError as exc:
            raise ValueError(f"autosoft.{self.name}: {exc}") from None
        return problem

    @staticmethod
    def _check_routing(problem: Problem) -> None:
        """k, n_group and topk_group that fit the expert count, else UserError saying which."""
        e = problem.shape[1]
        k, n_group, topk_group = (int(problem.option(n, 1)) for n in ("k", "n_group", "topk_group"))
        if not 1 <= k <= e:
            raise UserError(f"k={k} is outside 1 <= k <= {e} (the experts per token)")
        if not 1 <= n_group <= MAX_GROUPS or e % n_group:
            raise UserError(f"n_group={n_group} must divide the {e} experts and be at most {MAX_GROUPS}")
        if not 1 <= topk_group <= n_group:
            raise UserError(f"topk_group={topk_group} is outside 1 <= topk_group <= n_group={n_group}")
        if k > topk_group * (e // n_group):
            raise UserError(f"k={k} is more than the {topk_group * (e // n_group)} experts of the "
                            f"topk_group={topk_group} groups kept")
        if n_group > 1 and problem.option("bias") and e // n_group < 2:
            raise UserError(f"with a bias a group scores its two best experts: n_group={n_group} leaves "
                            f"{e // n_group} per group")

    def caller_outputs(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                       options: Mapping[str, OptionValue]) -> dict[str, tuple[tuple[int, ...], str]]:
        """weights (..., k) float32 and indices (..., k) int32, the logits' leading dimensions kept."""
        lead = tuple(shapes["logits"])[:-1]
        k = int(options["k"])
        return {"weights": ((*lead, k), "float32"), "indices": ((*lead, k), "int32")}

    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]:
        m, e = problem.shape
        return {"M": m, "E": e, "K": int(problem.option("k")), "itemsize": ITEMSIZE[problem.dtype],
                "n_group": int(problem.option("n_group", 1)), "topk_group": int(problem.option("topk_group", 1)),
                "key_bits": self._key_bits(problem),
                "arch": int(target.arch), "sm_count": target.sm_count}

    @classmethod
    def _key_bits(cls, problem: Problem) -> int:
        """32 where a selection key is a 16-bit logit beside its index (the plain form of float16
        and bfloat16: one integer max compares two keys), else 64 (an fp32 value beside it)."""
        return 32 if not cls._grouped(problem) and ITEMSIZE[problem.dtype] == 2 else 64

    # --- the Python function -----------------------------------------------------------------
    def python_call(self, router_logits: Any, k: int, renormalize: bool = True, *, n_group: int | None = None,
                    topk_group: int | None = None, scoring: str = "softmax", bias: Any = None,
                    routed_scaling_factor: float = 1.0) -> Call:
        """The router of a mixture-of-experts layer: (weights, indices) of the k best experts of
        each token, best first.

        router_logits: (..., E) CUDA torch tensor (float32, float16, bfloat16) or CuPy array
        (float32, float16), E <= 2048. Returns weights (..., k) float32 and indices (..., k) int32.
        Plain (the defaults): the k largest logits, weights softmax(logits) at them, divided by
        their sum with renormalize=True. Grouped (DeepSeek-V3): scoring="sigmoid" or "softmax"
        gives the scores; bias (E,) float32 (e_score_correction_bias) is added to them for the
        choice only; n_group groups of E / n_group consecutive experts, each scored by the sum of
        its two best biased scores (its best score without a bias), topk_group of them kept, then
        the k best among their experts; weights are the unbiased scores. Every weight is then
        multiplied by routed_scaling_factor.

        Ties go to the lower expert index (and the lower group); the plain form compares the
        logits themselves, so it chooses as torch.topk(logits, k) does with ties to the lower
        index. It has no backward: tensors that require gradients while autograd records raise
        RuntimeError (call it under torch.no_grad()). Bad arguments raise TypeError or ValueError
        before any kernel runs (a bias of another dtype than float32: TypeError). While
        torch.compile traces, it is the operator torch.ops.autosoft.topk_softmax."""
        who = f"autosoft.{self.name}"
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise TypeError(f"{who}: k must be an int, got {type(k).__name__}")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"{who}: scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
        if (n_group is None) != (topk_group is None):
            raise ValueError(f"{who}: give n_group and topk_group together (or neither)")
        for name, value in (("n_group", n_group), ("topk_group", topk_group)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise TypeError(f"{who}: {name} must be an int, got {type(value).__name__}")
        scale = float(routed_scaling_factor)
        if not math.isfinite(scale):
            raise ValueError(f"{who}: routed_scaling_factor must be finite, got {routed_scaling_factor}")
        options: dict[str, OptionValue] = {"k": int(k), "renormalize": bool(renormalize),
                                           "n_group": int(n_group or 1), "topk_group": int(topk_group or 1),
                                           "sigmoid": scoring == "sigmoid"}
        return Call((router_logits, bias), options, {"scale": np.float32(scale)}, ("weights", "indices"))

    # --- variants ----------------------------------------------------------------------------
    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        p = params
        return (f"topk_softmax_{_SHORT[problem.dtype]}_t{p['threads']}_g{p['row_threads']}_v{p['vec']}"
                f"_{p['select']}{'_k32' if p['short_keys'] else ''}{'_packed' if p['compact'] else ''}"
                f"{'_full' if p['full_occupancy'] else ''}")

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        grouped = self._grouped(problem)
        scores = "logit" if not grouped else ("sigmoid" if problem.option("sigmoid") else "softmax")
        return {**values, "dtype": problem.dtype, "vec_bits_type": VEC_BITS_TYPE[values["vec_bytes"]],
                "scores": scores, "bias": bool(problem.option("bias")), "renormalize": bool(problem.option("renormalize")),
                "topk_group": int(problem.option("topk_group", 1)),
                "group_score": "top2" if problem.option("bias") else "max",
                # short keys: the low bits of a key that hold an expert's index (inverted)
                "idx_mask": (1 << max(1, (problem.shape[1] - 1).bit_length())) - 1}

    @staticmethod
    def _grouped(problem: Problem) -> bool:
        """Scores (softmax or sigmoid) rather than logits are the keys: any grouped-form option."""
        return bool(problem.option("sigmoid") or problem.option("bias") or int(problem.option("n_group", 1)) > 1)

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        m = problem.shape[0]
        blocks = values["blocks"]
        if blocks > INT32_MAX:
            raise UserError(f"{problem.shape_text}: too many tokens for one launch")
        args: tuple[Any, ...] = ("logits", "weights", "indices") + (("bias",) if problem.option("bias") else ()) + \
            ("scale", np.int64(m))
        return (Launch("topk_softmax", (blocks, 1, 1), (values["threads"], 1, 1), 0, args),), 0

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue]:
        """16-byte loads where E allows (and, grouped, a vector inside a group), short keys where
        the values are fp32, up to 64 experts a thread (fewer threads per token: fewer shuffle
        rounds, and ptxas streams a thread's keys through its sorts in few registers), each
        thread's best keys by bitonic sorts, 128 threads a block; the rescan where a thread
        holds one expert."""
        _, e = problem.shape
        itemsize = ITEMSIZE[problem.dtype]
        group = e // int(problem.option("n_group", 1))
        vec = 1
        while vec * 2 * itemsize <= 16 and e % (vec * 2) == 0 and group % (vec * 2) == 0:
            vec *= 2
        vectors = e // vec
        short_keys = self._key_bits(problem) == 64
        per_thread = 64
        row_threads = min(32, pow2_ceil(-(-vectors * vec // per_thread)))
        p: dict[str, ParamValue] = {"threads": 128, "row_threads": row_threads, "vec": vec, "select": "bitonic",
                                    "short_keys": short_keys, "compact": False, "full_occupancy": False}
        return self.first_valid(problem, target, p, (
            {"row_threads": min(32, pow2_ceil(-(-vectors // 2)))}, {"select": "rescan"},
            {"row_threads": min(32, pow2_ceil(-(-vectors // 8)))}, {"row_threads": 32}))

    def seed_params(self, problem: Problem, target: Target) -> list[dict[str, ParamValue]]:
        """Every token group size with each strategy, bitonic sorts first and the sizes nearest
        the default's first (a short tune then tries both sides of it), each with 128 and 256
        threads a block, right after the default's and its nearest size's first point (both block
        sizes) with a full SM's blocks where keys are 16-bit, or with compact lists where the
        form is grouped; then, with fp32 values, 64-bit keys at the default's two nearest sizes
        (the measure of what short keys save); then narrower loads and other block sizes."""
        base = self.default_params(problem, target)
        changes: list[dict[str, ParamValue]] = []
        near = int(base["row_threads"]).bit_length()
        sizes = sorted((1, 2, 4, 8, 16, 32), key=lambda g: (abs(g.bit_length() - near), g))
        for select in ("bitonic", "sorted", "rescan"):
            for threads in (128, 256):
                for g in sizes:
                    changes.append({"row_threads": g, "select": select, "threads": threads})
        if base["short_keys"]:
            changes += [{"row_threads": g, "short_keys": False} for g in sizes[:2]]
            # grouped: the kept groups' keys alone, at the default's size and its nearest, both block sizes
            changes[2:2] = [{"row_threads": g, "threads": threads, "compact": True}
                            for g in sizes[:3] for threads in (128, 256)]
        else:  # 16-bit keys: a full SM's blocks at the default's size and its neighbours, both block sizes
            changes[2:2] = [{"row_threads": g, "threads": threads, "full_occupancy": True}
                            for g in sizes[:3] for threads in (128, 256)]
        for vec in (1, 2, 4):
            changes.append({"vec": vec})
        for threads in (32, 64, 256, 512):
            changes.append({"threads": threads})
        return valid_neighbours(self, problem, target, base, changes)

    # --- costs -------------------------------------------------------------------------------
    def bytes_moved(self, problem: Problem) -> int:
        """The logits read once, the weights and indices written once (the bias is E floats, cached)."""
        m, e = problem.shape
        return m * e * ITEMSIZE[problem.dtype] + m * int(problem.option("k")) * 8

    def shape_distance(self, a: tuple[int, ...], b: tuple[int, ...]) -> float:
        """Tokens in log2 steps; another expert count is another kernel (never borrowed)."""
        if a[1] != b[1]:
            return math.inf
        return abs(math.log2(a[0]) - math.log2(b[0]))

    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        m = problem.shape[0]
        k = int(problem.option("k"))
        return {"weights": ((m, k), "float32"), "indices": ((m, k), "int32")}

    # --- verification (on the GPU through CuPy; NumPy works too: xp is the array module) -----
    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]:
        """logits of one kind: normal, normal x10 (wide spreads), ties (values from a set of nine,
        so most rows hold equal logits at the k-th place), neg_inf (a fifth -inf, every row keeping
        k finite ones); with `bias`, a bias (E,) float32 (from a set of four for ties); scale 1,
        or 2.5 for the grouped form."""
        m, e = problem.shape
        k = int(problem.option("k"))
        if kind == "ties":
            x = (rng.integers(-4, 5, size=(m, e)).astype(np.float32) * np.float32(0.5))
        else:
            x = rng.standard_normal((m, e), dtype=np.float32)
        if kind == "normal_x10":
            x *= 10
        elif kind == "neg_inf":
            hidden = rng.random((m, e)) < 0.2
            hidden[:, :k] = False  # k finite logits per row
            x[hidden] = -np.inf
        bias: Any = 0
        if problem.option("bias"):
            bias = (rng.integers(0, 4, size=e).astype(np.float32) * np.float32(0.25) if kind == "ties"
                    else rng.standard_normal(e, dtype=np.float32) * np.float32(0.1))
        scale = np.float32(2.5 if self._grouped(problem) else SCALE_DEFAULT)
        return {"logits": to_storage(x, problem.dtype, xp), "bias": bias, "scale": scale}

    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
        return check_routing(problem, inputs, outputs, xp)


def reference_scores(problem: Problem, inputs: Mapping[str, Any], xp: Any) -> tuple[Any, Any, Any]:
    """float64 (keys, weights, spread) of every expert: the keys the choice compares (the logits;
    grouped: scores plus bias), the unnormalised weights (softmax(x); grouped: the scores) and, per
    row, the largest |exponent| the kernel's exponentials see (for the weights' tolerance)."""
    x = to_float64(inputs["logits"], problem.dtype, xp)
    finite = xp.isfinite(x)
    if TopkSoftmaxFamily._grouped(problem) and problem.option("sigmoid"):
        scores = 1.0 / (1.0 + xp.exp(-x))
        spread = xp.where(finite, xp.abs(x), 0.0).max(axis=1, keepdims=True)
    else:
        shifted = x - x.max(axis=1, keepdims=True)
        scores = xp.exp(shifted)
        scores /= scores.sum(axis=1, keepdims=True)
        spread = xp.where(finite, xp.abs(shifted), 0.0).max(axis=1, keepdims=True)
    if not TopkSoftmaxFamily._grouped(problem):
        return x, scores, spread
    keys = scores + (xp.asarray(inputs["bias"], dtype=np.float64)[None, :] if problem.option("bias") else 0.0)
    return keys, scores, spread


def group_scores(problem: Problem, keys: Any, xp: Any) -> Any:
    """(M, n_group): each group's best key, or the sum of its best two with a bias."""
    m, e = keys.shape
    n_group = int(problem.option("n_group", 1))
    grouped = xp.sort(keys.reshape(m, n_group, e // n_group), axis=2)
    return grouped[:, :, -1] + grouped[:, :, -2] if problem.option("bias") else grouped[:, :, -1]


def reference_routing(problem: Problem, inputs: Mapping[str, Any], xp: Any) -> tuple[Any, Any]:
    """The float64 composition: (indices (M, k) int64, weights (M, k) float64), ties to the lower
    index (stable sorts), groups as DeepSeek-V3's grouped_topk keeps them."""
    keys, scores, _ = reference_scores(problem, inputs, xp)
    m, e = keys.shape
    k, n_group = int(problem.option("k")), int(problem.option("n_group", 1))
    if n_group > 1:
        order = xp.argsort(-group_scores(problem, keys, xp), axis=1, kind="stable")
        kept = xp.zeros((m, n_group), dtype=bool)
        kept[xp.arange(m)[:, None], order[:, :int(problem.option("topk_group", 1))]] = True
        keys = xp.where(xp.repeat(kept, e // n_group, axis=1), keys, -xp.inf)
    index = xp.argsort(-keys, axis=1, kind="stable")[:, :k]
    return index, _weights(problem, inputs, scores, index, xp)


def _weights(problem: Problem, inputs: Mapping[str, Any], scores: Any, index: Any, xp: Any) -> Any:
    w = xp.take_along_axis(scores, index, axis=1)
    if problem.option("renormalize"):
        w = w / w.sum(axis=1, keepdims=True)
    return w * float(inputs["scale"])


def check_routing(problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
    """None when the kernel's choice and weights are right, else the first row that is wrong.

    Indices: in range, distinct, and at every rank the float64 key of the expert chosen equals the
    reference's at that rank; where it is the very same key (a tie), the index too (the lower
    first). The grouped form's keys are fp32 in the kernel: there a key within KEY_RTOL of the
    reference's passes, and rows whose kept groups are within KEY_RTOL of another choice are only
    checked for groups that could have been kept. Weights: float64 from the kernel's own indices."""
    m, e = problem.shape
    k = int(problem.option("k"))
    index = outputs["indices"].astype(np.int64)
    got_w = outputs["weights"].astype(np.float64)
    out_of_range = (index < 0) | (index >= e)
    if bool(out_of_range.any()):
        r = int(xp.argmax(out_of_range.any(axis=1)))
        return f"{int(out_of_range.sum())} indices outside 0..{e - 1}; row {r}: {index[r].tolist()}"
    ordered_index = xp.sort(index, axis=1)
    repeated = (ordered_index[:, 1:] == ordered_index[:, :-1]).any(axis=1)
    if bool(repeated.any()):
        r = int(xp.argmax(repeated))
        return f"{int(repeated.sum())} rows choose an expert twice; row {r}: {index[r].tolist()}"
    keys, scores, spread = reference_scores(problem, inputs, xp)
    ref_index, _ = reference_routing(problem, inputs, xp)
    grouped = TopkSoftmaxFamily._grouped(problem)
    tol = KEY_RTOL * (1.0 + xp.abs(keys)) if grouped else xp.zeros_like(keys)
    n_group = int(problem.option("n_group", 1))
    ambiguous = xp.zeros(m, dtype=bool)
    if n_group > 1:
        topk_group = int(problem.option("topk_group", 1))
        g = xp.sort(group_scores(problem, keys, xp), axis=1)[:, ::-1]
        g_tol = 2 * KEY_RTOL * (1.0 + xp.abs(g))
        last_kept = g[:, topk_group - 1:topk_group]
        if topk_group < n_group:
            ambiguous = g[:, topk_group - 1] - g[:, topk_group] <= g_tol[:, topk_group - 1]
        chosen_groups = xp.take_along_axis(group_scores(problem, keys, xp), index // (e // n_group), axis=1)
        bad_group = (chosen_groups < last_kept - g_tol[:, topk_group - 1:topk_group]).any(axis=1)
        if bool(bad_group.any()):
            r = int(xp.argmax(bad_group))
            return f"{int(bad_group.sum())} rows choose an expert of a group not kept; row {r}: {index[r].tolist()}"
    got_key = xp.take_along_axis(keys, index, axis=1)
    ref_key = xp.take_along_axis(keys, ref_index, axis=1)
    ref_tol = xp.take_along_axis(tol, ref_index, axis=1)
    both_inf = xp.isneginf(got_key) & xp.isneginf(ref_key)
    off = ~((xp.abs(xp.where(both_inf, 0.0, got_key - ref_key)) <= ref_tol) | both_inf)
    tie_broken = (got_key == ref_key) & (index != ref_index)
    wrong_rank = (off | tie_broken) & ~ambiguous[:, None]
    if grouped:  # near-ties of fp32 keys may swap neighbours: the kernel's order must still descend
        wrong_rank |= (got_key[:, 1:] > got_key[:, :-1] + xp.take_along_axis(tol, index, axis=1)[:, 1:]).any(
            axis=1, keepdims=True) & xp.ones((m, k), dtype=bool)
    if bool(wrong_rank.any()):
        r, j = (int(v) for v in np.unravel_index(int(xp.argmax(wrong_rank)), wrong_rank.shape))
        return (f"{int(wrong_rank.any(axis=1).sum())} rows choose wrongly; row {r} rank {j}: got expert "
                f"{int(index[r, j])} (key {float(got_key[r, j])!r}), expected {int(ref_index[r, j])} "
                f"(key {float(ref_key[r, j])!r}); row {index[r].tolist()} vs {ref_index[r].tolist()}")
    ref_w = _weights(problem, inputs, scores, index, xp)
    w_tol = xp.abs(ref_w) * (WEIGHT_RTOL + WEIGHT_SPREAD_RTOL * spread) + WEIGHT_ATOL
    bad_w = ~(xp.abs(got_w - ref_w) <= w_tol)
    if bool(bad_w.any()):
        r, j = (int(v) for v in np.unravel_index(int(xp.argmax(bad_w)), bad_w.shape))
        return (f"{int(bad_w.sum())} of {bad_w.size} weights off; first at [{r}, {j}] (expert {int(index[r, j])}): "
                f"got {float(got_w[r, j])!r}, expected {float(ref_w[r, j])!r}")
    return None


__all__ = ["TOPK_SOFTMAX", "TopkSoftmaxFamily", "check_routing", "reference_routing", "reference_scores"]


def _routing(logits: Any, bias: Any, scale: float, k: int, renormalize: bool, n_group: int, topk_group: int,
             sigmoid: bool) -> OperatorCall:
    """torch.ops.autosoft.topk_softmax's arguments as the family's call (the bias: None or (E,))."""
    options: dict[str, OptionValue] = {"k": k, "renormalize": renormalize, "n_group": n_group,
                                       "topk_group": topk_group, "sigmoid": sigmoid}
    return OperatorCall((logits, bias), options, {"scale": np.float32(scale)})


TopkSoftmaxFamily.torch_operators = (
    TorchOperator("topk_softmax", "topk_softmax",
                  "(Tensor logits, Tensor? bias, float scale, int k, bool renormalize, int n_group, int topk_group, "
                  "bool sigmoid) -> (Tensor, Tensor)", _routing, instead="softmax and topk"),
)

TOPK_SOFTMAX = register(TopkSoftmaxFamily())
