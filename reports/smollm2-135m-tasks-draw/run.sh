# Issue 17's Table 1 again, with each task's rows a random draw across the whole task instead of its first 1,000
# (commit e5f4cc1 found HellaSwag's first 1,000 rows are all ActivityNet; 68 % of the task is WikiHow): 1,000 rows drawn
# at random from all but each task's last 500, which are the selection split's task prompts (`python -m eval.lab selection-split` in
# ../smollm2-135m-distill-data). Same held-out texts, recipes and calibration as ../smollm2-135m-tasks-drop8; run
# from the repository root with ../shared/data beside it. The same command resumes: cells already in results.json
# (same recipe digest) are not run again.
D=../shared/data
SHARED="--heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt
  --heldout-tokens 8192 --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 1000~:-500 --data-dir $D --threads 2
  --speed-tokens 0 --out reports/smollm2-135m-tasks-draw"
python -m eval.compare --samples 32 --drop 4,8 --methods recipes/repairs/remove.yaml,layercut-linear,layercut-linear-distill $SHARED
# Then the fold (cosine span) at both drops, and the best drop-4 repair (KL, maps + LoRA, 200 steps).
python -m eval.compare --samples 32 --drop 4,8 --methods recipes/repairs/fold.yaml $SHARED
python -m eval.compare --samples 32 --drop 4 --methods recipes/repairs/linear-distill-kl-lora.yaml $SHARED
# Commit d80b510: ten times the distillation steps at drop 8 (67 min), LinearPatch at both drops (22 min), and KL with
# maps + LoRA at drop 8 (the best drop-4 row).
python -m eval.compare --samples 32 --drop 8 --methods recipes/repairs/linear-distill-2000.yaml $SHARED
python -m eval.compare --samples 32 --drop 4,8 --methods linearpatch $SHARED
python -m eval.compare --samples 32 --drop 8 --methods recipes/repairs/linear-distill-kl-lora.yaml $SHARED
# Removal of LinearPatch's own blocks (ShortGPT's Block Influence top-k), its fair baseline (22 min).
python -m eval.compare --samples 32 --drop 4,8 --methods shortgpt $SHARED
# Commit d715132: the full budget on four times the distinct distillation text (2,048 sequences instead of 512).
python -m eval.compare --samples 32 --drop 8 --methods recipes/repairs/linear-distill-2000-wide.yaml $SHARED
# The same 2,048 sequences at the default 200 steps (the sampled half is read from the cache the run above wrote).
python -m eval.compare --samples 32 --drop 8 --methods recipes/repairs/linear-distill-wide.yaml $SHARED
# Commit a659471: the same two recipes at drop 4 (65 and 17 min; the sampled half read from the cache d715132 wrote), and
# LLM-Streamline (one trained block in place of the span) at both drops (about 25 min).
python -m eval.compare --samples 32 --drop 4 --methods recipes/repairs/linear-distill-2000-wide.yaml $SHARED
python -m eval.compare --samples 32 --drop 4 --methods recipes/repairs/linear-distill-wide.yaml $SHARED
python -m eval.compare --samples 32 --drop 4,8 --methods llm-streamline $SHARED
# LLM-Streamline's block, then the default distillation of it (15 min).
python -m eval.compare --samples 32 --drop 8 --methods recipes/repairs/streamline-distill.yaml $SHARED
# Commit f6652c4: maps + LoRA on the full budget (2,000 steps on 2,048 sequences) at drop 4 (86 min), and removal at
# LLM-Streamline's size, 3 and 7 blocks (24 min).
python -m eval.compare --samples 32 --drop 4 --methods recipes/repairs/linear-distill-kl-lora-2000-wide.yaml $SHARED
python -m eval.compare --samples 32 --drop 3,7 --methods recipes/repairs/remove.yaml $SHARED
# The closed-form map of the same 7 blocks (10 min).
python -m eval.compare --samples 32 --drop 7 --methods layercut-linear $SHARED
# Commit 3d14f10: layercut-linear applying 0.7 of each map's update (--update-scale 0.7, chosen on the selection split in
# ../smollm2-135m-mapfit/selection-scale-*), training-free, at both drops (24 min).
python -m eval.compare --samples 32 --drop 4,8 --methods recipes/repairs/linear-scaled.yaml $SHARED
# Commit d2e7227: fold applying 0.7 of its update (a vanilla checkpoint; the share chosen on the selection split in
# ../smollm2-135m-mapfit/selection-fold-scale) at drop 4 (13 min), and the default distillation (200 steps of KL,
# the maps trained) started from linear-scaled's maps instead of least squares, at both drops (32 min).
python -m eval.compare --samples 32 --drop 4 --methods recipes/repairs/fold-scaled.yaml $SHARED
python -m eval.compare --samples 32 --drop 4,8 --methods recipes/repairs/linear-scaled-distill.yaml $SHARED
# Commit 92941a6: fold at 0.7 of its update at drop 8 too, fold's default since 92941a6 (fold-scaled.yaml sets 0.7, so
# its digest did not move with the default; 10 min).
python -m eval.compare --samples 32 --drop 8 --methods recipes/repairs/fold-scaled.yaml $SHARED
# Commit 226084b: removal of fold's own blocks at drop 8 (the cosine span 11-18; removal.yaml's are 12-19), fold's and
# LLM-Streamline's baseline (16 min), and fold on layercut-linear's blocks (linearity top-k, 12-19).
python -m eval.compare --samples 32 --drop 8 --methods recipes/repairs/remove-span.yaml $SHARED
python -m eval.compare --samples 32 --drop 8 --methods recipes/repairs/fold-topk.yaml $SHARED
