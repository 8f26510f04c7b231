"""Write a tuned variant as a standalone .cu file with a provenance header."""
from __future__ import annotations

import time

from . import __version__
from .cache import Entry
from .families.base import Variant


def standalone_source(variant: Variant, entry: Entry | None) -> str:
    """The variant's source behind a comment that says what it is, how to launch it and where it came from."""
    lines = [
        f"autosoft {__version__} export: {variant.name}",
        f"family {variant.family}, dtype {variant.problem.dtype}, shape {variant.problem.shape_text}",
        "params: " + ", ".join(f"{k}={v}" for k, v in variant.params.items()),
    ]
    for launch in variant.launches:
        args = ", ".join(a if isinstance(a, str) else f"{a.item()}" for a in launch.args)
        lines.append(f"launch {launch.kernel}<<<grid={launch.grid}, block={launch.block}, "
                     f"dynamic shared memory={launch.shared_mem} B>>>({args})")
        if launch.cooperative:
            lines.append(f"  {launch.kernel} must be launched cooperatively (cudaLaunchCooperativeKernel): "
                         "its blocks wait for each other")
        if launch.non_portable_cluster:
            lines.append(f"  {launch.kernel} runs clusters of {launch.cluster_blocks} blocks: set "
                         "cudaFuncAttributeNonPortableClusterSizeAllowed to 1 before launching it")
    if variant.workspace_bytes:
        lines.append(f"workspace: {variant.workspace_bytes} bytes of device memory, zeroed once before the "
                     "first launch and kept for later launches (the kernels' comments say what it holds)")
    if entry is not None:
        lines += [
            f"tuned on {entry.key.gpu_name} (sm_{entry.key.compute_capability}), CUDA {entry.key.cuda_version}",
            f"measured kernel time {entry.time_us:.2f} us"
            + (f" (heuristic default {entry.default_time_us:.2f} us)" if entry.default_time_us else "")
            + (f", device-to-device copy of the same bytes {entry.copy_time_us:.2f} us" if entry.copy_time_us else ""),
            f"tuned {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(entry.created))}",
        ]
    else:
        lines.append("untuned: heuristic default variant")
    lines += [
        f"source digest (sha256 over source, options, sm_{variant.target.arch}, NVRTC version): {variant.digest}",
        f"build: nvcc -c -arch=sm_{variant.target.arch} --use_fast_math -std=c++17 <this file>",
    ]
    header = "\n".join("// " + line for line in lines)
    return f"{header}\n\n{variant.source}"
