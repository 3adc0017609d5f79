#!/usr/bin/env bash
# The random-weight checkpoints of prune.model.shaped's SHAPE names, in $WORK/SHAPE/ ($DTYPE, $TOKENIZER's tokenizer),
# one after another; each folder gets layercut-shape.done once written. Called by run.sh and tests.sh.
#     TOKENIZER=smollm2-135m DTYPE=bfloat16 WORK=/tmp/ship bash reports/gpu-ship/shapes.sh llama-3-8b gemma-3-270m
set -u
cd "$(dirname "$0")/../.."
mkdir -p "$WORK/logs"
for shape in "$@"; do
    [ -f "$WORK/$shape/layercut-shape.done" ] && continue
    SECONDS=0
    python3 -c "
import sys
from prune.loading.loader import load_tokenizer
from prune.model.shaped import write_shaped
write_shaped(sys.argv[1], sys.argv[2], tokenizer=load_tokenizer(sys.argv[3]), dtype=sys.argv[4])
" "$shape" "$WORK/$shape" "$TOKENIZER" "$DTYPE" > "$WORK/logs/shape-$shape.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] && touch "$WORK/$shape/layercut-shape.done"
    echo "shape $shape: exit $rc in ${SECONDS} s ($(du -sh "$WORK/$shape" 2>/dev/null | cut -f1))" >> "$WORK/logs/shapes.log"
done
