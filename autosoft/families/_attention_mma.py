"""The attention family's mma engine: FlashAttention-2 forward on mma.sync tensor cores, any GPU
from sm_80 (templates/attention/attention.cu.j2, search_spaces/attention_mma.yaml).

Warps that load their own K/V tiles with cp.async; for few queries per head (decoding), `pack`
(the query heads of one KV head share a block's rows, so K and V are read once per group) and
`splits` (the keys of one query tile shared among blocks whose partial outputs the last of them
merges: flash-decoding).
"""
from __future__ import annotations

from typing import Any, Mapping

from ..space import ParamValue
from .base import Engine, Family, Launch, Problem, Target

SPLITS_MAX = 32  # the most blocks sharing a query tile's keys in attention_mma.yaml


def _layout(head_dim: int) -> str:
    """Swizzled rows where a row is a power-of-two number of 16-byte chunks, padded rows else."""
    chunks = head_dim // 8
    return "swizzle" if chunks & (chunks - 1) == 0 else "pad"


class MmaEngine(Engine):
    name = "mma"
    splits_max = SPLITS_MAX  # the most split keys its space offers (a space that offers more raises it)
    template = "attention/attention.cu.j2"

    def __init__(self, family: Family, space: str = "attention_mma", adds: Mapping[str, ParamValue] | None = None):
        """adds: the values at which this kernel's own points take the parameters an engine that
        builds on it adds to the space (attention_colsum's pass)."""
        super().__init__(family, space)
        self.adds = dict(adds or {})

    # --- a variant ----------------------------------------------------------------------

    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        p = params
        name = (self.family.name_prefix(problem) + f"_m{p['block_m']}_n{p['block_n']}_w{p['warps']}_s{p['stages']}"
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
        return {**values, **self.family.kernel_args(problem), "engine": self.name, "pack": bool(values["pack"]),
                "splits": int(values["splits"]), "key_warps": int(values["key_warps"]), "merge": values["merge"],
                "single_length": False, "mma_helpers": False}

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        b, h, n, d = problem.shape
        kv_heads, _ = self.family.kv(problem)
        pack, splits = bool(values["pack"]), int(values["splits"])
        rows = (h // kv_heads) * n if pack else n
        m_blocks = -(-rows // values["block_m"])
        grid = (m_blocks * splits, kv_heads if pack else h, b)
        block = (32 * values["warps"], 1, 1)
        args: tuple[str, ...] = ("q", "k", "v", "o", "lse", "scale")
        args += tuple(f"{name}_stride{i}" for name in self.family.strided_inputs for i in range(3))
        if splits > 1 and values["merge"] == "cluster":  # the splits of a query tile: one cluster
            return (Launch("attention_fwd", grid, block, values["smem_bytes"], args, cluster_blocks=splits),), 0
        workspace = 0
        if splits > 1:  # partial lse and O / l of every (query row, split), then arrival counters
            partials = b * h * n * splits
            workspace = 4 * (-(-partials // 4) * 4 + partials * d + m_blocks * grid[1] * b)
            args += ("workspace",)
        return (Launch("attention_fwd", grid, block, values["smem_bytes"], args),), workspace

    # --- default and seeds --------------------------------------------------------------

    @property
    def _splits(self) -> bool:
        """Whether its space has pack and splits (an engine that builds on it may hold them fixed)."""
        return "splits" in self.space.names

    def _point(self, p: Mapping[str, ParamValue]) -> dict[str, ParamValue]:
        """p's values of the parameters its space declares, with `adds` where p has none."""
        names = set(self.space.names)
        return {**{n: v for n, v in self.adds.items() if n in names}, **{n: v for n, v in p.items() if n in names}}

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue]:
        """Many queries per head: 4 warps of 32 query rows each (two mma tiles share every K/V
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
        b, h, n, d = problem.shape
        kv_heads, _ = self.family.kv(problem)
        group = h // kv_heads
        q_in = "registers" if d <= 64 else "smem"
        if self._splits and group * n <= 64:
            rows = group * n
            block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
            p: dict[str, ParamValue] = {**self.adds, "block_m": block_m, "block_n": 64, "warps": 4,
                                        "key_warps": 64 // block_m, "stages": 3, "layout": _layout(d),
                                        "q_in": "registers" if d <= 128 else "smem", "pack": group > 1, "splits": 1,
                                        "merge": "last_block"}
            # split the keys while the blocks still fit one per SM: on an H200 (132 SMs, bf16,
            # Hq32/Hkv8 D128 decode, at 3d851aa) B1 took 12.4 us at 16 splits against 12.7 at 32,
            # and B16 65.9 us unsplit against 67.5 at 2 splits
            blocks = kv_heads * b
            while blocks * 2 * int(p["splits"]) <= target.sm_count and int(p["splits"]) < self.splits_max and \
                    self.is_valid(problem, target, self._point({**p, "splits": 2 * int(p["splits"])})):
                p["splits"] = 2 * int(p["splits"])
            return self._first_valid(problem, target, p)
        p = {**self.adds, "block_m": 128, "block_n": 64, "warps": 4, "stages": 2, "layout": _layout(d),
             "q_in": q_in, "pack": False, "splits": 1, "key_warps": 1, "merge": "last_block"}
        if -(-n // 128) * b * h < target.sm_count:
            p.update(block_m=64)
        elif d == 256:  # 16 rows per warp (32 do not fit in registers), eight warps share the K/V tiles
            p.update(warps=8)
        blocks = -(-n // int(p["block_m"])) * b * h
        while self._splits and blocks * int(p["splits"]) < target.sm_count and int(p["splits"]) < 8 and \
                self.is_valid(problem, target, self._point({**p, "splits": 2 * int(p["splits"])})):
            p["splits"] = 2 * int(p["splits"])
        return self._first_valid(problem, target, p)

    def _first_valid(self, problem: Problem, target: Target, p: dict[str, ParamValue]) -> dict[str, ParamValue]:
        # smaller key tiles, shallower pipeline, fewer splits, smaller query tile: the last step
        # is valid for any problem
        p = self._point(p)
        tiles = [(p["block_m"], p["warps"], p.get("key_warps", 1)), (64, 4, 1), (16, 1, 1)]
        for block_m, warps, key_warps in tiles:
            for block_n in (p["block_n"], 64, 32):
                for stages in (p["stages"], 2, 1):
                    for splits in (p.get("splits", 1), 1):
                        candidate = {**p, "block_m": block_m, "warps": warps, "block_n": block_n, "stages": stages}
                        if "splits" in p:
                            candidate.update(splits=splits, key_warps=key_warps)
                        if int(block_n) <= int(p["block_n"]) and int(stages) <= int(p["stages"]) \
                                and self.is_valid(problem, target, candidate):
                            return candidate
        raise AssertionError(f"no valid default attention variant for {problem}")

    def seed_params(self, problem: Problem, target: Target, default: Mapping[str, ParamValue]) -> list[dict[str, ParamValue]]:
        """Neighbours of its default that are often better, in the order the tuner tries them (a
        short tune spends its trials on the likely winners); its default first where the family's
        default is another engine's."""
        base = self.default_params(problem, target)
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
               {"splits": min(self.splits_max, 2 * splits)}, {"splits": max(1, splits // 2)},
               {"splits": min(self.splits_max, 4 * splits)},
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
        neighbours = self.valid_neighbours(problem, target, base, changes)
        return neighbours if default.get("engine") == self.name else [base, *neighbours]
