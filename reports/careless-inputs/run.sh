#!/usr/bin/env bash
# The careless inputs of the "Dependable" issue, replayed against main 11c6b96 (before) and this checkout (after).
# Run from the repository root; ../shared/data must hold the Austen novels (LAYERCUT_DATA overrides).
set -euo pipefail
here=reports/careless-inputs
tiny=$(mktemp -d)/tiny
python -c "import sys; from tests.helpers import make_tiny_model, make_tiny_tokenizer; \
make_tiny_model('llama').save_pretrained(sys.argv[1]); make_tiny_tokenizer().save_pretrained(sys.argv[1])" "$tiny"
before=$(mktemp -d)/before
git worktree add --detach "$before" 11c6b96
python -m eval.lab.careless --code "$before" --tiny "$tiny" --out "$here/before.json"
python -m eval.lab.careless --code . --tiny "$tiny" --out "$here/after.json"
python -m eval.lab.careless --table "$here/before.json" "$here/after.json" > "$here/table.md"
git worktree remove --force "$before"
