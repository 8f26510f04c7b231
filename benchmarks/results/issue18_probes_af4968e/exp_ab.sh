# what the exponentials cost: today's template (old), no exponential at all (noexp, wrong results,
# timing only), and a quarter (emul4) or half (emul2) of them on the FMA pipe by a cubic
# .bench/NAME_wgmma.cu.j2: templates/attention/attention_wgmma.cu.j2 at af4968e with NAME.patch applied
# (half_pv.patch for halfpv: ../issue18_half_tile_3365f00/); .bench/old_wgmma.cu.j2: the template as it was
source .bench/common.sh  # the wheels the GPU machine lacks (optuna), the repo on PYTHONPATH
SH="16,16,512,64;4,16,1024,64;4,16,4096,64;4,16,4096,128"
RUNS="old1 noexp1 emul41 emul21 old2 emul42 emul22"
for r in $RUNS; do
  t=${r%?}
  cp .bench/${t}_wgmma.cu.j2 templates/attention/attention_wgmma.cu.j2
  timeout 100 python3 benchmarks/attention.py --seeds 4 --shapes "$SH" --dtypes bfloat16 --causal both --out $OUT/seeds_$r.json > $OUT/seeds_$r.log 2>&1; echo "$r rc=$?"
done
cp .bench/old_wgmma.cu.j2 templates/attention/attention_wgmma.cu.j2
RUNS="$RUNS" python3 - <<'PY'
import json, os
runs = os.environ["RUNS"].split()
data = {r: json.load(open(f"{os.environ['OUT']}/seeds_{r}.json")) for r in runs if os.path.exists(f"{os.environ['OUT']}/seeds_{r}.json")}
first = data[next(iter(data))]["seeds"]
print("runs:", " ".join(f"{r:>8}" for r in data))
for si, s in enumerate(first):
    cud = [min(x for x in data[r]["seeds"][si]["cudnn_us"] if x) for r in data]
    print(f"{s['shape']} {'causal' if s['causal'] else 'full'} cuDNN " + " ".join(f"{c:.1f}" for c in cud))
    for vi, v in enumerate(s["variants"]):
        ts = []
        for r in data:
            w = data[r]["seeds"][si]["variants"][vi]
            ts.append(f"{w.get('us', float('nan')):8.1f}{'' if w.get('verified', False) else '!'}")
        print("   " + " ".join(ts) + "  " + v["variant"].replace("attention_bf16_", ""))
PY
cd $OUT && tar czf exp_ab.tgz seeds_* && rm -f seeds_*
