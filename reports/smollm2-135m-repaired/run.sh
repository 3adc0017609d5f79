# Blocks chosen for their repair (issue "Choose blocks for their repair"), SmolLM2-135M on the CPU. Run from the
# repository root with ../shared/data beside it; the same command resumes (cells already in results.json with the
# same recipe digest are not run again). Four domains of 4,096 held-out tokens; four tasks on 400 rows drawn at
# random from all but each task's last 500 (the selection split's task prompts); the default calibration
# (32 x 512 tokens, half the built-in novel, half text sampled from the model).
D=../shared/data
SHARED="--heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt
  --heldout-tokens 4096 --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 400~:-500 --data-dir $D --threads 2
  --speed-tokens 0 --out reports/smollm2-135m-repaired"
# 1. removal and layercut's map on the linearity top-k (the draw's rows), against the repaired-greedy selection
#    with the map; the oracle with its repaired column.
python -m eval.compare --samples 32 --drop 4,8 --methods recipes/repairs/remove.yaml,layercut-linear,layercut-best \
  --oracle $SHARED

# 2. Which criterion and fit layercut-best uses, chosen on the selection split (texts and task prompts no reported
#    figure reads, python -m eval.lab selection-split): repaired-greedy ranking by perplexity (layercut-best) or by
#    KL (best-kl), the maps fitted on the original model's states or in order on the pruned model's own
#    (best-sequential, iterative compensation), against the linearity top-k (layercut-linear), at drops 4 and 8.
S=/tmp/layercut-selection
[ -f $S/piqa.jsonl ] || python -m eval.lab selection-split $D $S
python -m eval.compare --samples 32 --drop 4,8 \
  --methods layercut-linear,layercut-best,recipes/repairs/best-kl.yaml,recipes/repairs/best-sequential.yaml \
  --heldout novel=$D/austen/northangerabbey.txt,news=$D/ptb/ptb.valid.txt,wiki=$D/wikitext-2-raw-v1/validation.jsonl,plays=$S/plays_last_fifth.txt,arc_easy=$S/arc_easy.jsonl,hellaswag=$S/hellaswag.jsonl,piqa=$S/piqa.jsonl \
  --heldout-tokens 4096 --speed-tokens 0 --threads 2 --out reports/smollm2-135m-repaired/selection
