# IFEval (the offline task of eval/tasks/ifeval.yaml: lm-eval's checks, the chat template, greedy, at most 256 new
# tokens) on 200 of the 541 prompts drawn at random (seed 1234), the same rows for every model, for
# SmolLM2-135M-Instruct and the drop-4 checkpoint prune.ship shipped in reports/ship-fast (after4: fold on blocks
# 12-15, training-free), on this 2-core CPU in float32 (commit after 4853cfd, 2026-12-02). Run from the repository
# root with ../shared/data beside it, the ifeval extra installed and NLTK's punkt_tab under $NLTK_DATA
# (eval/tasks/README.md, IFEval). The checkpoint is reports/ship-fast/run.sh's after4 folder (/tmp/ship/after4).
python -m eval.run --model /tmp/ship/after4 --baseline smollm2-135m --tasks ifeval --limit "200~:" \
  --data-dir ../shared/data --batch-size 16 --threads 2 --out /tmp/smollm2-135m-ifeval
cp /tmp/smollm2-135m-ifeval/*.json /tmp/smollm2-135m-ifeval/*.png reports/smollm2-135m-ifeval/ && \
  cp /tmp/smollm2-135m-ifeval/README.md reports/smollm2-135m-ifeval/eval-run.md
