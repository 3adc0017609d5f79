#!/usr/bin/env bash
# Scoring, fitting and exporting block by block (--offload sequential) against the in-memory run, on
# SmolLM2-135M: equal scores and checkpoints, time, and peak memory.
#
#   bash reports/smollm2-135m-offload/run.sh     # about 12 minutes on 2 idle cores
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/layercut-offload}
mkdir -p "$OUT"
HERE=reports/smollm2-135m-offload
# scoring alone: time interleaved against the in-memory pass, peak memory in a fresh process each
python -m eval.bench scoring --methods streamed,sequential --tokens 8192,32768 --time-tokens 8192 --repeats 3 \
    --end-to-end 0 --out "$OUT/scoring"
cp "$OUT/scoring/scoring.json" "$OUT/scoring/scoring.md" "$HERE/"
# whole runs: prune with linear maps, in memory and block by block (peak RSS from GNU time)
RUN=(--model smollm2-135m --drop 4 --replace linear --data builtin --overwrite)
/usr/bin/time -f '%M %e' -o "$OUT/memory.time" python -m prune.run "${RUN[@]}" --out "$OUT/memory"
/usr/bin/time -f '%M %e' -o "$OUT/offload.time" python -m prune.run "${RUN[@]}" --offload sequential --out "$OUT/offload"
python -m eval.run --model "$OUT/memory" --tasks ppl:../shared/data/ptb/ptb.test.txt --ppl-tokens 8192 --out "$OUT/memory-eval" --overwrite
python -m eval.run --model "$OUT/offload" --tasks ppl:../shared/data/ptb/ptb.test.txt --ppl-tokens 8192 --out "$OUT/offload-eval" --overwrite
jq -n --slurpfile m "$OUT/memory/layercut.json" --slurpfile o "$OUT/offload/layercut.json" \
    --arg mt "$(cat "$OUT/memory.time")" --arg ot "$(cat "$OUT/offload.time")" \
    --slurpfile me "$OUT/memory-eval/results.json" --slurpfile oe "$OUT/offload-eval/results.json" '
  def run(r; t; e): {dropped: r[0].dropped, replacements: [r[0].replacements[] | {replaces, params}],
                     peak_rss_bytes: ((t | split(" ")[0] | tonumber) * 1024), seconds: (t | split(" ")[1] | tonumber),
                     ptb_test_perplexity: e[0].models[0].metrics["ppl:ptb.test/perplexity"]};
  {in_memory: run($m; $mt; $me), offload_sequential: run($o; $ot; $oe),
   scores_equal: ($m[0].scores == $o[0].scores)}' > "$HERE/results.json"
jq . "$HERE/results.json"
