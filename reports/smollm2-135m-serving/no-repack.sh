# What --no-repack costs: SmolLM2-135M's q4_k_m GGUF loaded twice in one process by the llamacpp engine, with
# llama.cpp's extra buffer types on (its default: the weights repacked for this CPU) and off (--no-repack), timed in
# interleaved rounds (the order alternating), one thread, on an otherwise idle machine (uptime first and last).
S=reports/smollm2-135m-serving
uptime
python - <<'PY'
import json, statistics, time
from pathlib import Path

import llama_cpp
import torch

from eval.speed.engines import EngineSettings, get_engine
from eval.speed.engines.llamacpp import gguf_file
from prune.loading.loader import hf_checkpoint

engine = get_engine("llamacpp")
gguf = gguf_file(hf_checkpoint("smollm2-135m"), outtype="q4_k_m")
handles = {flag: engine.load(str(gguf), EngineSettings.build(threads=1, context=512, no_repack=flag))
           for flag in (False, True)}
prompt = torch.randint(100, 40000, (1, 256), generator=torch.Generator().manual_seed(0))
times = {flag: {"prefill": [], "decode": []} for flag in handles}
for flag in handles:  # warm-up
    engine.decode_seconds(handles[flag], prompt, 8)
for round_ in range(9):
    for flag in ((False, True) if round_ % 2 == 0 else (True, False)):
        times[flag]["prefill"].append(256 / engine.prefill_seconds(handles[flag], prompt))
        times[flag]["decode"].append(64 / engine.decode_seconds(handles[flag], prompt, 64))
same = engine.greedy(handles[False], prompt, 16) == engine.greedy(handles[True], prompt, 16)
rows = {("repacked" if not flag else "no-repack"): {k: statistics.median(v) for k, v in t.items()}
        for flag, t in times.items()}
ratio = {k: rows["no-repack"][k] / rows["repacked"][k] for k in ("prefill", "decode")}
paired = {k: [b / a for a, b in zip(times[False][k], times[True][k])] for k in ("prefill", "decode")}
out = {"gguf": gguf.name, "threads": 1, "prompt_len": 256, "new_tokens": 64, "rounds": 9,
       "tokens_per_s": rows, "no_repack_over_repacked": ratio,
       "paired_range": {k: [min(v), max(v)] for k, v in paired.items()}, "same_greedy_16": same,
       "raw": {("repacked" if not f else "no-repack"): t for f, t in times.items()},
       "llama_cpp_system": llama_cpp.llama_print_system_info().decode()}
for handle in handles.values():
    engine.close(handle)
folder = Path("reports/smollm2-135m-serving/no-repack")
folder.mkdir(exist_ok=True)
(folder / "no-repack.json").write_text(json.dumps(out, indent=1))
md = ["| llama.cpp load | prefill tokens/s | decode tokens/s |", "|---|---:|---:|"]
md += [f"| {name} | {r['prefill']:.1f} | {r['decode']:.1f} |" for name, r in rows.items()]
md += ["", f"--no-repack / repacked: prefill x{ratio['prefill']:.3f} (paired {min(paired['prefill']):.3f}-"
       f"{max(paired['prefill']):.3f}), decode x{ratio['decode']:.3f} (paired {min(paired['decode']):.3f}-"
       f"{max(paired['decode']):.3f}); the same 16 greedy tokens: {same}."]
(folder / "no-repack.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
PY
uptime
# prune.ship's own retry, against a llama.cpp that crashes loading any model while its extra buffer types are on:
# simulated by a sitecustomize.py that sends SIGSEGV from its model load when they are (the crash seen on
# 2026-12-06 on another host); the card and verify.json in no-repack/ship-retry/
T=$(mktemp -d)
cat > $T/sitecustomize.py <<'PY'
import os, signal
import llama_cpp.llama_cpp as bindings
load = bindings.llama_model_load_from_file
def crashing_load(path, params):
    if params.use_extra_bufts:
        os.kill(os.getpid(), signal.SIGSEGV)
    return load(path, params)
bindings.llama_model_load_from_file = crashing_load
PY
PYTHONPATH=$T python -m prune.ship --model smollm2-135m --drop 8 --heal-steps 0 --engine llamacpp --gguf-type q4_k_m \
  --out $T/r8nr
mkdir -p $S/no-repack/ship-retry
cp $T/r8nr/README.md $S/no-repack/ship-retry/card.md
cp $T/r8nr.work/verify.json $T/r8nr.work/verify/*.no-repack.txt $T/r8nr.work/verify/serving.crashed.log \
  $S/no-repack/ship-retry/
sed -i "s#$T/##g" $S/no-repack/ship-retry/verify.json $S/no-repack/ship-retry/serving.crashed.log
uptime
