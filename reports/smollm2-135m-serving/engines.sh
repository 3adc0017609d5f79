# Every checkpoint of run.sh's two comparisons (and the dense model) in transformers and llama.cpp; engines-vllm.sh
# adds vLLM's column for a subset covering every layout. Same ids in every engine.
D=../shared/data
C=reports/smollm2-135m-serving/compare/cells
P=reports/smollm2-135m-serving/peers/cells
MODELS="--model dense=smollm2-135m"
for drop in 4 8; do
  for m in layercut-linear layercut-linear-vanilla layercut-linear-distill layercut-linear-distill-vanilla; do
    [ -f $C/$m-drop$drop/config.json ] && MODELS="$MODELS --model $m@$drop=$C/$m-drop$drop"  # cells that ran
  done
  for m in shortgpt gromov replaceme-ls replaceme-cosine prune-comp llm-streamline linearpatch layercut-sublayer; do
    [ -f $P/$m-drop$drop/config.json ] && MODELS="$MODELS --model $m@$drop=$P/$m-drop$drop"
  done
done
OUT=reports/smollm2-135m-serving/engines
python -m eval.bench serving $MODELS --heldout $D/ptb/ptb.test.txt --tokens 4096 --seq-len 512 \
  --engines transformers,llamacpp --threads 2 --out $OUT
