"""The Python dispatch cost of a torch operator, as autosoft registers its operators and as it did
before: runs on a CPU-only torch, no GPU needed.

    python benchmarks/op_dispatch.py [--calls 20000] [--rounds 7] [--out op_dispatch.json]

Each contender computes the same trivial implementation, `torch.empty_like(x)` on a small CPU
tensor, so what differs is the dispatch alone:

- custom_op: `torch.library.custom_op` with register_fake and register_autograd (the softmax's
  registration in autosoft.torch_ops before issue 19);
- library: autosoft's registration now (`torch.library.Library` schema with the pt2 tag, the
  implementation for CompositeExplicitAutograd, register_fake, and autosoft.torch_ops'
  own Autograd kernel, `_autograd_kernel`, the very code the operators use);
- direct: the implementation called from Python, no operator;
- and, for context, a Library op whose autograd is torch.library.register_autograd's, and one
  with no autograd kernel at all (torch's fallback, which lets outputs carry no gradient).

Per call from Python (`op(x, -1)` on the default overload, the input not requiring gradients),
in microseconds: the median of --rounds rounds that take turns, each timing --calls calls. The
dispatch overhead of a registration is its time minus direct's. On a GPU host the figures of
benchmarks/softmax.py --host-only include this overhead plus the launch; this isolates it.

Then autosoft's own two ways to a softmax, `autosoft.softmax(x)` and
`torch.ops.autosoft.softmax(x, -1)`, each up to the cached plan, which here is a stand-in
(`torch.empty_like(x)`, no launch) filed under call_family's key for the CPU tensor: the
Python that each way adds on top of the plan, which on a GPU host comes on top of the launch.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any, Callable


def per_call_us(fn: Callable[..., Any], x: Any, calls: int) -> float:
    for _ in range(200):
        fn(x, -1)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x, -1)
    return (time.perf_counter() - t0) / calls * 1e6


def contenders(torch: Any) -> dict[str, Callable[..., Any]]:
    from dataclasses import replace

    from autosoft.torch_ops import _autograd_kernel, declared

    schema = "(Tensor x, int dim) -> Tensor"

    def impl(x: Any, dim: int) -> Any:
        return torch.empty_like(x)

    def fake(x: Any, dim: int) -> Any:
        return torch.empty_like(x)

    def grad(ctx: Any, dy: Any) -> Any:
        return dy, None

    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(output)

    old = torch.library.custom_op("autosoft_bench::custom_op", impl, mutates_args=(), schema=schema)
    old.register_fake(fake)
    old.register_autograd(grad, setup_context=setup_context)

    lib = torch.library.Library("autosoft_bench", "FRAGMENT")
    for name in ("library", "library_register_autograd", "library_no_autograd"):
        lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        lib.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"autosoft_bench::{name}", fake, lib=lib)
    ops = torch.ops.autosoft_bench
    kernel = _autograd_kernel(torch, replace(declared("softmax"), plan_options=None), ops.library.default, impl)
    lib.impl("library", kernel, "Autograd", with_keyset=True)
    torch.library.register_autograd("autosoft_bench::library_register_autograd", grad, setup_context=setup_context,
                                    lib=lib)
    contenders.lib = lib  # type: ignore[attr-defined]  # the registrations last as long as the Library
    return {"custom_op": ops.custom_op.default, "library": ops.library.default, "direct": impl,
            "library_register_autograd": ops.library_register_autograd.default,
            "library_no_autograd": ops.library_no_autograd.default}


def autosoft_paths(torch: Any, x: Any) -> dict[str, Callable[..., Any]]:
    """autosoft.softmax and the operator, with a stand-in plan for x in call_family's cache."""
    import autosoft
    import autosoft.arrays
    import autosoft.torch_ops  # noqa: F401 - registers torch.ops.autosoft

    def stand_in(arrays: Any, scalars: Any, given: Any = None) -> tuple[Any, ...]:
        return (torch.empty_like(arrays[0]),)

    prepare = autosoft.arrays._prepare
    autosoft.arrays._prepare = lambda *args: stand_in  # files the stand-in under call_family's key for x
    try:
        autosoft.arrays.call_family("softmax", (x,))
    finally:
        autosoft.arrays._prepare = prepare
    softmax = autosoft.softmax
    return {"autosoft.softmax(x)": lambda x, dim: softmax(x),
            "torch.ops.autosoft.softmax(x, -1)": torch.ops.autosoft.softmax,
            "...softmax.default(x, -1)": torch.ops.autosoft.softmax.default,
            "plan alone": lambda x, dim: stand_in((x,), ())[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="", help="also write the result here as JSON")
    args = parser.parse_args()
    import torch

    x = torch.randn(64, 128)
    timers = contenders(torch)
    paths = autosoft_paths(torch, x)
    samples: dict[str, list[float]] = {name: [] for name in (*timers, *paths)}
    for _ in range(args.rounds):  # taking turns: a slow spell of the host weighs on all alike
        for name, fn in (*timers.items(), *paths.items()):
            samples[name].append(per_call_us(fn, x, args.calls))
    medians = {name: statistics.median(v) for name, v in samples.items()}
    result = {"us_per_call": medians,
              "overhead_us": {name: medians[name] - medians["direct"] for name in timers if name != "direct"},
              "autosoft_over_plan_us": {name: medians[name] - medians["plan alone"] for name in paths
                                        if name != "plan alone"},
              "torch": torch.__version__, "python": platform.python_version(), "machine": platform.processor() or
              platform.machine(), "calls": args.calls, "rounds": args.rounds, "input": "64x128 float32 CPU tensor"}
    for name in timers:
        extra = "" if name == "direct" else f"   (+{medians[name] - medians['direct']:.2f} us dispatch)"
        print(f"{name:34s} {medians[name]:7.2f} us/call{extra}")
    print()
    for name in paths:
        extra = "" if name == "plan alone" else f"   (+{medians[name] - medians['plan alone']:.2f} us over the plan)"
        print(f"{name:34s} {medians[name]:7.2f} us/call{extra}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
