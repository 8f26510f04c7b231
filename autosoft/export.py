"""Write a tuned variant as a standalone .cu file: a provenance header, the kernels, and a host
launcher (compiled only with -DAUTOSOFT_HOST_LAUNCH) that runs them from C++ as the tuner did.

The launcher is generated from the variant's Launch records and from the kernels' parameter lists,
parsed out of the rendered source, so no family has to declare its C types twice."""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._version import __version__
from .cache import Entry
from .errors import UserError
from .compile import build_lines
from .dtypes import ITEMSIZE
from .families.base import Launch, TensorMap, Variant
from .files import replace_text

# past this much dynamic shared memory a kernel must opt in before its launch (the default limit)
DEFAULT_DYNAMIC_SMEM = 48 * 1024
LAUNCHER = "autosoft_launch"
HOST_MACRO = "AUTOSOFT_HOST_LAUNCH"


def standalone_source(variant: Variant, entry: Entry | None) -> str:
    """The variant's source behind a comment that says what it is, how to launch it and where it came from,
    followed by the host launcher (inside #ifdef AUTOSOFT_HOST_LAUNCH)."""
    host = _HostLauncher(variant)
    lines = [
        f"autosoft {__version__} export: {variant.name}",
        f"family {variant.family}, dtype {variant.problem.dtype}, shape {variant.problem.shape_text}",
        "params: " + ", ".join(f"{k}={v}" for k, v in variant.params.items()),
    ]
    maps = [a for launch in variant.launches for a in launch.args if isinstance(a, TensorMap)]
    for launch in variant.launches:
        args = ", ".join(a if isinstance(a, str) else f"tensor_map({a.array})" if isinstance(a, TensorMap)
                         else f"{a.item()}" for a in launch.args)
        lines.append(f"launch {launch.kernel}<<<grid={launch.grid}, block={launch.block}, "
                     f"dynamic shared memory={launch.shared_mem} B>>>({args})")
        if launch.shared_mem > DEFAULT_DYNAMIC_SMEM:
            lines.append(f"  {launch.kernel} uses more than 48 KiB of dynamic shared memory: call "
                         f"cudaFuncSetAttribute({launch.kernel}, cudaFuncAttributeMaxDynamicSharedMemorySize, "
                         f"{launch.shared_mem}) before launching it")
        if launch.cooperative:
            lines.append(f"  {launch.kernel} must be launched cooperatively (cudaLaunchCooperativeKernel): "
                         "its blocks wait for each other")
        if launch.non_portable_cluster:
            lines.append(f"  {launch.kernel} runs clusters of {launch.cluster_blocks} blocks: set "
                         "cudaFuncAttributeNonPortableClusterSizeAllowed to 1 before launching it")
    for tmap in dict.fromkeys(maps):
        lines.append(f"  tensor_map({tmap.array}): a CUtensorMap (cuTensorMapEncodeTiled) over {tmap.array}, "
                     f"{tmap.dtype} of shape {tmap.shape} (outermost first) with its strides, box {tmap.box}, "
                     f"{tmap.swizzle_bytes}-byte swizzle, zero fill past the edges; passed by value"
                     + (f" (the first extent is its own rows, {tmap.rows_name})" if tmap.runtime_rows else ""))
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
        *build_lines(variant.source, variant.target.arch),
        f"host launcher: compile with -D{HOST_MACRO} to get (at the end of this file)"
        + (" and link with -lcuda (it encodes the tensor maps)" if maps else ""),
        f"  extern \"C\" {host.prototype};",
        "  it sets the attributes above, launches the kernels in order on `stream` and returns the first error",
    ]
    header = "\n".join("// " + line for line in lines)
    return f"{header}\n\n{variant.source}{host.definition()}"


# --- the host launcher ------------------------------------------------------------------------

@dataclass(frozen=True)
class _Param:
    ctype: str   # as written in the kernel, __restrict__ dropped: "const raw_t*", "long long"
    name: str

    @property
    def pointer(self) -> bool:
        return self.ctype.endswith("*")


def kernel_parameters(source: str, kernel: str) -> list[_Param]:
    """The parameter list of `extern "C" __global__ void ... <kernel>(...)` in a rendered source."""
    found = re.search(r'extern\s+"C"\s+__global__\s+void\b[^{;]*?\b' + re.escape(kernel) + r"\s*\(([^()]*)\)\s*\{",
                      source)
    if found is None:
        raise ValueError(f"kernel {kernel}: no extern \"C\" __global__ definition in the rendered source")
    params = []
    for text in filter(None, (p.strip() for p in found.group(1).split(","))):
        words = re.sub(r"\b__restrict__\b", " ", text).replace("*", " * ").split()
        if len(words) < 2 or not re.fullmatch(r"[A-Za-z_]\w*", words[-1]):
            raise ValueError(f"kernel {kernel}: cannot read parameter {text!r}")
        params.append(_Param(" ".join(words[:-1]).replace(" *", "*"), words[-1]))
    return params


