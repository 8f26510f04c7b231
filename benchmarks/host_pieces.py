"""Where a call's host time goes: per-call microseconds of the pieces of autosoft.softmax's path
and of its torch operator, against torch.softmax, on a tuned 4096x128 float32 CUDA tensor.

    python benchmarks/host_pieces.py benchmarks/results/softmax_h200.sqlite [1x1]   # the shape: default 4096x128

Each piece is called 2000 times per round after 50 warm-up calls, then the GPU is synchronised;
the median of 7 rounds. The kernels take ~5 us of GPU time, so the loops are host-bound: these
are the host's costs. "launch (pointers given)" is the plan's launch function alone (argument
slots written, cuLaunchKernel), "plan((x,), ())" the cached plan (allocation and launch). The operator's kernel is the compiled
one where `autosoft native` built it (AUTOSOFT_NATIVE=0: the Python one). The driver's cuLaunchKernel alone is timed
through both bindings the launch path can take: cuda-bindings (torch tensors' path) and CuPy's (CuPy arrays'); the
JSON says which one the plan used and whether CuPy was imported before those two pieces (it should not be).
Where `autosoft native` built the extension, autosoft.softmax takes its compiled entry: "compiled entry alone" is
that call (lookup, allocation, launch) without the public function around it, "public function, Python path" the
public function with the extension turned off (native.disable), the path without a build."""
import json
import statistics
import sys
import time

import torch
import autosoft
import autosoft.torch_ops  # noqa: F401
from autosoft import native
from autosoft.dispatch import DISPATCHER

autosoft.load_cache(sys.argv[1])
shape = tuple(int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "4096x128").split("x"))
x = torch.randn(*shape, device="cuda")
y = autosoft.softmax(x)
key = next(k for k in DISPATCHER.fast if k[0] == "softmax")
plan = DISPATCHER.fast[key]
cells = dict(zip(plan.__code__.co_freevars, (c.cell_contents for c in plan.__closure__)))
launch = cells["launch"]
out = torch.empty_like(x)
xp, op_ = x.data_ptr(), out.data_ptr()
cupy_before = "cupy" in sys.modules  # the torch path with a warm store imports none
loaded = next(v for k, v in DISPATCHER._loaded.items() if k[0].family == "softmax")
raw = loaded._launches[0]
gx, gy, gz, bx, by, bz, smem = raw.geometry
bindings_launch = loaded.driver.launch_kernel
from autosoft.runtime import cupy_driver  # noqa: E402 - after the check above: this imports CuPy

cupy_launch = cupy_driver().launch_kernel
raw_stream = torch._C._cuda_getCurrentRawStream
op = torch.ops.autosoft.softmax
entries = native.direct()  # autosoft.softmax's compiled first step, where the extension is built


pieces = {
    "torch.softmax": lambda: torch.softmax(x, -1),
    "torch.empty_like": lambda: torch.empty_like(x),
    "x.data_ptr()": lambda: x.data_ptr(),
    "x.is_contiguous()": lambda: x.is_contiguous(),
    "raw stream": lambda: raw_stream(0),
    "launch (pointers given)": lambda: launch(xp, op_, 0),
    "cuLaunchKernel alone, the plan's binding": lambda: bindings_launch(raw.function, gx, gy, gz, bx, by, bz, smem, 0,
                                                                      raw.params_ptr, 0),
    "cuLaunchKernel alone, CuPy's binding": lambda: cupy_launch(raw.address, gx, gy, gz, bx, by, bz, smem, 0,
                                                                raw.params_ptr, 0),
    "plan((x,), ())": lambda: plan((x,), ()),
    "autosoft.softmax": lambda: autosoft.softmax(x),
    "torch.ops.autosoft.softmax": lambda: op(x, -1),
    "op.default": lambda: op.default(x, -1),
    "torch.is_grad_enabled": lambda: torch.is_grad_enabled(),
    "torch.compiler.is_dynamo_compiling": lambda: torch.compiler.is_dynamo_compiling(),
    "empty lambda": lambda: None,
}
OFF = "autosoft.softmax, extension turned off"  # timed with native.disable() around its round: the Python path
if entries is not None:
    pieces["compiled entry alone"] = lambda: entries[0](x, -1, None)
    pieces[OFF] = lambda: autosoft.softmax(x)
res = {k: [] for k in pieces}
for _ in range(7):
    for name, f in pieces.items():
        if name == OFF:
            native.disable()
        for _ in range(50):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            f()
        torch.cuda.synchronize()
        res[name].append((time.perf_counter() - t) / 2000 * 1e6)
        if name == OFF:
            native.enable()
out = {k: statistics.median(v) for k, v in res.items()}
out["operator kernel"] = "compiled (autosoft.native)" if native.enabled() else "Python"
out["autosoft.softmax path"] = "compiled entry (autosoft.native)" if entries is not None else "Python"
out["shape"] = "x".join(map(str, shape))
out["plan's driver"] = loaded.driver.name
out["cupy imported by the torch path"] = cupy_before
print(json.dumps(out, indent=1))
