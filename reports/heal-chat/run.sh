# What --heal-data self:chat buys ship's heal: SmolLM2-135M-Instruct at drop 4, ship's defaults against the same run
# with the model's own conversations as heal text, on this 2-core CPU in float32, one job at a time (2026-12-05,
# commit 789cbed). Run from the repository root with ../shared/data beside it, the ifeval extra installed and
# NLTK's punkt_tab under $NLTK_DATA (eval/tasks/README.md, IFEval).
set -e
S=/tmp/layercut-selection
D=../shared/data
R=reports/heal-chat
[ -d $S ] || python -m eval.lab selection-split ../shared/data $S
# 1. the two ships (the training-free build of both is /tmp/mem4/slim4: reports/heal-train's step 7 with --heal-steps 0)
python -m prune.ship --model smollm2-135m --drop 4 --no-verify --engine transformers --threads 2 --out /tmp/chat/def
python -m prune.ship --model smollm2-135m --drop 4 --heal-data self:chat --no-verify --engine transformers \
  --threads 2 --out /tmp/chat/chat
# the control, after the evaluations below (03:57-04:40): as much of the model's text, sampled from BOS
python -m prune.ship --model smollm2-135m --drop 4 --heal-data self --no-verify --engine transformers \
  --threads 2 --out /tmp/chat/self
# 2. a held-out text of the model's own conversations: 16 x 512 tokens sampled as the heal samples them, at seed 1
#    (the heal's text is seed 0's)
python - <<'PY'
from prune.checkpoint.load_config import LoadConfig
from prune.data.calibration import DataConfig, calibration_data
loaded = LoadConfig(model="smollm2-135m").load()
data = calibration_data(loaded.tokenizer, DataConfig(data="self:chat", samples=16, seq_len=512, seed=1,
                                                     heldout_samples=0), model=loaded.model)
open("/tmp/chat/selfchat-seed1.txt", "w").write("\n".join(loaded.tokenizer.decode(r) for r in data.token_ids.tolist()))
PY
# 3. the selection split's four texts and that one, 16,384 tokens each in windows of 512
python -m eval.run --model /tmp/mem4/slim4 --model /tmp/chat/def --model /tmp/chat/chat --baseline smollm2-135m \
  --tasks ppl:$S/plays_last_fifth.txt,ppl:$S/arc_easy.jsonl,ppl:$S/hellaswag.jsonl,ppl:$S/piqa.jsonl,ppl:/tmp/chat/selfchat-seed1.txt \
  --seq-len 512 --ppl-tokens 16384 --threads 2 --out /tmp/chat/selection
python -m eval.run --model /tmp/chat/self --baseline smollm2-135m \
  --tasks ppl:$S/plays_last_fifth.txt,ppl:$S/arc_easy.jsonl,ppl:$S/hellaswag.jsonl,ppl:$S/piqa.jsonl,ppl:/tmp/chat/selfchat-seed1.txt \
  --seq-len 512 --ppl-tokens 16384 --threads 2 --out /tmp/chat/selection-self
# 4. IFEval on reports/smollm2-135m-ifeval's 200 rows (the dense model's 15.5 % and the training-free build's 9.0 %
#    are there)
python -m eval.run --model /tmp/chat/def --model /tmp/chat/chat --tasks ifeval --limit "200~:" \
  --data-dir $D --batch-size 16 --threads 2 --out /tmp/chat/ifeval
python -m eval.run --model /tmp/chat/self --tasks ifeval --limit "200~:" \
  --data-dir $D --batch-size 16 --threads 2 --out /tmp/chat/ifeval-self
for run in selection selection-self ifeval ifeval-self; do
  mkdir -p $R/$run && cp /tmp/chat/$run/*.json /tmp/chat/$run/*.png $R/$run/ && cp /tmp/chat/$run/README.md $R/$run/eval-run.md
done
cp /tmp/chat/def/README.md $R/card-default.md && cp /tmp/chat/chat/README.md $R/card-chat.md && \
  cp /tmp/chat/self/README.md $R/card-self.md
