"""Flash-attention backward: autosoft against SDPA (cuDNN and flash backends) and FlashAttention-4.

    python benchmarks/attention_backward.py                                   # untuned, every row, bf16 and fp16
    python benchmarks/attention_backward.py --rows 1,2 --dtypes bfloat16 --out bwd.json
    python benchmarks/attention_backward.py --tune 40 --cache attention_backward.sqlite --out bwd_tuned.json
    python3 /tmp/peers/run.py benchmarks/attention_backward.py --dtypes bfloat16   # with FA4 (peer-install)
    python benchmarks/attention_backward.py --list                            # the rows, numbered

Rows (issue 40; --rows takes their numbers): (4,16,4096,128) full and causal, (2,16,8192,64) full
and causal, (8,32,2048,128) causal, (16,16,1024,64) causal, GQA (2, 32/8, 4096, 128) causal,
D = 256 (2,16,4096,256) causal, Nq != Nkv (1, 32/8, 512 x 8192, 128) causal (bottom-right).

For each row and dtype, every contender is timed on the same torch tensors by the same method as
benchmarks/attention.py (autosoft.timing.time_gpu: CUDA events, warm-up, a spin-blocked queue,
median; inputs rotated over rotation_count sets so that no run reads them from L2), one after the
other in one process:
- autosoft: the backward alone through autosoft.attention_backward (o and lse from autosoft.attention),
  and its deterministic variant (deterministic=True);
- SDPA's backward with the cuDNN backend and with the flash backend (FA2), forced with
  torch.nn.attention.sdpa_kernel: the forward runs once per input set, then only
  torch.autograd.grad(out, (q, k, v), dO, retain_graph=True) is timed. GQA goes as enable_gqa=True;
  causal with Nq != Nkv as torch's lower-right causal bias (is_causal aligns top-left); a backend
  that refuses a row is listed with its error;
- FlashAttention-4's backward (flash_attn.cute.interface.flash_attn_func and autograd, (B, N, H, D)
  tensors) where that imports (the peer flash-attn-4), else skipped;
- forward + backward of one call: autosoft.attention with autograd, and SDPA (cuDNN).

TF/s counts the backward as 2.5 times the forward's 4 * B * H * (visible (query, key) pairs) * D
(causal halved, as autosoft.families.attention.visible_pairs counts), forward + backward as 3.5
times. autosoft's dq, dk, dv are compared with SDPA's (cuDNN, else flash, else SDPA's default) on
the same inputs, relative L2, printed and stored. Untuned, autosoft serves each problem as any
call does (the cache's entries, the selector, the nearest tuned shape, else the default; each
checked once on the shape). --tune TRIALS tunes the backward problems (both dq variants) and the
forward problem of each row into --cache FILE first (entries already there are kept); --cache
alone uses that file's entries. --out writes the rows as JSON after each row; a markdown table is
printed last.
"""
from __future__ import annotations

import argparse
import atexit
import inspect
import json
import sys
import time
import traceback
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.families import get_family  # noqa: E402
from autosoft.families.base import Problem  # noqa: E402

from provenance import commit  # noqa: E402

FAMILY = get_family("attention_backward")
FORWARD = get_family("attention")
DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class Row:
    """One benchmark row: q (batch, heads, queries, head_dim), k and v (batch, kv_heads, keys, head_dim)."""
    batch: int
    heads: int
    kv_heads: int
    queries: int
    keys: int
    head_dim: int
    causal: bool

    @property
    def label(self) -> str:
        heads = f"{self.heads}/{self.kv_heads}" if self.kv_heads != self.heads else str(self.heads)
        n = f"{self.queries}x{self.keys}" if self.keys != self.queries else str(self.queries)
        return f"{self.batch},{heads},{n},{self.head_dim}"

    @property
    def mask(self) -> str:
        return "causal" if self.causal else "full"

    def options(self, deterministic: bool = False) -> dict[str, Any]:
        """The attention_backward problem's options (the forward's without deterministic)."""
        options: dict[str, Any] = {"causal": self.causal}
        if self.kv_heads != self.heads:
            options["kv_heads"] = self.kv_heads
        if self.keys != self.queries:
            options["kv_len"] = self.keys
        if deterministic:
            options["deterministic"] = True
        return options

    def problem(self, dtype: str, deterministic: bool = False) -> Problem:
        shape = f"{self.batch},{self.heads},{self.queries},{self.head_dim}"
        return FAMILY.problem(shape, dtype, {k: v for k, v in self.options(deterministic).items() if v})

    def forward_problem(self, dtype: str) -> Problem:
        shape = f"{self.batch},{self.heads},{self.queries},{self.head_dim}"
        return FORWARD.problem(shape, dtype, {k: v for k, v in self.options().items() if v})


