# prune.ship timed on this 2-core CPU (commit after 1639b86, 2026-12-02), float32, one job at a time, an otherwise idle
# machine (uptime before and after each run is in its log). Run from the repository root with ../shared/data
# beside it; llama.cpp's converter from LLAMA_CPP_CONVERTER, llama-cpp-python 0.3.36 compiled here. Each run starts
# from a cache holding only SmolLM2-135M's converted checkpoint (as after a first `prune.run`), unless said.
D=../shared/data
HELDOUT="--heldout novel=$D/austen/sensesensibility.txt --heldout news=$D/ptb/ptb.test.txt --heldout wiki=$D/wikitext-2-raw-v1/test.jsonl --heldout plays=$D/tinyshakespeare/input.txt"
mkdir -p /tmp/ship
# SmolLM2-135M, drop 8, llama.cpp q4_k_m, training-free (the command of reports/ship/'s drop-8 row), from a cold
# cache: after8 ran the commit before the shared measuring pass, fold-rotate's rounds and the planner; after8b every
# change (a cache of its own, as cold)
for run in after8 after8b; do
  (cd /tmp/ship && LAYERCUT_CACHE=/tmp/ship-fast-cache-$run /usr/bin/time -v python -m prune.ship --model smollm2-135m \
    --drop 8 --samples 32 --engine llamacpp --gguf-type q4_k_m --threads 2 $HELDOUT --heal-steps 0 --out $run)
done
# SmolLM2-135M, drop 4, llama.cpp q8_0, the default calibration, training-free: after8's cache, now warm (the
# original's engine file and its serving rows kept by that run)
export LAYERCUT_CACHE=/tmp/ship-fast-cache-after8
(cd /tmp/ship && /usr/bin/time -v python -m prune.ship --model smollm2-135m --drop 4 --engine llamacpp --gguf-type q8_0 \
  --threads 2 $HELDOUT --heal-steps 0 --out after4)
for run in after8 after8b after4; do
  mkdir -p reports/ship-fast/$run
  cp /tmp/ship/$run/README.md /tmp/ship/$run/ship.json reports/ship-fast/$run/
  cp /tmp/ship/$run.work/*.json reports/ship-fast/$run/
done

# 2026-12-02, evening (after 556fb8f: fold-rotate no longer a candidate on a tied head; the heal reads the teacher's
# top-256 cache; the planner scaled by this CPU's speed, prune.planner.machine). Every run starts from a cache
# holding only SmolLM2-135M's converted checkpoint, except d4, which reads h8's (the original's engine file and
# serving rows kept, as on a user's second run).
for run in r8 h8 d4; do
  case $run in
    r8) flags="--drop 8 --samples 32 --heal-steps 0"; cache=/tmp/cacheR8 ;;
    h8) flags="--drop 8 --samples 32"; cache=/tmp/cacheH8 ;;
    d4) flags="--drop 4"; cache=/tmp/cacheH8 ;;
  esac
  [ "$run" = d4 ] || { rm -rf $cache; cp -r /tmp/cache0 $cache; }  # /tmp/cache0: the converted checkpoint alone
  (cd /tmp/ship && LAYERCUT_CACHE=$cache /usr/bin/time -v python -m prune.ship --model smollm2-135m $flags \
    --engine llamacpp --gguf-type q4_k_m --threads 2 $HELDOUT --out $run)
  mkdir -p reports/ship-fast/$run
  cp /tmp/ship/$run/README.md /tmp/ship/$run/ship.json reports/ship-fast/$run/
  cp /tmp/ship/$run.work/*.json reports/ship-fast/$run/
done
# the heal's step online and from the teacher's cache, on r8's checkpoint (the student the heal starts from)
python -m eval.bench teacher-cache --model smollm2-135m --student /tmp/ship/r8 --steps 40 --samples 160 --batch-size 4 \
  --k 256 --train lora --threads 2 --work /tmp/tc8/work --out reports/ship-fast/heal-teacher-cache
