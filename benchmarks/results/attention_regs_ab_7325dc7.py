"""A/B: the 64-row two-per-SM wgmma default with the producer at 24 registers (consumer 232) against 32 (consumer 224), verified, side by side, cuDNN beside."""
import concurrent.futures as cf, dataclasses, json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch
from attention import Inputs, time_sdpa, FAMILY
from autosoft.compile import compile_source
from autosoft.evaluate import verify, time_side_by_side
from autosoft.families.base import build_variant
from autosoft.runtime import LoadedVariant, device_info

target = device_info().target
results = []
for shape, causal, dtype in [("16,16,512,64", True, "bfloat16"), ("4,16,1024,64", True, "bfloat16"), ("3,7,1000,64", False, "float16"),
                             ("3,7,1000,64", True, "float16"), ("16,16,512,64", True, "float16")]:
    problem = FAMILY.problem(shape, dtype, ("causal",) if causal else ())
    v = build_variant(FAMILY, problem, FAMILY.default_params(problem, target), target)
    src = v.source.replace("setmaxnreg.dec.sync.aligned.u32 24;", "setmaxnreg.dec.sync.aligned.u32 32;").replace(
        "setmaxnreg.inc.sync.aligned.u32 232;", "setmaxnreg.inc.sync.aligned.u32 224;")
    assert src != v.source
    twin = dataclasses.replace(v, source=src, name=v.name + "_r32")
    variants = [v, twin]
    compiled = [compile_source(x.source, x.target.arch) for x in variants]
    loaded = [LoadedVariant(x, c.cubin) for x, c in zip(variants, compiled)]
    wrong = [verify(FAMILY, l, seed=21) or verify(FAMILY, l, seed=22) for l in loaded]
    us = time_side_by_side(FAMILY, loaded, rounds=7, reps=30)
    inputs = Inputs(torch, problem)
    cud = time_sdpa(torch, inputs, causal, "cudnn", 30)["us"]
    del inputs
    rec = {"row": f"{shape} {'causal' if causal else 'full'} {dtype}", "cudnn_us": cud, "wrong": [str(w) for w in wrong],
           "us": {l.variant.name: t for l, t in zip(loaded, us)}}
    results.append(rec)
    print(f"{rec['row']}: cuDNN {cud:.2f}  24/232 {us[0]:.2f} ({cud/us[0]:.3f}x)  32/224 {us[1]:.2f} ({cud/us[1]:.3f}x)  wrong={[bool(w) for w in wrong]}", flush=True)
json.dump(results, open(sys.argv[1], "w"), indent=1)
