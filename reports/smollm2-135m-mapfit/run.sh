# Where the linear map of blocks 12-15 errs: fitted on the calibration of issue 17's "before" (the shipped novel
# alone), measured on four held-out domains and on the prompts of the four tasks (prompts.py writes them as
# lm-eval builds them).
# Run from the repository root with ../shared/data beside it; 2-core CPU, about 4 minutes.
D=../shared/data; P=/tmp/layercut-prompts
PYTHONPATH=. python reports/smollm2-135m-mapfit/prompts.py $D $P
python -m eval.mapfit --span 12-15 --data builtin --short 64 \
  --heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt,arc_easy=$P/arc_easy.jsonl,hellaswag=$P/hellaswag.jsonl,piqa=$P/piqa.jsonl,lambada=$P/lambada_openai.jsonl \
  --heldout-tokens 8192 --out reports/smollm2-135m-mapfit
