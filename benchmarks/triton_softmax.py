"""The Triton row softmax users would otherwise write: a persistent grid, one row per program,
the whole row in one block of registers (as in Triton's public fused-softmax tutorial)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_rows(y_ptr, x_ptr, n_rows, n_cols, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    start = tl.program_id(0)
    step = tl.num_programs(0)
    for row in tl.range(start, n_rows, step, num_stages=NUM_STAGES):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n_cols
        base = row.to(tl.int64) * n_cols
        x = tl.load(x_ptr + base + offsets, mask=mask, other=-float("inf")).to(tl.float32)
        x = x - tl.max(x, axis=0)
        num = tl.exp(x)
        y = num / tl.sum(num, axis=0)
        tl.store(y_ptr + base + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


class TritonSoftmax:
    """Compiled once per (N, dtype); the grid is sized from the compiled kernel's occupancy."""

    def __init__(self, n_rows: int, n_cols: int, dtype: torch.dtype):
        self.n_rows, self.n_cols = n_rows, n_cols
        block = triton.next_power_of_2(n_cols)
        num_warps = 4 if block < 2048 else 8 if block < 8192 else 16
        num_stages = 4 if block <= 8192 else 2
        x = torch.empty((n_rows, n_cols), device="cuda", dtype=dtype)
        y = torch.empty_like(x)
        kernel = _softmax_rows.warmup(y, x, n_rows, n_cols, BLOCK=block, NUM_STAGES=num_stages,
                                      num_warps=num_warps, grid=(1,))
        kernel._init_handles()
        props = torch.cuda.get_device_properties(0)
        regs_per_sm = props.regs_per_multiprocessor
        by_regs = regs_per_sm // max(1, kernel.n_regs * 32 * num_warps)
        smem = kernel.metadata.shared
        by_smem = props.shared_memory_per_multiprocessor // smem if smem else by_regs
        occupancy = max(1, min(by_regs, by_smem, 2048 // (32 * num_warps)))
        self.grid = (min(n_rows, props.multi_processor_count * occupancy),)
        self.block, self.num_warps, self.num_stages = block, num_warps, num_stages

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        _softmax_rows[self.grid](y, x, self.n_rows, self.n_cols, BLOCK=self.block, NUM_STAGES=self.num_stages,
                                 num_warps=self.num_warps)