def _typedefs(source: str) -> dict[str, str]:
    """Top-level `typedef T name;` of the source (raw_t), so the launcher's prototype names real types."""
    return {name: " ".join(t.split()) for t, name in re.findall(r"^typedef\s+([A-Za-z_][\w ]*?)\s+(\w+)\s*;",
                                                                 source, re.M)}


def _literal(value: Any, ctype: str, kernel: str) -> str:
    """A numpy scalar Launch arg as a C expression of the kernel's parameter type: (long long)4096."""
    item = value.item() if isinstance(value, np.generic) else value
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, int):
        return f"({ctype}){item}"
    if isinstance(item, float) and np.isfinite(item):
        return f"({ctype}){item!r}"
    raise ValueError(f"kernel {kernel}: cannot write {value!r} as a C literal")


class _HostLauncher:
    """C++ source of `cudaError_t autosoft_launch(<buffers>, [void* workspace,] cudaStream_t stream)`."""

    def __init__(self, variant: Variant):
        self.variant = variant
        self.types = _typedefs(variant.source)
        self.kernels = [(launch, kernel_parameters(variant.source, launch.kernel)) for launch in variant.launches]
        host: dict[str, str] = {}   # named arg -> its type in the launcher's parameter list
        map_strides: list[str] = []  # a mapped array's strides, after every other parameter (as strided inputs')
        for launch, params in self.kernels:
            if len(params) != len(launch.args):
                raise ValueError(f"kernel {launch.kernel}: {len(launch.args)} launch args for {len(params)} parameters")
            for arg, param in zip(launch.args, params):
                if isinstance(arg, TensorMap):  # the launcher takes the array and its strides, and encodes the map
                    host.setdefault(arg.array, f"const {self.types.get('raw_t', 'void')}*")
                    map_strides += arg.stride_names + ((arg.rows_name,) if arg.runtime_rows else ())
                    continue
                if not isinstance(arg, str) or arg == "workspace":
                    continue
                ctype = self._resolved(param.ctype)
                if arg not in host:
                    host[arg] = ctype
                elif host[arg].replace("const ", "") != ctype.replace("const ", ""):
                    raise ValueError(f"argument {arg}: {host[arg]} in one kernel, {ctype} in {launch.kernel}")
                elif "const " not in ctype:
                    host[arg] = ctype  # writable where one kernel writes it; T* passes as const T* to the others
        for name in map_strides:
            host.setdefault(name, "long long")
        self.host = host

    def _resolved(self, ctype: str) -> str:
        return re.sub(r"\b\w+\b", lambda m: self.types.get(m.group(0), m.group(0)), ctype)

    @property
    def prototype(self) -> str:
        params = [f"{t} {name}" for name, t in self.host.items()]
        if self.variant.workspace_bytes:
            params.append("void* workspace")
        params.append("cudaStream_t stream")
        return f"cudaError_t {LAUNCHER}({', '.join(params)})"

    def _value(self, arg: Any, param: _Param, kernel: str) -> str:
        if isinstance(arg, TensorMap):
            return f"map_{arg.array}"
        if not isinstance(arg, str):
            return _literal(arg, param.ctype, kernel)
        if arg == "workspace":
            return f"static_cast<{param.ctype}>(workspace)"
        return arg  # the launcher's parameter has this type, or the type without const

    def definition(self) -> str:
        v = self.variant
        out = [
            "",
            f"#ifdef {HOST_MACRO}",
            f"// Host launcher for {v.name}: runs its kernel(s) in order on `stream` and returns the first error.",
        ]
        if v.workspace_bytes:
            out.append(f"// `workspace` is {v.workspace_bytes} bytes of device memory, zeroed (cudaMemset) once before "
                       "the first call and kept for later calls; one per stream running this concurrently.")
        maps = any(isinstance(a, TensorMap) for launch, _ in self.kernels for a in launch.args)
        out += ["#include <cuda_runtime.h>"]
        if maps:
            out += _TENSOR_MAP_HELPER
        out += [
            f"extern \"C\" {self.prototype} {{",
            "  cudaError_t err = cudaSuccess;",
        ]
        for launch, params in self.kernels:
            out += self._launch(launch, params)
        out += ["  return cudaSuccess;", "}", f"#endif  // {HOST_MACRO}", ""]
        return "\n".join(out)

    def _launch(self, launch: Launch, params: list[_Param]) -> list[str]:
        k = launch.kernel
        dims = [", ".join(f"{d}u" for d in launch.grid), ", ".join(f"{d}u" for d in launch.block)]
        grid, block = (f"dim3({d})" for d in dims)
        check = "if (err != cudaSuccess) return err;"
        lines = []
        if launch.shared_mem > DEFAULT_DYNAMIC_SMEM:
            lines.append(f"  err = cudaFuncSetAttribute({k}, cudaFuncAttributeMaxDynamicSharedMemorySize, "
                         f"{launch.shared_mem});  // more than 48 KiB")
            lines.append(f"  {check}")
        if launch.non_portable_cluster:
            lines.append(f"  err = cudaFuncSetAttribute({k}, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);"
                         f"  // clusters of {launch.cluster_blocks} blocks")
            lines.append(f"  {check}")
        for arg in dict.fromkeys(a for a in launch.args if isinstance(a, TensorMap)):
            lines += _encode_map(arg, check)
        values = [self._value(a, p, k) for a, p in zip(launch.args, params)]
        if launch.cooperative:  # its blocks wait for each other: all of them must be resident at once
            lines.append("  {")
            lines += [f"    {p.ctype} a{i} = {val};" for i, (p, val) in enumerate(zip(params, values))]
            lines.append(f"    void* args[] = {{{', '.join(f'&a{i}' for i in range(len(params)))}}};")
            lines.append(f"    err = cudaLaunchCooperativeKernel((const void*){k}, {grid}, {block}, args, "
                         f"{launch.shared_mem}, stream);")
            lines.append(f"    {check}")
            lines.append("  }")
        else:
            lines.append(f"  {k}<<<{grid}, {block}, {launch.shared_mem}, stream>>>({', '.join(values)});")
            lines.append("  err = cudaGetLastError();")
            lines.append(f"  {check}")
        return lines


