# S ahead (S of tile j + 1 issued before the softmax of tile j) against the template at HEAD, d64 rows, seeds side by side
# .bench/NAME_wgmma.cu.j2: templates/attention/attention_wgmma.cu.j2 at af4968e with NAME.patch applied
# (half_pv.patch for halfpv: ../issue18_half_tile_3365f00/); .bench/old_wgmma.cu.j2: the template as it was
source .bench/common.sh  # the wheels the GPU machine lacks (optuna), the repo on PYTHONPATH
# the patch compiles clean: no rejection to lift
SH="16,16,512,64;4,16,1024,64;4,16,4096,64"
for r in 1 2; do
  for t in ahead old; do
    cp .bench/${t}_wgmma.cu.j2 templates/attention/attention_wgmma.cu.j2
    timeout 140 python3 benchmarks/attention.py --seeds 6 --shapes "$SH" --dtypes bfloat16 --causal both --out $OUT/seeds_${t}$r.json > $OUT/seeds_${t}$r.log 2>&1; echo "$t$r rc=$?"
  done
done
cp .bench/old_wgmma.cu.j2 templates/attention/attention_wgmma.cu.j2
python3 - <<'PY'
import json, os
runs = ["ahead1", "old1", "ahead2", "old2"]
data = {r: json.load(open(f"{os.environ['OUT']}/seeds_{r}.json")) for r in runs if os.path.exists(f"{os.environ['OUT']}/seeds_{r}.json")}
first = data[next(iter(data))]["seeds"]
print("runs:", list(data))
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
cd $OUT && tar czf ahead_ab.tgz seeds_* && rm -f seeds_*
