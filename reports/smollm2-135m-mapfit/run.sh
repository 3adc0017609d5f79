# Where the linear map of blocks 12-15 errs: fitted on the calibration of issue 17's "before" (the shipped novel
# alone), measured on four held-out domains and on the prompts of the four tasks (`python -m eval.lab task-prompts` writes them as
# lm-eval builds them).
# Run from the repository root with ../shared/data beside it; 2-core CPU, about 4 minutes.
D=../shared/data; P=/tmp/layercut-prompts
python -m eval.lab task-prompts $D $P
python -m eval.mapfit --span 12-15 --data builtin --short 64 \
  --heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt,arc_easy=$P/arc_easy.jsonl,hellaswag=$P/hellaswag.jsonl,piqa=$P/piqa.jsonl,lambada=$P/lambada_openai.jsonl \
  --heldout-tokens 8192 --out reports/smollm2-135m-mapfit
# Commit 3d14f10: a share of the map's update (--update-scale), blocks 12-15 and 12-19, on the selection split only (the
# texts and task prompts no reported figure reads; `python -m eval.lab selection-split` writes the prompts): today's calibration and fit
# (--short 64, the default), the KL at the logits per variant (--logits). About 14 minutes a span.
S=/tmp/layercut-selection
python -m eval.lab selection-split $D $S
for span in 12-15 12-19; do
python -m eval.mapfit --span $span --short 64 --update-scale 0.3,0.5,0.7 --skip "" --shrink "" --logits \
  --heldout novel=$D/austen/northangerabbey.txt,news=$D/ptb/ptb.valid.txt,wiki=$D/wikitext-2-raw-v1/validation.jsonl,plays=$S/plays_last_fifth.txt,arc_easy=$S/arc_easy.jsonl,hellaswag=$S/hellaswag.jsonl,piqa=$S/piqa.jsonl \
  --heldout-tokens 4096 --threads 2 --out reports/smollm2-135m-mapfit/selection-scale-$span
done
# Task accuracy on the selection split's rows with each share in place (about 7 minutes a share).
python -m eval.lab share-tasks 12-15 removal,ls,0.5,0.75,0.7 \
  reports/smollm2-135m-mapfit/selection-scale-tasks.json
# Commit d2e7227: the same shares for fold (the least-squares fit into block 11's down_proj, a vanilla checkpoint), on the
# same selection texts, by eval.compare (8 minutes). The shares are recipes written here, outside recipes/ (the
# same bytes as those run, so the same command resumes them).
for s in 0.1 0.2 0.3 0.5 0.7; do cat > /tmp/fold-$s.yaml <<RECIPE
# fold applying $s of its fitted update (selection split only)
method: "cosine span, linear map folded into the previous block's MLP, $s of the update"
score: cosine
select: span
replace: {method: fold, update_scale: $s}
RECIPE
done
python -m eval.compare --samples 32 --drop 4,8 --threads 2 --speed-tokens 0 \
  --methods recipes/repairs/remove.yaml,recipes/repairs/fold.yaml,/tmp/fold-0.7.yaml,/tmp/fold-0.5.yaml,/tmp/fold-0.3.yaml,/tmp/fold-0.2.yaml,/tmp/fold-0.1.yaml \
  --heldout novel=$D/austen/northangerabbey.txt,news=$D/ptb/ptb.valid.txt,wiki=$D/wikitext-2-raw-v1/validation.jsonl,plays=$S/plays_last_fifth.txt,arc_easy=$S/arc_easy.jsonl,hellaswag=$S/hellaswag.jsonl,piqa=$S/piqa.jsonl \
  --heldout-tokens 4096 --out reports/smollm2-135m-mapfit/selection-fold-scale
# Commit 92941a6: why the update overshoots. The per-text optimum of the share from the two selection-scale runs above,
# then the same fits with each calibration token weighted by the loss gradient's norm at the span's output.
python -m eval.lab share-optimum reports/smollm2-135m-mapfit/selection-scale-12-15 \
  reports/smollm2-135m-mapfit/selection-scale-12-19
for span in 12-15 12-19; do
python -m eval.mapfit --span $span --short 64 --update-scale 0.7 --grad-weight --skip "" --shrink "" --logits \
  --heldout novel=$D/austen/northangerabbey.txt,news=$D/ptb/ptb.valid.txt,wiki=$D/wikitext-2-raw-v1/validation.jsonl,plays=$S/plays_last_fifth.txt,arc_easy=$S/arc_easy.jsonl,hellaswag=$S/hellaswag.jsonl,piqa=$S/piqa.jsonl \
  --heldout-tokens 4096 --threads 2 --out reports/smollm2-135m-mapfit/selection-grad-$span
done
