# compile every wgmma seed (all schedules, tiles, stages) of a spread of problems; report any ptxas
# "wgmma.mma_async instructions are serialized" message or C75xx code
import sys, re, multiprocessing as mp; sys.path.insert(0,'.')
from autosoft.families import get_family
from autosoft.families.base import build_variant, Target
from autosoft.compile import compile_source
t=Target.for_arch('90')
def jobs():
    out=[]
    att=get_family('attention')
    for shape in ("16,16,512,64","4,16,4096,64","3,7,1000,64","8,32,2048,128","1,8,3333,128","2,16,2048,256","2,32,1,128"):
        for dt in ("bfloat16","float16"):
            for causal in (False, True):
                opts={"causal":True} if causal else {}
                try: p=att.problem(shape,dt,opts)
                except Exception: continue
                for params in [att.default_params(p,t)]+att.seed_params(p,t):
                    if params.get("engine")=="wgmma": out.append(("attention",shape,dt,opts,params))
    cs=get_family('attention_colsum')
    for shape in ("4,16,1024,64","2,16,4096,128"):
        n=int(shape.split(",")[2])
        for dt in ("bfloat16","float16"):
            for opts in ({"split":n-64},{"split":n-64,"causal":True}):
                p=cs.problem(shape,dt,opts)
                out += [("attention_colsum",shape,dt,opts,pp) for pp in [cs.default_params(p,t)]+cs.seed_params(p,t) if pp.get("engine")=="wgmma"]
    if len(sys.argv) > 1: return [j for j in out if j[0] == "attention_colsum"]
    for opts in ({"kv_heads":8},{"kv_heads":2,"kv_len":4096}):
        p=att.problem("2,16,1024,128","bfloat16",opts)
        out += [("attention","2,16,1024,128","bfloat16",opts,pp) for pp in [att.default_params(p,t)]+att.seed_params(p,t) if pp.get("engine")=="wgmma"]
    return out
def one(job):
    fam,shape,dt,opts,params=job
    f=get_family(fam); p=f.problem(shape,dt,opts); v=build_variant(f,p,params,t)
    r=compile_source(v.source,t.arch)
    bad=[l.strip()[:160] for l in r.log.splitlines() if re.search(r"C75\d\d|serialized",l)]
    return v.name, r.ok, bad
if __name__=="__main__":
    js=jobs(); print(len(js),"variants", flush=True)
    seen=set(); n=0; flagged=0
    with mp.get_context("spawn").Pool(2) as pool:
        for name,ok,bad in pool.imap_unordered(one, js):
            if name in seen: continue
            seen.add(name); n+=1
            if bad or not ok: flagged+=1; print(name, ok, bad[:2], flush=True)
    print(f"{n} distinct variants compiled, {flagged} with a C75xx/serialized message or a failure")
