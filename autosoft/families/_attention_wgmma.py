"""The attention family's wgmma engine (sm_90a): Hopper's wgmma warpgroups of 64 query rows each,
fed by a TMA producer warpgroup, with FlashAttention-3's schedules
(templates/attention/attention_wgmma.cu.j2, search_spaces/attention_wgmma.yaml).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..dtypes import ITEMSIZE
from ..space import ParamValue
from .base import Engine, Family, Launch, Problem, Target, TensorMap

# every schedule off, O rescaled at every new max: where a point of this engine starts from
_NARROW: dict[str, ParamValue] = {"block_n": 64}  # the key tile of rows shorter than two 128-key tiles
_PLAIN: dict[str, ParamValue] = {"overlap": False, "pingpong": False, "blocks_per_sm": 1, "lpt": False,
                                 "persistent": False, "queue": False, "chain": False, "rescale": "eager"}


def swizzle_bytes(head_dim: int) -> int:
    """The bytes of a row chunk in the kernel's shared-memory tiles: the widest swizzle span
    (128, 64 or 32 bytes of 2-byte elements) that divides a row of head_dim columns, so that a
    row is whole chunks, each one TMA box wide (D = 96: three 64-byte chunks; D = 80: five
    32-byte ones)."""
    for span in (128, 64, 32):
        if head_dim * 2 % span == 0:
            return span
    raise ValueError(f"head dim {head_dim}: not a multiple of 16 columns")


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


class WgmmaEngine(Engine):
    name = "wgmma"
    template = "attention/attention_wgmma.cu.j2"
    archs = ("90",)

    def __init__(self, family: Family, space: str = "attention_wgmma", adds: Mapping[str, ParamValue] | None = None,
                 decoding: bool = False):
        """adds: as MmaEngine's. decoding: whether it offers the default where few rows per head
        (G * N <= 64) leave most warpgroups idle; the attention family leaves those to the mma
        engine's split keys."""
        super().__init__(family, space)
        self.adds = dict(adds or {})
        self.decoding = decoding

    # --- a variant ----------------------------------------------------------------------

    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        p = params
        return (self.family.name_prefix(problem) + f"_wgmma_m{p['block_m']}_n{p['block_n']}_s{p['stages']}"
                + ("_ov" if p.get("overlap") else "") + ("_pp" if p.get("pingpong") else "")
                + ("_2cta" if int(p.get("blocks_per_sm", 1)) == 2 else "") + ("_lpt" if p.get("lpt") else "")
                + ("_pers" if p.get("persistent") else "") + ("_queue" if p.get("queue") else "")
                + ("_chain" if p.get("chain") else "") + ("_lazy" if p.get("rescale") == "lazy" else ""))

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        return {**values, **self.family.kernel_args(problem), "engine": self.name,
                **{n: type(v)(values[n]) for n, v in _PLAIN.items()}, "lpt_heads": self._lpt_heads(problem, values),
                "single_length": False, "mma_helpers": False, "swizzle": swizzle_bytes(problem.shape[3])}

    def _lpt_heads(self, problem: Problem, values: Mapping[str, Any]) -> int:
        """(batch, head) pairs whose K and V fit in half the L2 (at least one): the group the
        longest-first order works within, so that a group's K and V stay in the L2 while it runs."""
        kv_heads, kv_len = self.family.kv(problem)
        per_head = 2 * kv_len * problem.shape[3] * ITEMSIZE[problem.dtype]
        group = problem.shape[1] // kv_heads  # query heads sharing one K and V
        return max(1, int(values.get("l2_bytes", 50 << 20)) // 2 // per_head * group)

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        """A producer warpgroup and one consumer per 64 rows; Q, K, V (and with a queue O) moved by TMA."""
        b, h, n, d = problem.shape
        kv_heads, kv_len = self.family.kv(problem)
        block_m, block_n = int(values["block_m"]), int(values["block_n"])
        queue = bool(values["queue"])  # a workspace: the tile counter and the blocks done (the last resets both)
        cols = swizzle_bytes(d) // 2  # a box is one chunk of the tiles' rows
        maps = (TensorMap("q", (b, h, n, d), (1, 1, block_m, cols), problem.dtype),
                TensorMap("k", (b, kv_heads, kv_len, d), (1, 1, block_n, cols), problem.dtype),
                TensorMap("v", (b, kv_heads, kv_len, d), (1, 1, block_n, cols), problem.dtype),
                # with a queue each consumer's 64 rows of O are stored by the tensor-memory accelerator
                *((TensorMap("o", (b, h, n, d), (1, 1, 64, cols), problem.dtype, always_contiguous=True),) if queue else ()))
        tiles = -(-n // block_m) * h * b
        grid = (min(tiles, target.sm_count * int(values["blocks_per_sm"])), 1, 1) \
            if values["persistent"] else (-(-n // block_m), h, b)
        queued: tuple[Any, ...] = ()
        if queue:  # a tile's (batch, head) comes from its number by dividing by the head count,
            # and with lpt by the last group's head count: each passed as multiplier and shift
            lpt_heads = self._lpt_heads(problem, values)
            queued = (*fast_divisor(h), *fast_divisor(h * b % lpt_heads or lpt_heads), "workspace")
        args = (*maps, "o", "lse", "scale", np.int32(h), np.int32(b), *queued)
        return (Launch("attention_fwd", grid, (128 * (block_m // 64 + 1), 1, 1), values["smem_bytes"], args),), \
            8 if queue else 0

    # --- default and seeds --------------------------------------------------------------

    def _point(self, p: Mapping[str, ParamValue]) -> dict[str, ParamValue]:
        """p's values of the parameters its space declares, with `adds` where p has none."""
        names = set(self.space.names)
        return {**{n: v for n, v in self.adds.items() if n in names}, **{n: v for n, v in p.items() if n in names}}

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue] | None:
        """With any head dim the family takes and enough rows for a 128-row tile: two consumer
        warpgroups of 64 rows, both FlashAttention-3 schedules (overlap, ping-pong), 128-key tiles
        (80 for D = 192 and 256, where shared memory is short), two stages; for D = 64 three consumers (192 rows)
        without ping-pong, and up to 1024 queries one consumer of 64 rows in blocks two of which
        share an SM (16x16x512x64 and 4x16x1024x64: 7 to 19 % faster).
        Without a mask the blocks are persistent (at D = 256 one block per tile: two Q buffers do
        not fit beside the K/V ring); causal with at most 32 heads orders the tiles longest first
        across heads; causal rows of up to 1024 keys at D = 64 run persistent blocks that take
        their tiles from a queue (10 to 14 % faster there); persistent ping-pong blocks chain their
        tiles (the next tile's first S issued with the last P.V).
        Among the variants timed on an H200 (bf16: 4x16x4096x128,
        8x32x2048x128 causal, 1x32x4096x128 GQA causal, 1x32x8192x64 causal, 4x16x4096x256 causal,
        16x16x512x64, 4x16x1024x128; 3x7x1000x64 fp16) these were the best or within 3 % of it,
        and 1.6 to 2.2 times the mma kernel's default. Rows of fewer keys than two 128-key tiles
        (a pipeline of two stages deeper than its tiles loads nothing) take 64-key tiles: a 40-trial
        tune of 32x16x128x64 chose them over the mma engine's default (BENCHMARKS.md, issue 44). None
        (the mma engine's) where no such point is valid, and for decoding unless `decoding`."""
        b, h, n, d = problem.shape
        group = h // self.family.kv(problem)[0]
        if not self.decoding and group * n <= 64:
            return None
        # persistent blocks overlap a tile's loads with the previous tile's end: 3 to 15 % faster
        # without a mask (16x16x512x64, 4x16x1024x128, 4x16x4096x128); with causal's tiles of
        # unequal length the static share of tiles per block loses as much
        base: dict[str, ParamValue] = {**self.adds, **_PLAIN, "overlap": True,
                                       "persistent": "causal" not in problem.flags, "stages": 2,
                                       "block_n": 80 if d >= 192 else 128}
        if d == 64 and n <= 1024:  # short rows: two one-consumer blocks per SM hide each other's prologues
            short = {"block_m": 64, "pingpong": False, "blocks_per_sm": 2, "lpt": False}
            if "causal" in problem.flags and "queue" in self.space.names:
                # causal tiles of unequal length: persistent blocks taking the next tile from a
                # queue as they finish one (bf16 on an H200 against one block per tile:
                # 16x16x512x64 47.2 -> 42.2 us; 4x16x1024x64 38.9 -> 33.6 us with the tiles
                # ordered longest first across heads, which 256 heads lose: 44.8 us)
                short.update(persistent=True, queue=True, lpt=b * h <= 64)
            found = self._first_valid(problem, target, self._point({**base, **short}))
            if found is not None:
                return found
        wide = d == 64 and n > 96  # three consumer warpgroups
        # causal with few heads: the tail of light tiles weighs, so order longest first across heads
        # (1x32x4096x128 causal with 8 KV heads: 7 % faster; with 64 or 256 heads 1 to 3 % slower)
        # two ping-pong consumers with a next tile (persistent): the next tile's first S issued with
        # the last P.V; faster or level at every head dim that has them (BENCHMARKS.md, issue 42),
        # slower with one or three consumers at D = 64
        p = self._point({**base, "block_m": 192 if wide else 128, "pingpong": not wide, "blocks_per_sm": 1,
                         "lpt": "causal" in problem.flags and b * h <= 32,
                         "chain": not wide and bool(base["persistent"])})
        # where two Q buffers do not fit beside the K/V ring (D = 256), one block per tile
        return self._first_valid(problem, target, p, self._point({**p, "persistent": False, "chain": False}))

    def _first_valid(self, problem: Problem, target: Target, *points: Mapping[str, ParamValue]
                     ) -> dict[str, ParamValue] | None:
        """The first valid of `points`, each tried as it is, then with 64-key tiles (_NARROW)."""
        for point in points:
            for tiles in (dict(point), self._point({**point, **_NARROW})):
                if self.is_valid(problem, target, tiles):
                    return tiles
        return None

    def seed_params(self, problem: Problem, target: Target, default: Mapping[str, ParamValue]) -> list[dict[str, ParamValue]]:
        """Hopper variants worth measuring, the likeliest first. Tile shapes: its default's first,
        then FlashAttention-3's (128 x 128 with ping-pong, 192 rows for D = 64, 80 or 64 keys for
        D = 256, 144 keys for D = 96, two one-consumer blocks per SM for short rows). Schedules of blocks: causal,
        persistent blocks taking tiles from a queue, longest first across heads (chained or not) or
        not, then one block per tile with and without that order; else persistent (chained or not)
        or not. The first tile under every schedule comes first, then its first two schedules with
        lazy rescaling, then every other tile under the first schedule, then the rest (two stages before three), the serial schedule last: a short
        tune sees each tile and each schedule. The space drops what does not fit."""
        fixed = {**_PLAIN, "overlap": True}
        # (block_m, block_n, pingpong, blocks_per_sm)
        tiles = [(128, 128, True, 1), (192, 128, False, 1), (64, 128, False, 2), (64, 64, False, 2),
                 (128, 80, True, 1), (128, 176, True, 1), (128, 144, True, 1), (128, 64, True, 1), (128, 128, False, 1),
                 (192, 80, False, 1), (128, 192, True, 1)]
        own = self.default_params(problem, target)
        if own is not None:
            mine = (own["block_m"], own["block_n"], own["pingpong"], own["blocks_per_sm"])
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

        # the first tile under every schedule, then with lazy rescaling, every other tile under the
        # first schedule, the rest (a point already listed is dropped by valid_neighbours)
        points = [point(tiles[0], sch, 2) for sch in schedules]
        points += [{**p, "rescale": "lazy"} for p in points[:2]]
        points += [point(t, schedules[0], 2) for t in tiles[1:]]
        points += [point(t, sch, st) for st in (2, 3) for t in tiles for sch in schedules]
        points += [{**fixed, "block_m": 128, "block_n": n, "pingpong": False, "overlap": False, "stages": 2}
                   for n in (128, 64, 80)]  # serial: S, softmax, P.V per tile
        return self.valid_neighbours(problem, target, {}, [self._point({**self.adds, **p}) for p in points])
