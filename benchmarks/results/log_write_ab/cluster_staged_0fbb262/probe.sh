. .bench/common.sh
W="storage=smem,threads=1024,row_threads=1024,normalise=online,chunks=4,stagger=2000"
for dt in bfloat16 float16; do
python benchmarks/softmax_variants.py --log --shape 1024x32768 --dtype $dt --set $W --set storage=smem,threads=512,row_threads=512,normalise=three_pass,chunks=8 \
  --match storage=smem,combine=cluster,split=2,vec=8,reduce=shuffle --match storage=smem,combine=cluster,split=4,vec=8,reduce=shuffle --limit 36 --out $OUT/log_$dt.json > $OUT/log_$dt.txt 2>&1
tail -9 $OUT/log_$dt.txt
done
python benchmarks/softmax_variants.py --shape 1024x32768 --dtype bfloat16 --set storage=smem,threads=256,row_threads=256,normalise=online,chunks=4,keep_exp=true \
  --match storage=smem,combine=cluster,split=2,vec=8,reduce=shuffle,keep_exp=True --limit 36 --out $OUT/fwd_bf16.json > $OUT/fwd_bf16.txt 2>&1
tail -9 $OUT/fwd_bf16.txt
grep -c WRONG $OUT/*.txt
