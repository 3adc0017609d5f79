set -o pipefail
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cat /tmp/part1 .gpu/b/part2 > /tmp/smol.gguf
echo "$(cat .gpu/b/sha)  /tmp/smol.gguf" | sha256sum -c || exit 3
M=/tmp/smol.gguf
step() { echo "== $1 $(date +%T)"; }
step "bf16 drop 8 linear + distill 200"
timeout 200 python3 -m prune.run --model $M --device cuda --dtype bfloat16 --drop 8 --replace linear --distill-steps 200 --samples 32 --heldout-samples 8 --out /tmp/slim8 > $OUT/run8.log 2>&1; echo rc=$?
tr '\r' '\n' < $OUT/run8.log | grep -v "%|" | tail -12
python3 -c "import json;r=json.load(open('/tmp/slim8/layercut.json'));print('bf16 drop8', r['dropped'], r['heldout'], r['seconds'])"
step "4-bit drop 4 linear"
timeout 120 python3 -m prune.run --model $M --device cuda --load-in-4bit --drop 4 --replace linear --samples 32 --heldout-samples 8 --out /tmp/slim4q > $OUT/run4q.log 2>&1; echo rc=$?
tr '\r' '\n' < $OUT/run4q.log | grep -v "%|" | tail -8
python3 -c "import json;r=json.load(open('/tmp/slim4q/layercut.json'));print('4bit drop4', r['dropped'], r['heldout'], r['seconds'])"
step "bench"
timeout 90 python3 -m eval.bench speed --baseline $M --model /tmp/slim8 --device cuda --dtype bfloat16 --out $OUT/speed 2>&1 | tr '\r' '\n' | grep -v "%|" | tail -6
step "compare"
timeout 200 python3 -m eval.compare --model $M --device cuda --dtype bfloat16 --drop 4,8 --methods shortgpt,gromov,layercut-linear,layercut-linear-distill --samples 32 --out $OUT/cmp > $OUT/cmp.log 2>&1; echo rc=$?
tr '\r' '\n' < $OUT/cmp.log | grep -v "%|" | tail -8
rm -rf $OUT/cmp/*.png $OUT/cmp/measurements.json $OUT/cmp/cells $OUT/cmp/oracle.md
step done
