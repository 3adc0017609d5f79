# Every checkpoint of run.sh's two comparisons (and the dense model) in transformers and llama.cpp, then a subset
# covering every layout in vLLM (its CPU start-up is ~1-2 min a model here). Same ids in every engine.
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
VLLM="--model dense=smollm2-135m"
for m in shortgpt@8 layercut-linear-vanilla@8 layercut-linear-distill-vanilla@4 prune-comp@8 llm-streamline@8 \
         layercut-sublayer@4 layercut-linear@4; do
  name=${m%@*}; drop=${m#*@}
  if [ -d $C/$name-drop$drop ]; then dir=$C/$name-drop$drop; else dir=$P/$name-drop$drop; fi
  VLLM="$VLLM --model $m=$dir"
done
/tmp/vllmenv/bin/python -m eval.bench serving $VLLM --heldout $D/ptb/ptb.test.txt --tokens 4096 --seq-len 512 \
  --engines vllm --threads 2 --out $OUT
