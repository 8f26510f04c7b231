"""The attention_backward family's wgmma engine (sm_90a): FlashAttention-3's backward, consumer
warpgroups of 64 keys fed by a TMA producer warpgroup
(templates/attention_backward/attention_backward_wgmma.cu.j2, search_spaces/attention_backward_wgmma.yaml).

The row pass and the dQ conversion are the mma engine's (templates/attention_backward/rows.cuh.j2).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..space import ParamValue
from ._attention_backward_mma import ROW_THREADS
from .base import Engine, Family, Launch, Problem, Target, TensorMap


# dq_add in a variant's name: the consumers' atomic adds unnamed, as before the writer warp
_DQ_ADD_SUFFIX = {"atomic": "", "ordered": "_ordered", "writer": "_dqw", "writer_ordered": "_dqw_ordered"}


class WgmmaBackwardEngine(Engine):
    name = "wgmma"
    template = "attention_backward/attention_backward_wgmma.cu.j2"
    archs = ("90",)

    def __init__(self, family: Family) -> None:
        super().__init__(family, "attention_backward_wgmma")

    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        p = params
        return (self.family.name_prefix(problem) + f"_wgmma_n{p['block_n']}_s{p['stages']}"
                + ("_ds2" if p["ds_buffers"] == 2 else "")
                + ("_heads" if p["tile_order"] == "heads" else "") + _DQ_ADD_SUFFIX[str(p["dq_add"])]
                + ("_m128" if p["block_m"] == 128 else ""))

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        return {**values, **self.family.kernel_args(problem), "engine": self.name}  # type: ignore[attr-defined]

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        """The row pass, the main kernel (a producer and block_n / 64 consumer warpgroups; q, k, v
        and do through tensor maps, q and do in boxes of block_m rows), the dQ conversion; the
        workspace as the mma engine's (turn counters for 64-row query tiles: enough for 128)."""
        b, h, n, d = problem.shape
        kv_heads, kv_len = self.family.kv(problem)  # type: ignore[attr-defined]
        block_n, block_m = int(values["block_n"]), int(values["block_m"])
        rows = b * h * n
        turns = b * h * -(-n // 64)
        workspace = 4 * (rows * d + 2 * rows + turns)
        row_blocks = max(1, min(-(-rows // (ROW_THREADS // 32)), 16 * target.sm_count))
        lse_args: tuple[str, ...] = ("lse", "dlse") if "lse_grad" in problem.flags else ("lse",)
        prep = Launch("attention_bwd_prep", (row_blocks, 1, 1), (ROW_THREADS, 1, 1), 0,
                      ("o", "do", *lse_args, "workspace", np.int64(rows), np.int32(turns)))
        maps = (TensorMap("q", (b, h, n, d), (1, 1, block_m, 64), problem.dtype),
                TensorMap("k", (b, kv_heads, kv_len, d), (1, 1, block_n, 64), problem.dtype),
                TensorMap("v", (b, kv_heads, kv_len, d), (1, 1, block_n, 64), problem.dtype),
                TensorMap("do", (b, h, n, d), (1, 1, block_m, 64), problem.dtype, always_contiguous=True))
        main = Launch("attention_bwd", (-(-kv_len // block_n), kv_heads, b), (128 * (block_n // 64 + 1), 1, 1),
                      values["smem_bytes"], (*maps, "dk", "dv", "scale", np.int32(h), np.int32(b), "workspace"))
        chunks = rows * d // 8
        convert = Launch("attention_bwd_dq", (max(1, min(-(-chunks // ROW_THREADS), 16 * target.sm_count)), 1, 1),
                         (ROW_THREADS, 1, 1), 0, ("dq", "workspace", np.int64(rows)))
        return (prep, main, convert), workspace

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue] | None:
        """Two consumers (128 keys) and two Q/dO stages, as FlashAttention-3 takes for D 64 and 128,
        with two dS^T buffers where they fit; one consumer where 128 keys are more than twice the
        keys there are. 128 queries a step where that fits (D 64), dQ added by the consumers; else
        64, dQ added by the writer warp where a consumer's dQ tile is widest (D 128 and more) or the
        adds must be ordered, by the consumers' atomics otherwise. Key tiles slowest under a causal
        mask (the heaviest blocks first), but not where the writer adds dQ unordered for a head of
        its own (no grouped query heads): its adds leave the consumers free, and the key tiles of a
        head launched together share its Q and dO in L2.
        None where no point is valid (the mma engine's default then)."""
        deterministic = "deterministic" in problem.flags
        plain = "ordered" if deterministic else "atomic"
        writer = "writer_ordered" if deterministic else "writer"
        by_writer = deterministic or problem.shape[3] >= 128
        grouped = self.family.kv(problem)[0] < problem.shape[1]  # type: ignore[attr-defined]
        for block_m, adders in ((128, (plain,)), (64, (writer, plain) if by_writer else (plain,))):
            for dq_add in adders:
                keys_first = "causal" not in problem.flags or (dq_add == "writer" and not grouped)
                order = "keys" if keys_first else "heads"
                for p in ({"block_n": 128, "stages": 2, "ds_buffers": 2}, {"block_n": 128, "stages": 2, "ds_buffers": 1},
                          {"block_n": 64, "stages": 2, "ds_buffers": 2}, {"block_n": 64, "stages": 1, "ds_buffers": 1}):
                    p = {**p, "block_m": block_m, "tile_order": order, "dq_add": dq_add}
                    if self.is_valid(problem, target, p):
                        return p
        return None

    def seed_params(self, problem: Problem, target: Target, default: Mapping[str, ParamValue]) -> list[dict[str, ParamValue]]:
        """Its default (where the family's is another engine's), then the other number of queries a
        step (with one dS^T buffer, or the other way of adding dQ, where the first leaves no room),
        the other way of adding dQ (the writer warp or the consumers, with one dS^T buffer where two
        leave no room for the writer's tiles), one dS^T buffer, the other block order, the other
        tile and stage counts."""
        own = self.default_params(problem, target)
        if own is None:
            return []
        other_order = "keys" if own["tile_order"] == "heads" else "heads"
        other_add = {"atomic": "writer", "writer": "atomic", "ordered": "writer_ordered",
                     "writer_ordered": "ordered"}[str(own["dq_add"])]
        other_m = 64 if own["block_m"] == 128 else 128
        changes = ({"dq_add": other_add}, {"dq_add": other_add, "ds_buffers": 1}, {"ds_buffers": 1},
                   {"tile_order": other_order}, {"block_n": 64}, {"stages": 1}, {"block_n": 64, "stages": 1})
        wide = self.valid_neighbours(problem, target, own, ({"block_m": other_m}, {"block_m": other_m, "ds_buffers": 1},
                                                            {"block_m": other_m, "dq_add": other_add}))[:1]
        neighbours = wide + [p for p in self.valid_neighbours(problem, target, own, changes) if p not in wide]
        return neighbours if default.get("engine") == self.name else [own, *neighbours]
