# prune.ship --tasks: lm-eval's IFEval and two multiple-choice tasks scored in the verify stage on the original and
# the checkpoint, on the same 60 drawn rows, and written into the card (2026-12-06, this 2-core CPU, float32, alone).
# SmolLM2-135M-Instruct at drop 4, training-free (--heal-steps 0), verified in transformers; the four held-out texts
# of reports/ship-fast. Run from the repository root, with ../shared/data beside it and beside /tmp/ship (a link
# /tmp/shared); IFEval needs pip install "layercut[ifeval]" and NLTK's punkt_tab (eval/tasks/README.md).
D=../shared/data
HELDOUT="--heldout novel=$D/austen/sensesensibility.txt --heldout news=$D/ptb/ptb.test.txt --heldout wiki=$D/wikitext-2-raw-v1/test.jsonl --heldout plays=$D/tinyshakespeare/input.txt"
mkdir -p /tmp/ship
(cd /tmp/ship && /usr/bin/time -v python -m prune.ship --model smollm2-135m --drop 4 --heal-steps 0 \
  --engine transformers --threads 2 $HELDOUT --tasks ifeval,arc_easy,piqa --limit '60~:' \
  --data-dir $D --out t4)
mkdir -p reports/ship-tasks/t4
cp /tmp/ship/t4.work/*.json reports/ship-tasks/t4/
cp /tmp/ship/t4/README.md /tmp/ship/t4/ship.json reports/ship-tasks/t4/  # the shipped folder's ship.json: every stage
cp /tmp/ship/t4.work/verify/tasks.json reports/ship-tasks/t4/verify-tasks.json
