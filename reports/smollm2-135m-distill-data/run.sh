# Which text to distil on: the novel alone (the distillation default) or novel + self-sampled text (the
# calibration default), chosen on the selection split (`python -m eval.lab selection-split`), drop 8, 200 steps each.
# Run from the repository root with ../shared/data beside it; 2-core CPU, about 40 minutes each.
D=../shared/data; S=/tmp/layercut-selection
python -m eval.lab selection-split $D $S
# layercut-linear-distill ran with the distillation defaults of the time (builtin, 1,024 x 128, layerwise MSE);
# run again, it runs today's defaults.
python -m eval.compare --samples 32 --drop 8 \
  --methods layercut-linear,layercut-linear-distill,recipes/repairs/linear-distill-mixed.yaml \
  --heldout novel=$D/austen/northangerabbey.txt,news=$D/ptb/ptb.valid.txt,wiki=$D/wikitext-2-raw-v1/validation.jsonl,plays=$S/plays_last_fifth.txt,arc_easy=$S/arc_easy.jsonl,hellaswag=$S/hellaswag.jsonl,piqa=$S/piqa.jsonl \
  --heldout-tokens 8192 --speed-tokens 0 --threads 2 --out reports/smollm2-135m-distill-data/selection
# Commit 610414f: what distillation matches, on the same split and text: KL on the logits (maps alone, and maps + LoRA).
python -m eval.compare --samples 32 --drop 8 \
  --methods recipes/repairs/linear-distill-kl.yaml,recipes/repairs/linear-distill-kl-lora.yaml \
  --heldout novel=$D/austen/northangerabbey.txt,news=$D/ptb/ptb.valid.txt,wiki=$D/wikitext-2-raw-v1/validation.jsonl,plays=$S/plays_last_fifth.txt,arc_easy=$S/arc_easy.jsonl,hellaswag=$S/hellaswag.jsonl,piqa=$S/piqa.jsonl \
  --heldout-tokens 8192 --speed-tokens 0 --threads 2 --out reports/smollm2-135m-distill-data/selection-loss
# Commit 20e657d: task accuracy on the selection split itself: the last 500 rows of each task (--limit=-500:), which the
# reported first 1,000 never reach. Does it order removal, the map and the distilled map as the reported rows do?
python -m eval.compare --samples 32 --drop 8 \
  --methods recipes/repairs/remove.yaml,layercut-linear,recipes/repairs/linear-distill-kl.yaml \
  --heldout novel=$D/austen/northangerabbey.txt,news=$D/ptb/ptb.valid.txt,wiki=$D/wikitext-2-raw-v1/validation.jsonl,plays=$S/plays_last_fifth.txt \
  --heldout-tokens 8192 --tasks arc_easy,hellaswag,piqa,lambada_openai --limit=-500: --data-dir $D \
  --speed-tokens 0 --threads 2 --out reports/smollm2-135m-distill-data/selection-tasks
# Commit e5f4cc1: the same three rows minus the distilled one, on 800 rows of each task drawn at random from the rows the
# reported first 1,000 never reach (--limit 800~1000:; PIQA has 838 there). Does a draw order removal and the map
# as the reported rows do, where the tail did not?
python -m eval.compare --samples 32 --drop 8 \
  --methods recipes/repairs/remove.yaml,layercut-linear \
  --heldout novel=$D/austen/northangerabbey.txt,news=$D/ptb/ptb.valid.txt,wiki=$D/wikitext-2-raw-v1/validation.jsonl,plays=$S/plays_last_fifth.txt \
  --heldout-tokens 8192 --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 800~1000: --data-dir $D \
  --speed-tokens 0 --threads 2 --out reports/smollm2-135m-distill-data/selection-draw
# Commit d4f8ab6, a second invocation: the distilled default added on the same draw (the cells above are not run again).
python -m eval.compare --samples 32 --drop 8 \
  --methods recipes/repairs/remove.yaml,layercut-linear,recipes/repairs/linear-distill-kl.yaml \
  --heldout novel=$D/austen/northangerabbey.txt,news=$D/ptb/ptb.valid.txt,wiki=$D/wikitext-2-raw-v1/validation.jsonl,plays=$S/plays_last_fifth.txt \
  --heldout-tokens 8192 --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 800~1000: --data-dir $D \
  --speed-tokens 0 --threads 2 --out reports/smollm2-135m-distill-data/selection-draw
# Commit d2e7227: the same distillation started from linear-scaled's maps (0.7 of each least-squares update) against the
# default start (least squares): drop 8 adds one cell beside 610414f's KL row (9 min), drop 4 runs both (18 min).
python -m eval.compare --samples 32 --drop 8 \
  --methods recipes/repairs/linear-scaled-distill.yaml \
  --heldout novel=$D/austen/northangerabbey.txt,news=$D/ptb/ptb.valid.txt,wiki=$D/wikitext-2-raw-v1/validation.jsonl,plays=$S/plays_last_fifth.txt,arc_easy=$S/arc_easy.jsonl,hellaswag=$S/hellaswag.jsonl,piqa=$S/piqa.jsonl \
  --heldout-tokens 8192 --speed-tokens 0 --threads 2 --out reports/smollm2-135m-distill-data/selection-loss
python -m eval.compare --samples 32 --drop 4 \
  --methods recipes/repairs/linear-distill-kl.yaml,recipes/repairs/linear-scaled-distill.yaml \
  --heldout novel=$D/austen/northangerabbey.txt,news=$D/ptb/ptb.valid.txt,wiki=$D/wikitext-2-raw-v1/validation.jsonl,plays=$S/plays_last_fifth.txt,arc_easy=$S/arc_easy.jsonl,hellaswag=$S/hellaswag.jsonl,piqa=$S/piqa.jsonl \
  --heldout-tokens 8192 --speed-tokens 0 --threads 2 --out reports/smollm2-135m-distill-data/selection-loss
