"""The attention_backward family's mma engine: FlashAttention-2's backward on mma.sync tensor
cores, any GPU from sm_80 (templates/attention_backward/, search_spaces/attention_backward_mma.yaml).

Three launches: a pass over the rows that forms Delta = rowsum(do * o) (less dlse) and lse in
base 2, and zeroes the float32 dQ accumulator; the main kernel, one block per tile of keys of a KV
head walking the query tiles that see them (for every query head of the group), dK and dV in
registers, dQ added to the accumulator; a pass that converts the accumulator to dq.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..space import ParamValue
from .base import Engine, Family, Launch, Problem, Target

ROW_THREADS = 256  # threads per block of the two row passes (one warp per row)


class MmaBackwardEngine(Engine):
    name = "mma"
    template = "attention_backward/attention_backward.cu.j2"

    def __init__(self, family: Family) -> None:
        super().__init__(family, "attention_backward_mma")

    # --- a variant ----------------------------------------------------------------------

    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        p = params
        return (self.family.name_prefix(problem) + f"_n{p['block_n']}_m{p['block_m']}_w{p['warps']}"
                f"_k{p['key_warps']}_q{p['dq_warps']}_s{p['stages']}" + ("_ordered" if p["dq_add"] == "ordered" else ""))

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        return {**values, **self.family.kernel_args(problem), "engine": self.name}  # type: ignore[attr-defined]

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        b, h, n, d = problem.shape
        kv_heads, kv_len = self.family.kv(problem)  # type: ignore[attr-defined]
        rows = b * h * n
        query_tiles = -(-n // values["block_m"])
        turns = b * h * query_tiles  # one counter per query tile: whose turn it is to add its dQ
        # the float32 dQ accumulator, Delta and lse (base 2) per row, the turn counters
        workspace = 4 * (rows * d + 2 * rows + turns)
        row_blocks = max(1, min(-(-rows // (ROW_THREADS // 32)), 16 * target.sm_count))
        lse_args: tuple[str, ...] = ("lse", "dlse") if "lse_grad" in problem.flags else ("lse",)
        prep = Launch("attention_bwd_prep", (row_blocks, 1, 1), (ROW_THREADS, 1, 1), 0,
                      ("o", "do", *lse_args, "workspace", np.int64(rows), np.int32(turns)))
        strides = tuple(f"{name}_stride{i}" for name in self.family.strided_inputs for i in range(3))
        main = Launch("attention_bwd", (-(-kv_len // values["block_n"]), kv_heads, b), (32 * values["warps"], 1, 1),
                      values["smem_bytes"], ("q", "k", "v", "do", "dk", "dv", "scale", *strides, "workspace"))
        chunks = rows * d // 8
        convert = Launch("attention_bwd_dq", (max(1, min(-(-chunks // ROW_THREADS), 16 * target.sm_count)), 1, 1),
                         (ROW_THREADS, 1, 1), 0, ("dq", "workspace", np.int64(rows)))
        return (prep, main, convert), workspace

    # --- default and seeds --------------------------------------------------------------

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue]:
        """64 queries per step, eight warps, two Q/dO stages, and as many keys per block (128 for
        D <= 64, else 64) as keep dK and dV in 64 registers per thread beside the scores, with
        room for the fragments' addresses (FlashAttention-2's 128 keys at D = 128 need every register
        ptxas has). The warps in the squarest tiles the sizes allow (the fewest shared-memory reads
        per product). Smaller tiles where those do not fit the problem or the shared memory."""
        d = problem.shape[3]
        ordered = "ordered" if "deterministic" in problem.flags else "atomic"
        p: dict[str, ParamValue] = {"block_n": 128 if d <= 64 else 64, "block_m": 64, "warps": 8, "stages": 2,
                                    "dq_add": ordered}
        fallbacks = ({}, {"stages": 1}, {"block_n": 64}, {"block_m": 32}, {"block_n": 32}, {"block_m": 16},
                     {"warps": 4}, {"warps": 2})
        for change in fallbacks:
            p = {**p, **change}
            for point in self._layouts(p):
                if self.is_valid(problem, target, point):
                    return point
        raise AssertionError(f"no valid default attention_backward variant for {problem}")

    @staticmethod
    def _layouts(p: Mapping[str, ParamValue]) -> list[dict[str, ParamValue]]:
        """p with its warps laid out, squarest first: key_warps nearest warps * block_n / (block_n
        + block_m) and dq_warps nearest warps * block_m / (block_m + D share), in powers of two."""
        warps, block_n, block_m = int(p["warps"]), int(p["block_n"]), int(p["block_m"])
        shares = [w for w in (1, 2, 4, 8) if w <= warps]
        by_keys = sorted(shares, key=lambda w: abs(block_n / w - block_m / (warps // w)))
        by_rows = sorted(shares, key=lambda w: abs(w - warps // w))
        return [{**p, "key_warps": kw, "dq_warps": qw} for kw in by_keys for qw in by_rows]

    def seed_params(self, problem: Problem, target: Target, default: Mapping[str, ParamValue]) -> list[dict[str, ParamValue]]:
        """Neighbours of the default, likeliest first: other key and query tiles, one stage, four warps."""
        base = {n: v for n, v in default.items() if n != "engine"} if default.get("engine") == self.name \
            else self.default_params(problem, target)
        changes = (
            {"block_m": 32}, {"block_n": 64}, {"block_n": 64, "block_m": 128}, {"stages": 1}, {"block_n": 128},
            {"block_n": 64, "warps": 4}, {"block_m": 128, "warps": 8}, {"block_n": 128, "block_m": 32},
            {"block_n": 32, "block_m": 64, "warps": 4}, {"block_n": 64, "block_m": 64, "warps": 4, "stages": 1},
        )
        candidates = [{**base, "key_warps": w} for w in (1, 2, 4, 8)] + [{**base, "dq_warps": w} for w in (1, 2, 4, 8)]
        for change in changes:  # each tile change in its squarest valid layout
            moved = {**base, **change}
            candidates += [next((c for c in self._layouts(moved) if self.is_valid(problem, target, c)), moved)]
        neighbours = self.valid_neighbours(problem, target, base, [dict(c) for c in candidates])
        return neighbours if default.get("engine") == self.name else [base, *neighbours]
