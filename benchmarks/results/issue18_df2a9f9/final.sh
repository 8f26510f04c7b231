# issue 18's table at $1 (att18.sh), then the ablation of its d64 rows with the time left
s0=$(date +%s)
bash .bench/att18.sh $1
source .bench/common.sh > /dev/null
left=$(( 575 - ($(date +%s) - s0) ))
echo "ablation gets ${left}s"
if [ $left -gt 60 ]; then
  timeout $left python3 benchmarks/attention.py --ablate $OUT/attention_tuned_bf16.json,$OUT/attention_tuned_fp16.json \
    --shapes "16,16,512,64;4,16,1024,64;4,16,4096,64" --out $OUT/ablation.json > $OUT/ablation.log 2>&1; echo "ablation rc=$?"
fi
cd $OUT && tar czf issue18_final.tgz *.json *.log att.sqlite && rm -f *.log att.sqlite && ls
