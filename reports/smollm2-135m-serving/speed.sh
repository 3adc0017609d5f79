# Decode and prefill tokens/s of the dense model against drop 4 and drop 8 (ShortGPT's removals from run.sh's second
# comparison: 26 and 22 plain Llama blocks; speed depends on the block count, not on which blocks), interleaved,
# on an otherwise idle machine (uptime first).
C=reports/smollm2-135m-serving/peers/cells
S=reports/smollm2-135m-serving
uptime
python -m eval.bench speed --engine llamacpp --baseline smollm2-135m --model $C/shortgpt-drop4 \
  --model $C/shortgpt-drop8 --threads 2 --prompt-len 256 --new-tokens 64 --repeats 9 --warmup 2 \
  --out $S/speed-llamacpp
python -m eval.bench speed --engine transformers --baseline smollm2-135m --model $C/shortgpt-drop4 \
  --model $C/shortgpt-drop8 --threads 2 --prompt-len 256 --new-tokens 64 --repeats 9 --warmup 2 \
  --memory off --out $S/speed-transformers
/tmp/vllmenv/bin/python -m eval.bench speed --engine vllm --baseline smollm2-135m \
  --model $C/shortgpt-drop4 --model $C/shortgpt-drop8 --threads 2 --prompt-len 256 \
  --new-tokens 64 --repeats 5 --warmup 1 --out $S/speed-vllm
# Both files q4_k_m, as prune.ship's speed check times them (2026-12-06; the drop-4 fold labelled fold-drop4 in the
# results)
S4=/tmp/smollm2-135m-drop4
[ -d $S4 ] || python -m prune.run --model smollm2-135m --drop 4 --out $S4
uptime
python -m eval.bench speed --baseline smollm2-135m --model $S4 --engine llamacpp --gguf-type q4_k_m --threads 1 \
  --repeats 9 --out $S/speed-llamacpp-q4_k_m
uptime
