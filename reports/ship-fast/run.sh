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
