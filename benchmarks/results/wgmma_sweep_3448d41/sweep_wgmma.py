"""Every valid wgmma variant of a few problems, timed beside cuDNN on the same tensors (bf16)."""
import concurrent.futures as cf, json, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.getcwd() + "/benchmarks")
import torch
import attention as B
from autosoft.families.base import build_variant, space_of
from autosoft.compile import compile_source
from autosoft.runtime import LoadedVariant, device_info
from autosoft.evaluate import verify
F = B.FAMILY
target = device_info().target
out = {}
for spec in sys.argv[1:]:
    shape, causal = spec.split(":")
    causal = causal == "causal"
    t0 = time.time()
    problem = F.problem(shape, "bfloat16", ("causal",) if causal else ())
    pts = [p for p in space_of(F).valid_points(F.problem_values(problem, target)) if p.get("engine") == "wgmma"]
    variants = [build_variant(F, problem, p, target) for p in pts]
    with cf.ThreadPoolExecutor(max_workers=16) as pool:
        built = list(pool.map(lambda v: compile_source(v.source, v.target.arch), variants))
    t1 = time.time()
    inputs = B.Inputs(torch, problem)
    cudnn = [B.time_sdpa(torch, inputs, causal, "cudnn", 10)["us"]]
    rows = []
    for v, r in zip(variants, built):
        if not r.ok:
            continue
        lv = LoadedVariant(v, r.cubin)
        rows.append([v.name, B.time_autosoft(lv, inputs, 10), lv])
    cudnn.append(B.time_sdpa(torch, inputs, causal, "cudnn", 10)["us"])
    rows.sort(key=lambda r: r[1])
    top = rows[:12]
    for r in top:  # re-timed, and verified
        r.append(B.time_autosoft(r[2], inputs, 20))
        r.append(verify(F, r[2], seed=1) is None)
    cudnn.append(B.time_sdpa(torch, inputs, causal, "cudnn", 20)["us"])
    default = F.variant_name(problem, F.default_params(problem, target))
    rank = next((i for i, r in enumerate(rows) if r[0] == default), None)
    out[spec] = {"cudnn_us": cudnn, "compiled": len(rows), "of": len(variants), "default": default, "default_rank": rank,
                 "rows": [[r[0], r[1]] + r[3:] for r in rows]}
    print(f"{spec}: {len(rows)}/{len(variants)} compiled in {t1 - t0:.0f}s, total {time.time() - t0:.0f}s; cuDNN {' '.join(f'{c:.1f}' for c in cudnn)}; default rank {rank} ({rows[rank][1]:.1f} us)" if rank is not None else f"{spec}: default not found", flush=True)
    for r in top:
        print(f"   {r[1]:8.1f} {r[3]:8.1f} {'ok' if r[4] else 'WRONG'} {r[0]}", flush=True)
    json.dump(out, open(os.environ["OUT"] + "/sweep_wgmma.json", "w"))
