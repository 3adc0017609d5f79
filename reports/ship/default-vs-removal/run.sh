# prune.run's default (--replace auto: fold here) against removal of the same blocks, SmolLM2-135M drop 4, one after
# the other on an otherwise idle 2-core CPU (2026-11-28), then both on the four held-out texts in transformers.
set -e
mkdir -p /tmp/default-vs-removal && cd /tmp/default-vs-removal && rm -rf def4 rem4 serving-*
D=$OLDPWD/../shared/data  # run from the repository root
uptime > uptime.txt
/usr/bin/time -f "%e s wall, %M KB peak" -o def4.time python -m prune.run --model smollm2-135m --drop 4 --threads 2 --out def4 > def4.log 2>&1
/usr/bin/time -f "%e s wall, %M KB peak" -o rem4.time python -m prune.run --model smollm2-135m --drop 4 --replace none --threads 2 --out rem4 > rem4.log 2>&1
for spec in novel=$D/austen/sensesensibility.txt news=$D/ptb/ptb.test.txt wiki=$D/wikitext-2-raw-v1/test.jsonl plays=$D/tinyshakespeare/input.txt; do
  name=${spec%%=*}; text=${spec#*=}
  python -m eval.bench serving --model default=def4 --model removal=rem4 --heldout $text --engines transformers --threads 2 --out serving-$name > serving-$name.log 2>&1
done
echo done > done.txt