ROWS = (
    Row(4, 16, 16, 4096, 4096, 128, False), Row(4, 16, 16, 4096, 4096, 128, True),
    Row(2, 16, 16, 8192, 8192, 64, False), Row(2, 16, 16, 8192, 8192, 64, True),
    Row(8, 32, 32, 2048, 2048, 128, True), Row(16, 16, 16, 1024, 1024, 64, True),
    Row(2, 32, 8, 4096, 4096, 128, True), Row(2, 16, 16, 4096, 4096, 256, True),
    Row(1, 32, 8, 512, 8192, 128, True),
)

CONTENDERS = ("autosoft", "autosoft_det", "cudnn", "flash", "fa4")  # backward alone
FWD_BWD = ("autosoft_fwdbwd", "cudnn_fwdbwd")


def fa4_function() -> Callable[..., Any] | None:
    """FlashAttention-4's flash_attn_func where flash_attn.cute imports and takes causal, else None."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception:  # noqa: BLE001 - absent, or present without its CUDA DSL: no FA4 column
        return None
    return flash_attn_func if "causal" in inspect.signature(flash_attn_func).parameters else None


def relative_l2(got: Any, ref: Any) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


class Sets:
    """Rotated input sets for one row: q, k, v, dO (B, H, N, D), and autosoft's o and lse."""

    def __init__(self, torch: Any, row: Row, dtype: str) -> None:
        import autosoft
        from autosoft.runtime import device_info
        from autosoft.timing import rotation_count

        self.torch, self.row = torch, row
        problem = row.problem(dtype)
        self.n = rotation_count(FAMILY.bytes_moved(problem), device_info().target.l2_bytes, max_bytes=2 << 30)
        tdtype = getattr(torch, dtype)
        self.sets = []
        for _ in range(self.n):
            q = torch.randn(row.batch, row.heads, row.queries, row.head_dim, device="cuda").to(tdtype)
            k, v = (torch.randn(row.batch, row.kv_heads, row.keys, row.head_dim, device="cuda").to(tdtype)
                    for _ in range(2))
            do = torch.randn_like(q)
            with torch.no_grad():
                o, lse = autosoft.attention(q, k, v, causal=row.causal, return_lse=True)
            self.sets.append({"q": q, "k": k, "v": v, "do": do, "o": o, "lse": lse})
        self.leaf_sets = [self.leaves(i) for i in range(self.n)]  # for forward + backward: no copy timed

    def leaves(self, i: int, layout: Callable[[Any], Any] = lambda t: t) -> list[Any]:
        s = self.sets[i]
        return [layout(s[n]).detach().clone().requires_grad_() for n in ("q", "k", "v")]