_TENSOR_MAP_HELPER = [
    "#include <cuda.h>",
    "#include <cstring>",
    "// a tiled TMA descriptor: dims and box innermost first, strides (of every dim but the first) in bytes",
    "static cudaError_t autosoft_tensor_map(void* map, const void* base, CUtensorMapDataType type, cuuint32_t rank,",
    "                                       const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,",
    "                                       CUtensorMapSwizzle swizzle) {",
    "  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};",
    "  CUtensorMap encoded;",
    "  CUresult r = cuTensorMapEncodeTiled(&encoded, type, rank, const_cast<void*>(base), dims, strides, box, ones,",
    "                                      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,",
    "                                      CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);",
    "  if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;  // an address or stride not a multiple of 16 bytes",
    "  std::memcpy(map, &encoded, 128);",
    "  return cudaSuccess;",
    "}",
]
_TMA_TYPES = {"float16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "bfloat16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"}
_TMA_SWIZZLES = {32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B", 128: "CU_TENSOR_MAP_SWIZZLE_128B"}


def _encode_map(tmap: TensorMap, check: str) -> list[str]:
    """Launcher lines that encode `map_<array>` from the array and its strides (elements) (and
    with runtime_rows its rows); a dimension of one element takes the contiguous stride, as the
    runtime does."""
    itemsize = ITEMSIZE[tmap.dtype]
    rank = len(tmap.shape)
    packed = tmap.contiguous_strides
    strides = [f"{packed[d] * itemsize}ull" if tmap.shape[d] == 1 or tmap.always_contiguous
               else f"(cuuint64_t){tmap.stride_names[d]} * {itemsize}"
               for d in reversed(range(rank - 1))]
    # a map over its array's own rows (runtime_rows) takes their count from the launcher's argument
    dims = [f"(cuuint64_t){tmap.rows_name}" if d == 0 and tmap.runtime_rows else f"{n}ull"
            for d, n in enumerate(tmap.shape)]
    return [
        f"  TensorMap map_{tmap.array};",
        "  {",
        f"    const cuuint64_t dims[{rank}] = {{{', '.join(reversed(dims))}}};",
        f"    const cuuint64_t strides[{rank - 1}] = {{{', '.join(strides)}}};",
        f"    const cuuint32_t box[{rank}] = {{{', '.join(f'{n}u' for n in reversed(tmap.box))}}};",
        f"    err = autosoft_tensor_map(&map_{tmap.array}, {tmap.array}, {_TMA_TYPES[tmap.dtype]}, {rank}, dims, strides, box,",
        f"                              {_TMA_SWIZZLES[tmap.swizzle_bytes]});",
        f"    {check}",
        "  }",
    ]


# --- writing the file -------------------------------------------------------------------------

def check_output(output: Path, cache_path: Path | None) -> None:
    """Refuse, before any work, an -o that cannot become the exported file: a folder, a path under a
    file, or the cache file itself (through links and relative paths too)."""
    try:
        if output.is_dir():
            raise UserError(f"-o {output}: is a folder; give a file path, e.g. -o {output / 'kernel.cu'}")
        for above in output.parents:
            if above.exists():  # the nearest existing folder: the file goes in it or below it
                if not above.is_dir():
                    raise UserError(f"-o {output}: {above} exists and is not a folder; choose another -o")
                break
        if cache_path is not None and _same_file(output, cache_path):
            raise UserError(f"-o {output} is the cache file {cache_path}: writing there would replace the tuned "
                            "kernels with C++ source; choose another -o")
    except OSError as exc:
        raise UserError(f"-o {output}: cannot write there ({exc.strerror or exc}); choose another -o") from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare where they would be
        try:
            return a.resolve() == b.resolve()
        except (OSError, RuntimeError):  # a symbolic link loop: the write itself will fail and say so
            return False


def write_atomically(output: Path, text: str) -> None:
    """Write text to output whole or not at all (files.replace_text), through a symbolic link as
    open() would; OSError becomes a one-line UserError."""
    target = output.resolve() if output.is_symlink() else output  # write through a link, as open() would
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        replace_text(target, text)
    except OSError as exc:
        raise UserError(f"-o {output}: cannot write ({exc.strerror or exc}); choose another -o") from None
