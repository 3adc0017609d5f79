# What run.sh and healed.sh share (sourced by both from the repository root): the grids' calibration, the four
# held-out texts the prompts are cut from, and the grids' kept self-text samples copied into the cache, so the
# same calibration rows are read.
D=../shared/data
HELDOUT="novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt"
COMMON="--data builtin@0.5,self@0.5 --samples 32 --seq-len 512 --heldout-samples 8 --batch-size 4 --speed-tokens 0
  --heldout $HELDOUT --heldout-tokens 4096 --metrics fidelity --threads 2"
CACHE="${LAYERCUT_CACHE:-$HOME/.cache/layercut}"
mkdir -p "$CACHE/self-text"
cp -n reports/smollm2-135m-grid/self-text/*.safetensors reports/gemma3-270m-grid/self-text/*.safetensors "$CACHE/self-text/"
