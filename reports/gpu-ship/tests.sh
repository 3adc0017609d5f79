#!/usr/bin/env bash
# The first call of a shapes-only run (README.md): the carried wheels and tokenizer put in place, the shapes the
# second call ships written in the background, and meanwhile the CUDA tests with bitsandbytes (its wheel carried:
# the H200 image has none). On the H200, after `bash reports/gpu-ship/prepare.sh shapes` here:
#     bash reports/gpu-ship/tests.sh SHAPE ...
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?OUT: the folder whose files come back}
WORK=${WORK:-/tmp/ship}
CARRIED=.gpu/ship/c
mkdir -p "$OUT" "$WORK/logs" "$WORK/runs"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cp -r "$CARRIED/tok" "$WORK/"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$CARRIED"/*.whl || exit 3
export PYTHONPATH="/tmp/site:$PWD"
TOKENIZER="$WORK/tok" DTYPE=bfloat16 WORK="$WORK" bash reports/gpu-ship/shapes.sh "$@" &
SHAPES_PID=$!
# prune.run finds its distill step through the package's entry points: an installed layercut
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
    || tail -3 "$OUT/install.log"
python3 -c "import bitsandbytes, torch; print('bitsandbytes', bitsandbytes.__version__, 'torch', torch.__version__)" \
    2>&1 | tail -1 | tee "$OUT/test_cuda.log"
python3 -m pytest tests/journeys/test_cuda.py -q -rs -p no:cacheprovider 2>&1 | tail -25 | tee -a "$OUT/test_cuda.log"
TESTS=${PIPESTATUS[0]}
SECONDS=0
wait "$SHAPES_PID"
echo "waited ${SECONDS} s for the shapes"; cat "$WORK/logs/shapes.log" | tee "$OUT/shapes.log"
df -h /tmp | tail -1
exit "$TESTS"  # the tests' status, not the shapes'
