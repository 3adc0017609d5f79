set -o pipefail
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cat /tmp/part1 .gpu/b/part2 > /tmp/smol.gguf
echo "$(cat .gpu/b/sha)  /tmp/smol.gguf" | sha256sum -c || exit 3
mkdir -p /tmp/data && tar xzf .gpu/b/data.tgz -C /tmp/data
D=/tmp/data
echo "== compare $(date +%T)"
timeout 530 python3 -m eval.compare --model /tmp/smol.gguf --device cuda --dtype float32 --drop 4,8 \
  --methods recipes/repairs/remove.yaml,layercut-linear,recipes/repairs/fold.yaml,linearpatch,layercut-linear-distill \
  --heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt \
  --heldout-tokens 8192 --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 1000 --data-dir $D \
  --out $OUT/cmp17 > $OUT/cmp17.log 2>&1; echo rc=$?
tr '\r' '\n' < $OUT/cmp17.log | grep -v "%|" | grep -v Warning | tail -15
rm -rf $OUT/cmp17/cells
echo "== done $(date +%T)"
