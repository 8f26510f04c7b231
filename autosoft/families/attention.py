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
from ..operators import OperatorCall, TorchOperator
from ..space import ParamValue
from . import register
from .base import Family, Launch, OptionValue, Problem, ProblemOption, Target, TensorMap, option_flag, valid_neighbours

_SHAPE = re.compile(r"^\s*(\d+)\s*[,xX]\s*(\d+)\s*[,xX]\s*(\d+)\s*[,xX]\s*(\d+)\s*$")
_SHORT = {"float16": "f16", "bfloat16": "bf16"}
_MMA_TYPE = {"float16": "f16", "bfloat16": "bf16"}
HEAD_DIMS = (32, 64, 96, 128, 256)
INT32_MAX = 2**31 - 1
GRID_YZ_MAX = 65535
SPLITS_MAX = 32
# the wgmma kernel's schedules switched off: the mma kernel's values, where a wgmma point starts from
_SCHEDULES_OFF: dict[str, ParamValue] = {"overlap": False, "pingpong": False, "blocks_per_sm": 1, "lpt": False,
                                         "persistent": False, "queue": False, "chain": False, "merge": "last_block"}
# the mma-only parameters at the one value each keeps under wgmma (the space's constraint)
_WGMMA_FIXED: dict[str, ParamValue] = {"engine": "wgmma", "warps": 4, "key_warps": 1, "q_in": "smem",
                                       "layout": "swizzle", "pack": False, "splits": 1}

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
        if "softcap" in opts and not (math.isfinite(float(opts["softcap"])) and float(opts["softcap"]) > 0):
            raise UserError(f"--softcap {opts['softcap']}: expected a positive number")
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

    # --- a variant ----------------------------------------------------------------------

    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        p = params
        kv_heads, kv_len = _kv(problem)
        group = problem.shape[1] // kv_heads
        mask = "_causal" if "causal" in problem.flags else ""
        if problem.option("window_left") is not None or problem.option("window_right") is not None:
            mask += "_window"
        name = (f"attention_{_SHORT[problem.dtype]}_d{problem.shape[3]}{mask}"
                f"{'_softcap' if problem.option('softcap') is not None else ''}"
                f"{f'_g{group}' if group > 1 else ''}")
        if p.get("engine") == "wgmma":  # its other parameters keep one value (the space's constraint)
            return (name + f"_wgmma_m{p['block_m']}_n{p['block_n']}_s{p['stages']}"
                    + ("_ov" if p.get("overlap") else "") + ("_pp" if p.get("pingpong") else "")
                    + ("_2cta" if int(p.get("blocks_per_sm", 1)) == 2 else "") + ("_lpt" if p.get("lpt") else "")
                + ("_pers" if p.get("persistent") else "") + ("_queue" if p.get("queue") else "")
                + ("_chain" if p.get("chain") else ""))
        name += (f"_m{p['block_m']}_n{p['block_n']}_w{p['warps']}_s{p['stages']}"
                 f"_{'swz' if p['layout'] == 'swizzle' else 'pad'}")
        if p["q_in"] == "registers":
            name += "_qreg"
        if int(p.get("key_warps", 1)) > 1:
            name += f"_kw{p['key_warps']}"
        if p.get("pack"):
            name += "_pack"
        if int(p.get("splits", 1)) > 1:
            name += f"_split{p['splits']}" + ("_cluster" if p.get("merge") == "cluster" else "")
        return name

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        """The space's values, with what the kernel bakes in: lengths, group, mask and cap (a family
        that extends the kernel without pack and splits gets neither)."""
        b, h, n, d = problem.shape
        kv_heads, kv_len = _kv(problem)
        window_left, window_right = problem.option("window_left"), problem.option("window_right")
        softcap = problem.option("softcap")
        return {**values, "dtype": problem.dtype, "mma_type": _MMA_TYPE[problem.dtype], "NQ": n, "NKV": kv_len,
                "group": h // kv_heads, "pack": bool(values.get("pack", False)), "splits": int(values.get("splits", 1)),
                "key_warps": int(values.get("key_warps", 1)),
                "strided": bool(self.strided_inputs),
                "window_left": -1 if window_left is None else int(window_left),
                "window_right": -1 if window_right is None else int(window_right),
                "softcap": "0.0" if softcap is None else repr(float(softcap)), "capped": softcap is not None,
                "single_length": False, "engine": values.get("engine", "mma"),
                "overlap": bool(values.get("overlap", False)), "pingpong": bool(values.get("pingpong", False)),
                "blocks_per_sm": int(values.get("blocks_per_sm", 1)), "lpt": bool(values.get("lpt", False)),
                "persistent": bool(values.get("persistent", False)), "queue": bool(values.get("queue", False)),
                "chain": bool(values.get("chain", False)), "mma_helpers": False, "merge": values.get("merge", "last_block"), "lpt_heads": self._lpt_heads(problem, values)}

    @staticmethod
    def _lpt_heads(problem: Problem, values: Mapping[str, Any]) -> int:
        """(batch, head) pairs whose K and V fit in half the L2 (at least one): the group the
        longest-first order works within, so that a group's K and V stay in the L2 while it runs."""
        kv_heads, kv_len = _kv(problem)
        per_head = 2 * kv_len * problem.shape[3] * ITEMSIZE[problem.dtype]
        group = problem.shape[1] // kv_heads  # query heads sharing one K and V
        return max(1, int(values.get("l2_bytes", 50 << 20)) // 2 // per_head * group)

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        b, h, n, d = problem.shape
        kv_heads, kv_len = _kv(problem)
        if values.get("engine") == "wgmma":  # a producer warpgroup and one consumer per 64 rows
            block_m, block_n = int(values["block_m"]), int(values["block_n"])
            queue = bool(values.get("queue"))  # a workspace: the tile counter and the blocks done (the last resets both)
            maps = (TensorMap("q", (b, h, n, d), (1, 1, block_m, 64), problem.dtype),
                    TensorMap("k", (b, kv_heads, kv_len, d), (1, 1, block_n, 64), problem.dtype),
                    TensorMap("v", (b, kv_heads, kv_len, d), (1, 1, block_n, 64), problem.dtype),
                    # with a queue each consumer's 64 rows of O are stored by the tensor-memory accelerator
                    *((TensorMap("o", (b, h, n, d), (1, 1, 64, 64), problem.dtype, always_contiguous=True),) if queue else ()))
            tiles = -(-n // block_m) * h * b
            grid = (min(tiles, target.sm_count * int(values.get("blocks_per_sm", 1))), 1, 1) \
                if values.get("persistent") else (-(-n // block_m), h, b)
            queued: tuple[Any, ...] = ()
            if queue:  # a tile's (batch, head) comes from its number by dividing by the head count,
                # and with lpt by the last group's head count: each passed as multiplier and shift
                lpt_heads = self._lpt_heads(problem, values)
                queued = (*fast_divisor(h), *fast_divisor(h * b % lpt_heads or lpt_heads), "workspace")
            args_w = (*maps, "o", "lse", "scale", np.int32(h), np.int32(b), *queued)
            return (Launch("attention_fwd", grid, (128 * (block_m // 64 + 1), 1, 1), values["smem_bytes"], args_w),), \
                8 if queue else 0
        pack, splits = bool(values.get("pack", False)), int(values.get("splits", 1))
        rows = (h // kv_heads) * n if pack else n
        m_blocks = -(-rows // values["block_m"])
        grid = (m_blocks * splits, kv_heads if pack else h, b)
        block = (32 * values["warps"], 1, 1)
        args: tuple[str, ...] = ("q", "k", "v", "o", "lse", "scale")
        args += tuple(f"{name}_stride{i}" for name in self.strided_inputs for i in range(3))
        if splits > 1 and values.get("merge") == "cluster":  # the splits of a query tile: one cluster
            return (Launch("attention_fwd", grid, block, values["smem_bytes"], args, cluster_blocks=splits),), 0
        workspace = 0
        if splits > 1:  # partial lse and O / l of every (query row, split), then arrival counters
            partials = b * h * n * splits
            workspace = 4 * (-(-partials // 4) * 4 + partials * d + m_blocks * grid[1] * b)
            args += ("workspace",)
        return (Launch("attention_fwd", grid, block, values["smem_bytes"], args),), workspace

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue]:
        """On sm_90 with D of 64, 128 or 256 and enough rows for a 128-row tile, the wgmma engine:
        two consumer warpgroups of 64 rows, both FlashAttention-3 schedules (overlap, ping-pong),
        128-key tiles (80 for D = 256, where shared memory is short), two stages; for D = 64 three
        consumers (192 rows) without ping-pong, and up to 1024 queries one consumer of 64 rows in
        blocks two of which share an SM (16x16x512x64 and 4x16x1024x64: 7 to 19 % faster).
        Without a mask the blocks are persistent (at D = 256 one block per tile: two Q buffers do
        not fit beside the K/V ring); causal with at most 32 heads orders the tiles longest first
        across heads; causal rows of up to 1024 keys at D = 64 run persistent blocks that take
        their tiles from a queue (10 to 14 % faster there); at D = 128 persistent ping-pong blocks
        chain their tiles (the next tile's first S issued with the last P.V: 1 to 2 % faster).
        Among the variants timed on an H200 (bf16: 4x16x4096x128,
        8x32x2048x128 causal, 1x32x4096x128 GQA causal, 1x32x8192x64 causal, 4x16x4096x256 causal,
        16x16x512x64, 4x16x1024x128; 3x7x1000x64 fp16) these were the best or within 3 % of it,
        and 1.6 to 2.2 times the mma kernel's default. Decoding keeps the mma kernel (below).

        Otherwise the mma kernel. Many queries per head: 4 warps of 32 query rows each (two mma tiles share every K/V
        fragment read from shared memory), 64 keys per tile, a two-stage pipeline, swizzled rows;
        Q fragments in registers for D <= 64 (re-read from shared memory for larger D, where
        registers are short). The best of all 102 / 82 variants at 1x32x8192x64 / 4x16x4096x128
        bf16 on an H200 (352 and 364 TFLOP/s). Smaller query tiles when 128-row tiles cannot fill
        the GPU. For D = 256, 8 warps of 16 rows: the best of 169 variants at 4x16x4096x256 causal
        bf16 on an H200 (1934 us, 284 TFLOP/s; 4 warps of 16 rows: 2442 us).

        Few rows per head (decoding: N * H / kv_heads <= 64 with the heads of a group packed):
        four warps per block that split every 64-key tile among them (their rows: the group's
        query heads packed, 16 to 64 rows), three tiles in flight, and the keys split among enough
        blocks to give every SM two."""
        hopper = self._hopper_default(problem, target)
        return hopper if hopper is not None else self._mma_default(problem, target)

    def _hopper_default(self, problem: Problem, target: Target) -> dict[str, ParamValue] | None:
        """The wgmma default where it is valid (sm_90, D of 64, 128 or 256, more than 64 rows), else None."""
        b, h, n, d = problem.shape
        group = h // _kv(problem)[0]
        if "engine" not in self.space.names or target.arch != "90" or (self._splits and group * n <= 64):
            return None
        # persistent blocks overlap a tile's loads with the previous tile's end: 3 to 15 % faster
        # without a mask (16x16x512x64, 4x16x1024x128, 4x16x4096x128); with causal's tiles of
        # unequal length the static share of tiles per block loses as much
        base: dict[str, ParamValue] = {**_SCHEDULES_OFF, **_WGMMA_FIXED, "overlap": True,
                                       "persistent": "causal" not in problem.flags, "stages": 2,
                                       "block_n": 80 if d == 256 else 128}
        if d == 64 and n <= 1024:  # short rows: two one-consumer blocks per SM hide each other's prologues
            short = {"block_m": 64, "pingpong": False, "blocks_per_sm": 2, "lpt": False}
            if "causal" in problem.flags and "queue" in self.space.names:
                # causal tiles of unequal length: persistent blocks taking the next tile from a
                # queue as they finish one (bf16 on an H200 against one block per tile:
                # 16x16x512x64 47.2 -> 42.2 us; 4x16x1024x64 38.9 -> 33.6 us with the tiles
                # ordered longest first across heads, which 256 heads lose: 44.8 us)
                short.update(persistent=True, queue=True, lpt=b * h <= 64)
            p = self._declared({**base, **short})
            if self._valid_point(problem, target, p):
                return p
        wide = d == 64 and n > 96  # three consumer warpgroups
        # causal with few heads: the tail of light tiles weighs, so order longest first across heads
        # (1x32x4096x128 causal with 8 KV heads: 7 % faster; with 64 or 256 heads 1 to 3 % slower)
        # two ping-pong consumers with a next tile (persistent, D = 128): the next tile's first S
        # issued with the last P.V (bf16 on an H200, 4x16x4096x128 and 8x32x2048x128 full: 1 to 2 %
        # faster; with one or three consumers at D = 64, 2 to 8 % slower)
        p = self._declared({**base, "block_m": 192 if wide else 128, "pingpong": not wide, "blocks_per_sm": 1,
                            "lpt": "causal" in problem.flags and b * h <= 32,
                            "chain": d == 128 and not wide and bool(base["persistent"])})
        # where two Q buffers do not fit beside the K/V ring (D = 256), one block per tile
        for point in (p, {**p, "persistent": False, "chain": False}):
            if self._valid_point(problem, target, point):
                return point
        return None

    def _mma_default(self, problem: Problem, target: Target) -> dict[str, ParamValue]:
        """The mma kernel's default (see default_params)."""
        b, h, n, d = problem.shape
        kv_heads, kv_len = _kv(problem)
        group = h // kv_heads
        q_in = "registers" if d <= 64 else "smem"
        if self._splits and group * n <= 64:
            rows = group * n
            block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
            p: dict[str, ParamValue] = {**self._mma, "block_m": block_m, "block_n": 64, "warps": 4,
                                        "key_warps": 64 // block_m, "stages": 3, "layout": "swizzle" if d != 96 else "pad",
                                        "q_in": "registers" if d <= 128 else "smem", "pack": group > 1, "splits": 1}
            # split the keys while the blocks still fit one per SM: on an H200 (132 SMs, bf16,
            # Hq32/Hkv8 D128 decode, at 3d851aa) B1 took 12.4 us at 16 splits against 12.7 at 32,
            # and B16 65.9 us unsplit against 67.5 at 2 splits
            blocks = kv_heads * b
            while self._splits and blocks * 2 * int(p["splits"]) <= target.sm_count and int(p["splits"]) < SPLITS_MAX and \
                    self._valid_point(problem, target, {**p, "splits": 2 * int(p["splits"])}):
                p["splits"] = 2 * int(p["splits"])
            return self._first_valid(problem, target, p)
        p = {**self._mma, "block_m": 128, "block_n": 64, "warps": 4, "stages": 2,
             "layout": "swizzle" if d != 96 else "pad", "q_in": q_in, "pack": False, "splits": 1, "key_warps": 1}
        if -(-n // 128) * b * h < target.sm_count:
            p.update(block_m=64)
        elif d == 256:  # 16 rows per warp (32 do not fit in registers), eight warps share the K/V tiles
            p.update(warps=8)
        blocks = -(-n // int(p["block_m"])) * b * h
        while self._splits and blocks * int(p["splits"]) < target.sm_count and int(p["splits"]) < 8 and \
                self.is_valid(problem, target, {**p, "splits": 2 * int(p["splits"])}):
            p["splits"] = 2 * int(p["splits"])
        return self._first_valid(problem, target, p)

    def seed_params(self, problem: Problem, target: Target) -> list[dict[str, ParamValue]]:
        """Neighbours of the default that are often better: the tuner tries these first, in this
        order, so a short tune spends its trials on the likely winners. Where the default is the
        wgmma kernel, the wgmma points (`_wgmma_points`) come first and the mma kernel's default and
        its neighbours after them (1.6 to 2.2 times slower there); elsewhere the mma neighbours, then
        the wgmma points (which the space drops off sm_90). The default itself is not among them."""
        default = self.default_params(problem, target)
        base = self._mma_default(problem, target)
        other_q = "smem" if base["q_in"] == "registers" else "registers"
        splits = int(base.get("splits", 1))
        changes = (
            {"stages": 3},
            {"q_in": other_q},
            {"layout": "pad"},
            {"block_n": 128, "q_in": "smem"},
            {"block_m": 64, "block_n": 128, "q_in": "registers"},
            {"block_m": 128, "warps": 8, "block_n": 128, "stages": 3, "q_in": "registers"},  # 16 rows per warp
            {"block_n": 32, "stages": 3},
        ) + (({"stages": 4},  # B1 decode, 32768 keys: 38.1 us against 38.6 at 3 stages (H200, 3d851aa)
               {"splits": min(SPLITS_MAX, 2 * splits)}, {"splits": max(1, splits // 2)},
               {"splits": min(SPLITS_MAX, 4 * splits)},
               # no cluster merge among them: on an H200 it lost to the last block's merge at every
               # split count the tuner tried (bf16 B1 Hq32/Hkv8 D128 decode, 4096 keys: 15.0 against
               # 13.2 us at 16 splits; 32768 keys: 44.7 against 39.3 us; B16: 7-22 % slower)
               {"block_n": 128, "stages": 2}, {"stages": 2},
               {"pack": not base.get("pack", False)}, {"key_warps": 2, "warps": 2}, {"key_warps": 1, "warps": 1},
               {"block_n": 128, "stages": 2, "key_warps": 4}, {"block_n": 128, "stages": 3, "key_warps": 4},
               # eight warps of 16 keys each: B16 decode, 32768 keys, 476.0 against 481.2 us (H200, 9c82293)
               {"block_n": 128, "warps": 8, "key_warps": 8, "stages": 3},
               {"block_n": 32, "key_warps": 2, "warps": 2, "stages": 2}, {"key_warps": 2, "warps": 2, "stages": 1})
            if self._splits else ())
        mma = valid_neighbours(self, problem, target, base, changes)
        wgmma = valid_neighbours(self, problem, target, base, self._wgmma_points(problem, default))
        if default == base:
            return mma + [p for p in wgmma if p not in mma]
        return [p for p in wgmma if p != default] + [p for p in [base, *mma] if p != default]

    def _wgmma_points(self, problem: Problem, default: Mapping[str, ParamValue]) -> list[dict[str, ParamValue]]:
        """Hopper variants worth measuring, the likeliest first. Tile shapes: the default's first,
        then FlashAttention-3's (128 x 128 with ping-pong, 192 rows for D = 64, 80 or 64 keys for
        D = 256, two one-consumer blocks per SM for short rows). Schedules of blocks: causal,
        persistent blocks taking tiles from a queue, longest first across heads (chained or not) or
        not, then one block per tile with and without that order; else persistent (chained or not)
        or not. The first tile under
        every schedule comes first, then every other tile under the first schedule, then the rest
        (two stages before three), the serial schedule last: a short tune sees each tile and each
        schedule. The space drops what does not fit."""
        if "engine" not in self.space.names:
            return []
        fixed = {**_SCHEDULES_OFF, **_WGMMA_FIXED, "overlap": True}
        # (block_m, block_n, pingpong, blocks_per_sm)
        tiles = [(128, 128, True, 1), (192, 128, False, 1), (64, 128, False, 2), (64, 64, False, 2),
                 (128, 80, True, 1), (128, 176, True, 1), (128, 64, True, 1), (128, 128, False, 1),
                 (192, 80, False, 1), (128, 192, True, 1)]
        if default.get("engine") == "wgmma":
            mine = (default["block_m"], default["block_n"], default["pingpong"], default["blocks_per_sm"])
            tiles = [mine] + [t for t in tiles if t != mine]
        if "causal" in problem.flags:  # tiles of unequal length
            schedules = [{"persistent": True, "queue": True, "lpt": True},
                         {"persistent": True, "queue": True, "lpt": True, "chain": True}, {"persistent": True, "queue": True},
                         {"lpt": True}, {}, {"persistent": True, "lpt": True}]
        else:
            schedules = [{"persistent": True}, {"persistent": True, "chain": True}, {}]

        def point(tile: tuple, schedule: dict, stages: int) -> dict[str, ParamValue]:
            m, n, pp, bps = tile
            return {**fixed, "block_m": m, "block_n": n, "pingpong": pp, "blocks_per_sm": bps, "stages": stages,
                    **schedule}

        # the first tile under every schedule, every other tile under the first schedule, the rest
        # (a point already listed is dropped later, by valid_neighbours)
        points = [point(tiles[0], sch, 2) for sch in schedules] + [point(t, schedules[0], 2) for t in tiles[1:]]
        points += [point(t, sch, st) for st in (2, 3) for t in tiles for sch in schedules]
        points += [{**fixed, "block_m": 128, "block_n": n, "pingpong": False, "overlap": False, "stages": 2}
                   for n in (128, 64, 80)]  # serial: S, softmax, P.V per tile
        return [self._declared(p) for p in points]

    def _valid_point(self, problem: Problem, target: Target, params: Mapping[str, Any]) -> bool:
        """is_valid, and False for values the space does not declare (a family that extends the
        kernel may declare fewer tiles)."""
        try:
            return self.is_valid(problem, target, params)
        except UserError:
            return False

    @property
    def _mma(self) -> dict[str, ParamValue]:
        """The engine and the wgmma schedules at their mma values, those the space declares (a
        family that extends the kernel may declare fewer, or no engine)."""
        return self._declared({"engine": "mma", **_SCHEDULES_OFF})

    def _declared(self, p: Mapping[str, ParamValue]) -> dict[str, ParamValue]:
        """p's values of the parameters the space declares, with the family's own (`_own_params`)
        where p has none: this family's points made whole for a family that extends the kernel."""
        names = set(self.space.names)
        return {**self._own_params(), **{n: v for n, v in p.items() if n in names}}

    def _own_params(self) -> dict[str, ParamValue]:
        """The default values of the parameters a family that extends the kernel adds (none here)."""
        return {}

    @property
    def _splits(self) -> bool:
        """Whether the space has pack and splits (a family that extends the kernel may not)."""
        return "splits" in self.space.names

    def _first_valid(self, problem: Problem, target: Target, p: dict[str, ParamValue]) -> dict[str, ParamValue]:
        # smaller key tiles, shallower pipeline, fewer splits, smaller query tile: the last step
        # is valid for any problem
        p = self._declared(p)
        tiles = [(p["block_m"], p["warps"], p.get("key_warps", 1)), (64, 4, 1), (16, 1, 1)]
        for block_m, warps, key_warps in tiles:
            for block_n in (p["block_n"], 64, 32):
                for stages in (p["stages"], 2, 1):
                    for splits in (p.get("splits", 1), 1):
                        candidate = {**p, "block_m": block_m, "warps": warps, "block_n": block_n, "stages": stages}
                        if "splits" in p:
                            candidate.update(splits=splits, key_warps=key_warps)
                        if int(block_n) <= int(p["block_n"]) and int(stages) <= int(p["stages"]) \
                                and self._valid_point(problem, target, candidate):
                            return candidate
        raise AssertionError(f"no valid default attention variant for {problem}")

    # --- what it costs ------------------------------------------------------------------

    def shape_distance(self, a: tuple[int, ...], b: tuple[int, ...]) -> float:
        """Log2 steps between shapes, N weighing 4x; a different head dim is another kernel."""
        if a[3] != b[3]:
            return math.inf
        return sum(abs(math.log2(x) - math.log2(y)) * w for x, y, w in zip(a[:3], b[:3], (1, 1, 4)))

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
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"{who}: softcap must be None or a positive finite number, got {cap}")
        options["softcap"] = cap
    return options


def fast_divisor(d: int) -> tuple[np.uint32, np.int32]:
    """The multiplier m and shift p that divide by d (1 <= d < 2**31) any n in [0, 2**31) as
    (n * m) >> p, a 64-bit product and a shift (the round-up method, as CUTLASS's FastDivmod):
    p = 31 + ceil(log2 d) and m = ceil(2**p / d). The kernel's divisions by a run-time head count
    take this instead of an integer division (some twenty instructions), and its source stays the
    same whatever the head count (the verification problem has fewer heads than the tuned one).
    Exact: m * d - 2**p = e < d <= 2**ceil(log2 d), so n * e < 2**p, and n / d plus n * e / (d 2**p)
    never reaches the next integer."""
    if not 1 <= d < 2**31:
        raise ValueError(f"fast_divisor: divisor {d} is outside [1, 2**31)")
    shift = 31 + (d - 1).bit_length()
    return np.uint32(-(-(1 << shift) // d)), np.int32(shift)


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


def reference(problem: Problem, inputs: Mapping[str, Any], xp: Any) -> tuple[Any, Any]:
    """float64 attention on the GPU with explicit masks, in chunks of KV heads and query rows so
    that no (query, key) block of all heads is ever held at once, and k and v are never copied
    per query head. Returns (o, lse) shaped like the kernel's outputs; a query that sees no key
    gets o = 0 and lse = -inf."""
    b, h, n, d = problem.shape
    kv_heads, kv_len = _kv(problem)
    group = h // kv_heads
    scale = float(inputs["scale"])
    cap = problem.option("softcap")
    # query head hkv * group + g reads KV head hkv: q as (B * kv_heads, group, N, D)
    q, k, v = (inputs[name].reshape(b * kv_heads, -1, inputs[name].shape[-2], d) for name in ("q", "k", "v"))
    o = xp.empty((b * kv_heads, group, n, d), dtype=np.float64)
    lse = xp.empty((b * kv_heads, group, n), dtype=np.float64)
    rows = max(1, min(n, _REF_BYTES // (8 * kv_len * group)))
    heads = max(1, min(b * kv_heads, _REF_BYTES // (8 * kv_len * group * rows)))
    keys = xp.arange(kv_len)[None, :]
    for h0 in range(0, b * kv_heads, heads):
        hs = slice(h0, min(b * kv_heads, h0 + heads))
        kh = to_float64(k[hs, 0], problem.dtype, xp)[:, None]  # (heads, 1, kv_len, D)
        vh = to_float64(v[hs, 0], problem.dtype, xp)[:, None]
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            s = xp.matmul(to_float64(q[hs, :, r0:r1], problem.dtype, xp), kh.transpose(0, 1, 3, 2)) * scale
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


ATTENTION = register(AttentionFamily())


# --- the torch operator (autosoft.torch_ops registers it) ---------------------------------------

def _operator_call(q: Any, k: Any, v: Any, causal: bool, scale: float, window_left: int | None = None,
                   window_right: int | None = None, softcap: float | None = None) -> OperatorCall:
    """What autosoft.attention runs for the same arguments (window=(window_left, window_right))."""
    if not scale > 0:  # the kernel tracks the running max of the unscaled scores
        raise ValueError(f"autosoft.attention: scale must be positive, got {scale}")
    window = None if window_left is None and window_right is None else (window_left, window_right)
    return OperatorCall((q, k, v), call_options(causal, window, softcap), {"scale": np.float32(scale)})


AttentionFamily.torch_operators = (
    TorchOperator("attention", "attention", "(Tensor q, Tensor k, Tensor v, bool causal, float scale, "
                  "int? window_left=None, int? window_right=None, float? softcap=None) -> (Tensor o, Tensor lse)",
                  _operator_call, instead="scaled_dot_product_attention"),
)