def sdpa_call(torch: Any, row: Row) -> Callable[..., Any]:
    """SDPA with the row's mask: is_causal where queries and keys align, else the lower-right causal bias."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gqa = {"enable_gqa": True} if row.kv_heads != row.heads else {}
    if row.causal and row.queries != row.keys:
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(row.queries, row.keys)
        return lambda q, k, v: sdpa(q, k, v, attn_mask=bias, **gqa)
    return lambda q, k, v: sdpa(q, k, v, is_causal=row.causal, **gqa)


def explicit_gradients(torch: Any, row: Row, leaves: list[Any], do: Any) -> list[Any]:
    """dq, dk, dv of SDPA (its default backend) on k and v repeated over each group and an explicit
    bottom-right mask: what any backend takes."""
    q, k, v = leaves
    group = row.heads // row.kv_heads
    mask = None
    if row.causal:
        at = torch.arange(row.queries, device="cuda")[:, None] + (row.keys - row.queries)
        mask = torch.arange(row.keys, device="cuda")[None, :] <= at
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), attn_mask=mask)
    return list(torch.autograd.grad(out, leaves, do))


def backend_context(torch: Any, backend: str) -> Any:
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}.get(backend)
    return sdpa_kernel(forced) if forced is not None else nullcontext()


def _error(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]


def time_row(torch: Any, row: Row, dtype: str, reps: int, fa4: Callable[..., Any] | None) -> dict[str, Any]:
    import autosoft
    from autosoft.timing import time_gpu

    problem = row.problem(dtype)
    flops = FAMILY.flops(problem)
    result: dict[str, Any] = {"row": row.label, "mask": row.mask, "dtype": dtype, "bwd_flops": flops}
    sets = Sets(torch, row, dtype)
    result["sets"] = sets.n
    times: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    grads: dict[str, list[Any]] = {}  # each contender's dq, dk, dv of set 0, for the comparison

    def timed(name: str, run: Callable[[int], Any], first: Callable[[], list[Any]] | None = None) -> None:
        try:
            if first is not None:
                grads[name] = first()
            torch.cuda.synchronize()
            times[name] = time_gpu(run, sets.n, reps).median_us
        except Exception as exc:  # noqa: BLE001 - a contender that refuses this row
            times[name], errors[name] = None, _error(exc)
        torch.cuda.synchronize()

    for name, deterministic in (("autosoft", False), ("autosoft_det", True)):
        def backward(i: int, deterministic: bool = deterministic) -> Any:
            s = sets.sets[i]
            return autosoft.attention_backward(s["q"], s["k"], s["v"], s["o"], s["do"], s["lse"], causal=row.causal,
                                               deterministic=deterministic)
        timed(name, backward, lambda backward=backward: list(backward(0)))

    sdpa = sdpa_call(torch, row)
    for backend in ("cudnn", "flash"):
        try:
            with backend_context(torch, backend):
                graphs = []
                for i in range(sets.n):
                    leaves = sets.leaves(i)
                    graphs.append((sdpa(*leaves), leaves))
        except Exception as exc:  # noqa: BLE001 - the backend refuses this row (GQA, a mask, D)
            times[backend], errors[backend] = None, _error(exc)
            continue

        def sdpa_backward(i: int, graphs: list = graphs) -> Any:
            out, leaves = graphs[i]
            return torch.autograd.grad(out, leaves, sets.sets[i]["do"], retain_graph=True)
        timed(backend, sdpa_backward, lambda f=sdpa_backward: list(f(0)))
        del graphs

    if fa4 is None:
        errors["fa4"] = "flash_attn.cute does not import"
        times["fa4"] = None
    else:
        to_bnhd = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731 - FA4 takes (B, N, H, D)
        try:
            runs = []
            for i in range(sets.n):
                leaves = sets.leaves(i, to_bnhd)
                out = fa4(*leaves, causal=row.causal)
                out = out[0] if isinstance(out, tuple) else out
                runs.append((out, leaves, to_bnhd(sets.sets[i]["do"])))

            def fa4_backward(i: int) -> Any:
                out, leaves, do = runs[i]
                return torch.autograd.grad(out, leaves, do, retain_graph=True)
            for i in range(3):  # FA4 compiles each configuration on its first call
                fa4_backward(i % sets.n)
            timed("fa4", fa4_backward, lambda: [g.transpose(1, 2) for g in fa4_backward(0)])
            del runs
        except Exception as exc:  # noqa: BLE001 - FA4 refuses this row or this GPU
            times["fa4"], errors["fa4"] = None, _error(exc)

    def autosoft_fwdbwd(i: int) -> Any:
        leaves = sets.leaf_sets[i]
        o = autosoft.attention(*leaves, causal=row.causal)
        return torch.autograd.grad(o, leaves, sets.sets[i]["do"])
    timed("autosoft_fwdbwd", autosoft_fwdbwd)

    def cudnn_fwdbwd(i: int) -> Any:
        leaves = sets.leaf_sets[i]
        with backend_context(torch, "cudnn"):
            out = sdpa(*leaves)
        return torch.autograd.grad(out, leaves, sets.sets[i]["do"])
    timed("cudnn_fwdbwd", cudnn_fwdbwd)

    reference = next((n for n in ("cudnn", "flash") if n in grads), None)
    if reference is None:  # neither backend takes the row: SDPA's own choice on k, v repeated and a boolean mask
        try:
            grads["sdpa"] = explicit_gradients(torch, row, sets.leaves(0), sets.sets[0]["do"])
            reference = "sdpa"
        except Exception as exc:  # noqa: BLE001
            errors["sdpa"] = _error(exc)
    result["reference"] = reference
    if reference is not None:
        for name in ("autosoft", "autosoft_det", "fa4"):
            if name in grads:
                result[f"{name}_rel_l2"] = {g: relative_l2(got, ref) for g, got, ref
                                            in zip(("dq", "dk", "dv"), grads[name], grads[reference])}
    for name, us in times.items():
        work = flops * (3.5 / 2.5 if name in FWD_BWD else 1.0)
        result[f"{name}_us"] = us
        result[f"{name}_tflops"] = work / (us * 1e-6) / 1e12 if us else None
    result["errors"] = errors
    return result


@lru_cache(maxsize=1)
def _tuning_runner() -> Any:
    """One GPU worker process for every tune of the run (starting one costs seconds)."""
    from autosoft.runners import GpuRunner

    runner = GpuRunner()
    atexit.register(runner.close)
    return runner


def tune_rows(rows: list[Row], dtypes: list[str], cache_path: Path, trials: int, seed: int) -> dict[str, str]:
    """Tune each row's backward problems (default and deterministic dq) and forward problem into
    the cache file, keeping entries already there; returns each problem's variant by key."""
    from autosoft.cache import Cache
    from autosoft.tune import tuned_kernel

    cache = Cache(cache_path)
    variants = {}
    for row in rows:
        for dtype in dtypes:
            for family, problem in ((FAMILY, row.problem(dtype)), (FAMILY, row.problem(dtype, True)),
                                    (FORWARD, row.forward_problem(dtype))):
                key = f"{family.name} {problem.shape_text} {problem.dtype} {dict(problem.options)}"
                t0 = time.perf_counter()
                try:
                    loaded, now = tuned_kernel(family, problem, cache, trials, runner=_tuning_runner(), seed=seed)
                    variants[key] = loaded.variant.name
                    print(f"{'tuned' if now else 'cached'} {key}: {loaded.variant.name} "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
                except Exception as exc:  # noqa: BLE001 - one problem that finds no variant must not end the run
                    variants[key] = f"error: {_error(exc)}"
                    print(f"tune {key} failed: {_error(exc)}", file=sys.stderr, flush=True)
    return variants


def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(result: dict[str, Any]) -> None:
    # tuned in this run, served from a cache tuned earlier, or untuned
    served = "tuned" if result.get("tuned") else f"entries of {result['cache']}" if result.get("cache") else "untuned"
    print(f"\nattention backward on {result['gpu']} (torch {result['torch']}, commit {result['commit']}, "
          f"{served}), TF/s (backward = 2.5x forward FLOPs; fwd+bwd 3.5x)")
    print("| B,H,N,D | mask | dtype | autosoft | autosoft det | cuDNN | FA2 (SDPA flash) | FA4 | vs cuDNN | vs FA4 "
          "| det / non-det | fwd+bwd autosoft | fwd+bwd cuDNN | dq rel L2 vs SDPA |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r['row']} | {r['mask']} | {r['dtype']} | error: {r['error'][:120]} |")
            continue
        t = {n: r.get(f"{n}_tflops") for n in CONTENDERS + FWD_BWD}
        ratio = lambda a, b: _fmt(t[a] / t[b], ".2f") + "x" if t[a] and t[b] else "-"  # noqa: E731
        dq = (r.get("autosoft_rel_l2") or {}).get("dq")
        print(f"| {r['row']} | {r['mask']} | {r['dtype']} | {_fmt(t['autosoft'])} | {_fmt(t['autosoft_det'])} "
              f"| {_fmt(t['cudnn'])} | {_fmt(t['flash'])} | {_fmt(t['fa4'])} | {ratio('autosoft', 'cudnn')} "
              f"| {ratio('autosoft', 'fa4')} | {ratio('autosoft_det', 'autosoft')} | {_fmt(t['autosoft_fwdbwd'])} "
              f"| {_fmt(t['cudnn_fwdbwd'])} | {_fmt(dq, '.2e')} |")


def parse_rows(text: str) -> list[Row]:
    """--rows: comma-separated row numbers (1-based, as --list prints them); empty: every row."""
    if not text:
        return list(ROWS)
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"--rows: expected comma-separated row numbers 1 to {len(ROWS)}, got {text!r}") from None
    bad = [n for n in numbers if not 1 <= n <= len(ROWS)]
    if bad:
        raise SystemExit(f"--rows: no row {bad[0]}; the rows are 1 to {len(ROWS)} (--list prints them)")
    return [ROWS[n - 1] for n in numbers]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="comma-separated row numbers (default: all; --list prints them)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: bfloat16, float16")
    parser.add_argument("--tune", type=int, default=0, metavar="TRIALS",
                        help="tune each row's backward and forward problems into --cache first")
    parser.add_argument("--cache", type=Path, default=None, help="cache file of tuned entries (with --tune: tuned into)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="print the rows, numbered, and exit")
    args = parser.parse_args()

    rows = parse_rows(args.rows)
    if args.list:
        for i, row in enumerate(ROWS, 1):
            print(f"{i:2d}  {row.label} {row.mask}")
        return 0
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        print(f"--dtypes: {unknown[0]!r} is not one of {', '.join(DTYPES)}", file=sys.stderr)
        return 2
    if args.tune and args.cache is None:
        print("--tune needs --cache FILE: the cache file to tune into", file=sys.stderr)
        return 2
    if args.tune < 0:
        print(f"--tune: expected a number of trials >= 1, got {args.tune}", file=sys.stderr)
        return 2

    import torch

    import autosoft
    from autosoft.runtime import device_info

    device = device_info()
    result: dict[str, Any] = {"gpu": device.name, "cc": device.compute_capability, "nvrtc": device.cuda_version,
                              "torch": torch.__version__, "commit": commit(), "tuned": bool(args.tune),
                              "cache": str(args.cache) if args.cache else None, "rows": []}
    if args.tune:
        result["variants"] = tune_rows(rows, dtypes, args.cache, args.tune, args.seed)
    if args.cache is not None:
        autosoft.load_cache(args.cache)
    fa4 = fa4_function()
    if fa4 is None:
        print("flash_attn.cute does not import: no FA4 column (run through /tmp/peers/run.py after peer-install)",
              file=sys.stderr)
    for row in rows:
        for dtype in dtypes:
            t0 = time.perf_counter()
            try:
                r = time_row(torch, row, dtype, args.reps, fa4)
            except Exception as exc:  # noqa: BLE001 - one broken row must not end the run
                traceback.print_exc()
                r = {"row": row.label, "mask": row.mask, "dtype": dtype, "error": _error(exc)}
            r["seconds"] = round(time.perf_counter() - t0, 1)
            result["rows"].append(r)
            if args.out is not None:
                args.out.write_text(json.dumps(result, indent=1))  # partial results survive a kill
            t = {n: r.get(f"{n}_tflops") for n in CONTENDERS + FWD_BWD}
            print(f"{row.label:>18} {row.mask:6} {dtype:8} " + "  ".join(f"{n} {_fmt(v)}" for n, v in t.items())
                  + f"  ({r['seconds']} s)" + (f"  ERROR {r['error']}" if "error" in r else ""), flush=True)
            for name, message in (r.get("errors") or {}).items():
                print(f"    {name}: {message}", flush=True)
    print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
